"""The data stage: inputs -> read -> extract -> language -> quality gates -> dedup -> profiles -> docs/.

`run_data` runs, on the engine (`executor.py`: a process pool or Ray), in this order:
1. the data tasks (`plan.py`: every input cut into pieces of about `data.task_bytes`, by format: byte ranges,
   row groups or spooled chunks): each reads its records through `steps.task_steps` and streams its own files
   into the work folder (`.docs-work-<key>/`): every document's outcome and the kept documents' dedup
   signatures; the driver writes the task's marker when the summary comes back (`vouch.py`), so a killed run
   redoes only what is missing, cut or changed;
2. the dedup stages (`dedup/stages.py`), tasks over key ranges of the signatures, and the clusters; one
   verdicts task writes each data task's verdicts to a file of its own;
3. one profile task per data task (`profile_task`): the distribution profile of its kept documents;
4. the merge (`merge.py`): a merge task per data task writes its outcome, through `steps.merge_steps` (its
   verdicts, the classifier's top fraction), as streams of its kept, rejected and set-aside records with its
   counts; part jobs write the docs parts (numbered from the tasks' counts, the same for any cut into tasks) and
   the ledger; the driver renames them into the staging folder, sums stats.json and the per-source side files
   (`tables.py`) from the tasks' counts, writes the manifest and commits; then the work folder is removed.
The output is byte-identical whatever the number of workers, the engine or the number of interruptions.
Memory: no task's outcome, verdict, record or per-source row passes through the driver, which holds a few numbers
per task; its merge step's time goes with the tasks, not the documents.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import socket
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import zstandard

from kiln.config import DataConfig
from kiln.data.dedup.index import add_run, runs_before, use_index
from kiln.data.dedup.signatures import Signer, forget_signed
from kiln.data.dedup.stages import STAGE_DIR, Layout, VerdictFiles, dedup_layout, run_stages
from kiln.data.docs import check_format, part_lines
from kiln.data.gates.distribution import SpilledProfiles, check_groups, part_bytes, profile_part, source_group
from kiln.data.merge import MERGE_DIR, merge
from kiln.data.tables import TABLES, write_table
from kiln.data.document import Document, ReadReport
from kiln.tasks.executor import engine, run_tasks
from kiln.data.gates.semantic import REVIEW as SEMANTIC_REVIEW
from kiln.data.gates.semantic import prepare as prepare_semantic
from kiln.data.language import check_model
from kiln.data.steps import StepTimer, forget_memo, run_steps, task_steps, worker_memo
from kiln.data.vouch import Recording, matches, record
from kiln.data.plan import READ_ATTEMPTS, Task, index_key, plan_tasks, read_task
from kiln.storage import StorageUnreachable, unreachable
from kiln.data.sources import expand_inputs as _expand
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import is_disk_full, staging_dir, write_atomic, write_manifest, writes_folder, writing_atomic

WORK_LAYOUT = 6  # what a task writes to the work folder (4: its outcome and dedup signatures, vouched by its marker;
# tasks are pieces of any input format, kiln.data.plan; 5: no shingle sets, the outcome at OUTCOME_LEVEL;
# 6: the exact keys by document, keys.npy)
OUTCOME_LEVEL = 6  # zstd level of a task's outcome, the work folder's bulk once shingle sets are not kept: 9% smaller
# than level 3 on the Debian crawl for ~1% of a task's CPU


def expand_inputs(patterns: list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    return _expand(patterns, storage_options)


def fingerprint(files: list[str], cfg: DataConfig) -> str:
    """What the output depends on: each input's identity (path, size, version), the data settings and the
    data.dedup.index runs it is deduplicated against."""
    base = index_key(files, cfg)
    runs = [run["key"] for run in runs_before(cfg.dedup, base)]
    layout = [] if cfg.docs_format == "jsonl" else [cfg.docs_format]  # not in the index key: the same documents
    return hashlib.sha256(json.dumps([base, runs, *layout]).encode()).hexdigest()[:16] if runs or layout else base


# --- tasks --------------------------------------------------------------------------------------

def work_key(data_fingerprint: str, cfg: DataConfig) -> str:
    """Names the work folder: finished tasks are reused only for the same inputs, settings and cut (the plan
    of tasks is a function of the inputs, which the fingerprint names, and of data.task_bytes)."""
    return hashlib.sha256(json.dumps([data_fingerprint, cfg.task_bytes, WORK_LAYOUT]).encode()).hexdigest()[:16]


def process_task(task: Task, cfg: DataConfig, report: ReadReport, timer: StepTimer) -> Iterator[Document]:
    """A task's documents, read and through `task_steps(cfg)` (extract, language, gates, perplexity), with this
    worker's memo of the verdicts of texts it has seen (`steps.worker_memo`)."""
    return run_steps(timer.wrap("read", read_task(task, cfg, report)), task_steps(cfg), timer, worker_memo(cfg))


