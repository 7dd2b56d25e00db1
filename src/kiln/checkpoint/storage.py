"""The storage layer of sharded checkpoints: pieces of tensors in safetensors files, located by JSON indexes.

Nothing here runs code on load: the tensor files are safetensors (a JSON header and raw bytes) and the
indexes are JSON, so there is no pickle anywhere (unlike torch.distributed.checkpoint's `.metadata`).

A piece is one box of a tensor: its `offsets` into the tensor's `global_shape` and its own `shape`. Each
rank writes one `{kind}-RRRRR.safetensors` per kind (model, optimizer) holding the pieces it owns, under
the tensor's key, and `index-RRRRR.json` saying, for each key, the piece's file, offsets, shape, the
global shape and the dtype. A rank whose share of a tensor is not one box (a strided DTensor placement)
writes it as several boxes: the index lists them, each stored in the file under `{key}#{n}` (`stored`).
`PieceIndex` reads every rank's index and `read_box` assembles any box (another world size's shard, or the
whole tensor) from the pieces that overlap it, reading only the slices it needs (safetensors `get_slice`
reads from a memory map).

Memory: a writer holds only what it is given; a reader holds the box it fills, plus the indexes (one
entry per piece: a few hundred bytes times tensors times ranks).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.errors import IntegrityError
from kiln.manifest import read_manifest
from kiln.names import listed_name

INDEX_VERSION = 1

# safetensors' dtype names (the header's "dtype"), both ways.
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_TORCH_DTYPES = {str(dt).removeprefix("torch."): dt for dt in _ST_DTYPES}
FROM_SAFETENSORS = {v: k for k, v in _ST_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str, where: Path) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise IntegrityError(f"{where}: unknown dtype {name!r} in the index") from None


def rank_file(kind: str, rank: int, ext: str = "safetensors") -> str:
    return f"{kind}-{rank:05d}.{ext}"


@dataclass(frozen=True)
class Piece:
    """Where one box of a tensor lives: `file` (relative to the folder) under `key`."""
    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    stored: str = ""  # its key in `file` when not the tensor's own (one of several boxes of a rank's share)

    def entry(self) -> dict:
        entry = {"file": self.file, "offsets": list(self.offsets), "shape": list(self.shape),
                 "global_shape": list(self.global_shape), "dtype": self.dtype}
        return {**entry, "stored": self.stored} if self.stored else entry


def write_safetensors(path: Path, names: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      tensor_for: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file one tensor at a time: the header from (name, dtype, shape), then each tensor's
    bytes as `tensor_for(name)` returns it, so at most one tensor is in memory (safetensors' own save_file
    holds every tensor plus a bytes copy of each). fsynced. Returns the bytes written.

    The layout is safetensors' own: an 8-byte little-endian header length, the JSON header (padded with
    spaces to a multiple of 8), then the tensors back to back in header order.
    """
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in names:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in names:
            t = tensor_for(name).detach()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path}: {name} is {t.dtype} {tuple(t.shape)}, the header says {dtype} {shape}")
            data = t.cpu().contiguous().reshape(-1)
            if data.numel():
                f.write(memoryview(data.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


@dataclass(frozen=True)
class StreamedWeights:
    """Weights given one tensor at a time: `names` [(name, dtype, shape)] in file order, `get(name)` the tensor
    (read when the writer reaches it): what write_safetensors takes, for a writer that never holds them all."""
    names: list[tuple[str, torch.dtype, tuple[int, ...]]]
    get: Callable[[str], torch.Tensor]


def write_pieces(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One rank's pieces of one kind, in one file (each key once)."""
    names = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    write_safetensors(path, names, tensors.__getitem__)


def write_index(path: Path, pieces: dict[str, dict[str, Piece | list[Piece]]]) -> None:
    """One rank's index: for each kind (model, optimizer), each key's piece (or pieces: a list)."""
    from kiln.manifest import fsync_dir

    with open(path, "w") as f:
        json.dump({"version": INDEX_VERSION,
                   "pieces": {kind: {k: [q.entry() for q in p] if isinstance(p, list) else p.entry()
                                     for k, p in of.items()} for kind, of in pieces.items()}}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


class PieceIndex:
    """Every piece of every tensor of one kind (model, optimizer) of a sharded checkpoint folder, read from the
    ranks' index files.

    Every index file and every piece's `file` (of every kind: a tampered optimizer file stops eval too) must be a
    plain name inside the folder that the folder's manifest lists with its size and sha256 (`kiln.names.
    listed_name`; `files`: the manifest's files, read from the folder when not given), so the hashes that `kiln
    ckpt verify` checks cover every byte loaded; anything else is an IntegrityError naming the index and the
    entry, before any tensor file is opened."""

    def __init__(self, folder: Path, index_files: Iterable[str], kind: str,
                 files: Mapping[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        files = read_manifest(self.folder)["files"] if files is None else files
        self.pieces: dict[str, list[Piece]] = {}
        listed: set[str] = set()
        for name in index_files:
            path = listed_name(self.folder, name, files, self.folder / "index.json")
            try:
                data = json.loads(path.read_text())
                for of_kind, entries in data["pieces"].items():  # every kind's files checked, this kind's kept
                    for key, given in entries.items():
                        for e in given if isinstance(given, list) else [given]:
                            if e["file"] not in listed:
                                listed_name(self.folder, e["file"], files, path)
                                listed.add(e["file"])
                            if of_kind == kind:
                                self.pieces.setdefault(key, []).append(Piece(
                                    e["file"], tuple(e["offsets"]), tuple(e["shape"]), tuple(e["global_shape"]),
                                    e["dtype"], e.get("stored", "")))
                if kind not in data["pieces"]:
                    raise KeyError(kind)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise IntegrityError(f"{path}: not a readable piece index ({type(exc).__name__}: {exc})") from None
        self._files: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.pieces)

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self._of(key)[0].global_shape

    def dtype(self, key: str) -> torch.dtype:
        return dtype_of(self._of(key)[0].dtype, self.folder)

    def _of(self, key: str) -> list[Piece]:
        try:
            return self.pieces[key]
        except KeyError:
            raise IntegrityError(f"{self.folder}: no piece of {key!r} in the index; the checkpoint does not hold "
                                 "this tensor (a different model, or an incomplete checkpoint)") from None

    def check_complete(self) -> None:
        """Every tensor's pieces tile its global shape exactly (no gap, no overlap): a count of elements and a
        pairwise overlap test, from the indexes alone."""
        for key, pieces in self.pieces.items():
            glob = pieces[0].global_shape
            total = 0
            for p in pieces:
                if p.global_shape != glob or len(p.offsets) != len(glob) or any(
                        o < 0 or o + s > g for o, s, g in zip(p.offsets, p.shape, glob)):
                    raise IntegrityError(f"{self.folder}: piece of {key!r} in {p.file} lies outside {list(glob)}")
                total += torch.Size(p.shape).numel()
            # Writers never overlap pieces except by writing one twice: distinct offsets plus the element count
            # (with every piece inside the shape) is what a tiling needs, in O(pieces).
            if total != torch.Size(glob).numel() or len({p.offsets for p in pieces}) != len(pieces):
                raise IntegrityError(f"{self.folder}: the pieces of {key!r} do not cover its shape {list(glob)} "
                                     "exactly once; the checkpoint is incomplete")

    def check_files(self) -> None:
        """Each piece is in its file under its key with its shape and dtype (headers only, no tensor read)."""
        from safetensors import safe_open

        by_file: dict[str, list[tuple[str, Piece]]] = {}
        for key, pieces in self.pieces.items():
            for p in pieces:
                by_file.setdefault(p.file, []).append((key, p))
        for name, items in by_file.items():
            path = self.folder / name
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key, p in items:
                        s = f.get_slice(p.stored or key)
                        if tuple(s.get_shape()) != p.shape or _ST_DTYPES[dtype_of(p.dtype, path)] != s.get_dtype():
                            raise ValueError(f"{key} is {s.get_dtype()} {s.get_shape()}, the index says "
                                             f"{p.dtype} {list(p.shape)}")
            except Exception as exc:  # SafetensorError, ValueError
                raise IntegrityError(f"{path}: does not hold the pieces its index names ({type(exc).__name__}: "
                                     f"{str(exc)[:160]})") from None

    def _open(self, name: str):
        from safetensors import safe_open

        if name not in self._files:
            try:
                self._files[name] = safe_open(str(self.folder / name), framework="pt").__enter__()
            except Exception as exc:  # SafetensorError, OSError: not a safetensors file
                raise IntegrityError(f"{self.folder / name}: cannot be opened as safetensors "
                                     f"({type(exc).__name__}: {str(exc)[:160]})") from None
        return self._files[name]

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()

    def __enter__(self) -> "PieceIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_box(self, key: str, out: torch.Tensor, offsets: tuple[int, ...] | None = None) -> torch.Tensor:
        """Fill `out` with the box of tensor `key` that starts at `offsets` (zeros: the whole tensor) and has
        `out`'s shape, from every piece that overlaps it. Raises IntegrityError if the pieces leave a gap."""
        pieces = self._of(key)
        glob = pieces[0].global_shape
        shape = tuple(out.shape)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
        if len(glob) != len(shape) or any(o + s > g for o, s, g in zip(offsets, shape, glob)):
            raise IntegrityError(f"{self.folder}: {key} is {list(glob)} in the checkpoint; the model wants a box "
                                 f"{list(shape)} at {list(offsets)} (a model of another size)")
        filled = 0
        for p in pieces:
            lo = [max(a, b) for a, b in zip(offsets, p.offsets)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, shape, p.offsets, p.shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                if shape or p.shape:  # a 0-d tensor is one box, which always overlaps
                    continue
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offsets))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            stored = p.stored or key
            part = self._open(p.file).get_slice(stored)[src] if src else self._open(p.file).get_tensor(stored)
            out[dst].copy_(part)
            filled += part.numel()
        if filled != out.numel():
            raise IntegrityError(f"{self.folder}: the pieces of {key} cover {filled} of the {out.numel()} elements "
                                 f"asked for; the checkpoint is incomplete")
        return out

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor `key`, assembled from its pieces. The files are closed after it: safetensors reads
        through a memory map, whose pages count as this process's resident memory while it is open, so a caller
        reading one tensor at a time (export) holds one tensor's pages, not every file's it has read."""
        try:
            return self.read_box(key, torch.empty(self.global_shape(key), dtype=self.dtype(key)))
        finally:
            self.close()

    def tensors(self, keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for key in keys:
            yield key, self.full(key)

