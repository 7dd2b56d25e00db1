"""What both near-duplicate methods share: clusters of the confirmed pairs, survivors, the ledger.

Documents are numbered in the stage's canonical order; the survivor of a cluster is its first
document, so the choice never depends on worker count. Only documents named in a confirmed pair
enter the clusters and the link graph, so both grow with the duplicates, not the corpus.

Each removed document's ledger row names the confirmed pair that joined it (`linked_to`): the
cluster's link graph is walked breadth-first from the survivor, neighbours in document order,
and each member is linked to the document it was reached from. Following `linked_to` from any
member therefore reaches the survivor, even when a member's only confirmed pair is with a later
document (A < B < C with pairs A-C and B-C: B links to C, C to A).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import zstandard

from kiln.manifest import writing_atomic

LEDGER = "dedup_ledger.jsonl.zst"

Pair = tuple[int, int, float]  # (earlier document, later document, similarity), confirmed


class UnionFind:
    """Union-find keyed by document number; a document never unioned is its own root and takes no memory."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, i: int) -> int:
        parent = self.parent
        root = i
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(i, i) != root:  # path compression
            parent[i], i = root, parent[i]
        return root

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:  # the smaller index (earlier document) stays the root: it is the survivor
            self.parent[max(a, b)] = min(a, b)
            self.parent.setdefault(min(a, b), min(a, b))

    def members(self) -> list[int]:
        """Every document that was unioned with another, in document order."""
        return sorted(self.parent)


def buckets_of(keys: np.ndarray, positions: np.ndarray) -> list[list[int]]:
    """Groups of two or more documents with equal keys (one band's), each group in document order."""
    order = np.lexsort((positions, keys))
    keys, positions = keys[order], positions[order]
    edges = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    starts, ends = np.concatenate([[0], edges]), np.concatenate([edges, [len(keys)]])
    big = np.flatnonzero(ends - starts > 1)
    return [positions[starts[g]:ends[g]].tolist() for g in big.tolist()]


def confirm_band(keys: np.ndarray, positions: np.ndarray, confirm: Callable[[int, int], float | None],
                 pairs: list[Pair]) -> int:
    """Confirm the candidate pairs of one band's buckets, each bucket with a union-find of its own, so the
    pairs found depend on the bucket alone (not on how a band is split into tasks or which worker runs
    it); appends them to `pairs`, returns how many were checked."""
    return sum(link_buckets([bucket], UnionFind(), confirm, pairs) for bucket in buckets_of(keys, positions))


def link_buckets(buckets: Iterable[list[int]], uf: UnionFind, confirm: Callable[[int, int], float | None],
                 pairs: list[Pair]) -> int:
    """Confirm candidate pairs bucket by bucket, in document order; returns how many were checked.

    A pair already in one cluster of `uf` is not checked again, so a bucket of k copies costs about
    k checks, not k^2. Every confirmed pair is appended to `pairs` as (j, i, similarity), j < i.
    """
    checked: set[tuple[int, int]] = set()
    for members in buckets:
        for pos, i in enumerate(members):
            for j in members[:pos]:
                if uf.find(i) == uf.find(j) or (j, i) in checked:
                    continue
                checked.add((j, i))
                sim = confirm(j, i)
                if sim is not None:
                    uf.union(i, j)
                    pairs.append((j, i, sim))
    return len(checked)


PAIR = np.dtype([("j", "<u8"), ("i", "<u8"), ("sim", "<f8")])  # a confirmed pair as stored: j < i


def pair_array(pairs: Iterable[Pair]) -> np.ndarray:
    return np.array(list(pairs), dtype=PAIR)


def unique_pairs(pairs: np.ndarray) -> np.ndarray:
    """The pairs sorted by (j, i), each once (a pair confirmed in several bands is one pair; given with two
    similarities, the higher counts, so the result never depends on the order)."""
    pairs = pairs[np.lexsort((-pairs["sim"], pairs["i"], pairs["j"]))]
    first = np.ones(len(pairs), dtype=bool)
    first[1:] = (pairs["j"][1:] != pairs["j"][:-1]) | (pairs["i"][1:] != pairs["i"][:-1])
    return pairs[first]


