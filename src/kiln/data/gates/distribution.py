"""Distribution check (SEEDS): a source whose token profile drifts from the corpus is down-weighted.

This is corpus-wide, so it runs over the kept documents after the merge, not per worker. For
each of the corpus's `top_tokens` most frequent tokens t, with f_d(t) its relative frequency
in document d:

    z_s(t) = (mean of f_d(t) over the source's documents - mean over the corpus) / std over the corpus

A source's z is the root mean square of z_s(t) over those tokens, each weighted by its corpus
frequency (so that "the" counts more than the thousandth token, whose per-document frequency
is mostly noise): 0 for a source that looks like the corpus, large when its common words are
not the corpus's. A source with z > max_z
gets sampling weight max_z / z (recorded in the manifest; nothing is dropped). Accumulating
per-source sums of f and f^2 keeps this one pass; the data stage adds them up from per-task parts with
`SpilledProfiles`, whose memory is a 64th of the corpus vocabulary plus sources x top_tokens, not sources x
vocabulary.

What a source is, `data.distribution.source_key`: the input file (default), the URL's host, or a
JSONL/Parquet record field (`field:NAME`). Each kept document carries its `source_group`; `kiln pack`
packs every down-weighted source into its own shard group, which the loader samples by weight.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit

from kiln.data.gates.text import words

# data.distribution.source_key for a document without the URL or field it names: one source for all of them
NO_HOST = "(no host)"


def record_field(source_key: str) -> str:
    """The JSONL/Parquet field that `field:NAME` names ("" for file and host): the reader keeps its value."""
    return source_key[len("field:"):] if source_key.startswith("field:") else ""


def source_group(source_key: str, source: str, url: str | None, field_value: str | None) -> str:
    """Which source a document counts for: its input file, its URL's host (lower case, no port) or the
    value the reader took from its record field (`field:NAME`; WARC input has no fields: its file)."""
    if source_key == "host":
        return (urlsplit(url).hostname if url else None) or NO_HOST
    if source_key.startswith("field:"):
        return field_value if field_value is not None else source
    return source


class Composition:
    """Kept documents and characters by source and by language: O(sources + languages) in memory."""

    def __init__(self) -> None:
        self.by_source: dict[str, Counter[str]] = defaultdict(Counter)
        self.by_lang: dict[str, Counter[str]] = defaultdict(Counter)

    def add(self, source: str, lang: str | None, chars: int) -> None:
        for row in (self.by_source[source], self.by_lang[lang or "unknown"]):
            row["documents"] += 1
            row["chars"] += chars

    def report(self) -> dict[str, dict[str, dict[str, float | int]]]:
        """{"by_source"|"by_lang": {name: {documents, chars, doc_share, char_share}}}, largest first."""
        out = {}
        for axis, rows in (("by_source", self.by_source), ("by_lang", self.by_lang)):
            docs, chars = sum(r["documents"] for r in rows.values()), sum(r["chars"] for r in rows.values())
            out[axis] = {name: {"documents": r["documents"], "chars": r["chars"],
                                "doc_share": round(r["documents"] / max(docs, 1), 4),
                                "char_share": round(r["chars"] / max(chars, 1), 4)}
                         for name, r in sorted(rows.items(), key=lambda kv: (-kv[1]["chars"], kv[0]))}
        return out


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
        top = [t for t, _ in sorted(corpus_f1.items(), key=lambda kv: (-kv[1], kv[0]))[: self.top_tokens]]
        mean = {t: corpus_f1[t] / total_docs for t in top}
        std = {t: math.sqrt(max(corpus_f2[t] / total_docs - mean[t] ** 2, 0.0)) for t in top}
        out = {}
        for src in sorted(self.docs):
            n = self.docs[src]
            used = [t for t in top if std[t] > 0]
            weight = sum(mean[t] for t in used)
            z = (
                math.sqrt(sum(mean[t] * ((self.sum_f[src][t] / n - mean[t]) / std[t]) ** 2 for t in used) / weight)
                if used
                else 0.0
            )
            out[src] = {"docs": n, "z": round(z, 4), "weight": round(min(1.0, self.max_z / z) if z else 1.0, 4)}
        return out


class SpilledProfiles:
    """The corpus's profile summed from per-task parts, in task order, without holding every source's whole
    vocabulary, nor the corpus's: each part is spilled to `folder` as it is added, and its sums of f are also
    appended to one of `PARTITIONS` token partitions (by a hash of the token). `total()` sums one partition at
    a time to rank the corpus's tokens (twice `top_tokens` are kept, so float rounding in the first ranking
    cannot move a token across the cut), then re-reads the parts one at a time, keeping each source's sums for
    those candidates only. The report is the same as a SourceProfiles that held everything (the same
    additions in the same order, token by token).
    Memory: one part while adding; then one partition's tokens (the corpus vocabulary / PARTITIONS, which
    grows with the corpus, slowly: a real crawl's vocabulary keeps growing with its size), 2 x top_tokens
    candidates, and sources x 2 x top_tokens sums."""

    PARTITIONS = 64

    def __init__(self, folder: Path, top_tokens: int, max_z: float) -> None:
        self.folder, self.top_tokens, self.max_z = Path(folder), top_tokens, max_z
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("tokens-*.pkl"):  # a resumed merge adds every part again
            stale.unlink()
        self.order: list[int] = []

    def _partition(self, p: int) -> Path:
        return self.folder / f"tokens-{p:03d}.pkl"

    def add(self, index: int, part: dict) -> None:
        """Task `index`'s part ({"docs", "sum_f", "sum_f2"}), in task order."""
        import pickle
        import zlib

        (self.folder / f"{index:05d}.pkl").write_bytes(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL))
        self.order.append(index)
        # Per partition, one fragment per source in the part's order: the additions stay in SourceProfiles's order.
        fragments: list[list[dict[str, float]]] = [[] for _ in range(self.PARTITIONS)]
        for src in part["docs"]:
            split: dict[int, dict[str, float]] = defaultdict(dict)
            for token, f in part["sum_f"].get(src, {}).items():
                split[zlib.crc32(token.encode("utf-8", "surrogatepass")) % self.PARTITIONS][token] = f
            for p, fragment in split.items():
                fragments[p].append(fragment)
        for p, frames in enumerate(fragments):
            if frames:
                with open(self._partition(p), "ab") as out:
                    pickle.dump(frames, out, protocol=pickle.HIGHEST_PROTOCOL)

    def _candidates(self) -> set[str]:
        """The corpus's 2 x top_tokens most frequent tokens, ranked (-f, token) as SourceProfiles ranks them."""
        import heapq
        import pickle

        best: list[tuple[float, str]] = []
        for p in range(self.PARTITIONS):
            if not self._partition(p).exists():
                continue
            f1: Counter[str] = Counter()
            with open(self._partition(p), "rb") as f:
                while True:
                    try:
                        frames = pickle.load(f)
                    except EOFError:
                        break
                    for fragment in frames:
                        f1.update(fragment)
            best = heapq.nsmallest(2 * self.top_tokens, best + [(-v, t) for t, v in f1.items()])
        return {t for _, t in best}

    def total(self) -> SourceProfiles:
        import pickle

        keep = self._candidates()
        out = SourceProfiles(self.top_tokens, self.max_z)
        for index in self.order:
            part = pickle.loads((self.folder / f"{index:05d}.pkl").read_bytes())
            out.docs.update(part["docs"])
            for src in part["docs"]:
                for sums, into in ((part["sum_f"], out.sum_f), (part["sum_f2"], out.sum_f2)):
                    into[src].update({t: v for t, v in sums.get(src, {}).items() if t in keep})
        return out


def source_weights(pairs: Iterable[tuple[str, str]], top_tokens: int = 1000, max_z: float = 3.0) -> dict[str, dict]:
    """Per-source sampling weight and z-score over (source, text) pairs; see the module docstring."""
    profiles = SourceProfiles(top_tokens, max_z)
    for source, text in pairs:
        profiles.add(source, text)
    return profiles.report()
