"""Atomic, verified checkpoints: `checkpoints/step-NNNNNNNN/` committed by rename after its manifest.

A checkpoint folder holds:
  model.safetensors   weights (no pickle, loads without running code); under FSDP2 the
                      full weights are gathered and written by rank 0, so any world size resumes
  optimizer.pt        AdamW state, read back with torch.load(weights_only=True)
  rng.pt              RNG states of every rank (python, numpy, torch CPU, the rank's own CUDA device)
  state.json          step, tokens seen, loader, guards, budget, schedule, counters
  config.yaml         the resolved config of the run
  tokenizer.json      the tokenizer, so the folder alone can evaluate and generate
  manifest.json       size and sha256 of each file above, step, tokens seen, config hash, data
                      fingerprint, world size, environment fingerprint, Kiln version; written last
  manifest.sig        optional Ed25519 signature of manifest.json's bytes
A sharded checkpoint (checkpoint.format: sharded) holds each rank's pieces of the weights and optimizer
state instead of model.safetensors and optimizer.pt: see train/sharded_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import (HASH_THREADS, MANIFEST, read_manifest, staging_dir, verify_folder, write_atomic,
                           write_manifest)

STEP_DIR = re.compile(r"^step-(\d{8})$")
SIGNATURE = "manifest.sig"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def step_of(folder: Path) -> int:
    return int(STEP_DIR.match(Path(folder).name).group(1))


# --- RNG -------------------------------------------------------------------------------------

def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states as tensors and plain lists, so they load with weights_only=True.

    CUDA: only this rank's own device (`device`), not every visible one, so a resume where each process sees
    fewer GPUs (a launcher that masks them) restores what it saved instead of failing on a missing index.
    """
    py = random.getstate()
    np_state = np.random.get_state()
    cuda = device is not None and device.type == "cuda"
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if cuda else None,
    }


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device is None or device.type != "cuda" or cuda is None or (isinstance(cuda, list) and not cuda):
        return
    if isinstance(cuda, list):  # written before states were per device: every visible device's, by index
        index = device.index or 0
        cuda = cuda[index] if index < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(cuda, device)


# --- signing ---------------------------------------------------------------------------------

def _read_key(path: str, private: bool):
    from cryptography.hazmat.primitives import serialization

    try:
        data = Path(path).read_bytes()
        if private:
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_pem_public_key(data)
    except (OSError, ValueError) as exc:
        kind = "checkpoint.signing_key" if private else "checkpoint.public_key"
        raise KilnError(f"{kind} {path}: not a readable Ed25519 PEM key ({exc})") from None


def sign_manifest(folder: Path, key_path: str) -> None:
    key = _read_key(key_path, private=True)
    write_atomic(Path(folder) / SIGNATURE, key.sign((Path(folder) / MANIFEST).read_bytes()).hex())


def verify_signature(folder: Path, public_key_path: str) -> None:
    from cryptography.exceptions import InvalidSignature

    sig = Path(folder) / SIGNATURE
    if not sig.is_file():
        raise IntegrityError(f"{folder}: unsigned, but checkpoint.public_key requires a signature ({SIGNATURE})")
    try:
        _read_key(public_key_path, private=False).verify(
            bytes.fromhex(sig.read_text().strip()), (Path(folder) / MANIFEST).read_bytes()
        )
    except (InvalidSignature, ValueError):
        raise IntegrityError(
            f"{folder}/{SIGNATURE}: signature does not match manifest.json under {public_key_path}"
        ) from None


# --- saving ----------------------------------------------------------------------------------

def snapshot(obj):
    """A CPU copy of every tensor in a (nested) state: what a background writer owns while training goes on.

    GPU tensors are copied into pinned host buffers with non-blocking copies and one synchronize at the end,
    so the snapshot costs no GPU memory (a clone on the device would add 8 bytes per parameter for Adam's
    moments for the whole write) and overlaps the copies. A GPU run confirms the stall it measures.
    """
    copies = _snapshot(obj)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return copies


def _snapshot(obj):
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            host = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=True)
            return host.copy_(obj.detach(), non_blocking=True)
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    return obj


