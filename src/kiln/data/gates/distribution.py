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
per-source sums of f and f^2 keeps this one pass and O(sources x vocabulary) in memory.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Iterable

from kiln.data.gates.text import words


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
            z = math.sqrt(sum(mean[t] * ((self.sum_f[src][t] / n - mean[t]) / std[t]) ** 2 for t in used) / weight) if used else 0.0
            out[src] = {"docs": n, "z": round(z, 4), "weight": round(min(1.0, self.max_z / z) if z else 1.0, 4)}
        return out


def source_weights(pairs: Iterable[tuple[str, str]], top_tokens: int = 1000, max_z: float = 3.0) -> dict[str, dict]:
    """Per-source sampling weight and z-score over (source, text) pairs; see the module docstring."""
    profiles = SourceProfiles(top_tokens, max_z)
    for source, text in pairs:
        profiles.add(source, text)
    return profiles.report()
