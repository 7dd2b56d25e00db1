"""Lose a node, keep training: elastic membership under torchrun, asserted end to end.

Two real torchrun agents on this machine stand for two nodes (benchmarks/elastic_agents.py: `--nnodes=1:2
--nproc_per_node=1`, one c10d rendezvous on localhost, gloo, KILN_HOST naming each node). Node B is lost at a
random step (SIGKILL of its agent and every descendant: torchrun starts workers in sessions of their own) or
stalls (SIGSTOP of its worker under `watchdog.on_stall: exclude_host`); node A goes on alone from the newest
checkpoint; B is started again (after the operator deletes its exclusion file, in the stall case) and the job
finishes on 2 ranks. Against an uninterrupted 2-rank run of the same config, asserted: every agent's exit 0 (the
excluded agent's first life ends by the signal its worker sends it); the `membership` records of the shrink and
the grow; at every step the same learning rate and the same global batch (the same 8 samples, in two
micro-batches of 4 on one rank, one on each of two); each sample of an epoch consumed exactly once (the
`samples` records, over two whole epochs and part of a third); losses and final weights within float tolerance
of the reduction order (LOSS_RTOL, WEIGHT_ATOL below: the one-rank steps sum two micro-batches where the two-rank
steps all-reduce them).

To keep A from finishing before B is back, A's worker is stopped (SIGSTOP) from B's start until A's agent has
asked it to stop for the re-rendezvous (its "closing signal SIGTERM" line), then continued: it finishes its step,
saves and exits, as a grow always makes it. Every wait is on a file or a log line, with long deadlines.
Slow (about a minute or two each); the parts' unit tests (test_membership.py, test_loader.py) are in the default
suite.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.elastic_agents import Job, records, signal_all, wait_until
from conftest import tiny_config, torchrun_kiln
from kiln.config import PackConfig
from kiln.data.docs import read_docs
from kiln.shards.pack import pack
from kiln.checkpoint import list_checkpoints, load_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MAX_STEPS, BATCH, MICRO = 40, 8, 4
LOSS_RTOL = 1e-5  # per-step loss, relative: two micro-batches summed on one rank, two ranks all-reduced (measured 4e-8)
WEIGHT_ATOL = 1e-5  # final weights, absolute, of weights up to ~1 (measured: bitwise equal, halving is exact)


@pytest.fixture(scope="module")
def small_shards(prepared, tmp_path_factory) -> Path:
    """Shards of 18 real documents cut to 1,200 characters: 142 training samples, 17 steps of 8 an epoch."""
    docs = [{**d, "text": d["text"][:1200]} for d in itertools.islice(read_docs(prepared.out / "docs"), 18)]
    out = tmp_path_factory.mktemp("elastic") / "shards"
    pack(docs, prepared.out / "tokenizer", out, PackConfig(seq_len=64, val_fraction=0.2, samples_per_shard=64))
    return out


def make_out(prepared, small_shards: Path, out: Path) -> Path:
    shutil.copytree(prepared.out / "tokenizer", out / "tokenizer")
    shutil.copytree(small_shards, out / "shards")
    return out


def write_config(path: Path, out: Path, **sections) -> Path:
    base = {"train": {"max_steps": MAX_STEPS, "batch_size": BATCH, "micro_batch_size": MICRO, "eval_every": 0,
                      "log_every": 5},
            "checkpoint": {"every": 3, "format": "sharded", "async_save": True, "keep_last": 3,
                           "save_timeout_s": 60},
            "loader": {"record_samples": True}, "parallel": {"step_timeout_s": 60},
            "watchdog": {"heartbeat_s": 0.5, "stall_timeout_s": 60}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    path.write_text(tiny_config(out, **base).to_yaml())
    return path


@pytest.fixture(scope="module")
def reference(prepared, small_shards, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run (one torchrun, two workers) of the same training settings."""
    tmp = tmp_path_factory.mktemp("reference")
    out = make_out(prepared, small_shards, tmp / "out")
    (tmp / "tmp").mkdir()  # torchrun's torchelastic_* folders go here, not to /tmp
    result = torchrun_kiln("train", write_config(tmp / "c.yaml", out), env={**ENV, "TMPDIR": str(tmp / "tmp")},
                           nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


# --- reading the run folder ------------------------------------------------------------------------

def steps_at(out: Path, world: int, after: int = 0) -> list[int]:
    return [r["step"] for r in records(out, "step") if r["world"] == world and r["step"] > after]


def membership(out: Path, change: str) -> list[dict]:
    return [r for r in records(out, "membership") if r["change"] == change]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(list_checkpoints(out / "run" / "checkpoints")[-1], verify=True)["model"]


# --- the two nodes ---------------------------------------------------------------------------------

def gate_and_bring_back(job: Job, out: Path) -> None:
    """With A training alone: stop A's worker, start B again, and let A's worker go on once A's agent has asked it
    to stop for the new rendezvous (so the job cannot finish on one rank before B is back)."""
    a = job.agents["node-a"]
    workers = a.workers()
    asked = [f"Sending process {pid} closing signal SIGTERM" for pid in workers]
    signal_all(workers, signal.SIGSTOP)
    try:
        b = job.start("node-b")
        wait_until(lambda: any(line in a.log() for line in asked), "A's agent to restart its worker for node B",
                   300, [a, b])
    finally:
        signal_all(workers, signal.SIGCONT)


def check_against_reference(out: Path, reference: Path) -> None:
    """Every step once, with the reference's learning rate, global batch and (within tolerance) loss; each sample
    of an epoch once; final weights within tolerance."""
    steps, ref_steps = records(out, "step"), records(reference, "step")
    assert [r["step"] for r in steps] == list(range(1, MAX_STEPS + 1)) == [r["step"] for r in ref_steps]
    assert [r["lr"] for r in steps] == [r["lr"] for r in ref_steps]
    assert [r["tokens_seen"] for r in steps] == [r["tokens_seen"] for r in ref_steps]
    np.testing.assert_allclose([r["loss"] for r in steps], [r["loss"] for r in ref_steps], rtol=LOSS_RTOL)
    samples, ref_samples = records(out, "samples"), records(reference, "samples")
    assert [r["step"] for r in samples] == list(range(1, MAX_STEPS + 1))
    for got, want in zip(samples, ref_samples):  # the same global batch at every step, whatever the world
        assert sum(got["ranks"], []) == sum(want["ranks"], []) and len(sum(got["ranks"], [])) == BATCH, got["step"]
        assert got["epoch"] == want["epoch"]
    by_epoch: dict[int, list[int]] = {}
    for r in samples:
        by_epoch.setdefault(r["epoch"], []).extend(sum(r["ranks"], []))
    n = 142
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch, taken in by_epoch.items():  # exactly once per epoch; whole epochs miss only the remainder
        assert len(taken) == len(set(taken)) and set(taken) <= set(range(n)), epoch
        assert epoch == 2 or len(taken) == n // BATCH * BATCH
    got, want = final_weights(out), final_weights(reference)
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst < WEIGHT_ATOL, worst


# --- the tests -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_lost_node_shrinks_the_job_and_its_return_grows_it(prepared, small_shards, reference, tmp_path):
    out = make_out(prepared, small_shards, tmp_path / "out")
    kill_at = random.Random().randint(4, 14)
    job = Job(write_config(tmp_path / "c.yaml", out), tmp_path, max_restarts=3)
    try:
        a, b = job.start("node-a"), job.start("node-b")
        wait_until(lambda: max(steps_at(out, 2), default=0) >= kill_at, f"step {kill_at} on 2 ranks", 300, [a, b])
        newest = list_checkpoints(out / "run" / "checkpoints")[-1].name
        b.lose()
        wait_until(lambda: membership(out, "shrink") and len(steps_at(out, 1, membership(out, "shrink")[-1]["step"]))
                   >= 2, "two steps of node A alone", 300, [a])
        gate_and_bring_back(job, out)
        assert a.wait(600) == 0, a.log()[-4000:]
        assert job.agents["node-b"].wait(600) == 0, job.agents["node-b"].log()[-4000:]
    finally:
        job.close()
    shrink, grow = membership(out, "shrink")[-1], membership(out, "grow")[-1]
    assert (shrink["world_before"], shrink["world_after"], shrink["left"]) == (2, 1, ["node-b"]), (kill_at, shrink)
    assert shrink["checkpoint"] >= newest and shrink["step"] <= shrink["last_step_before"], (kill_at, shrink)
    assert (shrink["micro_batch"], shrink["accumulation"]) == (MICRO, 2) and shrink["recovery_s"] > 0
    assert (grow["world_before"], grow["world_after"], grow["joined"]) == (1, 2, ["node-b"]), grow
    assert grow["step"] > shrink["step"] and (grow["micro_batch"], grow["accumulation"]) == (MICRO, 1)
    check_against_reference(out, reference)


@pytest.mark.slow
def test_a_stalled_host_is_excluded_and_the_job_goes_on_without_it(prepared, small_shards, reference, tmp_path):
    out = make_out(prepared, small_shards, tmp_path / "out")
    stall_at = random.Random().randint(4, 14)
    cfg = write_config(tmp_path / "c.yaml", out, watchdog={"stall_timeout_s": 4, "on_stall": "exclude_host"})
    excluded = out / "run" / "excluded_hosts" / "node-b"
    job = Job(cfg, tmp_path, max_restarts=5)
    try:
        a, b = job.start("node-a"), job.start("node-b")
        wait_until(lambda: max(steps_at(out, 2), default=0) >= stall_at, f"step {stall_at} on 2 ranks", 300, [a, b])
        signal_all(b.workers(), signal.SIGSTOP)  # alive and silent
        wait_until(excluded.is_file, "node A's watchdog to exclude node-b", 300, [a])
        report = json.loads(excluded.read_text())
        assert report["host"] == "node-b" and report["heartbeat_stopped"], report
        assert b.wait(600) != 0  # its next worker stopped it: an agent ended by a signal leaves the rendezvous open
        assert "host node-b is excluded from this run" in b.log()
        wait_until(lambda: membership(out, "shrink") and len(steps_at(out, 1, membership(out, "shrink")[-1]["step"]))
                   >= 2, "two steps of node A alone", 300, [a])
        excluded.unlink()  # the operator lets the host back in
        gate_and_bring_back(job, out)
        assert a.wait(600) == 0, a.log()[-4000:]
        assert job.agents["node-b"].wait(600) == 0, job.agents["node-b"].log()[-4000:]
    finally:
        job.close()
    assert "watchdog: host node-b excluded from this run" in job.agents["node-a"].log()
    shrink, grow = membership(out, "shrink")[-1], membership(out, "grow")[-1]
    assert (shrink["world_before"], shrink["world_after"], shrink["left"]) == (2, 1, ["node-b"]), (stall_at, shrink)
    assert (grow["world_before"], grow["world_after"], grow["joined"]) == (1, 2, ["node-b"]), grow
    check_against_reference(out, reference)
