"""Distribution check (SEEDS): a source whose token profile drifts from the corpus is down-weighted.

This is corpus-wide: after dedup, one task per data task profiles its kept documents (`profile_part`,
pipeline.profile_task) and the driver sums the parts. For
each of the corpus's `top_tokens` most frequent tokens t, with f_d(t) its relative frequency
in document d:

    z_s(t) = (mean of f_d(t) over the source's documents - mean over the corpus) / std over the corpus

A source's z is the root mean square of z_s(t) over those tokens, each weighted by its corpus
frequency (so that "the" counts more than the thousandth token, whose per-document frequency
is mostly noise): 0 for a source that looks like the corpus, large when its common words are
not the corpus's. A source with z > max_z
gets sampling weight max_z / z (recorded in the manifest; nothing is dropped). Accumulating
per-source sums of f and f^2 keeps this one pass; the data stage adds them up from per-task parts with
`SpilledProfiles`, whose memory is a 64th of the corpus vocabulary and a bounded slice of the sources (x 2
top_tokens), not sources x vocabulary.

What a source is, `data.distribution.source_key`: the input file (default), the URL's host, or a
JSONL/Parquet record field (`field:NAME`). Each kept document carries its `source_group`; `kiln pack`
packs every down-weighted source into its own shard group, which the loader samples by weight.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import math
import pickle
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import urlsplit

import numpy as np

from kiln.data.gates.text import words
from kiln.data.document import NO_HOST, missing_group
from kiln.data.tables import read_frames
from kiln.errors import KilnError

def check_groups(weights: dict[str, dict[str, float | int]], source_key: str) -> None:
    """Refuse a source_key that put every kept document in the one group of those lacking it (a field name's
    typo, `host` on records without URLs): the gate would compare the corpus with itself and do nothing."""
    missing = missing_group(source_key)
    if missing is not None and list(weights) == [missing]:
        what = "a URL (data.url_field)" if source_key == "host" else f"the field {source_key[len('field:'):]!r}"
        raise KilnError(f"data.distribution.source_key={source_key}: none of the {weights[missing]['docs']:,} kept "
                        f"documents has {what}, so they would all be one source and the distribution gate would do "
                        "nothing; fix the key (file, host or field:NAME of a field the records have), or set "
                        "data.distribution.enabled=false")


def source_group(source_key: str, source: str, url: str | None, field_value: str | None) -> str:
    """Which source a document counts for: its input file, its URL's host (lower case, no port) or the
    value the reader took from its record field (`field:NAME`; WARC input has no fields: its file)."""
    if source_key == "host":
        return (urlsplit(url).hostname if url else None) or NO_HOST
    if source_key.startswith("field:"):
        return field_value if field_value is not None else source
    return source


class Composition:
    """Kept documents and characters by language: O(languages) in memory. (By source, a table of its own:
    kiln.data.tables, as a crawl keyed by host has a source per site.)"""

    def __init__(self) -> None:
        self.by_lang: dict[str, Counter[str]] = defaultdict(Counter)

    def add(self, lang: str | None, chars: int) -> None:
        row = self.by_lang[lang or "unknown"]
        row["documents"] += 1
        row["chars"] += chars

    def report(self) -> dict[str, dict[str, float | int]]:
        """{lang: {documents, chars, doc_share, char_share}}, largest first."""
        rows = self.by_lang
        docs, chars = sum(r["documents"] for r in rows.values()), sum(r["chars"] for r in rows.values())
        return {name: {"documents": r["documents"], "chars": r["chars"],
                       "doc_share": round(r["documents"] / max(docs, 1), 4),
                       "char_share": round(r["chars"] / max(chars, 1), 4)}
                for name, r in sorted(rows.items(), key=lambda kv: (-kv[1]["chars"], kv[0]))}


def rank_key(value: float, token: str) -> tuple[float, str]:
    """How the corpus's tokens rank: most frequent first, ties by name. The sum is rounded to float32 first, so
    that the same terms added in another order (the spilled profile adds the sources in another order) rank
    alike."""
    return -float(np.float32(value)), token


def varies(std, mean):
    """Whether a token's frequency varies over the documents (it scores the sources only then): a deviation
    within float rounding of 0 (every document has the same frequency) would divide by noise."""
    return std > 1e-6 * mean


class SourceProfiles:
    def __init__(self, top_tokens: int = 1000, max_z: float = 3.0) -> None:
        self.top_tokens, self.max_z = top_tokens, max_z
        self.docs: Counter[str] = Counter()
        self.sum_f: dict[str, Counter[str]] = defaultdict(Counter)
        self.sum_f2: dict[str, Counter[str]] = defaultdict(Counter)

    def add(self, source: str, text: str) -> None:
        counts = Counter(w.lower() for w in words(text))
        n = sum(counts.values())
        self.docs[source] += 1
        if not n:
            return
        s1, s2 = self.sum_f[source], self.sum_f2[source]
        for tok, c in counts.items():
            f = c / n
            s1[tok] += f
            s2[tok] += f * f

    def report(self) -> dict[str, dict[str, float | int]]:
        """{source: {"docs", "z", "weight"}}, sources sorted by name."""
        total_docs = sum(self.docs.values())
        if not total_docs:
            return {}
        corpus_f1: Counter[str] = Counter()
        corpus_f2: Counter[str] = Counter()
        for src in self.sum_f:
            corpus_f1.update(self.sum_f[src])
            corpus_f2.update(self.sum_f2[src])
        top = sorted(corpus_f1, key=lambda t: rank_key(corpus_f1[t], t))[: self.top_tokens]
        mean = {t: corpus_f1[t] / total_docs for t in top}
        std = {t: math.sqrt(max(corpus_f2[t] / total_docs - mean[t] ** 2, 0.0)) for t in top}
        out = {}
        for src in sorted(self.docs):
            n = self.docs[src]
            used = [t for t in top if varies(std[t], mean[t])]
            weight = sum(mean[t] for t in used)
            z = (
                math.sqrt(sum(mean[t] * ((self.sum_f[src][t] / n - mean[t]) / std[t]) ** 2 for t in used) / weight)
                if used
                else 0.0
            )
            out[src] = {"docs": n, "z": round(z, 4), "weight": round(min(1.0, self.max_z / z) if z else 1.0, 4)}
        return out


TOKEN_PARTITIONS = 64  # SpilledProfiles: the corpus's tokens, by a hash of the token
SOURCE_PARTITIONS = 64  # and its sources, by a hash of the source


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def _crcs(texts: list[str]) -> np.ndarray:
    """`_crc` of each text, as int64 (each call in C: a task has a partition to find for every token)."""
    encoded = map(str.encode, texts, itertools.repeat("utf-8"), itertools.repeat("surrogatepass"))
    return np.fromiter(map(zlib.crc32, encoded), np.int64, len(texts))


class _Sums:
    """Sums of f and f^2 by token number, folded in from documents in batches (memory: the distinct tokens
    folded so far, 24 bytes each, and one batch)."""

    def __init__(self) -> None:
        self.ids, self.f1, self.f2 = np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
        self.pending_ids: list[np.ndarray] = []
        self.pending_fs: list[np.ndarray] = []

    def add(self, ids: np.ndarray, fs: np.ndarray) -> None:
        self.pending_ids.append(ids)
        self.pending_fs.append(fs)

    def fold(self) -> "_Sums":
        if self.pending_ids:
            fs = np.concatenate(self.pending_fs)
            ids, at = np.unique(np.concatenate([self.ids, *self.pending_ids]), return_inverse=True)
            weights = np.concatenate([self.f1, fs]), np.concatenate([self.f2, fs * fs])
            self.ids = ids
            self.f1, self.f2 = (np.bincount(at, weights=w, minlength=len(ids)) for w in weights)
            self.pending_ids, self.pending_fs = [], []
        return self


def _fold(task: _Sums, sums: dict[str, _Sums]) -> None:
    """Fold the pending pages into each source's sums and the task's. A task that has had one source so far (the
    usual: a source is by default an input file, and a task a piece of one) has had the same pages added in the
    same order as that source: its sums are the source's, folded once."""
    for own in sums.values():
        own.fold()
    if len(sums) == 1:
        (own,) = sums.values()
        task.ids, task.f1, task.f2, task.pending_ids, task.pending_fs = own.ids, own.f1, own.f2, [], []
    else:
        task.fold()


