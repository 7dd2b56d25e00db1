"""Dedup as partitioned stages on the workers: each step's memory is bounded by a constant or by the
duplicates, never by the corpus.

1. Signatures, inside each data task (`signatures.Signer`): every kept document's exact key and band keys,
   written beside the task's outcome, each array sorted so a key range is one slice. Memory: one task's
   documents.
2. Exact dedup (`exact_partition`): the 2^64 key space is cut into R equal ranges, R = kept documents /
   `data.dedup.bucket_docs` rounded up. A range is a task: it takes that range's slice of every task's
   sorted run (binary search in the memory-mapped file), merges them and emits (duplicate, first) for
   every key seen more than once. Memory: one range, about bucket_docs keys.
3. Buckets (`band_partition`): one task per (band, range), the same way. Documents agreeing on a band
   key form a bucket; its candidate pairs are confirmed (exact Jaccard of the shingle sets, or the
   Hamming distance) with a union-find of the task's own, and the confirmed pairs are emitted. Exact
   duplicates are left out. Memory: one range of one band and its confirmed pairs.
   MinHash without data.dedup.index keeps no shingle sets in the work folder (`signatures.keeps_shingles`), so
   this stage is three: the band tasks write each bucket of two or more (`cand-BBB-RRRRR.npy`, the candidates:
   a few in a hundred documents of a crawl); one task per group of consecutive data tasks (about bucket_docs
   documents, `Layout.groups`) reads their outcomes and derives the shingle sets of its candidates again
   (`shingles-GGGGG.npy`, `spans-`, `qs-`); then one task per (band, range) confirms the buckets as above
   (`confirm_partition`). The same buckets, the same shingles, the same pairs; the work folder holds the
   candidates' shingle sets, not every document's. Memory: one range's candidates, one document's shingles.
4. Clusters (`verdict_task`, one task on a worker): a walk of the confirmed pairs only (`clusters.Clusters`), in
   partitions of about data.dedup.verdict_pairs pairs that hold whole clusters (`Components`); the survivor is
   the cluster's earliest document; links and similarities for the ledger. Memory: one partition (and the
   largest cluster, walked whole), then one data task's verdicts: not the removed documents of the run.

Documents are numbered by their place among the kept documents of all tasks in canonical order (`Layout`):
documents of a `data.dedup.index` come first (so they always survive and are never re-emitted), then this run's.
Every result is therefore the same for any number of workers and on either engine. Each stage task writes its
result into the work folder (`dedup/ranges-NNNNN/`, one folder per plan of key ranges) and returns its record; the
driver appends a line vouching for it (`Results`), so a re-run redoes only what is missing, cut or changed, and no
result passes through the driver. Stage tasks read the work folder (and the index): on a Ray cluster of several
machines both must be on storage every node mounts.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.config import DedupConfig
from kiln.data.dedup.clusters import PAIR, Clusters, Pair, confirm_band, ledger_rows, name_rows, unique_pairs
from kiln.data.dedup.shingles import jaccard
from kiln.data.dedup.signatures import Part, keeps_shingles, npy_bytes, outcome_shingles, spilled_npy
from kiln.data.dedup.simhash import hamming_confirm
from kiln.data.vouch import Recording, matches, record

STAGE_DIR = "dedup"  # in the work folder: layout.json; ranges-NNNNN/: exact-RRRRR.npy, band-BBB-RRRRR.npy, ...


def band_count(cfg: DedupConfig) -> int:
    return {"minhash": cfg.bands, "simhash": cfg.hamming + 1}.get(cfg.method, 0)


# --- where every document's signatures are ------------------------------------------------------

class NpyFile:
    """Random reads from one .npy file with `os.pread`, not a memory map: the pages read stay in the page
    cache, not in this process's resident set (a map keeps every page it touched resident while it is
    open, so the driver's lookups over a corpus would grow it with the corpus)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
            self.offset = f.tell()
        self.dtype, self.shape = np.dtype(dtype), shape
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, a: int, b: int) -> np.ndarray:
        """Items a..b of the flat array."""
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self.fd, (b - a) * size, self.offset + a * size), dtype=self.dtype)

    def close(self) -> None:
        os.close(self.fd)


@dataclass(frozen=True)
class IdTable:
    """Document ids by document number, packed: 16 bytes and the id's UTF-8 per document, no object each."""
    qs: np.ndarray  # document numbers, ascending
    packed: bytes  # the ids, end to end
    ends: np.ndarray  # where each id ends in `packed`

    def __getitem__(self, q: int) -> str:
        n = int(np.searchsorted(self.qs, self.qs.dtype.type(q)))  # a Python int would convert all of qs per call
        if n == len(self.qs) or self.qs[n] != q:
            raise KeyError(q)
        return self.packed[int(self.ends[n - 1]) if n else 0:int(self.ends[n])].decode("utf-8", "surrogatepass")