def run_task(args: tuple[Task, DataConfig, str]) -> dict[str, Any]:
    """One task, start to end, in a worker; returns its summary. The worker writes the task's files into the
    work folder (each atomically): the zstd JSONL of every document's outcome (`jsonl.zst`, streamed as the
    documents come, so a task holds no outcome) and the kept documents' dedup signatures (`signatures.Signer`).
    The driver writes the completion marker when the summary comes back (`_commit`), so files without a
    marker are a task to redo. The files do not pass through the driver: its memory holds no task's outcome,
    and on Ray the work folder is on storage every node mounts, as the dedup stages already need.

    A storage error (OSError: a dropped connection, a throttled bucket, a failing disk) is not damage in
    the data: recording it as a cut would commit a short task as finished and lose the rest of the file for
    good. The task is pure, so it is read again from the start; when every attempt fails, the run stops
    with an error that names the file, and nothing of the task is committed, so the next run resumes it.
    Two OSErrors stop the run at once instead: a full disk (the output's, said by `writes_folder`) and a storage
    server that cannot be reached (`kiln.storage.StorageUnreachable`, after the client's own bounded attempts).
    """
    task, cfg, work = args
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            return _run_task_once(task, cfg, Path(work))
        except Exception as exc:
            if (error := unreachable(exc, task.source)) is not None:
                raise error from None
            if not isinstance(exc, OSError) or is_disk_full(exc):
                raise
            if attempt == READ_ATTEMPTS:
                where = f" (bytes {task.start}-{task.end or 'end'})" if task.start or task.end else ""
                raise KilnError(f"{task.source}{where}: reading failed {READ_ATTEMPTS} times ({exc}); the tasks "
                                f"finished so far are kept: fix the storage or network and run the same "
                                f"command again to resume") from None
            time.sleep(0.5 * 2 ** attempt)
    raise AssertionError("unreachable")


def _run_task_once(task: Task, cfg: DataConfig, work: Path) -> dict[str, Any]:
    report, timer = ReadReport(), StepTimer()
    signer = Signer(cfg.dedup, cfg.remember_texts)  # remembers the texts this worker signed (bounded)
    t0, cpu0 = time.perf_counter(), time.process_time()
    error = None
    read = kept = 0
    sign_s = 0.0
    scores: list[float] = []  # kept documents' classifier scores, for keep_top_fraction (one task's worth)
    with writing_atomic(work / f"{task.name}.jsonl.zst") as f:
        outcome = Recording(f)
        with zstandard.ZstdCompressor(level=OUTCOME_LEVEL).stream_writer(outcome, closefd=False) as zw:
            try:
                for doc in process_task(task, cfg, report, timer):
                    read += 1
                    kept += doc.rejection is None
                    if doc.rejection is None:
                        t_sign = time.perf_counter()
                        signer.add(doc.id, doc.text or "")
                        sign_s += time.perf_counter() - t_sign
                        if "quality_score" in doc.scores:
                            scores.append(doc.scores["quality_score"])
                    rec = doc.kept_record() if doc.rejection is None else \
                        doc.reject_record(with_text=doc.rejection.reason == SEMANTIC_REVIEW)
                    zw.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
            except (IntegrityError, StorageUnreachable):  # the work folder's own files (a spooled chunk), or the
                raise  # storage server, not the input's data: stop
            except KilnError as exc:
                error = str(exc)
    t_sign = time.perf_counter()
    files = {"jsonl.zst": outcome.record(), **signer.write(work, task.name)}
    sign_s += time.perf_counter() - t_sign
    summary = {**asdict(task), "records_by_type": report.records_by_type, "truncated_at": report.truncated_at,
               "error": error, "documents": read, "kept": kept, "seconds": round(time.perf_counter() - t0, 3),
               "steps_s": timer.own() | {"signatures": round(sign_s, 4)}, "files": files,
               "worker": f"{socket.gethostname()}:{os.getpid()}", "cpu_s": round(time.process_time() - cpu0, 3)}
    if cfg.quality.classifier.keep_top_fraction:
        from kiln.data.gates.classifier import histogram

        summary |= {"score_histogram": histogram(scores), "keep_top_fraction": cfg.quality.classifier.keep_top_fraction}
    return summary


