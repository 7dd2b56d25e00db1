"""The TrainState registry (train/checkpoint/checkpointer.py): each part's state is saved under its key and restored
by that key, a rollback restores only the parts that rewind, and a part moved into train/parts (the budget) resumes
bitwise through it. Also: an fp16 run measures the update-to-weight ratio like any other."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import tiny_config
from kiln.checkpoint import list_checkpoints, load_checkpoint
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


# --- what a resume refuses and says (issue 45.3) ------------------------------------------------------------------

def test_a_changed_model_key_is_refused_naming_it_and_a_changed_lr_is_said(workdir):
    from kiln.errors import KilnError

    Trainer(tiny_config(workdir, train={"max_steps": 2}, checkpoint={"every": 2}), log=quiet).run()
    with pytest.raises(KilnError) as refused:
        Trainer(tiny_config(workdir, train={"max_steps": 4}, model={"dim": 128, "n_layers": 3}), log=quiet).run()
    message = str(refused.value)
    assert "model.dim: 64 in the checkpoint, 128 in the config; model.n_layers: 2 in the checkpoint, 3 in the " \
           "config" in message and "\n" not in message and "new out_dir" in message
    log: list[str] = []
    trainer = Trainer(tiny_config(workdir, train={"max_steps": 4, "lr": 6e-3, "warmup_steps": 1,
                                                  "weight_decay": 0.05}), log=log.append)
    summary = trainer.run()
    assert summary["steps"] == 4
    [note] = [line for line in log if "schedule or optimizer settings" in line]
    assert note == ("note: resuming step-00000002 with other schedule or optimizer settings, applied from step 3 on: "
                    "train.lr: 0.003 in the checkpoint, 0.006 in the config; train.max_steps: 2 in the checkpoint, 4 "
                    "in the config; train.warmup_steps: 2 in the checkpoint, 1 in the config; train.weight_decay: 0.1 "
                    "in the checkpoint, 0.05 in the config")
    # What the note says is what the optimizer does: the decayed group takes this config's weight decay (the
    # checkpoint's param_groups would otherwise have brought 0.1 back), the other group keeps none.
    assert sorted(g["weight_decay"] for g in trainer.engine.optimizer.param_groups) == [0.0, 0.05]


def test_a_tokenizer_of_another_vocabulary_size_is_refused_without_an_override_that_would_fail(prepared, tmp_path):
    """check_resume_data: a changed tokenizer whose vocabulary the weights cannot take is not offered
    train.resume_on_new_data (the weights' check would refuse it next); one of the same size still is."""
    from itertools import islice

    from kiln.data.docs import read_docs
    from kiln.errors import KilnError
    from kiln.manifest import write_manifest
    from kiln.tokenizer import train_tokenizer
    from kiln.train.checkpoint.resume import check_resume_data

    folder = tmp_path / "run" / "checkpoints" / "step-00000002"
    folder.mkdir(parents=True)
    shutil.copy(prepared.out / "tokenizer" / "tokenizer.json", folder / "tokenizer.json")  # 1024 tokens
    write_manifest(folder)
    docs = list(islice(read_docs(prepared.out / "docs"), 40))
    train_tokenizer(docs, tmp_path / "tok512", tiny_config(tmp_path, tokenizer={"vocab_size": 512}).tokenizer, 7)
    saved = {"data_fingerprint": "d" * 64, "tokenizer_sha256": "a" * 64}
    for allow in (False, True):
        with pytest.raises(KilnError) as refused:
            check_resume_data(saved, folder, "e" * 64, "b" * 64, allow, quiet, tmp_path / "tok512" / "tokenizer.json")
        message = str(refused.value)
        assert "vocabulary of 1024 tokens" in message and "has 512" in message
        assert "resume_on_new_data=true" not in message and "\n" not in message
    with pytest.raises(KilnError, match=r"the tokenizer changed .*set train\.resume_on_new_data=true"):
        check_resume_data(saved, folder, "e" * 64, "b" * 64, False, quiet, prepared.out / "tokenizer")


@pytest.mark.slow  # ~10 s of CPU: a tokenizer trained and the shards repacked, as `kiln run` does
def test_another_vocabulary_size_is_refused_without_suggesting_resume_on_new_data(prepared, workdir):
    from kiln.errors import KilnError
    from kiln.stages import run_pack_stage, run_tokenizer_stage

    shutil.copytree(prepared.out / "docs", workdir / "docs")
    Trainer(tiny_config(workdir, train={"max_steps": 2}, checkpoint={"every": 2}), log=quiet).run()
    small = tiny_config(workdir, train={"max_steps": 4}, tokenizer={"vocab_size": 512})
    run_tokenizer_stage(small, quiet)  # what `kiln run` does after tokenizer.vocab_size changes
    run_pack_stage(small, quiet)
    for new_data in (False, True):
        with pytest.raises(KilnError) as refused:
            Trainer(tiny_config(workdir, train={"max_steps": 4, "resume_on_new_data": new_data},
                                tokenizer={"vocab_size": 512}), log=quiet).run()
        assert "tokenizer.vocab_size: 1024 in the checkpoint, 512 in the config" in str(refused.value)
        assert "resume_on_new_data=true" not in str(refused.value)
    with pytest.raises(KilnError) as refused:  # the settings as before, another tokenizer file (tokenizer.path's case)
        Trainer(tiny_config(workdir, train={"max_steps": 4}), log=quiet).run()
    message = str(refused.value)
    assert "vocabulary of 1024 tokens" in message and "has 512" in message and "resume_on_new_data=true" not in message
