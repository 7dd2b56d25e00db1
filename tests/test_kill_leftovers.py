"""A kill -9 leaves nothing behind (issue 45, items 7-9): retention sets a checkpoint aside before removing it, a
re-export never leaves its output missing nor its staging folder behind, and an export pins the checkpoint it
reads so that a running training's retention spares it. Kills are real SIGKILLs of a subprocess at the exact call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from kiln.errors import KilnError
from kiln.lock import pin_path, pinned
from kiln.manifest import read_manifest, remove_stale_staging, staging_dir, verify_folder, write_manifest
from kiln.checkpoint import list_checkpoints, retain, rng_state, write_checkpoint
from test_safety import ENV


def fake_checkpoint(root: Path, step: int) -> Path:
    """A committed folder with a checkpoint's manifest and file names (retention looks at nothing else)."""
    final = root / f"step-{step:08d}"
    with staging_dir(final) as tmp:
        for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "config.yaml", "tokenizer.json"):
            (tmp / name).write_bytes(name.encode() * 1000)
        write_manifest(tmp, stage="checkpoint", step=step)
    return final


def killed(code: str, *args: str) -> None:
    """Run `code` in a fresh python; it must die by SIGKILL (the hook it installs sends it)."""
    hook = ("import os, signal, sys\n"
            "def die(*_, **__):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", hook + code, *args], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]


# --- 7. retention: set aside, then removed; what a killed removal left is removed by the next run ---------

KILL_IN_RETENTION = """
from pathlib import Path
from kiln.checkpoint import retain
real, calls = os.unlink, []
def unlink(*a, **k):  # dies after the first file of the removal is gone
    calls.append(a)
    if len(calls) == 2:
        die()
    return real(*a, **k)
os.unlink = unlink
retain(Path(sys.argv[1]), 1, None, None)
"""


