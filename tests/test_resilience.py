"""Surviving crashes, spikes, hangs and budgets: SIGTERM/SIGUSR2, SIGKILL mid-save and on 2 ranks,
retention, signatures, async saves, environment changes, rollback on divergence, a stalled rank
restarted by torchrun, and the budget stop. Every process here is real; nothing is mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, tiny_config
from kiln.cli import main as kiln
from kiln.errors import KilnError
from kiln.manifest import read_manifest, write_manifest
from kiln.checkpoint import checkpoint_table, list_checkpoints, load_checkpoint
from kiln.train.checkpoint import SaveClock
from kiln.train.metrics import read_metrics
from kiln.train.trainer import Trainer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def clone(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def events(out: Path, kind: str) -> list[dict]:
    return [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == kind]


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in events(out, "step")]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(list_checkpoints(out / "run" / "checkpoints")[-1] / "model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def write_config(path: Path, out: Path, **sections) -> Path:
    path.write_text(tiny_config(out, **sections).to_yaml())
    return path


def launch(cfg_path: Path, nproc: int = 1, extra: list[str] | None = None) -> subprocess.Popen:
    if nproc == 1:
        cmd = [sys.executable, "-m", "kiln", "train", str(cfg_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *(extra or []), "-m", "kiln", "train", str(cfg_path)]
    return subprocess.Popen(
        cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_for(pred, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early:\n{proc.stdout.read().decode()[-3000:]}")
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out = proc.communicate(timeout=timeout)[0].decode()
    Path(os.environ.get("KILN_TEST_LOG", "/dev/null")).write_text(out)
    assert proc.returncode == 0, out[-3000:]
    return out


def last_step(out: Path) -> int:
    path = out / "run" / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(ln)["step"] for ln in path.read_text().splitlines() if ln.strip() and '"event": "step"' in ln]
    return max(steps, default=0)


# --- signals ------------------------------------------------------------------------------------

def test_sigterm_finishes_the_step_checkpoints_and_exits_zero(workdir, tmp_path):
    reference = clone(workdir, tmp_path / "ref")
    Trainer(tiny_config(reference, train={"max_steps": 30}), log=lambda *_: None).run()
    cfg = write_config(tmp_path / "c.yaml", workdir, train={"max_steps": 30}, checkpoint={"every": 100})
    proc = launch(cfg)
    wait_for(lambda: last_step(workdir) >= 4, proc)
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc)
    assert "stopping cleanly (SIGTERM)" in out
    stop = events(workdir, "stop")[0]
    assert stop["reason"] == "SIGTERM"
    assert [p.name for p in list_checkpoints(workdir / "run" / "checkpoints")] == [f"step-{stop['step']:08d}"]
    finish(launch(cfg))  # the same command continues to the end, bitwise as if never stopped
    assert losses(workdir) == losses(reference)
    assert same_weights(final_weights(workdir), final_weights(reference))


def test_sigusr2_checkpoints_at_the_next_step_and_goes_on(workdir, tmp_path):
    cfg = write_config(
        tmp_path / "c.yaml", workdir, train={"max_steps": 40}, checkpoint={"every": 1000, "keep_last": 5}
    )
    proc = launch(cfg)
    wait_for(lambda: last_step(workdir) >= 3, proc)
    os.kill(proc.pid, signal.SIGUSR2)
    finish(proc)
    saves = events(workdir, "save")
    assert saves[0]["reason"] == "signal" and saves[0]["step"] < 40
    assert saves[-1]["step"] == 40 and last_step(workdir) == 40


# --- SIGKILL at awkward moments -----------------------------------------------------------------

def test_sigkill_during_a_save_resumes_bitwise(workdir, tmp_path):
    reference = clone(workdir, tmp_path / "ref")
    Trainer(tiny_config(reference, train={"max_steps": 12}, checkpoint={"every": 3}), log=lambda *_: None).run()
    cfg = write_config(tmp_path / "c.yaml", workdir, train={"max_steps": 12}, checkpoint={"every": 3})
    proc = launch(cfg)
    root = workdir / "run" / "checkpoints"
    # The second save's temporary folder exists: kill it half-written.
    wait_for(
        lambda: root.is_dir() and any(".tmp-" in p.name and p.name.startswith("step-00000006") for p in root.iterdir()),
        proc,
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    table = checkpoint_table(root)
    assert all(r["valid"] or "temporary" in r["problem"] for r in table)
    finish(launch(cfg))
    assert losses(workdir) == losses(reference)
    assert same_weights(final_weights(workdir), final_weights(reference))


@pytest.mark.slow  # ~30 s each; the one-process SIGKILL tests (test_train, test_resilience) stay in the default suite
@pytest.mark.parametrize("kill_after_step", [4, 9])
def test_two_ranks_killed_and_restarted_continue_bitwise(workdir, tmp_path, kill_after_step):
    reference = clone(workdir, tmp_path / "ref")
    ref_cfg = write_config(tmp_path / "ref.yaml", reference, train={"max_steps": 12}, checkpoint={"every": 3})
    finish(launch(ref_cfg, nproc=2))
    cfg = write_config(tmp_path / "c.yaml", workdir, train={"max_steps": 12}, checkpoint={"every": 3})
    proc = launch(cfg, nproc=2)
    wait_for(lambda: last_step(workdir) >= kill_after_step, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks at once
    proc.wait()
    finish(launch(cfg, nproc=2))
    assert losses(workdir) == losses(reference)
    assert same_weights(final_weights(workdir), final_weights(reference))


# --- checkpoints: retention, signatures, async, environment -----------------------------------

def test_retention_keeps_last_every_mth_and_best(workdir):
    trainer = Trainer(tiny_config(workdir, train={"max_steps": 14, "eval_every": 2},
                                  checkpoint={"every": 2, "keep_last": 2, "keep_every": 6, "keep_best": True}),
                      log=lambda *_: None)
    trainer.run()
    vals = {int(s): v for s, v in trainer.validator.val_loss.items() if int(s) > 0}
    best = min(vals, key=vals.get)
    kept = {int(p.name[5:]) for p in list_checkpoints(workdir / "run" / "checkpoints")}
    assert kept == {12, 14, 6} | {best}


def _keypair(tmp_path: Path) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    priv, pub = tmp_path / "sign.pem", tmp_path / "sign.pub"
    priv.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return str(priv), str(pub)


def test_signed_checkpoints_load_and_a_bad_signature_is_refused(workdir, tmp_path):
    priv, pub = _keypair(tmp_path)
    Trainer(tiny_config(workdir, train={"max_steps": 10}, checkpoint={"signing_key": priv}), log=lambda *_: None).run()
    root = workdir / "run" / "checkpoints"
    newest, older = list_checkpoints(root)[-1], list_checkpoints(root)[-2]
    assert all(r["valid"] for r in checkpoint_table(root, pub))
    # A manifest edited and re-hashed by someone without the key no longer matches its signature.
    manifest = read_manifest(newest)
    write_manifest(newest, **{k: v for k, v in manifest.items() if k not in ("files", "kiln_version")}, tampered=True)
    messages = []
    trainer = Trainer(
        tiny_config(workdir, train={"max_steps": 10}, checkpoint={"public_key": pub}), log=messages.append
    )
    assert trainer.resume() == older
    assert any("signature does not match" in m for m in messages)
    (older / "manifest.sig").unlink()
    for p in list_checkpoints(root)[:-2]:
        (p / "manifest.sig").unlink()
    with pytest.raises(KilnError, match="valid signature"):
        Trainer(
            tiny_config(workdir, train={"max_steps": 10}, checkpoint={"public_key": pub}), log=lambda *_: None
        ).resume()


def test_async_save_gives_the_same_checkpoints_and_reports_the_stall(workdir, tmp_path):
    sync = clone(workdir, tmp_path / "sync")
    Trainer(tiny_config(sync, train={"max_steps": 10}), log=lambda *_: None).run()
    Trainer(tiny_config(workdir, train={"max_steps": 10}, checkpoint={"async_save": True}), log=lambda *_: None).run()
    assert same_weights(final_weights(workdir), final_weights(sync))
    saves = events(workdir, "save")
    assert [s["step"] for s in saves] == [5, 10] and all(s["async"] and s["stall_s"] >= 0 for s in saves)
    assert kiln(["ckpt", "verify", str(list_checkpoints(workdir / "run" / "checkpoints")[-1])]) == 0


def test_time_based_saves_are_async_sharded_and_reported_as_time(workdir):
    """checkpoint.every_seconds beside checkpoint.every: a clock that is always due saves at every step (the flag
    rides the step's all-reduce), async and sharded, each save named `time`; the weights are those of the run."""
    reference = clone(workdir, workdir.parent / "ref")
    Trainer(tiny_config(reference, train={"max_steps": 4}), log=lambda *_: None).run()
    cfg = tiny_config(workdir, train={"max_steps": 4},
                      checkpoint={"every": 1000, "every_seconds": 1e-9, "async_save": True, "format": "sharded"})
    Trainer(cfg, log=lambda *_: None).run()
    saves = events(workdir, "save")
    assert [(s["step"], s["reason"], s["async"], s["format"]) for s in saves] == [
        (k, "time", True, "sharded") for k in range(1, 5)]
    folder = list_checkpoints(workdir / "run" / "checkpoints")[-1]
    assert kiln(["ckpt", "verify", str(folder)]) == 0
    assert same_weights(load_checkpoint(folder)["model"], final_weights(reference))


def test_the_save_clock_asks_only_when_due(monkeypatch):
    import kiln.train.checkpoint.checkpointer as checkpointer

    now = [100.0]
    monkeypatch.setattr(checkpointer.time, "monotonic", lambda: now[0])
    assert SaveClock(None).flags() == {}
    clock = SaveClock(60.0)
    clock.pre_train()
    now[0] = 159.0
    assert clock.flags() == {"save_due": False}
    now[0] = 160.0
    assert clock.flags() == {"save_due": True}
    clock.saved()
    assert clock.flags() == {"save_due": False}


def test_environment_change_warns_or_stops_when_strict(workdir):
    Trainer(tiny_config(workdir, train={"max_steps": 5}), log=lambda *_: None).run()
    folder = list_checkpoints(workdir / "run" / "checkpoints")[-1]
    manifest = read_manifest(folder)
    manifest["env"]["torch"] = "1.0.0"
    write_manifest(folder, **{k: v for k, v in manifest.items() if k not in ("files", "kiln_version")})
    with pytest.raises(KilnError, match="strict_env"):
        Trainer(
            tiny_config(workdir, train={"max_steps": 6}, checkpoint={"strict_env": True}), log=lambda *_: None
        ).run()
    messages = []
    Trainer(tiny_config(workdir, train={"max_steps": 6}), log=messages.append).run()
    assert any("another environment" in m and "torch: 1.0.0 ->" in m for m in messages)


def test_ckpt_list_shows_each_checkpoint_and_whether_it_is_valid(workdir, capsys):
    Trainer(tiny_config(workdir, train={"max_steps": 10}), log=lambda *_: None).run()
    root = workdir / "run" / "checkpoints"
    blob = list_checkpoints(root)[-1] / "optimizer.pt"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    (root / "step-00000011.tmp-1234").mkdir()
    capsys.readouterr()
    assert kiln(["ckpt", "list", str(workdir / "run")]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("step-")}
    assert (
        "valid" in lines["step-00000005"]
        and "INVALID" in lines["step-00000010"]
        and "optimizer.pt" in lines["step-00000010"]
    )
    assert "temporary" in lines["step-00000011.tmp-1234"]


# --- divergence --------------------------------------------------------------------------------

def _spike(trainer: Trainer, steps: set[int]) -> None:
    """Make the batches that the given (1-based) steps of an uninterrupted run read produce a huge
    loss: the trouble is in the data, so after a rollback that skips that data it is gone."""
    batch = trainer.cfg.train.batch_size

    def hook(module, inputs, output):
        bad = module.training and trainer.loader.state.position // batch in steps
        return output * 1e3 if bad else output
    trainer.model.output.register_forward_hook(hook)


def test_injected_divergence_rolls_back_skips_the_data_and_recovers(workdir):
    guards = {"spike_min_history": 5, "spike_zscore": 4.0, "rollback_after": 3, "rollback_window": 10,
              "rollback_lr_factor": 0.5, "rollback_lr_steps": 5}
    trainer = Trainer(tiny_config(workdir, train={"max_steps": 24}, guards=guards), log=lambda *_: None)
    _spike(trainer, {12, 13, 14})
    summary = trainer.run()
    skips, rollbacks = events(workdir, "skip"), events(workdir, "rollback")
    assert [(s["step"], s["reason"]) for s in skips] == [(12, "loss_spike"), (13, "loss_spike"), (14, "loss_spike")]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 10 and rollbacks[0]["data_position"] == 14 * 8
    after = [m for m in events(workdir, "step") if m["step"] > 10][-14:]
    assert after[0]["step"] == 11 and after[0]["lr"] < trainer.lr_at(30) * 10  # lowered learning rate
    assert after[0]["data_position"] == 15 * 8  # the spiking batches are not seen again
    assert summary["steps"] == 24 and summary["rollbacks"] == 1
    assert summary["val_loss_end"] < summary["val_loss_start"]


def test_recurring_divergence_stops_with_a_message(workdir):
    guards = {
        "spike_min_history": 5,
        "spike_zscore": 4.0,
        "rollback_after": 2,
        "rollback_window": 10,
        "max_rollbacks": 1,
    }
    trainer = Trainer(tiny_config(workdir, train={"max_steps": 40}, guards=guards), log=lambda *_: None)
    _spike(trainer, set(range(12, 40)))
    with pytest.raises(KilnError, match=r"training diverged: 2 rollbacks .*metrics.jsonl"):
        trainer.run()


def test_a_checkpoint_with_non_finite_weights_is_never_written(workdir):
    trainer = Trainer(tiny_config(workdir, train={"max_steps": 5}), log=lambda *_: None)
    trainer.run()
    with torch.no_grad():
        trainer.model.norm.weight[0] = float("nan")
    trainer.state.step = 6
    trainer.save()
    assert [p.name for p in list_checkpoints(workdir / "run" / "checkpoints")][-1] == "step-00000005"


# --- hangs ---------------------------------------------------------------------------------------

def _rank_pid(root_pid: int, rank: int) -> int | None:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"KILN_TEST_MARK=" + str(root_pid).encode() in env:
                return int(pid)
    return None


@pytest.mark.slow  # ~55 s; the watchdog and step-timeout unit tests stay in the default suite
def test_a_stalled_rank_is_reported_and_the_group_restarts_and_resumes(workdir, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", workdir, train={"max_steps": 60}, checkpoint={"every": 5},
                       watchdog={"heartbeat_s": 0.5, "stall_timeout_s": 4})
    mark = str(os.getpid())
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "--max-restarts=1", "-m", "kiln", "train", str(cfg)],
                            env={**ENV, "KILN_TEST_MARK": mark}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: last_step(workdir) >= 12, proc)
        pid = _rank_pid(int(mark), 1)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # rank 1 hangs: alive, silent
        out = finish(proc, timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"rank 1 on host {os.uname().nodename} (pid {pid})" in out and "heartbeat stopped" in out
    assert (workdir / "run" / "stacks-rank00000.txt").is_file()
    assert "resumed from" in out and last_step(workdir) == 60


# --- budget --------------------------------------------------------------------------------------

def test_budget_guard_warns_then_checkpoints_and_stops_cleanly(workdir):
    trainer = Trainer(
        tiny_config(
            workdir, train={"max_steps": 10_000}, budget={"device_hours": 1.5 / 3600, "price_per_device_hour": 2.0}
        ),
        log=lambda *_: None,
    )
    summary = trainer.run()
    assert summary["stopped"] == "budget exhausted" and summary["steps"] < 10_000
    assert [b["fraction"] for b in events(workdir, "budget")] == [0.3, 0.6]
    step = events(workdir, "step")[-1]
    assert step["cost_so_far"] == pytest.approx(step["device_hours"] * 2.0) and step["cost_per_1k_steps"] > 0
    assert list_checkpoints(workdir / "run" / "checkpoints")[-1].name == f"step-{summary['steps']:08d}"
