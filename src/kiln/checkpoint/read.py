"""Reading a checkpoint of either format, the one way every reader does: load it, check that it verifies and
loads, pick the newest valid one of a run, and list a run's checkpoints with why each is valid or not. The
format is the folder's own (sharded.is_sharded), whatever the run's checkpoint.format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from kiln.errors import IntegrityError
from kiln.manifest import HASH_THREADS, verify_folder
from kiln.checkpoint import full, sharded
from kiln.checkpoint.folder import (STEP_DIR, check_step, half_deleted, list_checkpoints, step_of,
                                          verify_signature)


def load_checkpoint(folder: Path, verify: bool = True, weights: bool = True) -> dict[str, Any]:
    """Read a checkpoint back: {"model", "optimizer", "rng", "state"}, executing no code (full.read_folder).
    `weights=False` leaves the model and optimizer state empty (a rank that receives them by broadcast).
    A sharded checkpoint's weights are assembled whole; its optimizer state is None (the trainer reads it
    piece by piece, sharded.load)."""
    read = sharded.read_folder if sharded.is_sharded(folder) else full.read_folder
    return read(folder, verify, weights)


def check_loads(folder: Path) -> None:
    """That the weights, optimizer and RNG files open as what they claim to be, without reading their tensors:
    a checkpoint whose manifest verifies but whose files do not load is skipped like a corrupt one."""
    (sharded.check_loads if sharded.is_sharded(folder) else full.check_loads)(folder)


def verify_checkpoint(folder: Path, public_key: str | None = None) -> dict[str, Any]:
    """Sizes and sha256 of every file (HASH_THREADS files at once), the signature when a key is given, that every
    file a reader opens is listed (folder.check_listed), then that each piece loads without executing code."""
    manifest = verify_folder(folder, workers=HASH_THREADS)
    check_step(folder, manifest)
    if public_key:
        verify_signature(folder, public_key)
    check_loads(folder)  # first: every file a reader opens is listed (so hashed above), else one line naming it
    if not sharded.is_sharded(folder):
        load_checkpoint(folder, verify=False)
    return manifest


def latest_valid(root: Path, log: Callable[[str], None] = print, public_key: str | None = None) -> Path | None:
    """The newest checkpoint that verifies; a corrupt newer one is reported (file and hash) and skipped."""
    return latest_valid_of(list_checkpoints(root), log, public_key)


def latest_valid_of(folders: list[Path], log: Callable[[str], None] = lambda *_: None,
                    public_key: str | None = None) -> Path | None:
    for folder in reversed(folders):
        try:
            check_step(folder, verify_folder(folder, workers=HASH_THREADS))
            if public_key:
                verify_signature(folder, public_key)
            check_loads(folder)
            return folder
        except IntegrityError as exc:
            log(f"skipping corrupt checkpoint: {exc}")
    return None


def checkpoint_table(root: Path, public_key: str | None = None) -> list[dict[str, Any]]:
    """One row per checkpoint folder (temporary ones too): step, valid or why not, tokens, val loss."""
    rows = []
    root = Path(root)
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or not p.name.startswith("step-"):
            continue
        row: dict[str, Any] = {"path": str(p), "step": None, "valid": False, "problem": None}
        leftover = ".old-" in p.name or half_deleted(p)  # of a removal (retention) that was killed
        if leftover or not STEP_DIR.match(p.name):
            row["problem"] = ("left by a killed removal (never loaded); the next `kiln train` removes it" if leftover
                              else "temporary folder of an unfinished save (never loaded)")
            rows.append(row)
            continue
        try:
            m = verify_checkpoint(p, public_key)
            state = json.loads((p / "state.json").read_text())
            row.update(step=m["step"], valid=True, tokens_seen=m.get("tokens_seen"),
                       val_loss=state.get("history", {}).get("val_loss", {}).get(str(m["step"])))
        except IntegrityError as exc:
            row.update(step=step_of(p), problem=str(exc))
        rows.append(row)
    return rows
