"""Atomic, verified checkpoints: `checkpoints/step-NNNNNNNN/` committed by rename after its manifest.

A checkpoint folder holds:
  model.safetensors   weights (no pickle, loads without running code)
  optimizer.pt        AdamW state, read back with torch.load(weights_only=True)
  rng.pt              RNG states of every rank (python, numpy, torch CPU and CUDA)
  state.json          step, tokens seen, loader state, metrics needed to continue
  config.yaml         the resolved config of the run
  tokenizer.json      the tokenizer, so the folder alone can evaluate and generate
  manifest.json       size and sha256 of each file above, written last
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import read_manifest, staging_dir, verify_folder, write_atomic, write_manifest

STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _plain_rng(state: dict[str, Any]) -> dict[str, Any]:
    """RNG states as tensors and plain lists, so they load with weights_only=True."""
    py = state["python"]
    np_state = state["numpy"]
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": state["torch"], "cuda": state["cuda"],
    }


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                    rng_states: list[dict[str, Any]], state: dict[str, Any], config_yaml: str,
                    tokenizer_file: Path, keep_last: int) -> Path:
    """Write step-NNNNNNNN/ atomically (rank 0 only), then drop all but the newest `keep_last`."""
    final = step_dir(root, step)
    with staging_dir(final) as tmp:
        # safetensors refuses tensors that share memory (tied embeddings): store each once.
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save([_plain_rng(s) for s in rng_states], tmp / "rng.pt")
        write_atomic(tmp / "state.json", json.dumps(state, indent=1))
        write_atomic(tmp / "config.yaml", config_yaml)
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        write_manifest(tmp, stage="checkpoint", step=step, tokens_seen=state.get("tokens_seen"),
                       world_size=len(rng_states), config_hash=state.get("config_hash"))
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def verify_checkpoint(folder: Path) -> dict[str, Any]:
    """Sizes and sha256 of every file, then that each piece loads without executing code."""
    manifest = verify_folder(folder)
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
        if name not in manifest["files"]:
            raise IntegrityError(f"{folder}: {name} is not in manifest.json; the checkpoint is incomplete")
    load_checkpoint(folder, verify=False)
    return manifest


def latest_valid(root: Path, log=print) -> Path | None:
    """The newest checkpoint that verifies; a corrupt newer one is reported and skipped."""
    for folder in reversed(list_checkpoints(root)):
        try:
            verify_folder(folder)
            return folder
        except IntegrityError as exc:
            log(f"skipping corrupt checkpoint: {exc}")
    return None


def load_checkpoint(folder: Path, verify: bool = True) -> dict[str, Any]:
    """Read a checkpoint back: weights via safetensors, the rest via weights_only torch.load or JSON."""
    folder = Path(folder)
    if verify:
        verify_folder(folder)
    else:
        read_manifest(folder)
    try:
        return {
            "model": load_file(str(folder / "model.safetensors")),
            "optimizer": torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True),
            "rng": torch.load(folder / "rng.pt", map_location="cpu", weights_only=True),
            "state": json.loads((folder / "state.json").read_text()),
        }
    except Exception as exc:  # UnpicklingError for a pickle that is not plain data, SafetensorError, ...
        raise IntegrityError(f"{folder}: cannot be loaded safely ({type(exc).__name__}: {str(exc)[:200]})") from None


def checkpoint_config(folder: Path):
    from kiln.config import load_config

    path = Path(folder) / "config.yaml"
    if not path.is_file():
        raise KilnError(f"{folder}: no config.yaml; is this a Kiln checkpoint folder (run/checkpoints/step-NNNNNNNN)?")
    return load_config(path)
