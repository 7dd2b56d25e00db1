"""SimHash near-duplicate detection (Charikar 2002; SEEDS: 64 bits, Hamming distance <= 3).

A document's fingerprint has bit k set when more of its shingle hashes have bit k set than
not. Two fingerprints within Hamming distance d agree exactly on at least one of d + 1
blocks of the 64 bits (pigeonhole), so documents sharing a block value are the candidates,
and a candidate pair is a duplicate when the full distance is <= d. Similarity in the
ledger is 1 - distance / 64. With `tokens: char` (or `auto` on Chinese and Japanese, where
each character is a token) this is the character-level SimHash.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.data.dedup.clusters import Pair, UnionFind, cluster_links, ledger_rows, link_buckets, name_rows
from kiln.data.dedup.shingles import shingle_hashes

_BITS = np.arange(64, dtype=np.uint64)


def simhash(shingles: np.ndarray) -> int:
    if not len(shingles):
        return 0
    ones = ((shingles[:, None] >> _BITS) & np.uint64(1)).sum(axis=0, dtype=np.int64)
    return int(np.packbits((2 * ones > len(shingles))[::-1]).view(">u8")[0])


class SimHashDedup:
    def __init__(self, hamming: int = 3, ngram: int = 5, tokens: str = "auto") -> None:
        self.hamming, self.ngram, self.tokens = hamming, ngram, tokens
        self.ids: list[str] = []
        self.prints: list[int] = []
        self.pairs_checked = 0

    def add(self, doc_id: str, text: str) -> None:
        self.ids.append(doc_id)
        self.prints.append(simhash(shingle_hashes(text, self.ngram, self.tokens)))

    def _buckets(self) -> list[list[int]]:
        blocks = self.hamming + 1
        edges = [64 * b // blocks for b in range(blocks + 1)]
        out = []
        for lo, hi in zip(edges, edges[1:]):
            groups: dict[int, list[int]] = {}
            mask = (1 << (hi - lo)) - 1
            for i, fp in enumerate(self.prints):
                groups.setdefault((fp >> lo) & mask, []).append(i)
            out += [g for g in groups.values() if len(g) > 1]
        return out

    def distance(self, j: int, i: int) -> int:
        return (self.prints[j] ^ self.prints[i]).bit_count()

    def run(self) -> list[Pair]:
        """The confirmed pairs."""
        pairs: list[Pair] = []

        def confirm(j: int, i: int) -> float | None:
            d = self.distance(j, i)
            return 1 - d / 64 if d <= self.hamming else None

        self.pairs_checked = link_buckets(self._buckets(), UnionFind(), confirm, pairs)
        return pairs

    def ledger(self) -> list[dict[str, Any]]:
        uf, links = cluster_links(self.run())
        rows = ledger_rows(uf, links, lambda r, i: 1 - self.distance(r, i) / 64)
        return name_rows(rows, self.ids.__getitem__)

    def duplicates(self) -> dict[str, tuple[str, float]]:
        return {row["member"]: (row["survivor"], row["similarity"]) for row in self.ledger()}

    def index_bytes(self) -> int:
        return 8 * len(self.prints)
