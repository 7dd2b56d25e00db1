"""torchft replica groups (parallel.fault_tolerance: torchft), end to end on this CPU: a lighthouse on 127.0.0.1
(torchft's own `torchft_lighthouse`), two replica groups of one rank each (`kiln train` processes, gloo), as
README's commands start them.

- Two groups train as plain DDP on two ranks does: the same global batch each step, losses within LOSS_RTOL.
- kill -9 one group at step >= 10: the other's step counter never goes back and its largest gap between steps
  stays under MAX_GAP_S; the killed group, started again, heals from the live one and rejoins; every sample is
  consumed once; the `membership` records say when and who.
- train.outer (DiLoCo): a resume from a checkpoint taken between two syncs is bitwise the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.elastic_agents import Lighthouse, records, wait_until
from conftest import ROOT, tiny_config, torchrun_kiln

pytest.importorskip("torchft")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "KILN_FT_HOST": "127.0.0.1"}
BATCH, MICRO = 8, 4
LOSS_RTOL = 1e-5  # per-step loss against DDP on 2 ranks (measured below; the average is taken in another order)
MAX_GAP_S = 15.0  # the survivor's largest gap between two steps (measured 2.5 s; heartbeat timeout 1.5 s)


def start_group(cfg: Path, group: int, lighthouse: Lighthouse, log: Path) -> subprocess.Popen:
    env = {**ENV, "KILN_REPLICA_GROUP": str(group), "TORCHFT_LIGHTHOUSE": lighthouse.url}
    return subprocess.Popen([sys.executable, "-m", "kiln", "train", str(cfg)], cwd=ROOT, env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def write_config(path: Path, out: Path, max_steps: int, **sections) -> Path:
    base = {"train": {"max_steps": max_steps, "batch_size": BATCH, "micro_batch_size": MICRO, "eval_every": 0,
                      "log_every": 5, "threads": 1},
            "checkpoint": {"every": 5, "format": "full", "keep_last": 2},
            "loader": {"record_samples": True},
            "parallel": {"fault_tolerance": "torchft", "torchft": {"timeout_s": 5, "quorum_timeout_s": 120}}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    path.write_text(tiny_config(out, **base).to_yaml())
    return path


def run_groups(cfg: Path, tmp: Path, lighthouse: Lighthouse, groups: int = 2, timeout: float = 400) -> None:
    procs = [start_group(cfg, g, lighthouse, tmp / f"group-{g}.log") for g in range(groups)]
    try:
        for g, p in enumerate(procs):
            assert p.wait(timeout) == 0, (tmp / f"group-{g}.log").read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def steps(out: Path) -> list[dict]:
    return records(out, "step")


@pytest.mark.slow
def test_two_replica_groups_train_as_ddp_on_two_ranks(workdir, tmp_path):
    """Both groups from the first step (lighthouse min_replicas 2): each step the same global batch as DDP's,
    the loss averaged over the groups within LOSS_RTOL of DDP's."""
    ref = tmp_path / "ref"
    shutil.copytree(workdir, ref)
    ref_cfg = write_config(tmp_path / "ref.yaml", ref, 12, parallel={"fault_tolerance": "off"})
    done = torchrun_kiln("train", ref_cfg, env={**ENV}, nproc=2, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lighthouse = Lighthouse(tmp_path, min_replicas=2)
    try:
        run_groups(write_config(tmp_path / "c.yaml", workdir, 12), tmp_path, lighthouse)
    finally:
        lighthouse.close()
    got, want = steps(workdir), steps(ref)
    assert [r["step"] for r in got] == list(range(1, 13)) == [r["step"] for r in want]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=LOSS_RTOL)
    for a, b in zip(records(workdir, "samples"), records(ref, "samples")):
        assert a["ranks"] == b["ranks"], a["step"]
    start = records(workdir, "membership")[0]
    assert (start["change"], start["groups_after"], start["world_after"]) == ("start", [0, 1], 2)


def membership(out: Path, change: str) -> list[dict]:
    return [r for r in records(out, "membership") if r["change"] == change]