def profile_part(documents: Iterable[tuple[str, str]], batch: int = 512) -> dict:
    """One task's profile over its (source, text) `documents`, made on the worker and split there as
    SpilledProfiles spills it: {"tokens": {partition: pickle of (tokens, sums of f over the task)},
    "sources": {partition: pickle of [(source, documents, tokens, sums of f, sums of f^2)]}, "fragments":
    {partition: sources}}. The documents' f are summed `batch` documents at a time, in a fixed order, so a part
    is the same for any number of workers (SourceProfiles, one document at a time, agrees to float rounding).
    Memory: the task's distinct (source, token) pairs, 24 bytes each, and one batch of documents' tokens."""
    # A token's number is a serial drawn when it is first seen: drawn in C (`map(vocab.setdefault, ...)`, a serial
    # for every token of a page, so there are gaps), then closed up at the end (`np.searchsorted`) into the order of
    # first sight, which is `vocab`'s own order: the numbers `vocab.setdefault(t, len(vocab))` gives, one C call
    # per distinct token of a page instead of a Python one.
    vocab: dict[str, int] = {}
    serial = itertools.count()
    docs: Counter[str] = Counter()
    sums: dict[str, _Sums] = defaultdict(_Sums)
    task = _Sums()
    for k, (source, text) in enumerate(documents, start=1):
        counts = Counter(map(str.lower, words(text)))
        n = sum(counts.values())
        docs[source] += 1
        if n:
            ids = np.fromiter(map(vocab.setdefault, counts, serial), np.int64, len(counts))
            fs = np.fromiter(counts.values(), np.float64, len(counts)) / n  # c / n, rounded as Python rounds it
            sums[source].add(ids, fs)
            task.add(ids, fs)
        if k % batch == 0:
            _fold(task, sums)
    tokens = np.asarray(list(vocab), dtype=object)
    drawn = np.fromiter(vocab.values(), np.int64, len(vocab))  # increasing: a token's number is its place here
    _fold(task, sums)
    ids = np.searchsorted(drawn, task.ids)
    totals = np.zeros(len(tokens))
    totals[ids] = task.f1
    partition = _crcs(tokens[ids].tolist()) % TOKEN_PARTITIONS
    ids = ids[np.argsort(partition, kind="stable")]  # by partition, each one's tokens in the order of their numbers
    ends = np.cumsum(np.bincount(partition, minlength=TOKEN_PARTITIONS)).tolist()
    by_token = {p: ids[a:b] for p, (a, b) in enumerate(zip([0, *ends], ends)) if b > a}
    by_source: dict[int, list[tuple]] = defaultdict(list)
    for source, n in docs.items():
        own = sums[source].fold() if source in sums else _Sums()
        by_source[_crc(source) % SOURCE_PARTITIONS].append(
            (source, n, tokens[np.searchsorted(drawn, own.ids)].tolist(), own.f1, own.f2))
    dump = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
    return {"tokens": {p: dump((tokens[i].tolist(), totals[i])) for p, i in by_token.items()},
            "sources": {q: dump(frames) for q, frames in sorted(by_source.items())},
            "fragments": {q: len(frames) for q, frames in by_source.items()}}