def test_a_removal_killed_half_way_leaves_no_checkpoint_and_the_next_run_removes_it(tmp_path, capsys):
    from kiln.cli import main as kiln

    root = tmp_path / "run" / "checkpoints"
    first, second = fake_checkpoint(root, 1), fake_checkpoint(root, 2)
    killed(KILL_IN_RETENTION, str(root))
    assert list_checkpoints(root) == [second]  # step 1 is not a half-deleted checkpoint: it was set aside first
    [left] = [p for p in root.iterdir() if p.name.startswith("step-00000001")]
    assert left.name.startswith("step-00000001.old-") and (left / "manifest.json").is_file()
    assert kiln(["ckpt", "list", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"{left.name}  skipped  left by a killed removal" in out and "step-00000001  INVALID" not in out
    assert remove_stale_staging(first, "checkpoint") == [left]  # what `kiln train` runs first
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]


def test_a_half_deleted_checkpoint_of_an_older_kiln_is_listed_as_such_and_removed_by_retention(tmp_path, capsys):
    from kiln.cli import main as kiln

    root = tmp_path / "run" / "checkpoints"
    half, kept = fake_checkpoint(root, 1), fake_checkpoint(root, 2)
    for name in ("manifest.json", "model.safetensors", "config.yaml"):  # rmtree in place, killed: no manifest
        (half / name).unlink()
    mine = root / "step-00000000"  # a checkpoint's name without a manifest, but a user's file in it
    mine.mkdir()
    (mine / "state.json").write_text("{}")
    (mine / "notes.txt").write_text("mine")
    assert kiln(["ckpt", "list", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step-00000001  skipped  left by a killed removal" in out and "step-00000000  INVALID" in out
    assert retain(root, 1, None, None) == [half]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000000", "step-00000002"]
    assert (mine / "notes.txt").read_text() == "mine" and verify_folder(kept)


# --- 8. re-export: never without its output, and no NAME.tmp-* / NAME.old-* left -----------------------

def tiny_checkpoint(prepared, root: Path) -> Path:
    cfg = tiny_config(root / "out")
    from kiln.model.build import build_model

    torch.manual_seed(0)
    model = build_model(cfg.model, 1024, cfg.pack.seq_len)
    return write_checkpoint(root / "run" / "checkpoints", 1, model.state_dict(), {}, [rng_state()],
                            {"step": 1, "tokens_seen": 0}, cfg.to_yaml(),
                            prepared.out / "tokenizer" / "tokenizer.json", {})


KILL_IN_REEXPORT = """
from pathlib import Path
import kiln.manifest
from kiln.ops.export import export_hf
out = Path(sys.argv[2])
if sys.argv[3] == "between renames":
    kiln.manifest._exchange = lambda a, b: False  # a filesystem without an atomic swap: two renames
    real = os.replace
    def replace(src, dst):
        if Path(dst) == out:  # the new folder's rename into place: the old one is already aside
            die()
        return real(src, dst)
    os.replace = replace
else:  # after the swap, while the old export is being removed
    kiln.manifest.remove_folder = die
export_hf(Path(sys.argv[1]), out)
"""


@pytest.mark.parametrize("where", ["between renames", "after the swap"])
def test_a_killed_re_export_is_complete_after_the_rerun_which_leaves_nothing_else(prepared, tmp_path, where):
    from kiln.ops.export import export_hf

    ckpt = tiny_checkpoint(prepared, tmp_path)
    out = tmp_path / "hf" / "model"
    export_hf(ckpt, out)
    killed(KILL_IN_REEXPORT, str(ckpt), str(out), where)
    names = sorted(p.name.split("-")[0] for p in out.parent.iterdir() if not p.name.startswith("."))
    if where == "after the swap":  # the output was never missing: the new one is in place
        assert names == ["model", "model.tmp"] and verify_folder(out)
    else:
        assert names == ["model.old", "model.tmp"]
    export_hf(ckpt, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]
    assert verify_folder(out)["stage"] == "hf-export"


def test_a_committed_staging_folder_becomes_the_output_when_a_kill_left_none(tmp_path):
    out = tmp_path / "docs"
    with staging_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
        write_manifest(tmp, stage="data")
    os.replace(out, tmp_path / "docs.tmp-0123abcd")  # a finished staging folder (no mark) that never got renamed in
    assert remove_stale_staging(out, "data") == [] and (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


# --- 9. export pins what it reads: retention spares it -------------------------------------------------

def test_retention_spares_a_pinned_checkpoint_and_removes_it_at_the_next_save(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    first, second = fake_checkpoint(root, 1), fake_checkpoint(root, 2)
    with pinned(first, "gone"):
        assert retain(root, 1, None, None) == []
        assert verify_folder(first)["step"] == 1
    assert retain(root, 1, None, None) == [first]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]  # no pin file left either
    with pytest.raises(KilnError, match=r"step-00000001 was removed before it could be read"):
        with pinned(first, "was removed before it could be read"):
            pass
    assert not pin_path(first).exists() and list_checkpoints(root) == [second]


def test_export_while_retention_runs_succeeds_and_the_checkpoint_goes_afterwards(prepared, tmp_path, monkeypatch):
    import kiln.ops.export as export

    ckpt = tiny_checkpoint(prepared, tmp_path)
    root = ckpt.parent
    write = export._write_hf_weights
    newer: list[Path] = []

    def saving_meanwhile(*args, **kwargs):  # a training saves step 2 (keep_last=1) in the middle of the export
        newer.append(fake_checkpoint(root, 2))
        assert retain(root, 1, None, None) == []
        return write(*args, **kwargs)

    monkeypatch.setattr(export, "_write_hf_weights", saving_meanwhile)
    result = export.export_hf(ckpt, tmp_path / "hf")
    assert result["model_type"] == "llama" and read_manifest(tmp_path / "hf")["step"] == 1
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 1024
    assert retain(root, 1, None, None) == [ckpt] and list_checkpoints(root) == newer


def test_a_checkpoint_that_vanishes_while_being_verified_is_one_integrity_line(tmp_path, monkeypatch):
    import kiln.manifest as manifest
    from kiln.errors import IntegrityError

    ckpt = fake_checkpoint(tmp_path / "run" / "checkpoints", 1)
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p, *a: (os.unlink(p), real(p, *a))[1])
    with pytest.raises(IntegrityError, match=r"config.yaml: removed while being read; read the folder again"):
        verify_folder(ckpt)