def _commit(work: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The marker, after the worker wrote the task's outcome and signatures: it vouches for them (`vouch`)."""
    write_atomic(work / f"task-{summary['index']:05d}.done.json", json.dumps(summary))
    return summary


def unfinished(work: Path, tasks: list[Task], cfg: DataConfig, workers: int) -> list[Task]:
    """The tasks to (re)do: those without a marker, and those whose files no longer match it (`finished`),
    checked on the engine's workers, so a resume reads the finished tasks' files in parallel, not in the driver."""
    marked = [(str(work), t) for t in tasks if (work / f"{t.name}.done.json").exists()]
    good = {index for index, ok in run_tasks(check_task, marked, workers, cfg.executor, cfg.ray_address) if ok}
    return [t for t in tasks if t.index not in good]


def check_task(args: tuple[str, Task]) -> tuple[int, bool]:
    work, task = args
    return task.index, finished(Path(work), task)


def finished(work: Path, task: Task) -> bool:
    """The task's marker is there and every file it vouches for matches it: a task whose outcome or signatures
    were deleted, cut or changed since (or whose marker is) is done again, not read."""
    try:
        summary = json.loads((work / f"{task.name}.done.json").read_text())
    except (OSError, ValueError):
        return False
    files = summary.get("files") if isinstance(summary, dict) else None
    return isinstance(files, dict) and bool(files) and all(
        matches(work / f"{task.name}.{suffix}", rec) for suffix, rec in files.items())


# --- the stage ------------------------------------------------------------------------------------

def check_config(cfg: DataConfig) -> None:
    """What can be checked before any work starts."""
    check_model(cfg.lang_model)
    check_format(cfg.docs_format)
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


@writes_folder("data", out="out", inputs=("inputs",))  # refuses a folder Kiln may not replace; one writer at a time
def run_data(inputs: list[str], out: Path, cfg: DataConfig, workers: int | None = None,
             progress: bool | Callable[[dict[str, Any]], None] = False) -> dict[str, Any]:
    """Process `inputs` into the docs folder `out` (committed atomically). Returns stats.

    `progress`: True draws a rich progress bar on stderr; a callable gets each task's summary. With
    data.dedup.index, the index is checked and held for the whole run (`index.use_index`).
    """
    with use_index(cfg, inputs, out):
        try:
            return _run_data(inputs, out, cfg, workers, progress)
        finally:
            forget_memo()  # the verdicts and signatures the tasks left in this process (workers=1 runs them here)
            forget_signed()


def _run_data(inputs: list[str], out: Path, cfg: DataConfig, workers: int | None,
              progress: bool | Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    check_config(cfg)
    files = expand_inputs(inputs, cfg.storage_options)
    fp = fingerprint(files, cfg)
    work = out.parent / f".{out.name}-work-{work_key(fp, cfg)}"
    t0, cpu = time.perf_counter(), [cpu_seconds()]

    workers = workers or cfg.workers
    with engine(cfg.executor, workers, cfg.ray_address, cfg.ray_connect_timeout_s):
        work.mkdir(parents=True, exist_ok=True)  # once Ray is there: a cluster that never answers leaves nothing
        cfg = prepare_semantic(cfg, files, work)  # vectors trained on the corpus, when the semantic gate needs them
        tasks = plan_tasks(files, cfg, work, workers)
        todo = unfinished(work, tasks, cfg, workers)
        with _progress_sink(progress, tasks, todo) as on_done:
            for summary in run_tasks(run_task, [(t, cfg, str(work)) for t in todo], workers, cfg.executor,
                                   cfg.ray_address):
                on_done(_commit(work, summary))
        t_process = time.perf_counter() - t0
        cpu.append(cpu_seconds())
        summaries = [_held(json.loads((work / f"{t.name}.done.json").read_text())) for t in tasks]
        if todo:  # dedup and merge results of an earlier attempt were made from tasks' files that are written anew now
            shutil.rmtree(work / STAGE_DIR, ignore_errors=True)
            shutil.rmtree(work / MERGE_DIR, ignore_errors=True)
        layout = dedup_layout(work, summaries, cfg.dedup, index_key(files, cfg))
        verdicts = run_stages(layout, workers, cfg.executor, cfg.ray_address)
        t_dedup = time.perf_counter() - t0 - t_process
        cpu.append(cpu_seconds())
        weights = source_profiles(work, summaries, layout, verdicts, cfg, workers)
        t_profiles = time.perf_counter() - t0 - t_process - t_dedup
        cpu.append(cpu_seconds())

        with staging_dir(out) as tmp:
            stats, hashed = _merge(work, summaries, tmp, cfg, verdicts, weights, workers)
            stats["timings_s"] |= {"process": round(t_process, 3), "dedup_stages": round(t_dedup, 3),
                                   "profiles": round(t_profiles, 3),
                                   "merge": round(time.perf_counter() - t0 - t_process - t_dedup - t_profiles, 3)}
            cpu.append(cpu_seconds())
            stats["timings_s"]["cpu"] = {k: round(b - a, 3) for k, a, b in
                                         zip(("process", "dedup_stages", "profiles", "merge"), cpu, cpu[1:])}
            stats["timings_s"]["task_cpu_by_worker"] = cpu_by_worker(summaries)
            stats["tasks"] = len(tasks)
            stats["tasks_resumed"] = len(tasks) - len(todo)
            stats["dedup_tasks"] = verdicts.tasks  # how many key ranges: data.dedup.bucket_docs, not the output
            write_atomic(tmp / "stats.json", json.dumps(stats, indent=1, ensure_ascii=False))
            write_manifest(tmp, hashed, stage="data", fingerprint=fp, inputs=files,
                           documents=stats["documents"]["kept"], docs_per_part=cfg.docs_per_part,
                           tables=stats["tables"])
            if cfg.dedup.index:  # before the docs folder is committed: a crash in between re-runs onto the same index
                add_run(cfg.dedup, index_key(files, cfg), str(out), layout, verdicts.removed_in)
    for stale in out.parent.glob(f".{out.name}-work-*"):  # this run's, and any from older plans of this folder
        if re.fullmatch(rf"\.{re.escape(out.name)}-work-[0-9a-f]{{16}}", stale.name):  # work_key's name, ours
            shutil.rmtree(stale, ignore_errors=True)
    return stats


def _held(summary: dict[str, Any]) -> dict[str, Any]:
    """A task's summary as the driver keeps it until the merge: without the file records its marker vouches with
    and the spooled chunk (~1 KB a task then, not ~4: the driver holds one per task)."""
    return {k: v for k, v in summary.items() if k not in ("files", "chunk")}


def cpu_seconds() -> float:
    """User + system seconds of this process and of its children that have ended: the local pool's workers
    once their pool has closed (each stage's does), so the differences are each stage's CPU on this machine
    (a Ray cluster's workers are not children: there this counts the driver alone)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def cpu_by_worker(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds of the data tasks by the worker process that ran them (host:pid), busiest first: how
    evenly the engine spread the work (a task resumed from an earlier run counts for its worker then)."""
    cpu: Counter[str] = Counter()
    for s in summaries:
        cpu[s.get("worker", "?")] += s.get("cpu_s", 0.0)
    return {k: round(v, 3) for k, v in cpu.most_common()}


def _progress_sink(progress, tasks: list[Task], todo: list[Task]):
    from contextlib import nullcontext

    if callable(progress):
        return nullcontext(progress)
    if progress:
        from kiln.data.progress import DataProgress

        return DataProgress(total_bytes=sum(t.bytes for t in todo), tasks=len(todo))
    return nullcontext(lambda _summary: None)


def profile_task(args: tuple[str, int, int, DataConfig]) -> tuple[int, dict[str, Any]]:
    """After dedup, on a worker: the distribution profile (per-source token frequency sums) of one data
    task's kept documents, those dedup removed left out (its part's verdict file: `VerdictFiles.removed_in`).
    The worker writes it into the work folder (`profiles/parts/NNNNN.pkl`, `part_bytes`, as the data tasks
    write their files) and returns the file's record: a part is the sources' vocabularies, which never pass
    through the driver's pipe nor wait there for their turn, and the driver copies its pieces a block at a time."""
    work, index, k, cfg = args
    gone = set(VerdictFiles(Layout.load(work)).removed_in(k).tolist())

    def kept() -> Iterator[tuple[str, str]]:
        local = 0
        for line in part_lines(Path(work) / f"task-{index:05d}.jsonl.zst"):  # read_part's records, parsed when needed
            if not line.strip():
                continue
            # a rejection has the key "reason"; a line without the word is none, and is parsed only if it is kept
            rec = json.loads(line) if b'"reason"' in line else None
            if rec is not None and "reason" in rec:  # a rejection
                continue
            if local not in gone:
                rec = rec or json.loads(line)
                yield (source_group(cfg.distribution.source_key, rec["source"], rec.get("url"),
                                    rec.get("source_group")), rec.get("text") or "")
            local += 1

    data = part_bytes(profile_part(kept()))
    write_atomic(_profile_part(Path(work), index), data)
    return index, record(data)


def _profile_part(work: Path, index: int) -> Path:
    return work / "profiles" / "parts" / f"{index:05d}.pkl"


def source_profiles(work: Path, summaries: list[dict[str, Any]], layout, verdicts: VerdictFiles, cfg: DataConfig,
                    workers: int) -> int | None:
    """The corpus's per-source weights (SourceProfiles.report), written to `source_weights.jsonl.zst` in the work
    folder (the merge moves it into the docs folder); returns its rows (None: the distribution gate is off). One
    `profile_task` per data task on the engine (each reads its task's verdicts), its part added in task order (so
    the sums are the same for any number of workers). Memory: the numbers of the tasks whose parts wait for their
    turn (the parts wait on disk), then SpilledProfiles's bound; the weights are streamed to the table."""
    if not cfg.distribution.enabled:  # data.distribution.enabled=false: no weights, no profile
        return None
    jobs = [(str(work), int(part.name.split("-")[1]), k, cfg) for k, part in enumerate(layout.parts)
            if part.run is None]
    waiting: dict[int, dict[str, Any]] = {}
    order = iter([s["index"] for s in summaries])
    turn = next(order, None)
    spilled = SpilledProfiles(work / "profiles", cfg.distribution.top_tokens, cfg.distribution.max_z)
    _profile_part(work, 0).parent.mkdir(exist_ok=True)
    for index, rec in run_tasks(profile_task, jobs, workers, cfg.executor, cfg.ray_address):
        waiting[index] = rec
        while turn is not None and turn in waiting:
            path = _profile_part(work, turn)
            if not matches(path, waiting.pop(turn)):
                raise KilnError(f"{path}: the distribution profile a worker wrote is missing or changed; run the "
                                f"same command again (the work folder must be on storage every worker sees)")
            spilled.add_file(path)
            path.unlink()
            turn = next(order, None)
    if turn is not None or waiting:  # a task's part never came, or came for no task: the sums would be short
        raise RuntimeError(f"distribution profile: task {turn}'s part is missing ({len(waiting)} waiting)")
    first: list[dict[str, Any]] = []

    def noting_the_first(rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for row in rows:
            first[:1] = first[:1] or [row]
            yield row

    n = write_table(work / TABLES["source_weights"], noting_the_first(spilled.rows()))
    if n == 1:  # every kept document in one source: the group of those lacking the key is a typo's
        check_groups({first[0]["source"]: first[0]}, cfg.distribution.source_key)
    return n


def _merge(work: Path, summaries: list[dict[str, Any]], out: Path, cfg: DataConfig, verdicts: VerdictFiles,
           weights: int | None, workers: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The merge as tasks on the engine (`kiln.data.merge`) into the staging folder `out`: stats.json's fields
    and the hashes of the files the workers wrote."""
    return merge(work, summaries, out, cfg, verdicts, weights, workers)