def part_bytes(part: dict) -> bytes:
    """A task's part (`profile_part`) as a worker writes it: a JSON line naming each piece (kind, partition, size)
    and the sources' fragments, then the pieces end to end (`SpilledProfiles.add_file` copies them)."""
    pieces = [("tokens", p, b) for p, b in part["tokens"].items()] + \
        [("sources", q, b) for q, b in part["sources"].items()]
    header = {"pieces": [[kind, k, len(b)] for kind, k, b in pieces], "fragments": part["fragments"]}
    return json.dumps(header).encode() + b"\n" + b"".join(b for *_, b in pieces)


class SpilledProfiles:
    """The corpus's source report (SourceProfiles.report) summed from per-task parts (`profile_part`), in task
    order, with memory bounded neither by the corpus's vocabulary nor by its number of sources (a crawl keyed by
    data.distribution.source_key=host has a source per site, by file one per input file). A part comes split
    by token into TOKEN_PARTITIONS and by source into SOURCE_PARTITIONS; `add` appends each piece to its
    partition's file. `report()` then
    1. ranks the corpus's tokens one token partition at a time, keeping 2 x top_tokens candidates (so float
       rounding in this first ranking cannot move a token across the cut);
    2. sums each source's f and f^2 over the candidates one source partition at a time, at most SOURCES_AT_ONCE
       sources in memory (a larger partition is read once per slice of its sources), into arrays spilled beside
       the partition, and adds them into the corpus's sums;
    3. takes the corpus's top_tokens, their means and deviations, and scores the sources from the spilled arrays.
    The sums are those a SourceProfiles holding everything makes, added in another (fixed) order: the report is
    the same for any number of workers, and agrees with SourceProfiles's to float rounding (`rank_key`).
    Memory: a part's header while adding (`add_file`); then one token partition's tokens (the corpus vocabulary /
    TOKEN_PARTITIONS, which a real crawl's vocabulary keeps growing, slowly), SOURCES_AT_ONCE x 2 x 2 top_tokens
    floats (16 MB at the default top_tokens=1000); `rows` streams the report, one source at a time."""

    SOURCES_AT_ONCE = 512

    def __init__(self, folder: Path, top_tokens: int, max_z: float) -> None:
        self.folder, self.top_tokens, self.max_z = Path(folder), top_tokens, max_z
        self.folder.mkdir(parents=True, exist_ok=True)
        for pattern in ("tokens-*.pkl", "sources-*.pkl", "sums-*.pkl"):  # a resumed merge adds every part again
            for stale in self.folder.glob(pattern):
                stale.unlink()
        self.fragments = [0] * SOURCE_PARTITIONS  # per source partition: an upper bound of its sources

    def _partition(self, p: int) -> Path:
        return self.folder / f"tokens-{p:03d}.pkl"

    def _sources(self, q: int) -> Path:
        return self.folder / f"sources-{q:03d}.pkl"

    def add_file(self, path: Path) -> None:
        """A task's part as `part_bytes` wrote it to disk, each piece copied to its partition's file a block at a
        time: memory the header, not the part (whose sources grow with the task's). The caller adds them in task
        order."""
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            for kind, k, size in header["pieces"]:
                with open(self._partition(k) if kind == "tokens" else self._sources(k), "ab") as out:
                    while size:
                        block = f.read(min(size, 1 << 20))
                        if not block:
                            raise EOFError(f"{path}: cut inside its pieces")
                        out.write(block)
                        size -= len(block)
        for q, n in header["fragments"].items():
            self.fragments[int(q)] += n

    def add(self, part: dict) -> None:
        """A task's part (`profile_part`) held in memory: the caller adds them in task order."""
        for path, piece in [*((self._partition(p), b) for p, b in part["tokens"].items()),
                            *((self._sources(q), b) for q, b in part["sources"].items())]:
            with open(path, "ab") as out:
                out.write(piece)
        for q, n in part["fragments"].items():
            self.fragments[q] += n

    def _candidates(self) -> set[str]:
        """The corpus's 2 x top_tokens most frequent tokens, ranked by `rank_key` as SourceProfiles ranks them."""
        # A token behind `want` others (of its own partition, or of those kept so far) is behind the corpus's
        # `want` first: only those up to that cut join the pool (ties kept, their names decide), and the pool is cut
        # back to its `want` first, raising the cut, whenever it holds twice that.
        pool: list[tuple[float, str]] = []
        want, cut = 2 * self.top_tokens, math.inf
        for p in range(TOKEN_PARTITIONS):
            number: dict[str, int] = {}
            sums = np.zeros(1024)
            for tokens, values in read_frames(self._partition(p)):
                at = np.fromiter(map(number.get, tokens, itertools.repeat(-1)), np.int64, len(tokens))
                new = np.flatnonzero(at < 0)  # tokens this partition has not had yet: numbered in the order they come
                at[new] = np.arange(len(number), len(number) + len(new))
                number.update(zip(map(tokens.__getitem__, new.tolist()), at[new].tolist()))
                if len(number) > len(sums):
                    sums = np.concatenate([sums, np.zeros(max(len(number), 2 * len(sums)) - len(sums))])
                sums[at] += values  # a token is once in a piece
            keys = -sums[: len(number)].astype(np.float32)  # rank_key's, for the partition at once
            if len(keys) > want:
                cut = min(cut, float(np.partition(keys, want - 1)[want - 1]))
            near = np.flatnonzero(keys <= cut).tolist()
            names = list(number)
            pool += zip(keys[near].tolist(), map(names.__getitem__, near))
            if len(pool) > 2 * want > 0:
                pool = heapq.nsmallest(want, pool)
                cut = pool[-1][0]
        return {t for _, t in heapq.nsmallest(want, pool)}

    def _source_sums(self, column: dict[str, int]) -> Iterator[tuple[list[str], np.ndarray, np.ndarray, np.ndarray]]:
        """(sources, their documents, sums of f, sums of f^2 over the candidates `column` numbers), at most
        about SOURCES_AT_ONCE sources at a time, each source whole (all its parts, added in task order)."""
        for q in range(SOURCE_PARTITIONS):
            slices = -(-self.fragments[q] // self.SOURCES_AT_ONCE)
            for k in range(slices):
                rows: dict[str, int] = {}
                docs: list[int] = []
                s1 = np.zeros((min(self.fragments[q], self.SOURCES_AT_ONCE), len(column)))
                s2 = np.zeros_like(s1)
                for frames in read_frames(self._sources(q)):
                    for src, n, tokens, sum_f, sum_f2 in frames:
                        if slices > 1 and _crc(src) // SOURCE_PARTITIONS % slices != k:
                            continue
                        row = rows.setdefault(src, len(rows))
                        if row == len(docs):
                            docs.append(0)
                            if row == len(s1):  # more sources than the hash's share: grow
                                s1, s2 = (np.concatenate([a, np.zeros_like(a)]) for a in (s1, s2))
                        docs[row] += n
                        at = np.fromiter(map(column.get, tokens, itertools.repeat(-1)), np.int64, len(tokens))
                        kept = at >= 0
                        s1[row, at[kept]] += sum_f[kept]  # a token is once in a source's piece
                        s2[row, at[kept]] += sum_f2[kept]
                if rows:
                    yield list(rows), np.asarray(docs, dtype=np.int64), s1[:len(rows)], s2[:len(rows)]

    def report(self) -> dict[str, dict[str, float | int]]:
        """{source: {"docs", "z", "weight"}}, sources sorted by name: SourceProfiles.report of all the parts (a
        dict of every source: for small corpora; the data stage streams `rows`)."""
        return dict(sorted((row.pop("source"), row) for row in self.rows()))

    def rows(self) -> Iterator[dict[str, float | int | str]]:
        """{"source", "docs", "z", "weight"} for every source, one source partition (or slice) at a time."""
        candidates = sorted(self._candidates())
        column = {t: j for j, t in enumerate(candidates)}
        corpus_f1, corpus_f2, total_docs, spilled = np.zeros(len(column)), np.zeros(len(column)), 0, []
        for i, (names, docs, s1, s2) in enumerate(self._source_sums(column)):
            corpus_f1 += s1.sum(axis=0)
            corpus_f2 += s2.sum(axis=0)
            total_docs += int(docs.sum())
            spilled.append(self.folder / f"sums-{i:05d}.pkl")
            spilled[-1].write_bytes(pickle.dumps((names, docs, s1), protocol=pickle.HIGHEST_PROTOCOL))
        if not total_docs:
            return
        top = sorted(range(len(candidates)), key=lambda j: rank_key(corpus_f1[j], candidates[j]))[: self.top_tokens]
        mean = corpus_f1[top] / total_docs
        std = np.sqrt(np.maximum(corpus_f2[top] / total_docs - mean ** 2, 0.0))
        used = varies(std, mean)
        top, mean, std = np.asarray(top, dtype=np.int64)[used], mean[used], std[used]
        for path in spilled:
            names, docs, s1 = pickle.loads(path.read_bytes())
            path.unlink()
            if len(top):
                dev = (s1[:, top] / docs[:, None] - mean) / std
                zs = np.sqrt((dev * dev) @ mean / mean.sum())
            else:
                zs = np.zeros(len(names))
            for src, n, z in zip(names, docs.tolist(), zs.tolist()):
                yield {"source": src, "docs": n, "z": round(z, 4),
                       "weight": round(min(1.0, self.max_z / z) if z else 1.0, 4)}


def source_weights(pairs: Iterable[tuple[str, str]], top_tokens: int = 1000, max_z: float = 3.0) -> dict[str, dict]:
    """Per-source sampling weight and z-score over (source, text) pairs; see the module docstring."""
    profiles = SourceProfiles(top_tokens, max_z)
    for source, text in pairs:
        profiles.add(source, text)
    return profiles.report()
