"""One step protocol for the data stage (datatrove's PipelineStep idea, written our way).

A `Step` has a `name` (its key in stats.json `timings_s.steps`) and is called on a stream of documents,
returning the stream: `step(docs) -> docs`, in order, lazily, each document seen once (a step may hold a
bounded batch, as the perplexity scorer does). A step rejects a document with `doc.reject(stage, reason,
**signals)` and passes rejected documents through untouched, so every document read reaches the end of the
chain and `read = kept + rejected` holds. `run_steps` chains a list of steps; the pipeline builds two lists:
`task_steps(cfg)` on the workers (after reading a task) and `merge_steps(...)` in the merge (after reading the
tasks' outcomes in canonical order).

`run_steps` hands each step its documents in small batches (`batched`: up to BATCH_DOCS documents or
BATCH_BYTES of payload and text), so a step runs over several documents in a row instead of taking turns
with the others document by document: its code and tables (the HTML parser, the language model, the gates'
lookups) stay in the CPU's caches. On the long-pages crawl of `python -m benchmarks filter_stage` that
took ~15% off the stage's CPU time. The documents, their order and every decision are the same.
Memory: a batch per step, at most BATCH_BYTES plus one document each.

Quality gates are one step over a list of per-document `Gate` functions (kiln.data.gates.types), which share
one TextView of the text: a new gate goes into `default_gates` (kiln/data/gates/__init__.py); a new kind of
pass over the documents (one that needs the stream, a batch or the corpus) is a new Step here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Protocol, Sequence

from kiln.data.document import Document
from kiln.data.extract import extract
from kiln.data.gates import apply_gates, default_gates
from kiln.data.language import identify_language

Docs = Iterator[Document]


class Step(Protocol):
    name: str

    def __call__(self, docs: Docs) -> Docs: ...


class StepTimer:
    """Seconds spent in each step of a lazy generator chain.

    Each wrapped generator is timed including the steps upstream of it (pulling a
    document runs them); a step's own time is the difference to the step before.
    """

    def __init__(self, clock=time.perf_counter) -> None:
        self.cumulative: dict[str, float] = {}
        self.clock = clock  # wall clock; time.process_time gives a step's CPU seconds (a benchmark's view)

    def wrap(self, step: str, docs: Docs) -> Docs:
        self.cumulative.setdefault(step, 0.0)  # now, in chain order (the generator below starts last-first)
        return self._timed(step, docs)

    def _timed(self, step: str, docs: Docs) -> Docs:
        clock = self.clock
        while True:
            t0 = clock()
            doc = next(docs, None)
            self.cumulative[step] += clock() - t0
            if doc is None:
                return
            yield doc

    def own(self) -> dict[str, float]:
        out, before = {}, 0.0
        for step, total in self.cumulative.items():
            out[step], before = round(max(total - before, 0.0), 4), total
        return out


BATCH_DOCS = 32
BATCH_BYTES = 4 << 20


def batched(docs: Docs) -> Docs:
    """`docs` unchanged, pulled BATCH_DOCS (or BATCH_BYTES of payload and text) at a time. An error upstream
    (a cut input) comes after the documents read before it, as it would unbatched."""
    docs = iter(docs)
    while True:
        batch, size = [], 0
        try:
            while len(batch) < BATCH_DOCS and size < BATCH_BYTES:
                doc = next(docs, None)
                if doc is None:
                    break
                batch.append(doc)
                size += len(doc.payload or b"") + len(doc.text or "")
        except Exception:
            yield from batch
            raise
        if not batch:
            return
        yield from batch


def run_steps(docs: Docs, steps: Sequence[Step], timer: StepTimer) -> Docs:
    """`docs` through each step in order, in batches, each timed under its name (the executor's one chaining
    rule)."""
    for step in steps:
        docs = timer.wrap(step.name, step(batched(docs)))
    return docs


# --- the steps on the workers -------------------------------------------------------------------

@dataclass(frozen=True)
class Extract:
    """HTML (or a given text) -> text; binary, oversized or empty pages rejected (kiln.data.extract)."""
    max_page_bytes: int
    extractor: str
    name: ClassVar[str] = "extract"

    def __call__(self, docs: Docs) -> Docs:
        return extract(docs, self.max_page_bytes, self.extractor)


@dataclass(frozen=True)
class Language:
    """Language ID; a low score or a language not in data.languages is rejected (kiln.data.language)."""
    languages: list[str] | None
    threshold: float
    max_chars: int
    model_path: str | None
    name: ClassVar[str] = "language"

    def __call__(self, docs: Docs) -> Docs:
        return identify_language(docs, self.languages, self.threshold, self.max_chars, self.model_path)


@dataclass(frozen=True)
class Gates:
    """The quality gates in order, on one shared TextView per document (kiln.data.gates.apply_gates)."""
    gates: list[Any]
    name: ClassVar[str] = "gates"

    def __call__(self, docs: Docs) -> Docs:
        return apply_gates(docs, self.gates)


@dataclass(frozen=True)
class Perplexity:
    """data.quality.perplexity: bits per byte under a reference model, in batches (torch only when on)."""
    cfg: Any  # PerplexityConfig
    name: ClassVar[str] = "perplexity"

    def __call__(self, docs: Docs) -> Docs:
        from kiln.data.gates.perplexity import score_perplexity

        return score_perplexity(docs, self.cfg)


def task_steps(cfg) -> list[Step]:
    """The steps a task runs after reading, in order, for a DataConfig."""
    steps: list[Step] = [
        Extract(cfg.max_page_bytes, cfg.extractor),
        Language(cfg.languages, cfg.lang_threshold, cfg.lang_max_chars, cfg.lang_model),
        Gates(default_gates(cfg)),
    ]
    if cfg.quality.perplexity.on:
        steps.append(Perplexity(cfg.quality.perplexity))
    return steps


# --- the steps in the merge ---------------------------------------------------------------------

@dataclass(frozen=True)
class Dedup:
    """Reject the duplicates the dedup stages found, by document number: the kept documents in canonical
    order are numbered from `first` (the documents of a data.dedup.index come before them)."""
    verdicts: Any  # kiln.data.dedup.stages.Verdicts
    first: int
    name: ClassVar[str] = "dedup"

    def __call__(self, docs: Docs) -> Docs:
        pending = self.verdicts.rejections()  # in document order, like the documents: one merge-join pass
        nxt = next(pending, None)
        q = self.first
        for doc in docs:
            if doc.rejection is None:
                if nxt is not None and nxt[0] == q:
                    doc.reject("dedup", nxt[1], **nxt[2])
                    nxt = next(pending, None)
                q += 1
            yield doc
        if nxt is not None:  # a verdict for a document the merge never numbered: the accounting broke
            raise AssertionError(f"dedup: a verdict for document {nxt[0]}, but the merge numbered only up to {q}")


@dataclass(frozen=True)
class TopFraction:
    """data.quality.classifier.keep_top_fraction: the cut at the score that keeps the top fraction, from the
    tasks' score histograms. After Dedup: the dedup stages number the tasks' kept documents before any cut."""
    summaries: list[dict[str, Any]]
    fraction: float
    name: ClassVar[str] = "top_fraction"

    def __call__(self, docs: Docs) -> Docs:
        from kiln.data.gates.classifier import cut_below, top_fraction_bin

        lowest = top_fraction_bin((s["score_histogram"] for s in self.summaries), self.fraction)
        return cut_below(docs, lowest, self.fraction)


def merge_steps(verdicts, first: int, summaries: list[dict[str, Any]]) -> list[Step]:
    """The steps the merge runs over the tasks' outcomes, in order."""
    steps: list[Step] = [Dedup(verdicts, first)]
    fraction = summaries[0].get("keep_top_fraction") if summaries else None
    if fraction:
        steps.append(TopFraction(summaries, fraction))
    return steps