@pytest.mark.slow
def test_a_killed_group_costs_seconds_and_comes_back_healed(workdir, tmp_path):
    """kill -9 group 1 at step >= 10; group 0 goes on alone at once (no restart, no checkpoint read); group 1
    started again heals from group 0 and rejoins; every sample of an epoch is consumed once."""
    lighthouse = Lighthouse(tmp_path, min_replicas=1)
    cfg = write_config(tmp_path / "c.yaml", workdir, 60, train={"batch_size": 16, "micro_batch_size": 8},
                       model={"dim": 256, "n_layers": 4})  # steps long enough for group 1 to come back
    logs = [tmp_path / "group-0.log", tmp_path / "group-1.log"]
    a = b = start_group(cfg, 0, lighthouse, logs[0])
    try:
        wait_until(lambda: records(workdir, "membership"), "group 0's first quorum", 300)
        b = start_group(cfg, 1, lighthouse, logs[1])
        wait_until(lambda: any(r["groups_after"] == [0, 1] for r in records(workdir, "membership"))
                   and max((r["step"] for r in steps(workdir)), default=0) >= 10, "step 10 on both groups", 300)
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
        killed = time.time()
        b = start_group(cfg, 1, lighthouse, logs[1])  # at once: it heals from group 0, which did not stop
        assert a.wait(400) == 0, logs[0].read_text()[-4000:]
        assert b.wait(400) == 0, logs[1].read_text()[-4000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.close()
    done = steps(workdir)
    assert [r["step"] for r in done] == list(range(1, 61))  # never back, never twice
    times = [r["wall_time"] for r in done]
    gaps = np.diff(times)
    around = [g for g, t in zip(gaps, times[1:]) if t > killed - 1]
    print(f"largest gap between group 0's steps: {max(gaps):.2f} s (after the kill: {max(around):.2f} s)")
    assert max(gaps) < MAX_GAP_S, gaps
    shrink, grow = membership(workdir, "shrink"), membership(workdir, "grow")
    assert shrink and shrink[0]["left"] == [1] and shrink[0]["groups_after"] == [0], shrink
    assert shrink[0]["retried_step"] == shrink[0]["step"] + 1 and shrink[0]["wall_time"] >= killed - 1
    assert grow and grow[-1]["joined"] == [1] and grow[-1]["step"] > shrink[0]["step"], grow
    assert (shrink[0]["accumulation"], grow[-1]["accumulation"]) == (2, 1)
    group_1 = (workdir / "run" / "replicas" / "group-1" / "metrics.jsonl").read_text().splitlines()
    rejoined = [json.loads(line) for line in group_1 if '"membership"' in line]
    rejoined = [r for r in rejoined if r["wall_time"] > killed]  # its second life
    assert rejoined[0]["healed"] and rejoined[0]["step"] >= grow[-1]["step"], rejoined
    by_epoch: dict[int, list[int]] = {}
    for r in records(workdir, "samples"):
        assert len(sum(r["ranks"], [])) == 16, r
        by_epoch.setdefault(r["epoch"], []).extend(sum(r["ranks"], []))
    for epoch, taken in by_epoch.items():  # exactly once
        assert len(taken) == len(set(taken)), epoch
    assert sum(len(t) for t in by_epoch.values()) == 60 * 16


@pytest.mark.parametrize("algorithm", ["diloco", pytest.param("local_sgd", marks=pytest.mark.slow)])  # suite time
def test_outer_syncs_every_h_steps_on_two_groups(workdir, tmp_path, algorithm):
    """train.outer on 2 groups of 1 rank: both train to max_steps, an outer sync every H steps."""
    lighthouse = Lighthouse(tmp_path, min_replicas=2)
    cfg = write_config(tmp_path / "c.yaml", workdir, 20,
                       train={"outer": {"algorithm": algorithm, "sync_every": 10}}, checkpoint={"every": 10})
    try:
        run_groups(cfg, tmp_path, lighthouse)
    finally:
        lighthouse.close()
    assert [r["step"] for r in steps(workdir)] == list(range(1, 21))
    param_bytes = records(workdir, "startup")[0]["param_bytes"]  # fp32: one copy of the weights per sync
    for run in (workdir / "run", workdir / "run" / "replicas" / "group-1"):
        syncs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "outer_sync" in line]
        assert [(r["step"], r["algorithm"], r["committed"], r["groups"], r["outer_step"]) for r in syncs] == [
            (10, algorithm, True, [0, 1], 1), (20, algorithm, True, [0, 1], 2)], syncs
        assert syncs[0]["bytes"] == syncs[1]["bytes"] == param_bytes, syncs
    ours, theirs = (load_file(run / "checkpoints" / "step-00000020" / "model.safetensors")
                    for run in (workdir / "run", workdir / "run" / "replicas" / "group-1"))
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # the last sync made the groups' weights one