def all_finite(*states: dict) -> bool:
    """Never commit a checkpoint whose weights or optimizer state hold NaN/inf."""
    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)
    return all(bool(torch.isfinite(t).all()) for s in states for t in tensors(s) if t.is_floating_point())


def write_checkpoint(root: Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                     rng_states: list[dict[str, Any]], state: dict[str, Any], config_yaml: str,
                     tokenizer_file: Path, manifest_fields: dict[str, Any], signing_key: str | None = None) -> Path:
    """Write step-NNNNNNNN/ atomically: files, fsync, manifest (+ signature), rename, parent fsync."""
    final = step_dir(root, step)
    with staging_dir(final) as tmp:
        # safetensors refuses tensors that share memory (tied embeddings): store each once.
        save_file(
            {k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()}, str(tmp / "model.safetensors")
        )
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_states, tmp / "rng.pt")
        write_atomic(tmp / "state.json", json.dumps(state, indent=1))
        write_atomic(tmp / "config.yaml", config_yaml)
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        write_manifest(tmp, stage="checkpoint", step=step, tokens_seen=state.get("tokens_seen"),
                       world_size=len(rng_states), **manifest_fields)
        if signing_key:
            sign_manifest(tmp, signing_key)
    return final


def retain(root: Path, keep_last: int, keep_every: int | None, best_step: int | None) -> list[Path]:
    """Delete committed checkpoints that no rule keeps: the last K, every M-th, the best. Returns the deleted."""
    ckpts = list_checkpoints(root)
    keep = set(ckpts[-keep_last:])
    keep |= {c for c in ckpts if keep_every and step_of(c) % keep_every == 0}
    keep |= {c for c in ckpts if best_step is not None and step_of(c) == best_step}
    gone = [c for c in ckpts if c not in keep and _written_by_kiln(c)]  # never a folder Kiln cannot vouch for
    for c in gone:
        shutil.rmtree(c, ignore_errors=True)
    return gone


