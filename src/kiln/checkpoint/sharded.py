"""Sharded checkpoints (`checkpoint.format: sharded`, the default whenever a parameter is split over ranks):
every rank writes its own pieces of the weights and optimizer state; any world size and mesh reads them back.

A sharded `step-NNNNNNNN/` holds, beside the files every checkpoint has (folder.py: rng.pt, state.json,
config.yaml, tokenizer.json, manifest.json, manifest.sig):
  model-RRRRR.safetensors      rank R's pieces of the weights (its DTensor local shards), by name
  optimizer-RRRRR.safetensors  rank R's pieces of the AdamW state, keyed `{parameter name}/{state name}`
  index-RRRRR.json             for each key the piece's offsets, shape, global shape and dtype
  index.json                   format, world size, the ranks' files, the optimizer's param_groups (JSON)
A piece held by several ranks (a replicated dimension of an HSDP mesh, a DDP model, the optimizer's step
counters) is written once: a DTensor's by the ranks at coordinate 0 of its replicated mesh dimensions, a
plain tensor's by one of its holders, chosen to balance the bytes each rank writes.

What each kind of parallelism writes, every piece under the whole model's name and global shape (so each
kind reads what any other wrote):
  FSDP2 / HSDP      each parameter's and moment's DTensor shard (rows of dim 0)
  tensor parallel   the DTensor shares: column-parallel rows, row-parallel columns, vocabulary rows of the
                    embeddings and the head; replicated norm weights by the tp rank at coordinate 0
  tp x dp_shard     FSDP2's shard of each tensor-parallel share (_StridedShard, then Shard on one dim):
                    `local_boxes` finds the global rows from torch's own placement arithmetic; a share whose
                    rows have gaps is written as several boxes (`{key}#n` in the file, one index entry each)
  pipeline          each stage its own layers (`layers.5.attention.wq.weight`), embeddings on the first
                    stage, norm and head on the last; index.json holds the param_groups of all stages merged
  expert parallel   each rank's experts as a box along the expert dimension of the whole (n_experts, ...)
                    tensor (`Parallelized.checkpoint_slices`), moments alike; the dense DDP replicas once
Memory: each rank holds its own pieces only (plus one copy of them while an async save writes), never the
model; the index costs a few hundred bytes per piece.

Saving, on every rank: the state dicts of torch.distributed.checkpoint.state_dict (DTensors under FSDP2, no
gather), a CPU snapshot when async, then (in the background when async) write and fsync the rank's three
files, sha256 them, and send the hashes to rank 0 over a gloo group of the checkpoint's own. Rank 0 writes
the small files and manifest.json (the ranks' hashes, its own files hashed by itself) into the staging folder
and commits it by the same rename as the full format (`kiln.manifest.staging_dir`): the folder is not a
checkpoint until every rank's files are in its manifest. Rank 0 holds its own pieces only, never the model.

Loading executes no code: safetensors and JSON only (rng.pt is read with weights_only=True, as in the full
format). Each rank fills its own shard of the model it has (any world size, FSDP2, HSDP, DDP or one process)
from the pieces that overlap it (`storage.PieceIndex.read_box`), reading only those slices: a tp=2
checkpoint loads into one process and back, FSDP2 into tensor parallel, a pipeline's into one model.

Every file is in the manifest, so `kiln ckpt verify`, signing, retention and the fallback to an older
valid checkpoint treat a sharded folder as they treat a full one. The folder must be on a filesystem every
rank sees (a shared out_dir); a rank that cannot see the staging folder stops the save with a message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint.folder import check_listed, check_manifest, listed_file, loads_safely, read_small_files
from kiln.checkpoint.storage import FROM_SAFETENSORS, PieceIndex
from kiln.errors import IntegrityError
from kiln.manifest import MANIFEST, read_manifest
from kiln.names import listed_name

INDEX = "index.json"
FORMAT = "kiln-sharded"
KINDS = ("model", "optimizer")


def is_sharded(folder: Path) -> bool:
    return (Path(folder) / INDEX).is_file()


# --- reading ---------------------------------------------------------------------------------

def read_index(folder: Path, files: dict[str, Any] | None = None) -> dict[str, Any]:
    """index.json, a file the folder's manifest lists (`files`: its files, read from the folder when not given)."""
    files = read_manifest(folder)["files"] if files is None else files
    path = listed_name(folder, INDEX, files, Path(folder) / MANIFEST)
    try:
        index = json.loads(path.read_text())
        if index.get("format") != FORMAT or not isinstance(index.get("index_files"), list):
            raise ValueError(f"format {index.get('format')!r}, not {FORMAT!r}")
        return index
    except (OSError, ValueError, AttributeError) as exc:
        raise IntegrityError(f"{path}: not a Kiln sharded-checkpoint index ({exc})") from None


