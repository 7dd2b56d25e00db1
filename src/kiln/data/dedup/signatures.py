"""Dedup signatures, made inside each data task (`Signer`): for every kept document, in task order, the exact key
(xxh3-128 of the normalised text) and, for near-duplicate dedup, one key per band (MinHash: a hash of the
band's rows; SimHash: a block of the fingerprint) and what confirmation needs. Written beside the task's
outcome (`task-NNNNN.<kind>.npy`, see `KINDS`), each array sorted so a key range is one slice:
`exact` 3 x n uint64 (key high, key low, local index), sorted by key; `keys` n x 2 uint64, the same keys by
local index (the band stage tells exact copies in a bucket apart with them: `stages.copies_in_buckets`); `bands`
bands x 2 x n uint64 (per band: the sorted keys, their local indices); `prints` (SimHash); `ids.json`. A worker
remembers the signatures of the last data.remember_texts texts it signed, so a text seen again costs a lookup.
MinHash's shingle sets (`shingles` +
`spans`: the sets end to end and where each starts, 8 bytes a shingle, four times the rest together) are kept
only for data.dedup.index, which holds them for later runs (`keeps_shingles`); otherwise the dedup stages
derive them again from the task's outcome for the candidate documents alone (`outcome_shingles`, the same
function of the same text), so the work folder holds signatures, not shingle sets. Memory: one task's keys and
signatures (under 1 KB a document); kept shingle sets wait in a spill file.

`Part` says where one task's signatures are: this run's work folder, or a run folder of data.dedup.index.
The stages (stages.py) and the index (index.py) both read them.
"""

from __future__ import annotations

import io
import json
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import xxhash

from kiln.config import DedupConfig
from kiln.data.dedup.exact import spaced_key, spaced_text
from kiln.data.dedup.minhash import MinHasher
from kiln.data.dedup.shingles import spaced_shingles
from kiln.data.dedup.simhash import block_keys, simhash
from kiln.data.vouch import Recording, record
from kiln.errors import IntegrityError

KINDS = ("exact", "keys", "bands", "shingles", "spans", "prints")


def keeps_shingles(cfg: DedupConfig) -> bool:
    """Whether a task keeps its documents' MinHash shingle sets: only for data.dedup.index, which stores them."""
    return cfg.method == "minhash" and bool(cfg.index)


def shingles_of(spaced: bytes, cfg: DedupConfig) -> np.ndarray:
    """A document's shingle set, from its lower-cased text's words joined by single spaces (`spaced_text`)."""
    return spaced_shingles(spaced, cfg.ngram, cfg.tokens)