class Layout:
    """The parts in canonical order and each one's first document number; random access to a document's
    shingles, fingerprint and id. Memory: a bounded number of files held open at a time (`OPEN`); the key
    runs that stage tasks slice are memory-mapped (one task's slices), the per-document lookups read with
    `NpyFile`, and ids are looked up in batches (`doc_ids`), one part's id list at a time."""

    OPEN = 256  # files held open (memory maps or NpyFiles, each an open file): least recently used closed first

    def __init__(self, parts: list[Part], cfg: DedupConfig, work: Path) -> None:
        self.parts, self.cfg, self.work = parts, cfg, Path(work)
        self.starts = np.concatenate([[0], np.cumsum([p.count for p in parts], dtype=np.int64)]).astype(np.int64)
        first_own = next((k for k, p in enumerate(parts) if p.run is None), len(parts))
        self.indexed = int(self.starts[first_own])  # documents before this run's: the index's
        self._open: OrderedDict[tuple[int, str], Any] = OrderedDict()

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def save(self) -> None:
        folder = self.work / STAGE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        from kiln.manifest import write_atomic

        write_atomic(folder / "layout.json", json.dumps({"cfg": self.cfg.model_dump(mode="json"),
                                                         "parts": [p.__dict__ for p in self.parts]}))

    @classmethod
    def load(cls, work: str | Path) -> Layout:
        data = json.loads((Path(work) / STAGE_DIR / "layout.json").read_text())
        return cls([Part(**p) for p in data["parts"]], DedupConfig(**data["cfg"]), Path(work))

    def array(self, k: int | str, kind: str) -> Any:
        """Part k's `kind` (k "results": the file `kind` among the stage results), memory-mapped (JSON: read)."""
        key = (k, kind)
        if key in self._open:
            self._open.move_to_end(key)
        else:
            self._make_room()
            path = self.path(k, kind)
            self._open[key] = json.loads(path.read_text()) if kind.endswith(".json") else np.load(path, mmap_mode="r")
        return self._open[key]

    def _make_room(self) -> None:
        if len(self._open) >= self.OPEN:
            _, gone = self._open.popitem(last=False)
            if isinstance(gone, NpyFile):
                gone.close()

    def path(self, k: int | str, kind: str) -> Path:
        if k == "results":
            return self.results / kind
        return Path(self.parts[k].folder) / f"{self.parts[k].name}.{kind}"

    def reader(self, k: int | str, kind: str) -> NpyFile:
        """An NpyFile of part k's `kind` (held open among the `OPEN` files)."""
        key = (k, f"{kind}@pread")
        if key not in self._open:
            self._make_room()
            self._open[key] = NpyFile(self.path(k, kind))
        self._open.move_to_end(key)
        return self._open[key]

    def forget(self, k: int) -> None:
        """Close what is open of part k (its maps' pages leave this process's resident set)."""
        for key in [key for key in self._open if key[0] == k]:
            gone = self._open.pop(key)
            if isinstance(gone, NpyFile):
                gone.close()

    def locate(self, q: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.starts, q, side="right") - 1)
        return k, q - int(self.starts[k])

    def shingles(self, q: int) -> np.ndarray:
        """Document q's shingle set: from its part (an index's, or a run keeping them), else from its group's
        candidates (`shingle_task`; a document in no bucket of two has none)."""
        k, local = self.locate(q)
        if self.parts[k].run is None and self.candidates:
            g = int(np.searchsorted(self.group_starts(), q, side="right") - 1)
            qs = self.array("results", f"qs-{g:05d}.npy")
            local = int(np.searchsorted(qs, qs.dtype.type(q)))  # the array's own type: O(log n), not O(n)
            if local == len(qs) or qs[local] != q:
                raise KeyError(f"dedup: document {q} is no candidate; it has no shingle set")
            a, b = self.reader("results", f"spans-{g:05d}.npy").read(local, local + 2).tolist()
            return self.reader("results", f"shingles-{g:05d}.npy").read(a, b)
        a, b = self.reader(k, "spans.npy").read(local, local + 2).tolist()
        return self.reader(k, "shingles.npy").read(a, b)

    @property
    def candidates(self) -> bool:
        """MinHash whose data tasks kept no shingle sets: the band stage finds the candidates, the shingle tasks
        derive theirs again and the confirm stage confirms them."""
        return self.cfg.method == "minhash" and not keeps_shingles(self.cfg)

    def groups(self) -> list[tuple[int, int]]:
        """This run's parts as runs of consecutive parts of about bucket_docs kept documents, (first, end): each
        is one shingle task's."""
        out, first, size = [], None, 0
        for k, part in enumerate(self.parts):
            if part.run is not None:
                continue
            first = k if first is None else first
            size += part.count
            if size >= self.cfg.bucket_docs:
                out.append((first, k + 1))
                first, size = None, 0
        return out + ([(first, len(self.parts))] if first is not None else [])

    def group_starts(self) -> np.ndarray:
        """Each group's first document number."""
        if not hasattr(self, "_group_starts"):
            self._group_starts = self.starts[[first for first, _ in self.groups()]]
        return self._group_starts

    def fingerprint(self, q: int) -> int:
        k, local = self.locate(q)
        return int(self.reader(k, "prints.npy").read(local, local + 1)[0])

    def ids_of(self, qs: np.ndarray) -> IdTable:
        """The ids of the documents numbered `qs`, reading each part's id list once, one part at a time."""
        qs = np.unique(np.asarray(qs, dtype=np.int64))
        packed, ends = bytearray(), np.empty(len(qs), dtype=np.int64)
        bounds = np.searchsorted(qs, self.starts).tolist()
        for k in range(len(self.parts)):
            a, b = bounds[k], bounds[k + 1]
            if a == b:
                continue
            ids, start = json.loads(self.path(k, "ids.json").read_text()), int(self.starts[k])
            for n, q in enumerate(qs[a:b].tolist(), a):
                packed += ids[q - start].encode("utf-8", "surrogatepass")
                ends[n] = len(packed)
            del ids  # before the next part's list is read: one part's ids at a time
        return IdTable(qs, bytes(packed), ends)

    def run_of(self, q: int) -> str | None:
        return self.parts[self.locate(q)[0]].run

    def key_slices(self, kind: str, row: int | None, r: int, ranges: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys, document numbers) of key range r of `ranges` from every part's sorted run of `kind`."""
        lo = np.uint64((r << 64) // ranges)
        hi = None if r == ranges - 1 else np.uint64(((r + 1) << 64) // ranges)
        for k in range(len(self.parts)):
            arr = self.array(k, f"{kind}.npy")
            arr = arr if row is None else arr[row]
            keys = arr[0]
            a = int(np.searchsorted(keys, lo, side="left"))
            b = len(keys) if hi is None else int(np.searchsorted(keys, hi, side="left"))
            piece = np.array(arr[:, a:b])  # a copy, and the map closed: the pages the search and the kernel's
            self.forget(k)  # read-ahead brought in leave this process (a task reads a slice of every part)
            yield piece, piece[-1].astype(np.uint64) + np.uint64(self.starts[k])

    def confirm(self) -> tuple[Callable[[int, int], float | None], Callable[[int, int], float]]:
        """(confirm a candidate pair: its similarity or None, the similarity of any pair)."""
        if self.cfg.method == "simhash":
            confirm = hamming_confirm(self.cfg.hamming, self.fingerprint)
            return confirm, lambda j, i: 1 - (self.fingerprint(j) ^ self.fingerprint(i)).bit_count() / 64

        def similarity(j: int, i: int) -> float:
            return jaccard(self.shingles(j), self.shingles(i))

        threshold = self.cfg.threshold
        return (lambda j, i: s if (s := similarity(j, i)) >= threshold else None), similarity

    def ranges(self) -> int:
        return max(1, math.ceil(self.total / self.cfg.bucket_docs))

    @property
    def results(self) -> Path:
        """The stage results of this plan of key ranges: another data.dedup.bucket_docs is another folder."""
        return self.work / STAGE_DIR / f"ranges-{self.ranges():05d}"

    def exact_keys(self, qs: np.ndarray) -> np.ndarray | None:
        """(len(qs), 2) uint64: the exact keys of the documents numbered `qs` (ascending), read from their parts'
        `keys.npy` (memory: the documents asked for); None when a part has none (an index run written before)."""
        out = np.empty((len(qs), 2), dtype=np.uint64)
        bounds = np.searchsorted(qs, self.starts.astype(np.uint64)).tolist()
        for k in range(len(self.parts)):
            a, b = bounds[k], bounds[k + 1]
            if a == b:
                continue
            if not self.path(k, "keys.npy").exists():
                return None
            file, start = self.reader(k, "keys.npy"), int(self.starts[k])
            local = (qs[a:b] - np.uint64(start)).astype(np.int64)
            if local[-1] - local[0] < 8 * (b - a):  # dense: one read of the span
                span = file.read(2 * int(local[0]), 2 * int(local[-1]) + 2).reshape(-1, 2)
                out[a:b] = span[local - local[0]]
            else:
                for n, at in enumerate(local.tolist(), a):
                    out[n] = file.read(2 * at, 2 * at + 2)
        return out

    def exact_removed(self) -> np.ndarray:
        """(2, m): exact duplicates and their first copy, sorted by the duplicate (a whole run's: for an index run
        written before `keys.npy`, and for tests)."""
        found = [np.load(p) for p in sorted(self.results.glob("exact-*.npy"))]
        both = np.concatenate(found, axis=1) if found else np.empty((2, 0), dtype=np.uint64)
        return both[:, np.argsort(both[0], kind="stable")]


# --- the stage tasks (on the workers: each writes its result into the plan's results folder and returns its
# record, which the driver vouches for; no result passes through the driver) -----------------------------

def _written(layout: Layout, name: str, blob: bytes) -> tuple[str, dict[str, Any]]:
    from kiln.manifest import write_atomic

    write_atomic(layout.results / name, blob)
    return name, record(blob)


def exact_partition(job: tuple[str, int, int]) -> tuple[str, dict[str, Any]]:
    """Exact duplicates in key range r: (duplicate, first) document numbers, sorted by the duplicate, as
    `exact-RRRRR.npy`."""
    work, r, ranges = job
    layout = Layout.load(work)
    pieces = list(layout.key_slices("exact", None, r, ranges))
    hi = np.concatenate([p[0][0] for p in pieces]) if pieces else np.empty(0, np.uint64)
    lo = np.concatenate([p[0][1] for p in pieces]) if pieces else np.empty(0, np.uint64)
    q = np.concatenate([p[1] for p in pieces]) if pieces else np.empty(0, np.uint64)
    order = np.lexsort((q, lo, hi))
    hi, lo, q = hi[order], lo[order], q[order]
    new_group = np.ones(len(q), dtype=bool)
    new_group[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    first = q[np.flatnonzero(new_group)][np.cumsum(new_group) - 1]
    dup = ~new_group & (q >= np.uint64(layout.indexed))  # an index's documents are never removed
    found = np.stack([q[dup], first[dup]])
    return _written(layout, f"exact-{r:05d}.npy", npy_bytes(found[:, np.argsort(found[0], kind="stable")]))


def band_partition(job: tuple[str, int, int, int]) -> tuple[str, dict[str, Any]]:
    """Confirmed near-duplicate pairs of band `band`, key range r, as `band-BBB-RRRRR.npy`; with `candidates`, the
    buckets to confirm instead, as `cand-BBB-RRRRR.npy`."""
    work, band, r, ranges = job
    layout = Layout.load(work)
    pieces = list(layout.key_slices("bands", band, r, ranges))
    keys = np.concatenate([p[0][0] for p in pieces]) if pieces else np.empty(0, np.uint64)
    q = np.concatenate([p[1] for p in pieces]) if pieces else np.empty(0, np.uint64)
    keep = ~copies_in_buckets(layout, keys, q)
    if layout.candidates:
        found = bucket_members(keys[keep], q[keep], layout.indexed)
        return _written(layout, f"cand-{band:03d}-{r:05d}.npy", npy_bytes(found))
    return _written(layout, f"band-{band:03d}-{r:05d}.npy", _confirmed(layout, keys[keep], q[keep]))


def copies_in_buckets(layout: Layout, keys: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Which of one band's documents `q` (with band keys `keys`) the exact stage removes: a document of this run
    whose text an earlier document has. Such a copy has its first copy's band keys, so both are in one bucket:
    the exact keys of the buckets of two or more (`Layout.exact_keys`) find every copy, and no task holds the
    run's exact duplicates (an index run without keys.npy: the exact stage's results, as before)."""
    order = np.lexsort((q, keys))
    shared = np.zeros(len(q), dtype=bool)  # in a bucket of two or more
    if len(q):
        same = keys[order][1:] == keys[order][:-1]
        shared[order[1:][same]] = shared[order[:-1][same]] = True
    at = np.flatnonzero(shared)
    at = at[np.argsort(q[at], kind="stable")]  # by document number, as exact_keys reads them
    exact = layout.exact_keys(q[at])
    if exact is None:
        return np.isin(q, layout.exact_removed()[0])
    by = np.lexsort((q[at], exact[:, 1], exact[:, 0], keys[at]))  # bucket, exact key, then document order
    at, exact = at[by], exact[by]
    copy = np.zeros(len(at), dtype=bool)
    copy[1:] = (keys[at][1:] == keys[at][:-1]) & (exact[1:] == exact[:-1]).all(axis=1)
    copy &= q[at] >= np.uint64(layout.indexed)  # an index's documents are never removed
    out = np.zeros(len(q), dtype=bool)
    out[at[copy]] = True
    return out


def bucket_members(keys: np.ndarray, q: np.ndarray, indexed: int) -> np.ndarray:
    """(2, m) uint64, sorted by document: the documents (row 0) and keys (row 1) of the buckets of two or more
    holding one of this run's documents (number >= `indexed`): the only ones `confirm_band` compares."""
    order = np.lexsort((q, keys))
    keys, q = keys[order], q[order]
    new = np.ones(len(q), dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    bucket = np.cumsum(new) - 1
    ends = np.append(np.flatnonzero(new)[1:], len(q)) if len(q) else np.empty(0, np.int64)
    size = ends - np.flatnonzero(new)
    keep = (size[bucket] > 1) & (q[ends - 1][bucket] >= np.uint64(indexed)) if len(q) else new
    mine = np.argsort(q[keep], kind="stable")
    return np.stack([q[keep][mine], keys[keep][mine]]).astype(np.uint64)


def _confirmed(layout: Layout, keys: np.ndarray, q: np.ndarray) -> bytes:
    """The confirmed pairs of one band's documents `q` with keys `keys`, as a PAIR .npy."""
    confirm, _ = layout.confirm()
    indexed = layout.indexed

    def confirm_new(j: int, i: int) -> float | None:  # two documents of the index were compared by its own run
        return None if i < indexed else confirm(j, i)

    pairs: list[Pair] = []
    confirm_band(keys, q, confirm_new, pairs)
    return npy_bytes(np.array(pairs, dtype=PAIR))


def shingle_task(job: tuple[str, int, int]) -> list[tuple[str, dict[str, Any]]]:
    """The shingle sets of group g's candidates (every document of a `cand-*` file in its range), derived again
    from its parts' outcomes: `qs-GGGGG.npy` (their numbers, ascending), `spans-GGGGG.npy` and
    `shingles-GGGGG.npy` (as a part's spans and shingles). Memory: the group's candidates' numbers, one record."""
    import tempfile

    from kiln.manifest import writing_atomic

    work, g, ranges = job
    layout = Layout.load(work)
    first, end = layout.groups()[g]
    lo, hi = np.uint64(layout.starts[first]), np.uint64(layout.starts[end])
    qs = np.empty(0, np.uint64)
    for band in range(band_count(layout.cfg)):
        for r in range(ranges):
            found = layout.array("results", f"cand-{band:03d}-{r:05d}.npy")[0]
            qs = np.union1d(qs, found[np.searchsorted(found, lo):np.searchsorted(found, hi)])  # one file's at a
            layout.forget("results")  # time: the group's candidates once, not once a band (20x at 1 M documents)
    sizes = []
    with tempfile.TemporaryFile() as spill:
        for k in range(first, end):
            start = int(layout.starts[k])
            mine = qs[(qs >= np.uint64(start)) & (qs < np.uint64(layout.starts[k + 1]))] - np.uint64(start)
            path = Path(layout.parts[k].folder) / f"{layout.parts[k].name}.jsonl.zst"
            for shingles in outcome_shingles(path, mine.tolist(), layout.cfg):
                spill.write(shingles.tobytes())
                sizes.append(len(shingles))
        spill.flush()
        out = [_written(layout, f"qs-{g:05d}.npy", npy_bytes(qs)),
               _written(layout, f"spans-{g:05d}.npy", npy_bytes(np.concatenate([[0], np.cumsum(sizes,
                                                                                             dtype=np.int64)])))]
        with writing_atomic(layout.results / f"shingles-{g:05d}.npy") as f:
            rec = Recording(f)
            for block in spilled_npy(spill, sum(sizes)):
                rec.write(block)
        return out + [(f"shingles-{g:05d}.npy", rec.record())]


def confirm_partition(job: tuple[str, int, int, int]) -> tuple[str, dict[str, Any]]:
    """The confirmed pairs of one band task's buckets (`cand-BBB-RRRRR.npy`), as `band-BBB-RRRRR.npy`."""
    work, band, r, ranges = job
    layout = Layout.load(work)
    found = np.load(layout.results / f"cand-{band:03d}-{r:05d}.npy")
    return _written(layout, f"band-{band:03d}-{r:05d}.npy", _confirmed(layout, found[1], found[0]))


STAGES = {"exact": exact_partition, "band": band_partition, "cand": band_partition, "shingles": shingle_task,
          "confirm": confirm_partition}


def stage_task(job: tuple) -> list[tuple[str, dict[str, Any]]]:
    """Run one stage job (its first item names the stage); returns its results' (name, record)."""
    out = STAGES[job[0]](job[1:])
    return out if isinstance(out, list) else [out]


def stage_jobs(layout: Layout) -> list[list[tuple]]:
    """The stages' jobs, stage by stage (each stage needs the results of those before it): exact, band, and with
    `candidates` the shingle and confirm stages."""
    work, ranges = str(layout.work), layout.ranges()
    exact = [("exact", work, r, ranges) for r in range(ranges)]
    bands = [("band", work, b, r, ranges) for b in range(band_count(layout.cfg)) for r in range(ranges)]
    if not layout.candidates:
        return [exact, bands]
    groups = [("shingles", work, g, ranges) for g in range(len(layout.groups()))]
    return [exact, [("cand", *job[1:]) for job in bands], groups, [("confirm", *job[1:]) for job in bands]]


def result_names(job: tuple) -> list[str]:
    kind, *rest = job
    if kind == "exact":
        return [f"exact-{rest[1]:05d}.npy"]
    if kind == "shingles":
        return [f"{what}-{rest[1]:05d}.npy" for what in ("qs", "spans", "shingles")]
    return [f"{'cand' if kind == 'cand' else 'band'}-{rest[1]:03d}-{rest[2]:05d}.npy"]


class Results:
    """A plan's stage results (`Layout.results`, written by the stage tasks on the workers) and `results.jsonl`,
    a line per result the driver vouched for from the record its task returned (`kiln.data.vouch`). A result
    counts only when its line does and its file matches it."""

    def __init__(self, layout: Layout) -> None:
        self.folder = layout.results
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = self.folder / "results.jsonl"

    def keep_vouched(self) -> set[str]:
        """The names of the results that count; every other .npy file here (ours: a killed run's, a cut or
        changed one) is removed, so the stage tasks that read this folder see only results that count."""
        records = {}
        if self.log.exists():
            for line in self.log.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                    records[rec["name"]] = rec
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a kill: that result is done again
        good = {name for name, rec in records.items() if matches(self.folder / name, rec)}
        for path in self.folder.glob("*.npy"):
            if path.name not in good:
                path.unlink()
        return good

    def add(self, name: str, blob: bytes) -> None:
        from kiln.manifest import write_atomic

        write_atomic(self.folder / name, blob)
        self.vouch(name, record(blob))

    def vouch(self, name: str, rec: dict[str, Any]) -> None:
        """A line for a result a worker wrote (its record made from the bytes it wrote)."""
        with open(self.log, "a") as f:
            f.write(json.dumps({"name": name, **rec}) + "\n")
            f.flush()
            os.fsync(f.fileno())


# --- the verdicts ---------------------------------------------------------------------------------

@dataclass
class Verdicts:
    """Who goes among one data task's documents, by document number, as arrays sorted by document number (the
    verdicts task makes one per data task from its partitions' files: `Components.task_verdicts`).

    Memory: ~100 bytes per removed document of the task (16 per exact duplicate; 48 per near duplicate; 16 and
    the id for each document a verdict names), nothing per kept document. The ledger rows and the rejections are
    made one at a time, in document order, from these arrays."""
    exact: np.ndarray  # (2, m) uint64: each exact duplicate and its first copy, sorted by the duplicate
    near: Clusters
    similarity: np.ndarray  # each near duplicate's similarity to its survivor, in member order
    ids: IdTable  # of every document the verdicts name
    layout: Layout
    dropped_before: int = 0  # the run's exact duplicates before these documents

    def _run(self, q: int) -> dict[str, str]:
        """{"duplicate_in": run} for a document of data.dedup.index (they come first), else nothing."""
        return {"duplicate_in": self.layout.run_of(q)} if q < self.layout.indexed else {}

    def ledger(self) -> Iterator[dict[str, Any]]:
        """The near-duplicate ledger rows, in member order, documents named by id, each member's `position` its
        place among this run's exact-dedup survivors."""
        rows = name_rows(ledger_rows(self.near, self.similarity.tolist()), self.ids.__getitem__)
        dropped_before = self.exact[0]
        for out, survivor in zip(rows, self.near.survivor.tolist()):
            q = out["position"]
            out["position"] = q - self.layout.indexed - self.dropped_before - int(np.searchsorted(dropped_before, q))
            if survivor < self.layout.indexed:
                out["survivor_run"] = self.layout.run_of(survivor)
            yield out

    def rejections(self) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """(document number, reason, signals) of every removed document, in document order."""
        exact = zip(self.exact[0].tolist(), self.exact[1].tolist())
        near = zip(self.near.member.tolist(), self.near.survivor.tolist(), self.near.cluster.tolist(),
                   self.similarity.tolist())
        e, n = next(exact, None), next(near, None)
        while e is not None or n is not None:
            if n is None or (e is not None and e[0] < n[0]):
                yield e[0], "exact_duplicate", {"duplicate_of": self.ids[e[1]], **self._run(e[1])}
                e = next(exact, None)
            else:
                q, survivor, cluster, sim = n
                yield q, "near_duplicate", {"duplicate_of": self.ids[survivor], "similarity": round(sim, 4),
                                            "cluster": cluster, **self._run(survivor)}
                n = next(near, None)


VERDICTS = "verdicts"  # in a plan's results folder: one file per data task, task-NNNNN.jsonl.zst
VERDICT_STATS = "verdicts.json"  # beside it: the counts of stats.json `dedup`
SCRATCH = "components"  # beside it, while the verdicts task runs: its partitions' files
NEAR = np.dtype([("member", "<u8"), ("survivor", "<u8"), ("linked_to", "<u8"), ("link_similarity", "<f8"),
                 ("similarity", "<f8"), ("cluster", "<i8")])  # a near duplicate's verdict, as a partition keeps it


class Components:
    """The clusters of the confirmed pairs, walked in partitions of about data.dedup.verdict_pairs pairs, so the
    verdicts task's memory is bounded by that budget (and by the largest cluster, walked whole), never by the
    duplicates. Every step keeps its arrays in files of the scratch folder (`SCRATCH`) and holds one partition:
    1. `split`: each band result's pairs, as edges both ways, into P partitions by document range (and the pairs
       by their earlier document);
    2. `label`: every document in a pair gets its cluster's earliest document (its survivor) by rounds of
       minimum-label propagation with pointer jumping over the partitions (a few rounds: each at least halves
       the distance labels still have to travel), until a round changes nothing;
    3. `gather`: each pair moves to the partition of its cluster's survivor, so a partition holds whole clusters;
    4. `walk`: each partition's clusters walked as `Clusters.of` walks them (the same survivors, links and
       similarities, since each walk sees one cluster), numbered in the order of their first removed member
       among every partition's (`number`);
    5. `task_verdicts`: one data task's `Verdicts` from the slices of the exact results and the partitions.
    The result is the single walk's, for any number of partitions."""

    def __init__(self, layout: Layout) -> None:
        import shutil

        self.layout, self.folder = layout, layout.results / SCRATCH
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.bands = sorted(layout.results.glob("band-*.npy"))
        pairs = sum(np.load(path, mmap_mode="r").shape[0] for path in self.bands)
        self.count = max(1, math.ceil(2 * pairs / layout.cfg.verdict_pairs))
        self.bounds = (np.arange(self.count + 1, dtype=np.int64) * layout.total // self.count).astype(np.uint64)
        self.exact = sorted(layout.results.glob("exact-*.npy"))
        self.pairs_confirmed, self.sizes = 0, Counter()

    def part_of(self, q: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds[1:-1], q, side="right")

    def _path(self, name: str, p: int) -> Path:
        return self.folder / f"{name}-{p:05d}.bin"

    def _read(self, name: str, p: int, dtype: Any) -> np.ndarray:
        path = self._path(name, p)
        return np.fromfile(path, dtype=dtype) if path.exists() else np.empty(0, dtype=dtype)

    def _route(self, name: str, rows: np.ndarray, key: np.ndarray) -> None:
        """Append `rows` to partition files `name`, each row to the partition of its `key`."""
        parts = self.part_of(key)
        order = np.argsort(parts, kind="stable")
        rows, parts = rows[order], parts[order]
        edges = np.searchsorted(parts, np.arange(self.count + 1))
        for p in np.flatnonzero(np.diff(edges)).tolist():
            with open(self._path(name, p), "ab") as f:
                f.write(rows[edges[p]:edges[p + 1]].tobytes())

    def split(self) -> None:
        for path in self.bands:
            pairs = np.load(path)
            ends = np.stack([np.concatenate([pairs["j"], pairs["i"]]), np.concatenate([pairs["i"], pairs["j"]])], 1)
            self._route("edges", ends, ends[:, 0])
            self._route("pairs", pairs, pairs["j"])

    def _labels(self, p: int) -> np.ndarray:
        path = self.folder / f"labels-{p:05d}.npy"
        return np.load(path) if path.exists() else np.empty((2, 0), np.uint64)

    def _lookup(self, q: np.ndarray, p: int, own: np.ndarray) -> np.ndarray:
        """The labels of documents `q` (each in some pair), partition p's from `own`, the others' from their files."""
        out = np.empty(len(q), dtype=np.uint64)
        parts = self.part_of(q)
        for r in np.unique(parts).tolist():
            sel = parts == r
            nodes, labels = own if r == p else self._labels(r)
            out[sel] = labels[np.searchsorted(nodes, q[sel])]
        return out

    def label(self) -> None:
        for p in range(self.count):  # each partition's edges once each, sorted by their first end
            ends = self._read("edges", p, np.uint64).reshape(-1, 2)
            ends = ends[np.lexsort((ends[:, 1], ends[:, 0]))]
            first = np.ones(len(ends), dtype=bool)
            first[1:] = (ends[1:, 0] != ends[:-1, 0]) | (ends[1:, 1] != ends[:-1, 1])
            ends = ends[first]
            ends.tofile(self._path("edges", p))
            nodes = np.unique(ends[:, 0])
            np.save(self.folder / f"labels-{p:05d}.npy", np.stack([nodes, nodes]))
        changed = True
        while changed:
            changed = False
            for p in range(self.count):
                ends = self._read("edges", p, np.uint64).reshape(-1, 2)
                nodes, labels = self._labels(p)
                if not len(nodes):
                    continue
                starts = np.flatnonzero(np.concatenate([[True], ends[1:, 0] != ends[:-1, 0]]))
                new = np.minimum(labels, np.minimum.reduceat(self._lookup(ends[:, 1], p, (nodes, labels)), starts))
                new = np.minimum(new, self._lookup(new, p, (nodes, new)))  # pointer jumping: a label's own label
                if np.any(new != labels):
                    changed = True
                    np.save(self.folder / f"labels-{p:05d}.npy", np.stack([nodes, new]))

    def gather(self) -> None:
        for p in range(self.count):
            pairs = self._read("pairs", p, PAIR)
            nodes, labels = self._labels(p)
            self._route("clusters", pairs, labels[np.searchsorted(nodes, pairs["j"])])

    def walk(self) -> None:
        _, similarity = self.layout.confirm()
        for p in range(self.count):
            pairs = unique_pairs(self._read("clusters", p, PAIR))
            self.pairs_confirmed += len(pairs)
            near = np.empty(0, dtype=NEAR)
            if len(pairs):
                found = Clusters.of(pairs)
                near = np.empty(len(found), dtype=NEAR)
                for field in ("member", "survivor", "linked_to", "link_similarity", "cluster"):
                    near[field] = getattr(found, field)
                near["similarity"] = [similarity(r, i) for r, i in zip(found.survivor.tolist(), found.member.tolist())]
                self.sizes.update(np.bincount(found.cluster).tolist())
            _, first = np.unique(near["cluster"], return_index=True)
            np.save(self.folder / f"firsts-{p:05d}.npy", near["member"][first])  # each cluster's first member
            np.save(self.folder / f"near-{p:05d}.npy", near)

    def number(self) -> None:
        """Each partition's clusters numbered among every partition's, by their first removed member."""
        for p in range(self.count):
            firsts = np.load(self.folder / f"firsts-{p:05d}.npy")
            rank = np.zeros(len(firsts), dtype=np.int64)
            for r in range(self.count):
                rank += np.searchsorted(np.load(self.folder / f"firsts-{r:05d}.npy"), firsts)
            near = np.load(self.folder / f"near-{p:05d}.npy")
            near["cluster"] = rank[near["cluster"]]
            np.save(self.folder / f"near-{p:05d}.npy", near)

    def task_verdicts(self, k: int) -> Verdicts:
        """Part k's verdicts: the slices of every exact result and partition in its document range."""
        layout = self.layout
        start, end = int(layout.starts[k]), int(layout.starts[k + 1])
        exact, before = [], 0
        for path in self.exact:
            found = np.load(path, mmap_mode="r")
            a, b = np.searchsorted(found[0], [start, end]).tolist()
            exact.append(np.array(found[:, a:b]))
            before += a
        exact = np.concatenate(exact, axis=1) if exact else np.empty((2, 0), np.uint64)
        exact = exact[:, np.argsort(exact[0], kind="stable")]
        near = [np.empty(0, dtype=NEAR)]
        for p in range(self.count):
            found = np.load(self.folder / f"near-{p:05d}.npy", mmap_mode="r")
            a, b = np.searchsorted(found["member"], [start, end]).tolist()
            near.append(np.array(found[a:b]))
        rows = np.concatenate(near)
        rows = rows[np.argsort(rows["member"], kind="stable")]
        clusters = Clusters(rows["member"], rows["survivor"], rows["linked_to"], rows["link_similarity"],
                            rows["cluster"])
        ids = layout.ids_of(np.concatenate([exact[1], rows["survivor"], rows["member"], rows["linked_to"]]))
        return Verdicts(exact, clusters, rows["similarity"], ids, layout, before)

    def stats(self) -> dict[str, Any]:
        exact = against = near = 0
        for path in self.exact:
            found = np.load(path, mmap_mode="r")
            exact += found.shape[1]
            against += int(np.sum(found[1] < self.layout.indexed))
        for p in range(self.count):
            found = np.load(self.folder / f"near-{p:05d}.npy", mmap_mode="r")
            near += len(found)
            against += int(np.sum(found["survivor"] < self.layout.indexed))
        return {"exact_removed": exact, "near_removed": near, "pairs_confirmed": self.pairs_confirmed,
                "cluster_sizes": {str(k + 1): v for k, v in sorted(self.sizes.items())},
                "removed_against_index": against}


def verdict_task(work: str) -> dict[str, Any]:
    """On a worker: the run's verdicts (the exact results and the clusters walk, `Components`), written one file per
    data task of this run, `verdicts/task-NNNNN.jsonl.zst`: a line per removed document, in document order,
    `{"n": its number among the task's kept documents, "reason", "signals"}` and, for a near duplicate, its
    ledger row (`"ledger"`). Returns the files' records and the counts. The driver then holds none of it: the
    merge reads one task's file at a time (`VerdictFiles`). Memory here: one partition of about
    data.dedup.verdict_pairs pairs (`Components`), then one data task's verdicts."""
    import shutil

    import zstandard

    from kiln.manifest import writing_atomic

    layout = Layout.load(work)
    parts = Components(layout)
    for step in (parts.split, parts.label, parts.gather, parts.walk, parts.number):
        step()
    files = {}
    (layout.results / VERDICTS).mkdir(exist_ok=True)
    for k, part in enumerate(layout.parts):
        if part.run is not None:
            continue
        held = parts.task_verdicts(k)
        start = int(layout.starts[k])
        ledger = held.ledger()
        name = f"{VERDICTS}/{part.name}.jsonl.zst"
        with writing_atomic(layout.results / name) as f:
            out = Recording(f)
            with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as zw:
                for q, reason, signals in held.rejections():
                    row = {"n": q - start, "reason": reason, "signals": signals}
                    if reason == "near_duplicate":
                        row["ledger"] = next(ledger)
                    zw.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
        files[name] = out.record()
        del held, ledger  # before the next task's are made: one task's verdicts at a time
    stats = parts.stats()
    shutil.rmtree(parts.folder, ignore_errors=True)
    return {"files": files, "stats": stats}


class VerdictFiles:
    """The verdicts as the driver sees them: the verdicts task's files, read one data task at a time (memory: one
    line), and its counts. `rejections()` and `ledger()` stream them in document order, as `Verdicts` gives them;
    `removed_in(k)` is one part's removed documents (for its profile task and the index)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.counts: dict[str, Any] = {}
        self.seconds, self.tasks = 0.0, 0

    def names(self) -> list[str]:
        return [f"{VERDICTS}/{p.name}.jsonl.zst" for p in self.layout.parts if p.run is None] + [VERDICT_STATS]

    def vouched(self, done: set[str]) -> bool:
        return all(name in done for name in self.names())

    def load(self) -> None:
        self.counts = json.loads((self.layout.results / VERDICT_STATS).read_text())

    def path(self, k: int) -> Path:
        """Part k's verdict file (a merge task reads its own: `kiln.data.merge`)."""
        return self.layout.results / VERDICTS / f"{self.layout.parts[k].name}.jsonl.zst"

    def _rows(self, k: int) -> Iterator[dict[str, Any]]:
        from kiln.data.docs import read_part

        return read_part(self.path(k))

    def _own(self) -> list[int]:
        return [k for k, p in enumerate(self.layout.parts) if p.run is None]

    def rejections(self) -> Iterator[tuple[int, str, dict[str, Any]]]:
        for k in self._own():
            start = int(self.layout.starts[k])
            for row in self._rows(k):
                yield start + row["n"], row["reason"], row["signals"]

    def ledger(self) -> Iterator[dict[str, Any]]:
        for k in self._own():
            yield from (row["ledger"] for row in self._rows(k) if "ledger" in row)

    def removed_in(self, k: int) -> np.ndarray:
        """Part k's removed documents, by their number among its kept documents."""
        return np.array([row["n"] for row in self._rows(k)], dtype=np.int64)

    def removed(self) -> np.ndarray:
        """Every removed document's number, sorted (a whole run's: for tests and benchmarks)."""
        parts = [self.removed_in(k) + int(self.layout.starts[k]) for k in self._own()]
        return np.concatenate(parts).astype(np.uint64) if parts else np.empty(0, np.uint64)

    def stats(self) -> dict[str, Any]:
        return self.counts


# --- the driver -----------------------------------------------------------------------------------

def dedup_layout(work: Path, summaries: list[dict[str, Any]], cfg: DedupConfig, key: str = "") -> Layout:
    """The layout of this run's tasks (after those of data.dedup.index, for the run whose index key is
    `key`), saved in the work folder."""
    from kiln.data.dedup.index import index_parts

    own = [Part(str(work), f"task-{s['index']:05d}", int(s["kept"])) for s in summaries]
    layout = Layout(index_parts(cfg, key) + own, cfg, work)
    layout.save()
    return layout


def run_stages(layout: Layout, workers: int, executor: str = "local", ray_address: str | None = None) -> VerdictFiles:
    """The exact stage, then the band stage, then the verdicts task, on the engine; results the driver has
    written (and vouched for) are not redone, and the verdicts only when no stage result was."""
    from kiln.tasks.executor import run_tasks

    t0 = time.perf_counter()
    results = Results(layout)
    done = results.keep_vouched()
    stages = stage_jobs(layout)
    redone = False
    for jobs in stages:
        todo = [job for job in jobs if not set(result_names(job)) <= done]
        for found in run_tasks(stage_task, todo, workers, executor, ray_address):
            for name, rec in found:
                results.vouch(name, rec)
            redone = True
    out = VerdictFiles(layout)
    if redone or not out.vouched(done):
        for found in run_tasks(verdict_task, [str(layout.work)], workers, executor, ray_address):
            for name, rec in found["files"].items():
                results.vouch(name, rec)
            results.add(VERDICT_STATS, json.dumps(found["stats"]).encode())
    out.load()
    out.seconds, out.tasks = time.perf_counter() - t0, sum(map(len, stages)) + 1
    return out