def pieces(folder: Path, kind: str = "model") -> PieceIndex:
    """The pieces of `kind` in a sharded checkpoint folder (use as a context manager: it keeps files open)."""
    files = read_manifest(folder)["files"]
    return PieceIndex(folder, read_index(folder, files)["index_files"], kind, files)


def check_loads(folder: Path) -> None:
    """That the folder opens as what it claims, without reading tensors: the index, every piece's header
    (key, shape, dtype in its file), that the pieces tile each tensor exactly, rng.pt and state.json."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    index = read_index(folder, manifest["files"])
    check_listed(folder, index["index_files"], manifest["files"])
    for kind in index.get("kinds", KINDS):
        with pieces(folder, kind) as p:
            p.check_complete()
            p.check_files()
    try:
        torch.load(folder / "rng.pt", map_location="cpu", weights_only=True, mmap=True)
        json.loads((folder / "state.json").read_text())
    except Exception as exc:  # UnpicklingError, RuntimeError (not a zip), ValueError: the file does not load
        raise IntegrityError(f"{folder}: matches its manifest but does not load ({type(exc).__name__}: "
                             f"{str(exc)[:160]})") from None


def read_folder(folder: Path, verify: bool = True, weights: bool = True) -> dict[str, Any]:
    """{"model", "optimizer", "rng", "state"} as full.read_folder gives them: the weights assembled whole (or empty
    when not `weights`), the optimizer state None (`load` reads it piece by piece, into the model it fills)."""
    folder = Path(folder)
    check_manifest(folder, verify, weights)
    with loads_safely(folder):
        return {"model": full_model_state(folder) if weights else {}, "optimizer": None, **read_small_files(folder)}


def full_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every weight, whole (assembled from the pieces): for eval and generate, which hold the model anyway."""
    with pieces(folder, "model") as p:
        return dict(p.tensors(p.keys()))


def model_shapes(folder: Path) -> dict[str, torch.Tensor]:
    """{name: a meta tensor of the weight's global shape}: sizes without reading any tensor."""
    with pieces(folder, "model") as p:
        return {k: torch.empty(p.global_shape(k), dtype=p.dtype(k), device="meta") for k in p.keys()}


class CheckpointWeights:
    """A checkpoint's weights read one tensor at a time, full or sharded: `keys()`, `shape(k)`, `dtype(k)` from
    the headers and indexes, `get(k)` the whole tensor (a sharded one assembled from its pieces). Memory: the
    tensor asked for (its file pages are unmapped after it). Use as a context manager (it keeps the headers open)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self._pieces = pieces(folder, "model") if is_sharded(folder) else None
        self._path = None if self._pieces else listed_file(folder, "model.safetensors")
        self._file = None if self._pieces else safe_open(str(self._path), framework="pt")

    def __enter__(self) -> "CheckpointWeights":
        if self._file is not None:
            self._file = self._file.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._pieces is not None:
            self._pieces.close()
        else:
            self._file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._pieces.keys() if self._pieces is not None else list(self._file.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        if self._pieces is not None:
            return tuple(self._pieces.global_shape(key))
        return tuple(self._file.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        if self._pieces is not None:
            return self._pieces.dtype(key)
        return self.get_meta(key).dtype

    def get_meta(self, key: str) -> torch.Tensor:
        """A meta tensor of `key`'s shape and dtype (nothing read)."""
        if self._pieces is not None:
            return torch.empty(self.shape(key), dtype=self.dtype(key), device="meta")
        s = self._file.get_slice(key)
        return torch.empty(tuple(s.get_shape()), dtype=FROM_SAFETENSORS[s.get_dtype()], device="meta")

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor, its file's memory map dropped after it (PieceIndex.full): one tensor's pages held."""
        if self._pieces is not None:
            return self._pieces.full(key)
        from safetensors import safe_open

        with safe_open(str(self._path), framework="pt") as f:
            return f.get_tensor(key)