def test_diloco_resume_between_syncs_is_bitwise_the_uninterrupted_run(workdir, tmp_path):
    """DiLoCo (H=10) on 2 groups to step 20, then both groups' checkpoints after step 15 removed (a crash after
    the save at step 15, between two syncs: the outer momentum and the global weights in flight) and both
    started again: steps 16-20 give bitwise the losses and the weights of the uninterrupted run, in each group."""
    lighthouse = Lighthouse(tmp_path, min_replicas=2)
    cfg = write_config(tmp_path / "c.yaml", workdir, 20, train={"outer": {"algorithm": "diloco", "sync_every": 10}})
    runs = (workdir / "run", workdir / "run" / "replicas" / "group-1")
    try:
        run_groups(cfg, tmp_path, lighthouse)
        want = [(run / "metrics.jsonl").read_text() for run in runs]
        weights = [load_file(run / "checkpoints" / "step-00000020" / "model.safetensors") for run in runs]
        for run in runs:
            shutil.rmtree(run / "checkpoints" / "step-00000020")
        run_groups(cfg, tmp_path, lighthouse)
    finally:
        lighthouse.close()
    for group, (run, text, before) in enumerate(zip(runs, want, weights)):
        log = (tmp_path / f"group-{group}.log").read_text()  # each group its own checkpoint (its inner state)
        assert f"resumed from {run / 'checkpoints' / 'step-00000015'} (step 15)" in log, log[-2000:]
        losses = [[(r["step"], r["loss"]) for r in map(json.loads, t.splitlines()) if r.get("event") == "step"]
                  for t in (text, (run / "metrics.jsonl").read_text())]
        assert losses[0] == losses[1] and len(losses[1]) == 20, run
        after = load_file(run / "checkpoints" / "step-00000020" / "model.safetensors")
        assert all(torch.equal(before[k], after[k]) for k in before), run


def run_records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("event") == kind]


