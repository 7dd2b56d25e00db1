"""MinHash LSH near-duplicate detection, global over the kept documents in canonical order.

Signature: for each of bands x rows hash functions h_k(x) = (a_k x + b_k mod 2^64) >> 32
(multiply-shift, a_k odd), the minimum over the document's shingle hashes, computed for all
k at once with numpy. Documents whose signatures agree on every row of some band become
candidate pairs; a candidate pair is a duplicate only when the exact Jaccard similarity of
the two shingle sets reaches `threshold`. `MinHasher` computes signatures and band keys (the data
stage's signatures.Signer uses it); `MinHashDedup` is the in-memory index over one stream (see
dedup/__init__.py): it spills shingle sets to a temporary file as they arrive, so its memory holds the
signatures (4 x bands x rows bytes per document), not texts.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from kiln.data.dedup.clusters import Pair, confirm_band, in_memory_ledger
from kiln.data.dedup.shingles import MULT, jaccard, shingle_hashes

_CHUNK = 4096  # shingles per block of the (hash functions x shingles) matrix
_ONE_BY_ONE = 1024  # shingles from which the functions are taken one at a time over the whole set


class MinHasher:
    """The bands x rows hash functions of a seed, and band keys: one uint64 per band, a hash of its rows."""

    def __init__(self, bands: int = 20, rows: int = 6, seed: int = 1) -> None:
        self.bands, self.rows = bands, rows
        rng = np.random.default_rng(seed)
        k = bands * rows
        self.a = rng.integers(1, 2**63, size=k, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 2**63, size=k, dtype=np.uint64)
        self._a, self._b = self.a[:, None], self.b[:, None]  # as columns, against a block of shingles
        self._pairs = list(zip(self.a, self.b))  # as numpy scalars, one function at a time

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        """The bands x rows minima, in blocks of shingles computed in one (hash functions x shingles) buffer,
        so that each function's minimum is a reduction over contiguous memory (not rows of a column); from
        `_ONE_BY_ONE` shingles, one function at a time over one 1-d buffer, which stays in cache (0.7x the CPU
        on real text; below it, the 3 calls per function cost more). The shift by 32 is monotone, so it is
        taken once on the minima rather than on every product."""
        if len(shingles) >= _ONE_BY_ONE:
            sig = np.empty(len(self.a), dtype=np.uint64)
            buf = np.empty(len(shingles), dtype=np.uint64)
            for k, (a, b) in enumerate(self._pairs):
                np.multiply(shingles, a, out=buf)
                buf += b
                sig[k] = buf.min()
            return (sig >> np.uint64(32)).astype(np.uint32)
        sig = np.full(len(self.a), np.iinfo(np.uint64).max, dtype=np.uint64)
        buf = np.empty((len(self.a), min(len(shingles), _CHUNK)), dtype=np.uint64)
        for start in range(0, len(shingles), _CHUNK):
            x = shingles[start:start + _CHUNK]
            out = buf[:, :len(x)]
            np.multiply(self._a, x, out=out)
            np.add(out, self._b, out=out)
            np.minimum(sig, out.min(axis=1), out=sig)
        return (sig >> np.uint64(32)).astype(np.uint32)

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        """(documents, bands) uint64: equal keys for equal bands (a 64-bit hash: a collision only adds a
        candidate, which the exact confirmation then rejects)."""
        rows = signatures.reshape(len(signatures), self.bands, self.rows).astype(np.uint64)
        key = np.full(rows.shape[:2], 0x2545F4914F6CDD1D, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for r in range(self.rows):
                key = (key ^ rows[:, :, r]) * MULT
        return key


class MinHashDedup:
    """The in-memory index over a small corpus (tests, benchmarks): signatures in RAM, shingles spilled.
    The data stage runs the same hashing partitioned on its workers (`kiln.data.dedup.stages`)."""

    def __init__(self, bands: int = 20, rows: int = 6, threshold: float = 0.8, ngram: int = 5,
                 tokens: str = "auto", seed: int = 1, spill_dir: str | None = None) -> None:
        self.bands, self.rows, self.threshold, self.ngram, self.tokens = bands, rows, threshold, ngram, tokens
        self.hasher = MinHasher(bands, rows, seed)
        self.ids: list[str] = []
        self.signatures: list[np.ndarray] = []
        self.spans: list[tuple[int, int]] = []  # (byte offset, shingle count) in the spill file
        self._spill = tempfile.TemporaryFile(dir=spill_dir)
        self._size = 0
        self.pairs_checked = 0

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        return self.hasher.signature(shingles)

    def add(self, doc_id: str, text: str) -> None:
        shingles = shingle_hashes(text, self.ngram, self.tokens)
        self.ids.append(doc_id)
        self.signatures.append(self.signature(shingles))
        self._spill.write(shingles.tobytes())
        self.spans.append((self._size, len(shingles)))
        self._size += shingles.nbytes

    def _shingles(self, i: int) -> np.ndarray:
        offset, count = self.spans[i]
        return np.frombuffer(os.pread(self._spill.fileno(), count * 8, offset), dtype=np.uint64)

    def _confirm(self, j: int, i: int) -> float | None:
        sim = jaccard(self._shingles(j), self._shingles(i))
        return sim if sim >= self.threshold else None

    def run(self) -> list[Pair]:
        """The confirmed pairs."""
        self._spill.flush()  # _shingles reads the file descriptor, under Python's buffer
        pairs: list[Pair] = []
        if self.signatures:
            keys = self.hasher.band_keys(np.stack(self.signatures))
            positions = np.arange(len(self.ids), dtype=np.uint64)
            self.pairs_checked = sum(confirm_band(keys[:, b], positions, self._confirm, pairs)
                                     for b in range(self.bands))
        return pairs

    def ledger(self) -> list[dict[str, Any]]:
        similarity = lambda r, i: jaccard(self._shingles(r), self._shingles(i))  # noqa: E731
        return in_memory_ledger(self.run(), similarity, self.ids.__getitem__)

    def duplicates(self) -> dict[str, tuple[str, float]]:
        """{removed id: (survivor id, Jaccard similarity to the survivor)}."""
        return {row["member"]: (row["survivor"], row["similarity"]) for row in self.ledger()}

    def index_bytes(self) -> int:
        """Bytes the index holds in memory (signatures and spill offsets; the ids are the caller's)."""
        return sum(s.nbytes for s in self.signatures) + 16 * len(self.spans)
