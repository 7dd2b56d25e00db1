"""The parts of an elastic job, one process at a time (the two-agent runs are in test_elastic.py, slow):

- the rendezvous store's prefix: the restart count only for a store shared with the agent (torch's own rule); an
  unshared store is new each round, and a restarted agent's workers and a joining one's meet under one prefix;
- KILN_HOST names the node;
- the membership record: a shrink found from run/membership.json (else the checkpoint's record), with the lost
  steps and their wall time and the recovery time read from metrics.jsonl (a torn last line skipped), one console
  line, the record at the first step; nothing for the same group; the warning that a shared store cannot grow;
- excluded hosts: one file per host, names that cannot be file names refused, a rank on an excluded host stops
  every rank with one line (its own, or naming the rank and host); the watchdog excludes a host only when another
  would be left, and judges a silent rank by stall_timeout_s even mid-save;
- metrics.jsonl: a torn last line (a killed writer) is dropped on resume;
- a one-process run with loader.record_samples writes the sample indices of every step, in the loader's order,
  and a batch the world cannot split stops before any step with one line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from kiln.config import WatchdogConfig
from kiln.errors import KilnError
from kiln.train.data import Mixture
from kiln.train.metrics import MetricsLog, read_metrics
from kiln.train.parallel.dist import Dist, node_name, store_prefix
from kiln.train.parts.outcome import Outcome
from kiln.train.parts.membership import GROUP_FILE, Membership, exclude_host, excluded_hosts, last_steps
from kiln.train.parts.watchdog import Watchdog
from kiln.train.trainer import Trainer

ELASTIC = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "KILN_HOST")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ELASTIC:
        monkeypatch.delenv(name, raising=False)


def test_store_prefix_uses_the_restart_count_only_for_a_store_shared_with_the_agent(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert store_prefix() == "kiln/attempt-2"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    restarted = store_prefix()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # an agent that just joined
    assert store_prefix() == restarted


def test_kiln_host_names_the_node(monkeypatch):
    monkeypatch.setenv("KILN_HOST", "node-7")
    assert node_name() == "node-7" == Dist().host


# --- the membership record -----------------------------------------------------------------------

def step_line(step: int, wall_time: float) -> str:
    return json.dumps({"event": "step", "step": step, "loss": 1.0, "world": 2, "wall_time": wall_time,
                       "step_time_s": 0.5}) + "\n"


def make_membership(run: Path, host: str = "node-a") -> tuple[Membership, list[dict], list[str]]:
    events, lines = [], []
    return Membership(Dist(host=host), run, events.append, lines.append), events, lines


def outcome(step: int) -> Outcome:
    return Outcome(step, 1e-3, 0.1, 512, 512 * step, {}, {})


def test_a_shrink_is_one_line_at_once_and_a_record_at_the_next_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / GROUP_FILE).write_text(json.dumps({"world": 2, "hosts": ["node-a", "node-b"]}))
    now = time.time()
    (run / "metrics.jsonl").write_text(step_line(5, now - 30) + step_line(6, now - 29) + step_line(7, now - 28.5)
                                       + step_line(8, now - 28) + '{"event": "step", "step": 9, "lo')  # torn
    part, events, lines = make_membership(run)
    part.begin(run / "checkpoints" / "step-00000006", 6, micro_batch=4, accumulation=2)
    assert lines == ["membership: shrink, world 2 -> 1 (left: node-b); resumed from step-00000006, 2 steps of work "
                     "lost; the global batch kept: 2 micro-batches of 4 per rank"]
    assert json.loads((run / GROUP_FILE).read_text()) == {"world": 1, "hosts": ["node-a"]}  # the next one's before
    assert events == []
    part.post_step(outcome(7))
    part.post_step(outcome(8))
    [record] = events
    assert {k: v for k, v in record.items() if k not in ("recovery_s", "lost_s")} == {
        "event": "membership", "step": 6, "change": "shrink", "world_before": 2, "world_after": 1,
        "hosts_before": ["node-a", "node-b"], "hosts_after": ["node-a"], "left": ["node-b"], "joined": [],
        "checkpoint": "step-00000006", "last_step_before": 8, "lost_steps": 2, "micro_batch": 4, "accumulation": 2}
    assert record["lost_s"] == pytest.approx(1.0, abs=1e-3) and 28 <= record["recovery_s"] < 60
    assert lines[-1].startswith("membership: step 7 done 28.")


def test_the_same_group_again_is_no_change_and_the_checkpoint_stands_in_for_a_missing_file(tmp_path):
    run = tmp_path / "run"
    part, events, lines = make_membership(run)
    part.begin(None, 0, 8, 1)  # a fresh run: nothing before it
    part.post_step(outcome(1))
    assert (events, lines) == ([], [])
    part.begin(None, 0, 8, 1)  # the same group restarting
    assert part.change is None
    (run / GROUP_FILE).unlink()
    again, events, lines = make_membership(run, host="node-c")
    again.load_state_dict({"world": 1, "hosts": ["node-a"]})  # what the checkpoint says saved it
    again.begin(run / "checkpoints" / "step-00000004", 4, 8, 1)
    assert again.change["change"] == "hosts" and again.change["left"] == ["node-a"]
    assert again.change["joined"] == ["node-c"] and again.change["lost_steps"] is None
    again.post_step(outcome(5))
    assert events[0]["recovery_s"] is None and "other hosts" not in lines[0]


def test_a_shrink_on_a_store_shared_with_the_agent_warns_that_it_cannot_grow_back(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    run = tmp_path / "run"
    run.mkdir()
    (run / GROUP_FILE).write_text(json.dumps({"world": 3, "hosts": ["node-a", "node-b", "node-c"]}))
    part, _, lines = make_membership(run)
    part.begin(None, 0, 8, 1)
    assert lines[0].startswith("membership: shrink, world 3 -> 1 (left: node-b, node-c); no checkpoint: starting over")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[1]


def test_last_steps_reads_a_torn_file_and_a_missing_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_steps(path, 3) == {"last_step": None, "last_time": None, "resume_time": None}
    path.write_text(step_line(1, 8.0) + step_line(2, 9.0) + step_line(3, 10.0) + step_line(4, 11.0)
                    + '{"event": "step", "ste')
    assert last_steps(path, 3) == {"last_step": 4, "last_time": 11.0, "resume_time": 10.0}
    assert last_steps(path, 0)["resume_time"] == 7.5  # from scratch: when step 1 began


# --- excluded hosts ------------------------------------------------------------------------------

def test_excluded_hosts_are_files_named_by_host(tmp_path):
    assert exclude_host(tmp_path, "node-b", {"rank": 1}) == tmp_path / "excluded_hosts" / "node-b"
    for bad in ("../etc", "a/b", "", ".hidden", "x" * 300):
        assert exclude_host(tmp_path, bad, {}) is None
    (tmp_path / "excluded_hosts" / ".node-c.tmp-1234").write_text("{}")  # a write in progress
    assert excluded_hosts(tmp_path) == ["node-b"] and excluded_hosts(tmp_path / "nowhere") == []


def test_a_rank_on_an_excluded_host_stops_every_rank_with_one_line(tmp_path):
    exclude_host(tmp_path, "node-b", {"rank": 1})
    own, _, _ = make_membership(tmp_path, host="node-b")
    with pytest.raises(KilnError) as err:
        own.admit()
    assert str(err.value) == (f"host node-b is excluded from this run ({tmp_path}/excluded_hosts/node-b): its "
                              "workers leave the job and stop its torchrun agent (this process's parent is not one);"
                              " to let it back in, delete that file and start the agent again")
    other, _, _ = make_membership(tmp_path, host="node-a")
    other.admit()  # a group without the excluded host goes on
    other.hosts = ["node-a", "node-b"]  # as the gather would give it on two ranks
    with pytest.raises(KilnError, match="^rank 1 on host node-b is excluded from this run .*; exiting so torchrun "
                                        "restarts the group without it$"):
        other.admit()


def test_the_watchdog_excludes_a_host_only_when_another_is_left(tmp_path):
    lines = []
    dog = Watchdog(Dist(host="node-a"), WatchdogConfig(on_stall="exclude_host"), tmp_path, lines.append)
    report = {"rank": 1, "host": "node-b", "step": 12}
    dog._exclude("node-b", report, {0: {"host": "node-b"}, 1: {"host": "node-b"}})  # one host: restart only
    assert excluded_hosts(tmp_path) == [] and "no other host would be left" in lines[-1]
    dog._exclude("node-b", report, {0: {"host": "node-a"}, 1: {"host": "node-b"}})
    assert excluded_hosts(tmp_path) == ["node-b"]
    assert json.loads((tmp_path / "excluded_hosts" / "node-b").read_text())["step"] == 12
    assert lines[-1].startswith(f"watchdog: host node-b excluded from this run ({tmp_path}/excluded_hosts/node-b)")


def test_a_silent_rank_is_judged_by_the_stall_timeout_even_mid_save(tmp_path):
    dog = Watchdog(Dist(), WatchdogConfig(stall_timeout_s=4, heartbeat_s=1), tmp_path, startup_timeout_s=100)
    saving = {"saving": 600.0, "warm": True}
    assert dog.timeout_for(saving) == 600 and dog.timeout_for(saving, silent=True) == 4
    assert dog.timeout_for({"warm": False}) == 100 and dog.timeout_for({"warm": True}, silent=True) == 4
    assert dog.silent({1: (5, 100.0), 2: (9, 108.0)}, now=110.0) == {1}


# --- metrics and the loop --------------------------------------------------------------------------

def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(step_line(1, 1.0) + step_line(2, 2.0) + step_line(3, 3.0) + '{"event": "step", "st')
    MetricsLog(path, resume_step=2).close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_record_samples_writes_each_steps_indices_in_the_loaders_order(workdir):
    cfg = tiny_config(workdir, train={"max_steps": 4, "eval_every": 0}, loader={"record_samples": True})
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.run()
    records = read_metrics(workdir / "run" / "metrics.jsonl")
    samples = [r for r in records if r["event"] == "samples"]
    order = Mixture([trainer.train_set.sets[0]]).epoch_order(cfg.seed, 0)
    assert [r["step"] for r in samples] == [1, 2, 3, 4] and all(r["epoch"] == 0 for r in samples)
    assert [r["ranks"] for r in samples] == [[order[8 * k: 8 * k + 8].tolist()] for k in range(4)]
    steps = [r for r in records if r["event"] == "step"]
    assert all(r["world"] == 1 for r in steps)
    assert steps[0]["wall_time"] <= steps[-1]["wall_time"] <= time.time()


def test_a_batch_the_world_cannot_split_stops_before_any_step(workdir):
    cfg = tiny_config(workdir, train={"batch_size": 6, "micro_batch_size": 4})
    with pytest.raises(KilnError, match="^train.batch_size=6 must be a multiple of micro_batch_size×world = 4×1"):
        Trainer(cfg, log=lambda *_: None)
    assert not (workdir / "run" / "metrics.jsonl").exists()
