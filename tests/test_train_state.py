"""The TrainState registry (train/checkpoint/checkpointer.py): each part's state is saved under its key and restored
by that key, a rollback restores only the parts that rewind, and a part moved into train/parts (the budget) resumes
bitwise through it. Also: an fp16 run measures the update-to-weight ratio like any other."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import tiny_config
from kiln.train.checkpoint import list_checkpoints, load_checkpoint
from kiln.train.metrics import read_metrics
from kiln.train.checkpoint import TrainState
from kiln.train.trainer import Trainer


def quiet(*_):
    return None


class Counter:
    """A stateful part as a newcomer would add one: a state_key and its own state_dict."""

    state_key = "counter"

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


class Phase(Counter):
    state_key = "phase"
    restore_on_rollback = True


def test_parts_are_saved_and_restored_by_their_key():
    counter, phase, stateless = Counter(), Phase(), object()
    state = TrainState([counter, stateless, phase], world=2, config_hash="abc")
    counter.n, phase.n, state.step, state.tokens_seen = 7, 3, 12, 4096
    saved = json.loads(json.dumps(state.state_dict()))  # as state.json holds it
    assert saved == {"step": 12, "tokens_seen": 4096, "world_size": 2, "config_hash": "abc",
                     "counter": {"n": 7}, "phase": {"n": 3}}

    fresh_counter, fresh_phase = Counter(), Phase()
    TrainState([fresh_counter, fresh_phase], 2, "abc").load_state_dict(saved)
    assert (fresh_counter.n, fresh_phase.n) == (7, 3)

    counter.n = phase.n = 99
    state.load_state_dict(saved, rollback=True)  # a rollback rewinds the phase, not the counter
    assert (counter.n, phase.n, state.step) == (99, 3, 12)

    newcomer = Counter()
    newcomer.n = 5
    TrainState([newcomer], 2, "abc").load_state_dict({"step": 1, "tokens_seen": 0})  # an older checkpoint
    assert newcomer.n == 5  # no entry: the part keeps its fresh state


def test_two_parts_under_one_key_are_refused():
    with pytest.raises(ValueError, match="two parts save their state as 'counter'"):
        TrainState([Counter(), Counter()], 1, "abc")
    with pytest.raises(ValueError, match="'step'"):
        TrainState([type("Bad", (Counter,), {"state_key": "step"})()], 1, "abc")


class Crash(Exception):
    pass


def test_the_budget_part_resumes_bitwise_through_the_registry(workdir, tmp_path):
    other = tmp_path / "crash"
    shutil.copytree(workdir, other)
    sections = dict(train={"max_steps": 9, "log_every": 1}, checkpoint={"every": 3},
                    budget={"device_hours": 100.0, "price_per_device_hour": 2.0})
    Trainer(tiny_config(workdir, **sections), log=quiet).run()

    def crash_at_step_5(msg: str) -> None:
        if msg.startswith("step 5/"):
            raise Crash

    with pytest.raises(Crash):
        Trainer(tiny_config(other, **sections), log=crash_at_step_5).run()
    [step3] = list_checkpoints(other / "run" / "checkpoints")
    saved = load_checkpoint(step3, weights=False)["state"]["budget"]
    assert saved["device_hours"] > 0

    resumed = Trainer(tiny_config(other, **sections), log=quiet)
    assert resumed.resume() == step3
    assert resumed.budget.state_dict() == saved  # restored by its key, not started over
    summary = Trainer(tiny_config(other, **sections), log=quiet).run()
    assert summary["steps"] == 9

    def steps(out):
        return [r for r in read_metrics(out / "run" / "metrics.jsonl") if r["event"] == "step"]

    assert [r["loss"] for r in steps(other)] == [r["loss"] for r in steps(workdir)]
    after = [r["device_hours"] for r in steps(other)]
    assert after[3] > saved["device_hours"]  # step 4 of the resumed run spends on top of steps 1-3's hours
    final = load_checkpoint(list_checkpoints(other / "run" / "checkpoints")[-1], weights=False)["state"]
    assert final["budget"]["device_hours"] == pytest.approx(after[-1])


def test_an_fp16_run_measures_the_update_to_weight_ratio(workdir):
    Trainer(tiny_config(workdir, train={"max_steps": 4, "dtype": "fp16", "update_ratio_every": 1}), log=quiet).run()
    records = [r for r in read_metrics(workdir / "run" / "metrics.jsonl") if r["event"] == "step"]
    skipped = {r["step"] for r in read_metrics(workdir / "run" / "metrics.jsonl") if r["event"] == "skip"}
    measured = {r["step"]: r["update_to_weight"] for r in records if "update_to_weight" in r}
    assert set(measured) == {1, 2, 3, 4} - skipped and measured  # every step taken: none before the fix
    assert all(0 < v < 1 for v in measured.values())
