"""What both near-duplicate methods share: union-find over confirmed pairs, survivors, the ledger.

Documents are numbered in the order they were added (the stage's canonical order); the
survivor of a cluster is its first document, so the choice never depends on worker count.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable

import zstandard

from kiln.manifest import write_atomic

LEDGER = "dedup_ledger.jsonl.zst"


class UnionFind:
    def __init__(self) -> None:
        self.parent: list[int] = []

    def add(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:  # path compression
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:  # the smaller index (earlier document) stays the root: it is the survivor
            self.parent[max(a, b)] = min(a, b)


def link_buckets(buckets: list[list[int]], uf: UnionFind, confirm: Callable[[int, int], float | None],
                 links: dict[int, tuple[int, float]]) -> int:
    """Confirm candidate pairs bucket by bucket, in document order; returns how many were checked.

    A pair already in one cluster is not checked again, so a bucket of k copies costs about k
    checks, not k^2. `links[i] = (j, similarity)` records the first confirmed earlier match of i.
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
                    links.setdefault(i, (j, sim))
    return len(checked)


def ledger_rows(ids: list[str], uf: UnionFind, links: dict[int, tuple[int, float]],
                similarity: Callable[[int, int], float]) -> list[dict[str, Any]]:
    """One row per removed document: cluster number, survivor, member, similarity to the survivor, the link."""
    cluster_of: dict[int, int] = {}
    rows = []
    for i in range(len(ids)):
        root = uf.find(i)
        if root == i:
            continue
        cluster = cluster_of.setdefault(root, len(cluster_of))
        j, link_sim = links[i]
        rows.append({"cluster": cluster, "survivor": ids[root], "member": ids[i],
                     "similarity": round(similarity(root, i), 4), "linked_to": ids[j],
                     "link_similarity": round(link_sim, 4)})
    return rows


def write_ledger(path: Path, rows: list[dict[str, Any]]) -> None:
    """The ledger as zstd JSON lines, written atomically (empty file when nothing was removed)."""
    buf = io.BytesIO()
    for row in rows:
        buf.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    write_atomic(Path(path), zstandard.ZstdCompressor(level=3).compress(buf.getvalue()))