def outcome_shingles(path: Path, wanted: list[int], cfg: DedupConfig) -> Iterator[np.ndarray]:
    """The shingle sets of the kept documents numbered `wanted` (ascending, by place among the task's kept
    documents) of a task's outcome file, in that order: what `Signer` hashed, derived again from the same text.
    Memory: one record."""
    from kiln.data.docs import read_part

    if not wanted:
        return
    want, local = iter(wanted), 0
    nxt = next(want)
    for rec in read_part(path):
        if "reason" in rec:  # a rejection
            continue
        if local == nxt:
            low = (rec.get("text") or "").lower()
            yield shingles_of(spaced_text(low), cfg)
            if (nxt := next(want, None)) is None:
                return
        local += 1
    raise IntegrityError(f"{path}: {len(wanted)} kept documents wanted, the outcome has {local}; the work folder "
                         "changed after its task wrote it: run the same command again")


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def spilled_npy(spill: Any, count: int) -> Iterator[bytes]:
    """A .npy file of `count` uint64 (as np.save writes them) from a spill file holding their bytes, in blocks."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.dtype(np.uint64).str, "fortran_order": False,
                                                  "shape": (count,)})
    yield header.getvalue()
    spill.seek(0)
    while block := spill.read(1 << 20):
        yield block


class Signer:
    """Collects one task's kept documents and returns the files `KINDS` describes (`files`), or writes them
    (`write`). Memory: per document its keys, signature or fingerprint and id (under 1 KB); the MinHash
    shingle sets, when kept (`keeps_shingles`), wait in a spill file and are copied into `shingles.npy` by `write`."""

    def __init__(self, cfg: DedupConfig, remember: int = 0) -> None:
        self.cfg = cfg
        self.remember = remember if not keeps_shingles(cfg) else 0  # kept shingle sets are not remembered
        self._memo = _signed(cfg, self.remember)  # this process's, found once per task (not once a document)
        self.hasher = MinHasher(cfg.bands, cfg.rows, cfg.seed) if cfg.method == "minhash" else None
        self.ids: list[str] = []
        self.keys: list[bytes] = []
        self.near: list[Any] = []  # MinHash signatures or SimHash fingerprints
        self.sizes: list[int] = []  # each document's shingles (MinHash), spilled to `_spill` in order
        self._spill = tempfile.TemporaryFile() if keeps_shingles(cfg) else None

    def add(self, doc_id: str, text: str) -> None:
        self.ids.append(doc_id)
        memo = self._memo
        if memo is not None:
            seen = xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))
            if seen in memo:  # a text this worker signed before: the same key and signature
                memo.move_to_end(seen)
                key, near = memo[seen]
                self.keys.append(key)
                if near is not None:
                    self.near.append(near)
                return
        spaced = spaced_text(text.lower())  # once, for the exact key and the shingles (as text_key, shingle_hashes)
        self.keys.append(spaced_key(spaced))
        near = None
        if self.cfg.method != "none":
            shingles = shingles_of(spaced, self.cfg)
            if self.hasher is not None:
                near = self.hasher.signature(shingles)
                if self._spill is not None:
                    self._spill.write(shingles.tobytes())
                    self.sizes.append(len(shingles))
            else:
                near = simhash(shingles)
            self.near.append(near)
        if memo is not None:
            memo[seen] = (self.keys[-1], near)
            if len(memo) > self.remember:
                memo.popitem(last=False)

    def files(self) -> dict[str, bytes]:
        out = self._files()
        if self._spill is not None:
            out["shingles.npy"] = b"".join(self._shingles_npy())
        return out

    def write(self, folder: Path, stem: str) -> dict[str, dict[str, Any]]:
        """Write the files as `folder/stem.<kind>`, each atomically; returns their records (`vouch.record`)."""
        from kiln.manifest import writing_atomic

        done = {}
        for suffix, data in self._files().items():
            with writing_atomic(folder / f"{stem}.{suffix}") as f:
                f.write(data)
            done[suffix] = record(data)
        if self._spill is not None:
            with writing_atomic(folder / f"{stem}.shingles.npy") as f:
                out = Recording(f)
                for block in self._shingles_npy():
                    out.write(block)
            done["shingles.npy"] = out.record()
        return done

    def _shingles_npy(self) -> Iterator[bytes]:
        """shingles.npy (as np.save writes the shingle sets end to end), from the spill file, in blocks."""
        return spilled_npy(self._spill, sum(self.sizes))

    def _files(self) -> dict[str, bytes]:
        """Every file but shingles.npy."""
        n = len(self.ids)
        local = np.arange(n, dtype=np.uint64)
        key = np.frombuffer(b"".join(self.keys), dtype=">u8").reshape(n, 2).astype(np.uint64)
        order = np.lexsort((local, key[:, 1], key[:, 0]))
        out = {"exact.npy": npy_bytes(np.stack([key[order, 0], key[order, 1], local[order]])),
               "ids.json": json.dumps(self.ids, ensure_ascii=False).encode()}
        if self.cfg.method == "none":
            return out
        out["keys.npy"] = npy_bytes(key)
        if self.hasher is not None:
            sigs = np.stack(self.near) if n else np.empty((0, self.cfg.bands * self.cfg.rows), dtype=np.uint32)
            keys = self.hasher.band_keys(sigs)
            if self._spill is not None:
                sizes = np.array(self.sizes, dtype=np.int64)
                out["spans.npy"] = npy_bytes(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        else:
            prints = np.array(self.near, dtype=np.uint64)
            keys = block_keys(prints, self.cfg.hamming)
            out["prints.npy"] = npy_bytes(prints)
        bands = np.empty((keys.shape[1], 2, n), dtype=np.uint64)
        for b in range(keys.shape[1]):
            order = np.argsort(keys[:, b], kind="stable")
            bands[b, 0], bands[b, 1] = keys[order, b], order
        out["bands.npy"] = npy_bytes(bands)
        return out


_SIGNED: tuple[str, OrderedDict] | None = None  # this process's signatures of the texts it signed last


def _signed(cfg: DedupConfig, capacity: int) -> OrderedDict | None:
    """The signatures this process made for `cfg`'s settings (the `capacity` texts signed last, by the xxh3-128 of
    the text; ~700 bytes each: data.remember_texts), a new memo when the settings changed; None for capacity 0."""
    global _SIGNED
    if not capacity:
        return None
    settings = cfg.model_dump_json()
    if _SIGNED is None or _SIGNED[0] != settings:
        _SIGNED = (settings, OrderedDict())
    return _SIGNED[1]


def forget_signed() -> None:
    """Drop this process's remembered signatures (the driver's, after a run whose tasks ran in it)."""
    global _SIGNED
    _SIGNED = None


@dataclass(frozen=True)
class Part:
    folder: str  # a work folder, or a run folder inside data.dedup.index
    name: str  # task-NNNNN
    count: int  # kept documents (before dedup)
    run: str | None = None  # the index run it belongs to; None: this run
