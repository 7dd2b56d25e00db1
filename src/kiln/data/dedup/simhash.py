"""SimHash near-duplicate detection (Charikar 2002; SEEDS: 64 bits, Hamming distance <= 3).

A document's fingerprint has bit k set when more of its shingle hashes have bit k set than
not. Two fingerprints within Hamming distance d agree exactly on at least one of d + 1
blocks of the 64 bits (pigeonhole), so documents sharing a block value are the candidates,
and a candidate pair is a duplicate when the full distance is <= d. Similarity in the
ledger is 1 - distance / 64. With `tokens: char` (or `auto` on Chinese and Japanese, where
each character is a token) this is the character-level SimHash.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.data.dedup.clusters import Pair, confirm_band, in_memory_ledger
from kiln.data.dedup.shingles import shingle_hashes

_BITS = np.arange(64, dtype=np.uint64)


def simhash(shingles: np.ndarray) -> int:
    if not len(shingles):
        return 0
    ones = ((shingles[:, None] >> _BITS) & np.uint64(1)).sum(axis=0, dtype=np.int64)
    return int(np.packbits((2 * ones > len(shingles))[::-1]).view(">u8")[0])


def block_keys(prints: np.ndarray, hamming: int) -> np.ndarray:
    """(documents, hamming + 1) uint64: each fingerprint cut into hamming + 1 blocks of bits (the bands)."""
    blocks = hamming + 1
    edges = [64 * b // blocks for b in range(blocks + 1)]
    out = np.empty((len(prints), blocks), dtype=np.uint64)
    for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
        mask = np.uint64((1 << (hi - lo)) - 1)
        out[:, b] = (prints >> np.uint64(lo)) & mask
    return out


def hamming_confirm(hamming: int, fingerprint: Callable[[int], int]) -> Callable[[int, int], float | None]:
    """A pair is a duplicate when its fingerprints differ in at most `hamming` bits; similarity 1 - d / 64."""
    def confirm(j: int, i: int) -> float | None:
        d = (fingerprint(j) ^ fingerprint(i)).bit_count()
        return 1 - d / 64 if d <= hamming else None
    return confirm


class SimHashDedup:
    def __init__(self, hamming: int = 3, ngram: int = 5, tokens: str = "auto") -> None:
        self.hamming, self.ngram, self.tokens = hamming, ngram, tokens
        self.ids: list[str] = []
        self.prints: list[int] = []
        self.pairs_checked = 0

    def add(self, doc_id: str, text: str) -> None:
        self.ids.append(doc_id)
        self.prints.append(simhash(shingle_hashes(text, self.ngram, self.tokens)))

    def distance(self, j: int, i: int) -> int:
        return (self.prints[j] ^ self.prints[i]).bit_count()

    def run(self) -> list[Pair]:
        """The confirmed pairs."""
        pairs: list[Pair] = []
        confirm = hamming_confirm(self.hamming, self.prints.__getitem__)
        if self.prints:
            keys = block_keys(np.array(self.prints, dtype=np.uint64), self.hamming)
            positions = np.arange(len(self.ids), dtype=np.uint64)
            self.pairs_checked = sum(confirm_band(keys[:, b], positions, confirm, pairs)
                                     for b in range(keys.shape[1]))
        return pairs

    def ledger(self) -> list[dict[str, Any]]:
        return in_memory_ledger(self.run(), lambda r, i: 1 - self.distance(r, i) / 64, self.ids.__getitem__)

    def duplicates(self) -> dict[str, tuple[str, float]]:
        return {row["member"]: (row["survivor"], row["similarity"]) for row in self.ledger()}

    def index_bytes(self) -> int:
        return 8 * len(self.prints)
