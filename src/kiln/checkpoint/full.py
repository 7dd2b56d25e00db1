"""The full checkpoint format (`checkpoint.format: full`): whole weights and optimizer state, written by rank 0.

Beside the files every checkpoint has (folder.py), a full `step-NNNNNNNN/` holds
  model.safetensors   the weights (no pickle, loads without running code); under FSDP2 the full weights are
                      gathered and written by rank 0, so any world size resumes
  optimizer.pt        AdamW state keyed by parameter name (parallel/optimizer_state.py), read back with
                      torch.load(weights_only=True); any layout loads it by name
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.errors import IntegrityError
from kiln.manifest import staging_dir, write_atomic, write_manifest
from kiln.checkpoint.folder import (check_listed, check_manifest, listed_file, loads_safely, read_small_files,
                                          sign_manifest, step_dir)
from kiln.checkpoint.storage import StreamedWeights, write_safetensors

FILES = ("model.safetensors", "optimizer.pt")  # beside folder.COMMON_FILES

def write_checkpoint(root: Path, step: int, model_state: dict[str, torch.Tensor] | StreamedWeights,
                     optimizer_state: dict,
                     rng_states: list[dict[str, Any]], state: dict[str, Any], config_yaml: str,
                     tokenizer_file: Path, manifest_fields: dict[str, Any], signing_key: str | None = None) -> Path:
    """Write step-NNNNNNNN/ atomically: files, fsync, manifest (+ signature), rename, parent fsync."""
    final = step_dir(root, step)
    with staging_dir(final) as tmp:
        if isinstance(model_state, StreamedWeights):  # one tensor in memory at a time (kiln import --hf)
            write_safetensors(tmp / "model.safetensors", model_state.names, model_state.get)
        else:  # safetensors refuses tensors that share memory (tied embeddings): store each once.
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()},
                      str(tmp / "model.safetensors"))
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


def read_folder(folder: Path, verify: bool = True, weights: bool = True) -> dict[str, Any]:
    """{"model", "optimizer", "rng", "state"}: the weights via safetensors, the rest via weights_only torch.load
    or JSON. `weights=False` leaves the model and optimizer state empty (a rank that receives them by broadcast).
    """
    folder = Path(folder)
    files = check_manifest(folder, verify, weights)
    model, optimizer = (listed_file(folder, name, files) for name in FILES) if weights else (None, None)
    with loads_safely(folder):
        return {
            "model": load_file(str(model)) if weights else {},
            "optimizer": torch.load(optimizer, map_location="cpu", weights_only=True) if weights else {},
            **read_small_files(folder),
        }


def check_loads(folder: Path) -> None:
    """That every file a reader opens is listed in the manifest (folder.check_listed), and the weights, optimizer
    and RNG files open as what they claim to be, without reading their tensors."""
    from safetensors import safe_open

    check_listed(folder, FILES)
    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            f.keys()
        json.loads((folder / "state.json").read_text())
    except Exception as exc:  # SafetensorError, ValueError
        raise IntegrityError(f"{folder}: matches its manifest but does not load ({type(exc).__name__}: "
                             f"{str(exc)[:160]})") from None
    with loads_safely(folder):  # a bare pickle (not torch's zip archive) is refused unread, never unpickled
        for name in ("optimizer.pt", "rng.pt"):
            if not zipfile.is_zipfile(folder / name):
                raise ValueError(f"{name} is not a torch zip archive")
            torch.load(folder / name, map_location="cpu", weights_only=True, mmap=True)
