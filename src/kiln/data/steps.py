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

A step whose verdict is a function of the text alone says so (`by_text`: language ID, the gates unless one reads
the URL). With a `TextMemo` (a worker's, `worker_memo`), `run_steps` runs such a run of steps only for a text it
has not seen: a page whose extracted text came before (a copy on another URL, a mirrored site, a crawl of the same
pages again) gets the verdict recorded then, the same in every field, for a lookup. Memory: data.remember_texts
verdicts and MEMO_BYTES of edited text (compressed).

Quality gates are one step over a list of per-document `Gate` functions (kiln.data.gates.types), which share
one TextView of the text: a new gate goes into `default_gates` (kiln/data/gates/__init__.py); a new kind of
pass over the documents (one that needs the stream, a batch or the corpus) is a new Step here.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Protocol, Sequence

import xxhash
import zstandard

from kiln.data.document import Document, Rejection
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


def run_steps(docs: Docs, steps: Sequence[Step], timer: StepTimer, memo: "TextMemo | None" = None) -> Docs:
    """`docs` through each step in order, in batches, each timed under its name (the executor's one chaining
    rule). With `memo`, each run of steps that decide `by_text` is skipped for the texts it remembers."""
    k = 0
    while k < len(steps):
        end = k + 1
        if memo is not None and getattr(steps[k], "by_text", False):
            while end < len(steps) and getattr(steps[end], "by_text", False):
                end += 1
            docs = memo.around(docs, lambda fresh, run=steps[k:end]: _chain(fresh, run, timer))
        else:
            docs = _chain(docs, steps[k:end], timer)
        k = end
    return docs


def _chain(docs: Docs, steps: Sequence[Step], timer: StepTimer) -> Docs:
    for step in steps:
        docs = timer.wrap(step.name, step(batched(docs)))
    return docs


MEMO_BYTES = 8 << 20  # a TextMemo's edited texts (zstd level 1, ~4x smaller than the text), at most: a verdict that
# kept the text as it was holds none; with room for ~30 MB of edited text, a crawl of a few thousand long pages read
# twice is remembered whole


class TextMemo:
    """The verdicts of the by-text steps for texts a worker has seen, by the xxh3-128 of the text: language, score,
    rejection, edited text, edits and scores, as the steps left the document. Bounded: `capacity` verdicts and
    MEMO_BYTES of edited text (compressed); when full, the oldest verdict not asked for since it came goes first
    (a second chance for the ones asked for: a crawl's repeated boilerplate stays)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[bytes, list] = OrderedDict()  # key -> [verdict, asked for since, its bytes held]
        self.bytes = 0
        self.hits = 0

    @staticmethod
    def key(text: str) -> bytes:
        return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))

    def around(self, docs: Docs, decide: Any) -> Docs:
        """`docs` in order, each with a verdict: the remembered one, else the one `decide` gives (the by-text steps
        chained over the documents not remembered, in order), which is then remembered. A text read again while
        its first copy is still in the chain's batch waits for that copy's verdict. Documents rejected before (by
        extraction) pass through, as those steps pass them."""
        queue: deque[tuple[Document, Any]] = deque()  # every document read, in order, with what decides it
        waiting: dict[bytes, list] = {}  # a text in the chain: [its verdict once decided, copies waiting for it]

        def unknown() -> Docs:
            for doc in docs:
                if doc.rejection is not None:
                    queue.append((doc, None))
                    continue
                key = self.key(doc.text or "")
                found = self.held.get(key)
                if found is not None:
                    found[1] = True
                    self.hits += 1
                    queue.append((doc, found[0]))
                elif key in waiting:
                    waiting[key][1] += 1
                    self.hits += 1
                    queue.append((doc, key))
                else:
                    waiting[key] = [None, 0]
                    queue.append((doc, (key, doc.text)))
                    yield doc

        decided = decide(unknown())
        ready = None  # the document the chain gave back: the first one in the queue still to decide
        while True:
            if not queue:
                try:
                    ready = next(decided, None)  # reads on: the queue fills up to (at least) this document
                except Exception:  # a cut input: what was read before it comes out first, as without the memo
                    # (the chain gave back every document it took before raising: none in the queue is its)
                    yield from (_recalled(doc, waiting[how][0] if isinstance(how, bytes) else how)
                                for doc, how in queue)
                    raise
                if not queue:
                    return
            doc, how = queue.popleft()
            if how is None or isinstance(how, tuple) and len(how) == 6:  # extraction rejected it; remembered
                yield _recalled(doc, how)
            elif isinstance(how, bytes):  # a copy of a text decided just before it
                copy = waiting[how]
                copy[1] -= 1
                if not copy[1]:
                    del waiting[how]
                yield _recalled(doc, copy[0])
            else:
                if ready is None:
                    ready = next(decided)
                if ready is not doc:
                    raise AssertionError("TextMemo: the by-text steps handed back documents out of order")
                ready = None
                key, text = how
                verdict = self._remember(key, text, doc)
                if waiting[key][1]:
                    waiting[key][0] = verdict
                else:
                    del waiting[key]
                yield doc

    def _remember(self, key: bytes, text: str | None, doc: Document) -> tuple:
        """The verdict the steps gave `doc` (whose text was `text`), held when it fits."""
        edited = None if doc.text is text or doc.text == text else _ZIP.compress(
            (doc.text or "").encode("utf-8", "surrogatepass"))
        r = doc.rejection
        verdict = (doc.lang, doc.lang_score, None if r is None else (r.stage, r.reason, r.signals), edited,
                   dict(doc.edits), dict(doc.scores))
        size = len(edited or b"")
        if size > MEMO_BYTES // 8:  # a long page the gates rewrote: not worth an eighth of the memo
            return verdict
        while self.held and (len(self.held) >= self.capacity or self.bytes + size > MEMO_BYTES):
            old, entry = self.held.popitem(last=False)
            if entry[1]:  # asked for since it came (or since its last chance): to the back, once more
                entry[1] = False
                self.held[old] = entry
            else:
                self.bytes -= entry[2]
        self.held[key] = [verdict, False, size]
        self.bytes += size
        return verdict


def _recalled(doc: Document, verdict: tuple | None) -> Document:
    """`doc` with a verdict (`TextMemo._remember`'s) set as the by-text steps set it; None: as it is."""
    if verdict is None:
        return doc
    lang, score, rejection, edited, edits, scores = verdict
    doc.lang, doc.lang_score = lang, score
    if edited is not None:
        doc.text = _UNZIP.decompress(edited).decode("utf-8", "surrogatepass")
    doc.edits, doc.scores = dict(edits), dict(scores)
    if rejection is not None:
        doc.rejection = Rejection(rejection[0], rejection[1], dict(rejection[2]))
        doc.payload = None
    return doc


_ZIP, _UNZIP = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
_MEMO: tuple[str, TextMemo] | None = None  # this process's: one configuration's verdicts at a time


def worker_memo(cfg) -> TextMemo | None:
    """This process's TextMemo for the DataConfig `cfg` (a new one when the configuration changed); None when
    data.remember_texts is 0 or the perplexity gate is on (its scores come in batches)."""
    global _MEMO
    if not cfg.remember_texts or cfg.quality.perplexity.on:
        return None
    name = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    if _MEMO is None or _MEMO[0] != name:
        _MEMO = (name, TextMemo(cfg.remember_texts))
    return _MEMO[1]


def forget_memo() -> None:
    """Drop this process's TextMemo (the driver's, after a run whose tasks ran in it)."""
    global _MEMO
    _MEMO = None


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
    by_text: ClassVar[bool] = True

    def __call__(self, docs: Docs) -> Docs:
        return identify_language(docs, self.languages, self.threshold, self.max_chars, self.model_path)


@dataclass(frozen=True)
class Gates:
    """The quality gates in order, on one shared TextView per document (kiln.data.gates.apply_gates)."""
    gates: list[Any]
    name: ClassVar[str] = "gates"

    @property
    def by_text(self) -> bool:
        """Every gate reads the text alone (url_blocklist reads the URL)."""
        return not any(getattr(gate, "reads_url", False) for gate in self.gates)

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