@dataclass(frozen=True)
class Clusters:
    """The clusters of a set of confirmed pairs, one entry per removed document, sorted by document number.

    Memory: five 8-byte numbers per removed document; while it is built, 48 bytes per confirmed pair (the
    pairs and their adjacency) and 24 per document in a pair. Nothing for a document that is in no pair.
    """
    member: np.ndarray  # the removed document (uint64), ascending
    survivor: np.ndarray  # its cluster's earliest document
    linked_to: np.ndarray  # the document it was reached from, walking the cluster from its survivor
    link_similarity: np.ndarray  # the confirmed similarity of (member, linked_to)
    cluster: np.ndarray  # numbered in order of the clusters' first removed member

    @classmethod
    def of(cls, pairs: np.ndarray) -> Clusters:
        """From confirmed pairs (a PAIR array, any order, repeats allowed): a breadth-first walk of each cluster
        from its survivor, neighbours in document order, each member linked to the document it was reached
        from. Walking documents in order, the first one not yet reached is its cluster's earliest: the survivor.
        The result depends only on the set of pairs."""
        pairs = unique_pairs(pairs)
        nodes = np.unique(np.concatenate([pairs["j"], pairs["i"]]))
        a, b = np.searchsorted(nodes, pairs["j"]), np.searchsorted(nodes, pairs["i"])
        src, dst, sim = np.concatenate([a, b]), np.concatenate([b, a]), np.concatenate([pairs["sim"]] * 2)
        order = np.lexsort((dst, src))  # each node's neighbours in document order
        dst, sim = dst[order], sim[order]
        bounds = np.searchsorted(src[order], np.arange(len(nodes) + 1)).tolist()
        root = np.empty(len(nodes), dtype=np.int64)
        parent = np.full(len(nodes), -1, dtype=np.int64)
        link = np.zeros(len(nodes), dtype=np.float64)
        seen = bytearray(len(nodes))
        for start in range(len(nodes)):
            if seen[start]:
                continue
            seen[start], root[start] = 1, start
            queue = deque([start])
            while queue:
                node = queue.popleft()
                lo, hi = bounds[node], bounds[node + 1]
                for nxt, s in zip(dst[lo:hi].tolist(), sim[lo:hi].tolist()):
                    if not seen[nxt]:
                        seen[nxt], root[nxt], parent[nxt], link[nxt] = 1, start, node, s
                        queue.append(nxt)
        removed = parent >= 0
        roots = root[removed]
        _, first, inverse = np.unique(roots, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        return cls(nodes[removed], nodes[roots], nodes[parent[removed]], link[removed], rank[inverse.ravel()])

    def __len__(self) -> int:
        return len(self.member)

    def links(self) -> dict[int, tuple[int, float]]:
        """{member: (linked_to, link_similarity)} (small sets: tests and the in-memory indexes)."""
        return {m: (j, s) for m, j, s in zip(self.member.tolist(), self.linked_to.tolist(),
                                             self.link_similarity.tolist())}


def ledger_rows(clusters: Clusters, similarity: Iterable[float]) -> Iterator[dict[str, Any]]:
    """One row per removed document, in document order: cluster number, survivor, member, similarity to the
    survivor (`similarity`: one per member, in member order), and the link (all as document numbers)."""
    for c, r, i, sim, j, link in zip(clusters.cluster.tolist(), clusters.survivor.tolist(), clusters.member.tolist(),
                                     similarity, clusters.linked_to.tolist(), clusters.link_similarity.tolist()):
        yield {"cluster": c, "survivor": r, "member": i, "similarity": round(sim, 4), "linked_to": j,
               "link_similarity": round(link, 4)}


def name_rows(rows: Iterable[dict[str, Any]], ids: Callable[[int], str]) -> Iterator[dict[str, Any]]:
    """The ledger as written: document numbers replaced by ids, the member's number kept as `position`."""
    for row in rows:
        yield row | {"position": row["member"]} | {k: ids(row[k]) for k in ("survivor", "member", "linked_to")}


def in_memory_ledger(pairs: list[Pair], similarity: Callable[[int, int], float],
                     ids: Callable[[int], str]) -> list[dict[str, Any]]:
    """The named ledger of a small in-memory index (MinHashDedup, SimHashDedup)."""
    clusters = Clusters.of(pair_array(pairs))
    sims = [similarity(r, i) for r, i in zip(clusters.survivor.tolist(), clusters.member.tolist())]
    return list(name_rows(ledger_rows(clusters, sims), ids))


def write_ledger(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """The ledger as zstd JSON lines, streamed to a file that replaces `path` when complete (memory: a
    compression window; an empty file when nothing was removed)."""
    with writing_atomic(path) as f, zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as zw:
        for row in rows:
            zw.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
