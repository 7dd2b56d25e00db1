"""The data stage: inputs -> read -> extract -> language -> quality gates -> global dedup -> docs/.

Work is cut into tasks: one per input file, or byte ranges of a large gzipped
WARC (at record boundaries, `data.task_bytes`). Tasks run on a local process
pool or on Ray (`kiln.data.executor`) and are pure: each returns its outcomes
(kept and rejected documents in record order, zstd-compressed) and a summary;
the driver commits them to a work folder, the outcome first and then a
completion marker, so a killed run redoes only the tasks without a marker. The
merge then reads the tasks in canonical order (input order, then record order),
runs the global steps (exact dedup, then near-duplicate dedup) and writes the
parts: the output is byte-identical whatever the number of workers, the engine
or the number of interruptions.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import zstandard

from kiln.config import DataConfig
from kiln.data.dedup import LEDGER, ExactDedup, drop_near_duplicates, near_dedup, near_duplicate_ledger, write_ledger
from kiln.data.gates.distribution import SourceProfiles
from kiln.data.document import Document, ReadReport
from kiln.data.executor import run_tasks
from kiln.data.extract import extract
from kiln.data.gates import apply_gates, default_gates
from kiln.data.gates.semantic import REVIEW as SEMANTIC_REVIEW
from kiln.data.gates.semantic import prepare as prepare_semantic
from kiln.data.language import check_model, identify_language
from kiln.data.read import read_warc, splittable
from kiln.data.sources import expand_inputs as _expand, input_format, input_identity, input_size, read_jsonl, read_parquet
from kiln.errors import KilnError
from kiln.manifest import staging_dir, write_atomic, write_manifest

# Settings that change how the work runs, never what it outputs (storage_options may hold secrets).
EXECUTION_KEYS = {"inputs", "workers", "executor", "ray_address", "task_bytes", "storage_options"}
STEPS = ("read", "extract", "language", "gates")


def expand_inputs(patterns: list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    return _expand(patterns, storage_options)


def fingerprint(files: list[str], cfg: DataConfig) -> str:
    """What the output depends on: each input's identity (path, size, version) and the data settings."""
    settings = cfg.model_dump(mode="json", exclude=EXECUTION_KEYS)
    ident = [input_identity(str(f), cfg.storage_options) for f in files]
    return hashlib.sha256(json.dumps([ident, settings], sort_keys=True).encode()).hexdigest()[:16]


# --- tasks --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    index: int  # position in the canonical order
    source: str
    start: int = 0  # byte range of a split gzipped WARC: records whose member starts in [start, end)
    end: int | None = None
    bytes: int = 0  # input bytes this task covers (for the progress bar)

    @property
    def name(self) -> str:
        return f"task-{self.index:05d}"


def plan_tasks(files: list[str], cfg: DataConfig) -> list[Task]:
    tasks: list[Task] = []
    for source in files:
        size = input_size(source, cfg.storage_options)
        if size > cfg.task_bytes and input_format(source) == "warc" and splittable(source, cfg.storage_options):
            for start in range(0, size, cfg.task_bytes):
                end = min(start + cfg.task_bytes, size)
                tasks.append(Task(len(tasks), source, start, None if end == size else end, end - start))
        else:
            tasks.append(Task(len(tasks), source, bytes=size))
    return tasks


def work_key(data_fingerprint: str, tasks: list[Task]) -> str:
    """Names the work folder: finished tasks are reused only for the same inputs, settings and plan."""
    plan = [(t.source, t.start, t.end) for t in tasks]
    return hashlib.sha256(json.dumps([data_fingerprint, plan]).encode()).hexdigest()[:16]


class StepTimer:
    """Seconds spent in each step of a lazy generator chain.

    Each wrapped generator is timed including the steps upstream of it (pulling a
    document runs them); a step's own time is the difference to the step before.
    """

    def __init__(self) -> None:
        self.cumulative: dict[str, float] = {}

    def wrap(self, step: str, docs: Iterator[Document]) -> Iterator[Document]:
        self.cumulative.setdefault(step, 0.0)  # now, in chain order (the generator below starts last-first)
        return self._timed(step, docs)

    def _timed(self, step: str, docs: Iterator[Document]) -> Iterator[Document]:
        while True:
            t0 = time.perf_counter()
            doc = next(docs, None)
            self.cumulative[step] += time.perf_counter() - t0
            if doc is None:
                return
            yield doc

    def own(self) -> dict[str, float]:
        out, before = {}, 0.0
        for step, total in self.cumulative.items():
            out[step], before = round(max(total - before, 0.0), 4), total
        return out


