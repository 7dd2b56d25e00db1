"""What both near-duplicate methods share: union-find over confirmed pairs, survivors, the ledger.

Documents are numbered in the stage's canonical order; the survivor of a cluster is its first
document, so the choice never depends on worker count. Only documents named in a confirmed pair
enter the union-find and the link graph, so both grow with the duplicates, not the corpus.

Each removed document's ledger row names the confirmed pair that joined it (`linked_to`): the
cluster's link graph is walked breadth-first from the survivor, neighbours in document order,
and each member is linked to the document it was reached from. Following `linked_to` from any
member therefore reaches the survivor, even when a member's only confirmed pair is with a later
document (A < B < C with pairs A-C and B-C: B links to C, C to A).
"""

from __future__ import annotations

import io
import json
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import zstandard

from kiln.manifest import write_atomic

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


def cluster_links(pairs: Iterable[Pair]) -> tuple[UnionFind, dict[int, tuple[int, float]]]:
    """Clusters of the confirmed pairs and, for each removed document, the link that reaches it from its survivor.

    Returns (union-find, {member: (linked_to, link_similarity)}). A pair confirmed twice (in two bands)
    counts once; the result depends only on the set of pairs, not on their order.
    """
    uf = UnionFind()
    adjacent: dict[int, dict[int, float]] = defaultdict(dict)
    for j, i, sim in pairs:
        uf.union(i, j)
        adjacent[i][j] = adjacent[j][i] = sim
    links: dict[int, tuple[int, float]] = {}
    for root in uf.members():
        if uf.find(root) != root:
            continue
        queue = deque([root])
        seen = {root}
        while queue:
            node = queue.popleft()
            for nxt in sorted(adjacent[node]):
                if nxt not in seen:
                    seen.add(nxt)
                    links[nxt] = (node, adjacent[node][nxt])
                    queue.append(nxt)
    return uf, links


def ledger_rows(uf: UnionFind, links: dict[int, tuple[int, float]],
                similarity: Callable[[int, int], float]) -> list[dict[str, Any]]:
    """One row per removed document, in document order: cluster number (in order of the clusters' first
    removed member), survivor, member, similarity to the survivor, and the link (all as document numbers)."""
    cluster_of: dict[int, int] = {}
    rows = []
    for i in uf.members():
        root = uf.find(i)
        if root == i:
            continue
        cluster = cluster_of.setdefault(root, len(cluster_of))
        j, link_sim = links[i]
        rows.append({"cluster": cluster, "survivor": root, "member": i, "similarity": round(similarity(root, i), 4),
                     "linked_to": j, "link_similarity": round(link_sim, 4)})
    return rows


def name_rows(rows: list[dict[str, Any]], ids: Callable[[int], str]) -> list[dict[str, Any]]:
    """The ledger as written: document numbers replaced by ids, the member's number kept as `position`."""
    return [row | {"position": row["member"]} | {k: ids(row[k]) for k in ("survivor", "member", "linked_to")}
            for row in rows]


def write_ledger(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """The ledger as zstd JSON lines, written atomically (empty file when nothing was removed)."""
    buf = io.BytesIO()
    for row in rows:
        buf.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    write_atomic(Path(path), zstandard.ZstdCompressor(level=3).compress(buf.getvalue()))