def _written_by_kiln(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("stage") == "checkpoint"
    except (OSError, ValueError, AttributeError):
        return False


class Saver:
    """Writes checkpoints on rank 0, synchronously or in a background thread; never two at once.

    Async: the caller hands over CPU copies (the snapshot, taken at the step boundary),
    training continues while the thread writes. The time the loop waited is the stall.
    `busy`: a context the loop waits in (a synchronous write, or the wait for a background one): the
    trainer's `Watchdog.saving`, so a long save is not reported as a stalled rank.
    """

    def __init__(self, async_save: bool, log: Callable[[str], None] = print) -> None:
        self.async_save, self.log = async_save, log
        self.busy: Callable[[], Any] = contextlib.nullcontext
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_write_s: float | None = None

    def wait(self) -> float:
        """Block until the previous save is committed; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            with self.busy():
                self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise KilnError(f"background checkpoint save failed: {err}") from err
        return time.perf_counter() - t0

    def save(self, write: Callable[[], Any]) -> float:
        """Run `write` (which commits one checkpoint); returns the stall in seconds."""
        stall = self.wait()
        if not self.async_save:
            t0 = time.perf_counter()
            with self.busy():
                write()
            self.last_write_s = time.perf_counter() - t0
            return stall + self.last_write_s

        def run():
            t0 = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # reported on the next wait()
                self.error = exc
            self.last_write_s = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="kiln-checkpoint", daemon=False)
        self._thread.start()
        return stall


# --- reading ---------------------------------------------------------------------------------

def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def verify_checkpoint(folder: Path, public_key: str | None = None) -> dict[str, Any]:
    """Sizes and sha256 of every file (HASH_THREADS files at once), the signature when a key is given, then that
    each piece loads without executing code."""
    manifest = verify_folder(folder, workers=HASH_THREADS)
    if _sharded(folder):
        if public_key:
            verify_signature(folder, public_key)
        check_loads(folder)
        return manifest
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
        if name not in manifest["files"]:
            raise IntegrityError(f"{folder}: {name} is not in manifest.json; the checkpoint is incomplete")
    if public_key:
        verify_signature(folder, public_key)
    load_checkpoint(folder, verify=False)
    return manifest


def latest_valid(root: Path, log: Callable[[str], None] = print, public_key: str | None = None) -> Path | None:
    """The newest checkpoint that verifies; a corrupt newer one is reported (file and hash) and skipped."""
    return latest_valid_of(list_checkpoints(root), log, public_key)


def latest_valid_of(folders: list[Path], log: Callable[[str], None] = lambda *_: None,
                    public_key: str | None = None) -> Path | None:
    for folder in reversed(folders):
        try:
            verify_folder(folder, workers=HASH_THREADS)
            if public_key:
                verify_signature(folder, public_key)
            check_loads(folder)
            return folder
        except IntegrityError as exc:
            log(f"skipping corrupt checkpoint: {exc}")
    return None


def check_loads(folder: Path) -> None:
    """That the weights, optimizer and RNG files open as what they claim to be, without reading their tensors:
    a checkpoint whose manifest verifies but whose files do not load is skipped like a corrupt one."""
    from safetensors import safe_open

    if _sharded(folder):
        from kiln.train.sharded_checkpoint import check_loads as check_sharded

        return check_sharded(folder)

    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            f.keys()
        for name in ("optimizer.pt", "rng.pt"):
            torch.load(folder / name, map_location="cpu", weights_only=True, mmap=True)
        json.loads((folder / "state.json").read_text())
    except Exception as exc:  # SafetensorError, UnpicklingError, RuntimeError (not a zip), ValueError
        raise IntegrityError(f"{folder}: matches its manifest but does not load ({type(exc).__name__}: "
                             f"{str(exc)[:160]})") from None


# What a rank other than 0 reads on resume: rank 0 reads the weights and broadcasts them.
SMALL_FILES = {"rng.pt", "state.json"}


def load_checkpoint(folder: Path, verify: bool = True, weights: bool = True) -> dict[str, Any]:
    """Read a checkpoint back: weights via safetensors, the rest via weights_only torch.load or JSON.
    `weights=False` leaves the model and optimizer state empty (a rank that receives them by broadcast).
    A sharded checkpoint's weights are assembled whole; its optimizer state is None (the trainer reads it
    piece by piece, sharded_checkpoint.load)."""
    folder = Path(folder)
    sharded = _sharded(folder)
    if verify:
        verify_folder(folder, only=None if weights else SMALL_FILES)
    else:
        read_manifest(folder)
    try:
        return {
            "model": (_sharded_model(folder) if sharded else load_file(str(folder / "model.safetensors")))
            if weights else {},
            "optimizer": None if sharded else
            torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True) if weights else {},
            "rng": torch.load(folder / "rng.pt", map_location="cpu", weights_only=True),
            "state": json.loads((folder / "state.json").read_text()),
        }
    except Exception as exc:  # UnpicklingError for a pickle that is not plain data, SafetensorError, ...
        raise IntegrityError(f"{folder}: cannot be loaded safely ({type(exc).__name__}: {str(exc)[:200]})") from None


def _sharded(folder: Path) -> bool:
    from kiln.train.sharded_checkpoint import is_sharded

    return is_sharded(folder)


def _sharded_model(folder: Path) -> dict[str, torch.Tensor]:
    from kiln.train.sharded_checkpoint import full_model_state

    return full_model_state(folder)


def checkpoint_table(root: Path, public_key: str | None = None) -> list[dict[str, Any]]:
    """One row per checkpoint folder (temporary ones too): step, valid or why not, tokens, val loss."""
    rows = []
    root = Path(root)
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or not p.name.startswith("step-"):
            continue
        row: dict[str, Any] = {"path": str(p), "step": None, "valid": False, "problem": None}
        if not STEP_DIR.match(p.name):
            row["problem"] = "temporary folder of an unfinished save (never loaded)"
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


def checkpoint_config(folder: Path):
    from kiln.config import load_config

    path = Path(folder) / "config.yaml"
    if not path.is_file():
        raise KilnError(f"{folder}: no config.yaml; is this a Kiln checkpoint folder (run/checkpoints/step-NNNNNNNN)?")
    return load_config(path)