def read_task(task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
    kind = input_format(task.source)
    fields = (cfg.text_field, cfg.id_field, cfg.url_field)
    if kind == "jsonl":
        return read_jsonl(task.source, report, fields, cfg.storage_options)
    if kind == "parquet":
        return read_parquet(task.source, report, fields, cfg.storage_options)
    return read_warc(task.source, report, task.start, task.end, cfg.storage_options)


def process_task(task: Task, cfg: DataConfig, report: ReadReport, timer: StepTimer) -> Iterator[Document]:
    docs = timer.wrap("read", read_task(task, cfg, report))
    docs = timer.wrap("extract", extract(docs, cfg.max_page_bytes, cfg.extractor))
    docs = timer.wrap("language", identify_language(docs, cfg.languages, cfg.lang_threshold, cfg.lang_max_chars, cfg.lang_model))
    docs = timer.wrap("gates", apply_gates(docs, default_gates(cfg)))
    if cfg.quality.perplexity.on:
        from kiln.data.gates.perplexity import score_perplexity  # torch only when the gate is on

        docs = timer.wrap("perplexity", score_perplexity(docs, cfg.quality.perplexity))
    return docs


READ_ATTEMPTS = 3


def run_task(args: tuple[Task, DataConfig]) -> tuple[dict[str, Any], bytes]:
    """One task, start to end, in a worker: (summary, zstd JSONL of every document's outcome).

    A storage error (OSError: a dropped connection, a throttled bucket, a failing disk) is not damage in
    the data: recording it as a cut would commit a short task as finished and lose the rest of the file for
    good. The task is pure, so it is read again from the start; when every attempt fails, the run stops
    with an error that names the file, and nothing of the task is committed, so the next run resumes it.
    """
    task, cfg = args
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            return _run_task_once(task, cfg)
        except OSError as exc:
            if attempt == READ_ATTEMPTS:
                where = f" (bytes {task.start}-{task.end or 'end'})" if task.start or task.end else ""
                raise KilnError(f"{task.source}{where}: reading failed {READ_ATTEMPTS} times ({exc}); the tasks "
                                f"finished so far are kept: fix the storage or network and run the same "
                                f"command again to resume") from None
            time.sleep(0.5 * 2 ** attempt)
    raise AssertionError("unreachable")


def _run_task_once(task: Task, cfg: DataConfig) -> tuple[dict[str, Any], bytes]:
    report, timer = ReadReport(), StepTimer()
    t0 = time.perf_counter()
    buf = io.BytesIO()
    error = None
    read = kept = 0
    scores: list[float] = []  # kept documents' classifier scores, for keep_top_fraction (one task's worth)
    with zstandard.ZstdCompressor(level=3).stream_writer(buf, closefd=False) as zw:
        try:
            for doc in process_task(task, cfg, report, timer):
                read += 1
                kept += doc.rejection is None
                if doc.rejection is None and "quality_score" in doc.scores:
                    scores.append(doc.scores["quality_score"])
                rec = doc.kept_record() if doc.rejection is None else \
                    doc.reject_record(with_text=doc.rejection.reason == SEMANTIC_REVIEW)
                zw.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
        except KilnError as exc:
            error = str(exc)
    summary = {**asdict(task), "records_by_type": report.records_by_type, "truncated_at": report.truncated_at,
               "error": error, "documents": read, "kept": kept, "seconds": round(time.perf_counter() - t0, 3),
               "steps_s": timer.own()}
    if cfg.quality.classifier.keep_top_fraction:
        from kiln.data.gates.classifier import histogram

        summary |= {"score_histogram": histogram(scores), "keep_top_fraction": cfg.quality.classifier.keep_top_fraction}
    return summary, buf.getvalue()


def _commit(work: Path, result: tuple[dict[str, Any], bytes]) -> dict[str, Any]:
    """Outcome first, marker last: a marker vouches for an outcome file that is complete."""
    summary, blob = result
    name = f"task-{summary['index']:05d}"
    write_atomic(work / f"{name}.jsonl.zst", blob)
    write_atomic(work / f"{name}.done.json", json.dumps(summary))
    return summary


def read_part(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one zstd-compressed JSONL file (a docs part, a rejects part, a task's outcomes), streamed."""
    with open(path, "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            if line.strip():
                yield json.loads(line)


# --- the stage ------------------------------------------------------------------------------------

class PartWriter:
    """Writes records as part-NNNNN.jsonl.zst files of at most `per_part` records each."""

    def __init__(self, folder: Path, per_part: int) -> None:
        self.folder, self.per_part = folder, per_part
        self.folder.mkdir(parents=True, exist_ok=True)
        self.parts, self.buffer = 0, []

    def add(self, rec: dict[str, Any]) -> None:
        self.buffer.append(json.dumps(rec, ensure_ascii=False))
        if len(self.buffer) >= self.per_part:
            self.flush()

    def flush(self) -> None:
        if self.buffer or self.parts == 0:
            data = ("\n".join(self.buffer) + "\n" if self.buffer else "").encode()
            (self.folder / f"part-{self.parts:05d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
            self.parts += 1
            self.buffer = []


def check_config(cfg: DataConfig) -> None:
    """What can be checked before any work starts."""
    check_model(cfg.lang_model)
    if cfg.quality.classifier.model:
        from kiln.data.gates.classifier import check

        check(cfg.quality.classifier)
    if cfg.quality.semantic.keywords:
        from kiln.data.gates.classifier import _floret
        from kiln.data.gates.semantic import _model

        _model(cfg.quality.semantic.vectors) if cfg.quality.semantic.vectors else _floret()
    if cfg.quality.perplexity.on:
        from kiln.data.gates.perplexity import check as check_perplexity

        check_perplexity(cfg.quality.perplexity)
    if cfg.extractor == "trafilatura":
        from kiln.data.extract import trafilatura_text

        trafilatura_text("<html></html>")  # raises the install hint when it cannot import


def run_data(inputs: list[str], out: Path, cfg: DataConfig, workers: int | None = None,
             progress: bool | Callable[[dict[str, Any]], None] = False) -> dict[str, Any]:
    """Process `inputs` into the docs folder `out` (committed atomically). Returns stats.

    `progress`: True draws a rich progress bar on stderr; a callable gets each task's summary.
    """
    check_config(cfg)
    files = expand_inputs(inputs, cfg.storage_options)
    fp = fingerprint(files, cfg)
    tasks = plan_tasks(files, cfg)
    work = out.parent / f".{out.name}-work-{work_key(fp, tasks)}"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = prepare_semantic(cfg, files, work)  # vectors trained on the corpus, when the semantic gate needs them

    todo = [t for t in tasks if not (work / f"{t.name}.done.json").exists()]
    workers = workers or cfg.workers
    with _progress_sink(progress, tasks, todo) as on_done:
        for result in run_tasks(run_task, [(t, cfg) for t in todo], workers, cfg.executor, cfg.ray_address):
            on_done(_commit(work, result))
    t_process = time.perf_counter() - t0

    summaries = [json.loads((work / f"{t.name}.done.json").read_text()) for t in tasks]
    with staging_dir(out) as tmp:
        stats = _merge(work, summaries, tmp, cfg)
        stats["timings_s"] |= {"process": round(t_process, 3), "merge": round(time.perf_counter() - t0 - t_process, 3)}
        stats["tasks"] = len(tasks)
        stats["tasks_resumed"] = len(tasks) - len(todo)
        write_atomic(tmp / "stats.json", json.dumps(stats, indent=1, ensure_ascii=False))
        write_manifest(tmp, stage="data", fingerprint=fp, inputs=files, documents=stats["documents"]["kept"],
                       source_weights=stats["source_weights"])
    for stale in out.parent.glob(f".{out.name}-work-*"):  # this run's, and any from older plans of this folder
        shutil.rmtree(stale, ignore_errors=True)
    return stats


def _progress_sink(progress, tasks: list[Task], todo: list[Task]):
    from contextlib import nullcontext

    if callable(progress):
        return nullcontext(progress)
    if progress:
        from kiln.data.progress import DataProgress

        return DataProgress(total_bytes=sum(t.bytes for t in todo), tasks=len(todo))
    return nullcontext(lambda _summary: None)


def global_steps(cfg: DataConfig, work: Path, summaries: list[dict[str, Any]],
                 out: Path) -> list[Callable[[Iterator[Document]], Iterator[Document]]]:
    """Steps that see every document of every task, in canonical order: exact, then near-duplicate dedup.

    Near-duplicate dedup needs the whole corpus before it can say who survives, so it indexes a
    first pass over the task outputs, writes its ledger, then rejects the members in the main pass.
    """
    near = near_dedup(cfg.dedup, spill_dir=str(work))
    if near is None:
        return [ExactDedup()]
    ledger = near_duplicate_ledger(near, ExactDedup()(_documents(work, summaries)))
    write_ledger(out / LEDGER, ledger)
    return [ExactDedup(), lambda docs: drop_near_duplicates(docs, ledger)]


def _documents(work: Path, summaries: list[dict[str, Any]]) -> Iterator[Document]:
    """Every task's outcomes in canonical order (with the classifier's top-fraction cut, when set)."""
    docs = (Document.from_record(rec) for s in summaries for rec in read_part(work / f"task-{s['index']:05d}.jsonl.zst"))
    fraction = summaries[0].get("keep_top_fraction") if summaries else None
    if fraction:
        from kiln.data.gates.classifier import cut_below, top_fraction_bin

        docs = cut_below(docs, top_fraction_bin((s["score_histogram"] for s in summaries), fraction), fraction)
    yield from docs


def _merge(work: Path, summaries: list[dict[str, Any]], out: Path, cfg: DataConfig) -> dict[str, Any]:
    kept_w, rej_w = PartWriter(out, cfg.docs_per_part), PartWriter(out / "rejects", cfg.docs_per_part)
    review_w = PartWriter(out / "review", cfg.docs_per_part) if cfg.quality.semantic.action == "review" \
        and cfg.quality.semantic.keywords else None
    timer = StepTimer()
    docs = timer.wrap("tasks", _documents(work, summaries))
    t_index = time.perf_counter()
    for step in global_steps(cfg, work, summaries, out):
        docs = step(docs)
    t_index = time.perf_counter() - t_index
    docs = timer.wrap("dedup", docs)
    profiles = SourceProfiles(cfg.distribution.top_tokens, cfg.distribution.max_z)
    edits: Counter[str] = Counter()

    reasons: Counter[str] = Counter()
    langs: Counter[str] = Counter()
    by_source = {s["source"]: Counter() for s in summaries}  # every input, in input order, even an empty one
    read = kept = chars = 0
    for doc in docs:
        read += 1
        counts = by_source[doc.source]
        counts["read"] += 1
        if doc.rejection is None:
            kept_w.add(doc.kept_record())
            profiles.add(doc.source, doc.text or "")
            edits.update(doc.edits)
            kept += 1
            chars += len(doc.text or "")
            langs[doc.lang] += 1
            counts["kept"] += 1
        else:
            rej_w.add(doc.reject_record())
            if review_w is not None and doc.rejection.reason == SEMANTIC_REVIEW:  # set aside, with its score
                review_w.add(doc.kept_record() | {"semantic_score": doc.rejection.signals["semantic_score"]})
            reasons[f"{doc.rejection.stage}/{doc.rejection.reason}"] += 1
            counts["rejected"] += 1
    kept_w.flush()
    rej_w.flush()
    if review_w is not None:
        review_w.flush()
    rejected = sum(reasons.values())
    assert read == kept + rejected, "accounting broke: every document must be kept or rejected"

    by_type: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    for s in summaries:
        by_type.update(s["records_by_type"])
        steps.update(s["steps_s"])
    errors: dict[str, str] = {}
    for s in summaries:
        if s["error"]:
            errors.setdefault(s["source"], s["error"])
    stages: Counter[str] = Counter()
    for reason, n in reasons.items():
        stages[reason.split("/")[0]] += n
    return {
        "files": len({s["source"] for s in summaries}),
        "file_errors": [{"source": src, "error": err} for src, err in errors.items()],
        "truncated": [{"source": s["source"], "offset": s["truncated_at"]} for s in summaries if s["truncated_at"] is not None],
        "warc_records": {"total": sum(by_type.values()), "by_type": dict(sorted(by_type.items()))},
        "documents": {"read": read, "kept": kept, "rejected": rejected},
        "rejected_by_reason": dict(sorted(reasons.items())),
        "rejected_by_stage": dict(sorted(stages.items())),
        "kept_by_lang": dict(sorted(langs.items(), key=lambda kv: (-kv[1], kv[0]))),
        "by_source": {src: {k: c[k] for k in ("read", "kept", "rejected")} for src, c in by_source.items()},
        "kept_chars": chars,
        "edits": dict(sorted(edits.items())),
        # per-source sampling weights: a source whose top tokens drift is down-weighted, never dropped
        "source_weights": profiles.report(),
        "parts": kept_w.parts,
        "timings_s": {"steps": {**{k: round(steps[k], 3) for k in STEPS}, "dedup": round(timer.own().get("dedup", 0.0) + t_index, 3)}},
    }


def read_docs(folder: Path) -> Iterator[dict[str, Any]]:
    """Kept documents of a docs folder, in order."""
    parts = sorted(Path(folder).glob("part-*.jsonl.zst"))
    if not parts:
        raise KilnError(f"{folder}: no part-*.jsonl.zst files; run `kiln data` first")
    for part in parts:
        yield from read_part(part)