@pytest.mark.slow
def test_a_group_joining_mid_run_under_diloco_heals_at_the_next_sync_and_takes_part(workdir, tmp_path):
    """Group 0 trains alone (DiLoCo, H=10); group 1 started mid-run waits for group 0's next sync, heals there from
    it and takes part in that sync's all-reduce: every sync of both groups commits (none lost to a group that
    healed and then did not all-reduce), group 1 goes on from that step, and the last sync makes the weights one."""
    lighthouse = Lighthouse(tmp_path, min_replicas=1)
    cfg = write_config(tmp_path / "c.yaml", workdir, 40, train={"outer": {"algorithm": "diloco", "sync_every": 10},
                       "batch_size": 16, "micro_batch_size": 8}, checkpoint={"every": 20},
                       model={"dim": 256, "n_layers": 4})  # steps long enough for group 1 to start meanwhile
    runs = (workdir / "run", workdir / "run" / "replicas" / "group-1")
    a = b = start_group(cfg, 0, lighthouse, tmp_path / "group-0.log")
    try:
        wait_until(lambda: steps(workdir), "group 0's first step", 300)
        b = start_group(cfg, 1, lighthouse, tmp_path / "group-1.log")
        for g, p in enumerate((a, b)):
            assert p.wait(400) == 0, (tmp_path / f"group-{g}.log").read_text()[-4000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.close()
    joined = run_records(runs[1], "membership")[0]
    at = joined["step"]
    assert joined["healed"] and joined["groups_after"] == [0, 1] and at % 10 == 0 and at < 40, joined
    assert [r["step"] for r in run_records(runs[1], "step")] == list(range(at + 1, 41))
    syncs = [[(r["step"], r["committed"], r["groups"]) for r in run_records(run, "outer_sync")] for run in runs]
    assert syncs[0] == [(s, True, [0] if s < at else [0, 1]) for s in range(10, 41, 10)], syncs[0]
    assert syncs[1] == [(s, True, [0, 1]) for s in range(at, 41, 10)], syncs[1]
    assert [r["step"] for r in steps(workdir)] == list(range(1, 41))
    ours, theirs = (load_file(run / "checkpoints" / "step-00000040" / "model.safetensors") for run in runs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_a_group_that_resumes_an_older_checkpoint_heals_from_the_one_ahead(workdir, tmp_path):
    """DiLoCo (H=10) on 2 groups to step 20, then group 0's checkpoints after step 10 and group 1's after 15
    removed: at the first quorum group 0 (step 10) heals from group 1 (step 15), both go on from step 16 at the
    same data position; group 1's losses are bitwise the first run's, the last sync makes the weights one."""
    lighthouse = Lighthouse(tmp_path, min_replicas=2)
    cfg = write_config(tmp_path / "c.yaml", workdir, 20, train={"outer": {"algorithm": "diloco", "sync_every": 10}},
                       checkpoint={"keep_last": 4})
    runs = (workdir / "run", workdir / "run" / "replicas" / "group-1")
    try:
        run_groups(cfg, tmp_path, lighthouse)
        want = run_records(runs[1], "step")
        for run, steps_ in zip(runs, ((15, 20), (20,))):
            for step in steps_:
                shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
        run_groups(cfg, tmp_path, lighthouse)
    finally:
        lighthouse.close()
    healed = run_records(runs[0], "membership")[-1]
    assert (healed["step"], healed["healed"], healed["groups_after"]) == (15, True, [0, 1]), healed
    assert [r["step"] for r in run_records(runs[0], "step")] == [*range(1, 11), *range(16, 21)]
    assert [(r["step"], r["loss"]) for r in run_records(runs[1], "step")] == [(r["step"], r["loss"]) for r in want]
    for run in runs:
        assert [(r["step"], r["committed"], r["outer_step"]) for r in run_records(run, "outer_sync")][-1] == (20, True,
                                                                                                              2)
    ours, theirs = (load_file(run / "checkpoints" / "step-00000020" / "model.safetensors") for run in runs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


class FakeManager:
    """What LocalSGD asks of torchft's Manager, recorded: a quorum and a commit per sync."""

    def __init__(self) -> None:
        self.quorums, self.step = 0, 0

    def disallow_state_dict_read(self) -> None: ...

    def allow_state_dict_read(self) -> None: ...

    def start_quorum(self) -> None:
        self.quorums += 1

    def allreduce(self, tensor):
        return type("Done", (), {"wait": lambda self: None})()

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step


def test_a_step_the_guards_skip_still_counts_toward_the_next_sync():
    """LocalSGD counts optimizer steps; a skipped step takes none, so without Outer.skipped a group that skipped
    one would sync a step later than the others (and at other data)."""
    from types import SimpleNamespace

    from kiln.config import OuterConfig
    from kiln.train.parallel.ft import Outer

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = SimpleNamespace(manager=FakeManager(), bytes=0, committed=True)
    outer = Outer(OuterConfig(algorithm="local_sgd", sync_every=4), groups, model, opt)
    synced_at = []
    for step in range(1, 9):
        model(torch.ones(1, 2)).sum().backward()
        if step in (2, 7):  # the guards skip it: no optimizer step
            outer.skipped(opt)
        else:
            opt.step()
        opt.zero_grad()
        if outer.synced is not None:
            synced_at.append((step, outer.synced["outer_step"]))
            outer.synced = None
    assert synced_at == [(4, 1), (8, 2)] and groups.manager.quorums == 2
