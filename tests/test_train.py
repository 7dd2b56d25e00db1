"""Training: the loss falls, schedules and the loader behave, guards skip bad steps, checkpoints are
atomic and verified, and a resumed run is bitwise the same as one never interrupted (in-process and
after a real SIGKILL). DDP over 2 real gloo processes matches one process."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import ROOT, tiny_config, torchrun_kiln
from kiln.cli import main as kiln
from kiln.errors import IntegrityError
from kiln.manifest import write_manifest
from kiln.checkpoint import latest_valid, list_checkpoints, load_checkpoint, verify_checkpoint
from kiln.train.metrics import read_metrics
from kiln.train.schedule import Cosine
from kiln.train.trainer import Trainer


def run(out: Path, **train) -> dict:
    return Trainer(tiny_config(out, train=train), log=lambda *_: None).run()


def steps(out: Path) -> list[dict]:
    return [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == "step"]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(list_checkpoints(out / "run" / "checkpoints")[-1] / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- schedule and loader ------------------------------------------------------------------------

def test_warmup_cosine_curve():
    lrs = [Cosine(1.0, 10, 100, 0.1).lr(s) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # non-increasing after warmup
    assert lrs[-1] == pytest.approx(0.1)
    assert Cosine(1.0, 10, 100, 0.1).lr(55) == pytest.approx(0.55)  # halfway through the cosine


# --- the loop -----------------------------------------------------------------------------------

def test_loss_falls_and_metrics_are_complete(workdir):
    summary = run(workdir, max_steps=20)
    assert summary["val_loss_end"] < summary["val_loss_start"] - 0.5
    rows = steps(workdir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for r in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys()
        assert np.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert np.mean([r["loss"] for r in rows[-5:]]) < np.mean([r["loss"] for r in rows[:5]])
    evals = [m for m in read_metrics(workdir / "run" / "metrics.jsonl") if m["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 10, 20]


def test_gradient_accumulation_matches_one_big_batch(workdir, tmp_path):
    other = tmp_path / "accum"
    shutil.copytree(workdir, other)
    run(workdir, max_steps=4, micro_batch_size=8)
    run(other, max_steps=4, micro_batch_size=2)
    a, b = [r["loss"] for r in steps(workdir)], [r["loss"] for r in steps(other)]
    assert a == pytest.approx(b, abs=1e-5)


def test_non_finite_loss_skips_the_step_and_is_recorded(workdir):
    cfg = tiny_config(workdir, train={"max_steps": 5})
    trainer = Trainer(cfg, log=lambda *_: None)
    weights = {}

    def poison(module, inputs, output):  # the third step's forward pass produces NaN logits
        if trainer.step == 2 and module.training:
            weights.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
            return output * float("nan")
        return output

    trainer.model.output.register_forward_hook(poison)
    trainer.run()
    rows = steps(workdir)
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]
    skips = [m for m in read_metrics(workdir / "run" / "metrics.jsonl") if m["event"] == "skip"]
    assert [(s["step"], s["reason"]) for s in skips] == [(3, "non_finite")]
    assert skips[0]["data_position"] == 3 * 8
    final = load_checkpoint(list_checkpoints(workdir / "run" / "checkpoints")[-1])["model"]
    assert all(torch.isfinite(v).all() for v in final.values())


# --- checkpoints and resume ---------------------------------------------------------------------

class Crash(Exception):
    pass


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(workdir, tmp_path):
    other = tmp_path / "crash"
    shutil.copytree(workdir, other)
    run(workdir, max_steps=12, log_every=1)

    def crash_at_step_8(msg: str) -> None:
        if msg.startswith("step 8/"):
            raise Crash

    with pytest.raises(Crash):
        Trainer(tiny_config(other, train={"max_steps": 12, "log_every": 1}), log=crash_at_step_8).run()
    assert [p.name for p in list_checkpoints(other / "run" / "checkpoints")] == ["step-00000005"]
    run(other, max_steps=12, log_every=1)  # same command again
    assert [r["loss"] for r in steps(other)] == [r["loss"] for r in steps(workdir)]
    assert_same_weights(final_weights(other), final_weights(workdir))


def _train_cli(cfg_path: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "kiln", "train", str(cfg_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)


# slow: test_resilience.py::test_sigkill_during_a_save_resumes_bitwise kills harder (mid-save) in the default suite
@pytest.mark.slow
def test_sigkill_then_same_command_continues_bitwise(workdir, tmp_path):
    other = tmp_path / "killed"
    shutil.copytree(workdir, other)
    run(workdir, max_steps=15)
    cfg_path = tmp_path / "killed.yaml"
    cfg_path.write_text(tiny_config(other, train={"max_steps": 15}).to_yaml())

    proc = _train_cli(cfg_path)
    deadline = time.time() + 120
    while not (other / "run" / "checkpoints" / "step-00000010").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = _train_cli(cfg_path)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out[-2000:]
    assert "resumed from" in out
    assert [r["loss"] for r in steps(other)] == [r["loss"] for r in steps(workdir)]
    assert_same_weights(final_weights(other), final_weights(workdir))


def test_corrupt_newest_checkpoint_falls_back_to_previous(workdir, capsys):
    run(workdir, max_steps=10)
    ckpts = list_checkpoints(workdir / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-00000005", "step-00000010"]
    assert kiln(["ckpt", "verify", str(ckpts[-1])]) == 0
    blob = ckpts[-1] / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    assert kiln(["ckpt", "verify", str(ckpts[-1])]) == 1
    assert "model.safetensors" in capsys.readouterr().err
    messages = []
    assert latest_valid(workdir / "run" / "checkpoints", log=messages.append) == ckpts[0]
    assert "model.safetensors" in messages[0] and "sha256" in messages[0]
    summary = run(workdir, max_steps=10)  # resumes from step 5 and redoes 6..10
    assert summary["steps"] == 10


def test_temporary_checkpoint_folders_are_never_loaded(workdir):
    run(workdir, max_steps=5)
    root = workdir / "run" / "checkpoints"
    shutil.copytree(root / "step-00000005", root / "step-00000009.tmp-deadbeef")
    (root / "step-00000007").mkdir()  # a folder without a manifest
    assert latest_valid(root, log=lambda *_: None) == root / "step-00000005"


def test_checkpoint_with_a_pickle_payload_is_refused_not_run(workdir, tmp_path):
    run(workdir, max_steps=5)
    folder = list_checkpoints(workdir / "run" / "checkpoints")[-1]
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "optimizer.pt").write_bytes(pickle.dumps({"state": Payload()}))
    manifest = json.loads((folder / "manifest.json").read_text())
    write_manifest(folder, **{k: v for k, v in manifest.items() if k not in ("files", "kiln_version")})
    with pytest.raises(IntegrityError, match="cannot be loaded safely"):
        verify_checkpoint(folder)
    assert not marker.exists()


def test_checkpoint_folder_is_self_describing(workdir):
    run(workdir, max_steps=5)
    folder = list_checkpoints(workdir / "run" / "checkpoints")[-1]
    manifest = verify_checkpoint(folder)
    assert set(manifest["files"]) == {
        "model.safetensors",
        "optimizer.pt",
        "rng.pt",
        "state.json",
        "config.yaml",
        "tokenizer.json",
    }
    state = json.loads((folder / "state.json").read_text())
    assert state["step"] == 5 and state["loader"]["position"] == 5 * 8
    assert yaml.safe_load((folder / "config.yaml").read_text())["train"]["max_steps"] == 5


# --- DDP over real processes ---------------------------------------------------------------------

def test_ddp_two_gloo_ranks_match_one_process(workdir, tmp_path):
    other = tmp_path / "ddp"
    shutil.copytree(workdir, other)
    run(workdir, max_steps=6)
    cfg_path = tmp_path / "ddp.yaml"
    cfg_path.write_text(tiny_config(other, train={"max_steps": 6}).to_yaml())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = torchrun_kiln("train", cfg_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single, ddp = [r["loss"] for r in steps(workdir)], [r["loss"] for r in steps(other)]
    assert ddp == pytest.approx(single, abs=1e-4)  # same global batch; float sums differ in order only
    a, b = final_weights(workdir), final_weights(other)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-4), k


def test_an_unsigned_manifest_edited_to_another_step_is_refused(workdir, tmp_path, capsys):
    """step-00000006's manifest.json edited to say step 60 (its hashes untouched, so they all still match): verify
    and list reported step 60, and a resume would have taken it for step 60."""
    Trainer(tiny_config(workdir, train={"max_steps": 6, "eval_every": 0}, checkpoint={"every": 3}),
            log=lambda *_: None).run()
    root = workdir / "run" / "checkpoints"
    six = root / "step-00000006"
    manifest = json.loads((six / "manifest.json").read_text())
    (six / "manifest.json").write_text(json.dumps({**manifest, "step": 60}, indent=1))
    capsys.readouterr()
    assert kiln(["ckpt", "verify", str(six)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"kiln: verification failed: {six}: manifest.json says step 60, but the folder is step 6 and "
                   "state.json says 6; the manifest was changed after Kiln wrote it: restore the checkpoint from a "
                   "copy, or resume from another (checkpoint.signing_key signs manifests)")
    assert kiln(["ckpt", "list", str(workdir / "run")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("step-00000003  valid    step 3 ") and rows[1].startswith("step-00000006  INVALID ")
    assert "says step 60" in rows[1]
    assert latest_valid(root, log=lambda *_: None) == root / "step-00000003"  # a resume takes the honest one


def test_the_mfu_note_is_said_once_per_process(workdir, tmp_path, monkeypatch):
    """Issue 37 item 16: an ablation trains many runs in one process; "MFU not reported: unknown device 'cpu'" is
    said by the first, not repeated by each."""
    import kiln.train.trainer as trainer

    monkeypatch.setattr(trainer, "_MFU_NOTED", set())
    other = tmp_path / "other"
    shutil.copytree(workdir, other)
    said = []
    for out in (workdir, other):
        Trainer(tiny_config(out, train={"max_steps": 2, "eval_every": 0}), log=said.append).run()
    assert [line for line in said if line.startswith("MFU not reported")] == [
        "MFU not reported: unknown device 'cpu': set train.peak_tflops to report MFU"]
