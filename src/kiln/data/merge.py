"""The data stage's merge, as tasks on the engine (issue 44.1): what every data task's outcome becomes in the docs
folder, with nothing in the driver that grows with the documents.

1. One merge task per data task (`merge_task`, on the workers): its outcome in record order through
   `steps.merge_steps` (its own verdict file; the classifier's top-fraction cut at the bin the driver computed from
   the tasks' histograms), its kept, rejected and set-aside records written as JSON lines to scratch streams of
   its own in the work folder (`merge/task-NNNNN.{kept,rejects,review}.zst`, and its near duplicates' ledger rows,
   `.ledger.zst`), its kept documents per source group (`.groups.json`, in order of first appearance) and the
   counts stats.json sums (documents by reason, language, length bin; edits; characters).
2. The parts (`part_task`): from the tasks' counts the driver numbers every record of each set (kept, rejects,
   review) in canonical order; part p holds records p * data.docs_per_part onwards, the same parts for any cut of
   the inputs into tasks. One job per task in which parts begin writes those parts, reading on into the next tasks'
   streams for the last one; one job writes the ledger (the tasks' rows, in order, into one file). Each part is
   written under its final name into `merge/out/`, fsynced and hashed there.
3. The commit, in the driver (`merge`): the parts and the ledger renamed into the staging folder, stats.json and the
   per-source tables summed from the tasks' counts, the manifest from the parts' hashes. Its memory and time go
   with the number of tasks (and of source groups, whose table it writes through `SpilledCounts`), not the
   documents.
Each task's and job's result is vouched for by a marker the driver writes when it comes back (`merge/*.done.json`:
the counts and every file's size, xxh3 and sha256), so after a kill -9 anywhere in it a rerun redoes only the tasks
and jobs whose marker is missing or whose files no longer match it. The output is byte-identical for any number of
workers, either engine and any number of interruptions (a zstd stream's bytes do not depend on how its input was cut
into writes).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from contextlib import ExitStack
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import xxhash
import zstandard

from kiln.config import DataConfig
from kiln.data.dedup.clusters import LEDGER
from kiln.data.docs import part_lines, part_name, read_part, set_writer, write_card
from kiln.data.document import Document
from kiln.data.gates.distribution import Composition, source_group
from kiln.data.gates.semantic import REVIEW as SEMANTIC_REVIEW
from kiln.data.shape import CorpusShape
from kiln.data.steps import StepTimer, merge_steps, run_steps
from kiln.data.tables import TABLES, SpilledCounts, TableWriter, composition_rows, write_table
from kiln.data.vouch import Recording, matches, record
from kiln.manifest import fsync_dir, write_atomic, writing_atomic
from kiln.tasks.executor import run_tasks

MERGE_DIR = "merge"  # in the work folder
OUT = "out"  # in MERGE_DIR: the parts and the ledger under their names in the docs folder, until the commit
SCRATCH_LEVEL = 1  # zstd level of a merge task's streams: read once or twice, then removed with the work folder
STEPS = ("read", "extract", "language", "gates")
CHUNK = 1 << 20


# --- 1. a merge task per data task ------------------------------------------------------------------------------

class TaskVerdicts:
    """One data task's verdicts as the Dedup step takes them (`rejections()`: by the document's number among the
    task's kept documents), read once from its verdict file; each near duplicate's ledger row goes to `ledger`."""

    def __init__(self, path: Path, ledger: Any) -> None:
        self.path, self.ledger = path, ledger

    def rejections(self) -> Iterator[tuple[int, str, dict[str, Any]]]:
        for row in read_part(self.path):
            if self.ledger is not None and "ledger" in row:
                self.ledger.add(row["ledger"])
            yield row["n"], row["reason"], row["signals"]


class Stream:
    """A scratch stream of JSON lines (zstd), recorded as it is written; it appears when the task's block ends."""

    def __init__(self, stack: ExitStack, path: Path) -> None:
        self.out = Recording(stack.enter_context(writing_atomic(path)))
        self.zw = stack.enter_context(zstandard.ZstdCompressor(level=SCRATCH_LEVEL).stream_writer(self.out,
                                                                                                   closefd=False))
        self.lines = 0

    def add(self, rec: dict[str, Any]) -> None:
        self.zw.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
        self.lines += 1


class TaskCounts:
    """What one merge task counts for stats.json and the tables: memory a counter per reason, language, length
    bin and edit, and the task's source groups."""

    def __init__(self) -> None:
        self.read = self.kept = self.chars = 0
        self.reasons: Counter[str] = Counter()
        self.langs: Counter[str] = Counter()
        self.edits: Counter[str] = Counter()
        self.composition, self.shape = Composition(), CorpusShape()
        self.groups: dict[str, list[int]] = {}  # in order of first appearance

    def add(self, doc: Document) -> None:
        self.read += 1
        self.shape.add(doc)
        if doc.rejection is None:
            chars = len(doc.text or "")
            self.kept += 1
            self.chars += chars
            row = self.groups.setdefault(doc.source_group, [0, 0])
            row[0] += 1
            row[1] += chars
            self.composition.add(doc.lang, chars)
            self.langs[doc.lang] += 1
            self.edits.update(doc.edits)
        else:
            self.reasons[f"{doc.rejection.stage}/{doc.rejection.reason}"] += 1

    def report(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "rejected": self.read - self.kept, "chars": self.chars,
                "reasons": self.reasons, "langs": self.langs, "edits": self.edits,
                "composition": {lang: [r["documents"], r["chars"]] for lang, r in self.composition.by_lang.items()},
                "rejected_by_lang": self.shape.rejected_by_lang,
                "lengths": {k: {str(b): n for b, n in c.items()} for k, c in self.shape.lengths.items()}}


def merge_task(job: tuple[str, int, str, dict[str, Any] | None, DataConfig]) -> dict[str, Any]:
    """One data task's outcome through the merge steps into its scratch streams (module docstring, 1); returns
    its counts and its files' records. Memory: one batch of documents and the task's source groups."""
    work, index, verdicts, top, cfg = job
    folder, stem = Path(work) / MERGE_DIR, f"task-{index:05d}"
    review = cfg.quality.semantic.action == "review" and bool(cfg.quality.semantic.keywords)
    names = ["kept", "rejects"] + ["review"] * review + ["ledger"] * (cfg.dedup.method != "none")
    counts, timer = TaskCounts(), StepTimer()
    with ExitStack() as stack:
        out = {name: Stream(stack, folder / f"{stem}.{name}.zst") for name in names}
        found = TaskVerdicts(Path(verdicts), out.get("ledger"))
        docs = (Document.from_record(rec) for rec in read_part(Path(work) / f"{stem}.jsonl.zst"))
        for doc in run_steps(timer.wrap("tasks", docs), merge_steps(found, 0, [top] if top else []), timer):
            if doc.rejection is None:
                doc.source_group = source_group(cfg.distribution.source_key, doc.source, doc.url, doc.source_group)
                out["kept"].add(doc.kept_record())
            else:
                out["rejects"].add(doc.reject_record())
                if review and doc.rejection.reason == SEMANTIC_REVIEW:  # set aside, with its score
                    out["review"].add(doc.kept_record() | {"semantic_score": doc.rejection.signals["semantic_score"]})
            counts.add(doc)
    groups = json.dumps(list(counts.groups.items()), ensure_ascii=False).encode()
    write_atomic(folder / f"{stem}.groups.json", groups)
    files = {f"{stem}.{name}.zst": s.out.record() for name, s in out.items()} | {f"{stem}.groups.json": record(groups)}
    lines = {name: s.lines for name, s in out.items()}
    return {"index": index, **counts.report(), "lines": lines, "dedup_s": timer.own().get("dedup", 0.0),
            "files": files}


# --- 2. the parts ----------------------------------------------------------------------------------------------

def plan_parts(counts: list[int], per_part: int) -> tuple[int, list[tuple[int, int, list[tuple[int, int, int]]]]]:
    """A set's parts from its records per task (in canonical order): (how many parts, jobs), a job per task in
    which parts begin: (first part, last part, [(task position, records skipped, records taken), ...]). A set with
    no record has one empty part. Time: the tasks and the jobs."""
    total = sum(counts)
    parts = max(1, -(-total // per_part))
    if not total:
        return parts, [(0, 0, [])]
    jobs, before = [], 0
    for i, c in enumerate(counts):
        p0, p1 = -(-before // per_part), -(-(before + c) // per_part) - 1
        if c and p0 <= p1:
            need, sources, j, at = min((p1 + 1) * per_part, total) - p0 * per_part, [], i, p0 * per_part - before
            while need:
                take = min(counts[j] - at, need)
                if take:
                    sources.append((j, at, take))
                need, j, at = need - take, j + 1, 0
            jobs.append((p0, p1, sources))
        before += c
    return parts, jobs


def file_record(path: Path) -> dict[str, Any]:
    """A written file fsynced, with its size, xxh3 (the work folder's vouch) and sha256 (the docs manifest's)."""
    sha, xxh, size = hashlib.sha256(), xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while block := f.read(CHUNK):
            sha.update(block)
            xxh.update(block)
            size += len(block)
    return {"size": size, "xxh3": xxh.hexdigest(), "sha256": sha.hexdigest()}


def part_task(job: tuple) -> dict[str, Any]:
    """Parts p0..p1 of one set, written under their names in `merge/out/` from the tasks' streams (module
    docstring, 2). Memory: a compression window (a Parquet row group)."""
    work, fmt, kind, per_part, total, p0, p1, sources = job
    folder = Path(work) / MERGE_DIR
    writer = set_writer(folder / OUT, fmt, kind, per_part, p0, total)
    for index, skip, take in sources:
        for line in islice(part_lines(folder / f"task-{index:05d}.{kind}.zst"), skip, skip + take):
            writer.add_line(line)
    writer.close()
    names = [part_name(fmt, kind, p, total) for p in range(p0, p1 + 1)]
    return {"files": {f"{OUT}/{name}": file_record(folder / OUT / name) for name in names}}


def ledger_task(job: tuple[str, list[int]]) -> dict[str, Any]:
    """The near-duplicate ledger: the tasks' rows, in task order, into one file (a byte copy: no row is parsed)."""
    work, indices = job
    folder = Path(work) / MERGE_DIR
    path = folder / OUT / LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing_atomic(path) as f, zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as zw:
        for index in indices:
            with open(folder / f"task-{index:05d}.ledger.zst", "rb") as src:
                reader = zstandard.ZstdDecompressor().stream_reader(src)
                while block := reader.read(CHUNK):
                    zw.write(block)
    return {"files": {f"{OUT}/{LEDGER}": file_record(path)}}


# --- the rounds and their markers ------------------------------------------------------------------------------

def _marker(folder: Path, stem: str) -> Path:
    return folder / f"{stem}.done.json"


def vouched(job: tuple[str, str, Any]) -> tuple[str, bool]:
    """On a worker: whether a task's or job's marker is there, for the same plan, and every file it names matches."""
    folder, stem, plan = Path(job[0]), job[1], job[2]
    try:
        found = json.loads(_marker(folder, stem).read_text())
    except (OSError, ValueError):
        return stem, False
    files = found.get("files") if isinstance(found, dict) else None
    ok = found.get("plan") == plan and isinstance(files, dict) and all(
        matches(folder / name, rec) for name, rec in files.items())
    return stem, bool(ok)


def _stemmed(job: tuple[Any, str, tuple]) -> tuple[str, dict[str, Any]]:
    fn, stem, args = job
    return stem, fn(args)


def run_round(folder: Path, jobs: list[tuple[Any, str, Any, tuple]], cfg: DataConfig, workers: int) -> int:
    """Run the jobs ((function, marker stem, plan, arguments)) whose marker does not vouch for their files; each
    marker is written when its result comes back. Returns how many ran."""
    present = [(str(folder), stem, plan) for _, stem, plan, _ in jobs if _marker(folder, stem).exists()]
    good = {stem for stem, ok in run_tasks(vouched, present, workers, cfg.executor, cfg.ray_address) if ok}
    plans = {stem: plan for _, stem, plan, _ in jobs}
    todo = [(fn, stem, args) for fn, stem, _, args in jobs if stem not in good]
    for stem, result in run_tasks(_stemmed, todo, workers, cfg.executor, cfg.ray_address):
        write_atomic(_marker(folder, stem), json.dumps({"plan": plans[stem], **result}, ensure_ascii=False))
    return len(todo)


def read_marker(folder: Path, stem: str) -> dict[str, Any]:
    return json.loads(_marker(folder, stem).read_text())


# --- 3. the driver ---------------------------------------------------------------------------------------------

class Totals:
    """stats.json's sums over the merge tasks' counts: memory a counter per reason, language, length bin, edit."""

    def __init__(self) -> None:
        self.reasons: Counter[str] = Counter()
        self.langs: Counter[str] = Counter()
        self.edits: Counter[str] = Counter()
        self.composition, self.shape = Composition(), CorpusShape()
        self.kept = self.chars = 0
        self.dedup_s = 0.0
        self.by_task: list[tuple[str, int, int, int]] = []  # (input, read, kept, rejected) of each task, in order

    def add(self, r: dict[str, Any]) -> None:
        self.kept += r["kept"]
        self.chars += r["chars"]
        self.dedup_s += r["dedup_s"]
        for mine, theirs in ((self.reasons, r["reasons"]), (self.langs, r["langs"]), (self.edits, r["edits"])):
            mine.update(theirs)
        for lang, (docs, chars) in r["composition"].items():
            row = self.composition.by_lang[lang]
            row["documents"] += docs
            row["chars"] += chars
        for lang, c in r["rejected_by_lang"].items():
            self.shape.rejected_by_lang.setdefault(lang, Counter()).update(c)
        for kind, c in r["lengths"].items():
            self.shape.lengths[kind].update({int(b): n for b, n in c.items()})


def merge(work: Path, summaries: list[dict[str, Any]], out: Path, cfg: DataConfig, verdicts: Any,
          weights: int | None, workers: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The merge (module docstring): the tasks, the parts, then the commit into the staging folder `out`. Returns
    stats.json's fields but the run's (tasks, the other steps' timings), and {name: {size, sha256}} of the files
    the workers wrote and hashed, for the manifest."""
    folder = work / MERGE_DIR
    (folder / OUT).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    own = [k for k, part in enumerate(verdicts.layout.parts) if part.run is None]
    top = _top_fraction(summaries)
    tasks = [(merge_task, f"task-{s['index']:05d}", None, (str(work), s["index"], str(verdicts.path(k)), top, cfg))
             for s, k in zip(summaries, own)]
    ran = {"tasks": run_round(folder, tasks, cfg, workers)}
    t1 = time.perf_counter()
    totals, lines = Totals(), {"kept": [], "rejects": [], "review": []}  # records per task: ints, not documents
    for s in summaries:
        found = read_marker(folder, f"task-{s['index']:05d}")
        totals.add(found)
        for kind in lines:
            lines[kind].append(found["lines"].get(kind, 0))
        totals.by_task.append((s["source"], found["read"], found["kept"], found["rejected"]))
    review = cfg.quality.semantic.action == "review" and bool(cfg.quality.semantic.keywords)
    jobs, kept_parts = _part_jobs(work, summaries, lines if review else {k: lines[k] for k in ("kept", "rejects")},
                                  cfg)
    ran["jobs"] = run_round(folder, jobs, cfg, workers)
    t2 = time.perf_counter()
    hashed = _commit_files(folder, out, [stem for _, stem, _, _ in jobs])
    if cfg.docs_format == "parquet":
        write_card(out, review)
    stats = _stats(work, summaries, out, cfg, verdicts, weights, totals, kept_parts)
    stats["timings_s"]["merge_steps"] = {"tasks": round(t1 - t0, 3), "parts": round(t2 - t1, 3),
                                         "commit": round(time.perf_counter() - t2, 3), "ran": ran}
    return stats, hashed


def _top_fraction(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """data.quality.classifier.keep_top_fraction: the tasks' score histograms summed (what `TopFraction` cuts at)."""
    fraction = summaries[0].get("keep_top_fraction") if summaries else None
    if not fraction:
        return None
    total: Counter[str] = Counter()
    for s in summaries:
        total.update(s["score_histogram"])
    return {"score_histogram": dict(total), "keep_top_fraction": fraction}


def _part_jobs(work: Path, summaries: list[dict[str, Any]], lines: dict[str, list[int]],
               cfg: DataConfig) -> tuple[list[tuple], int]:
    """Round 2's jobs: the ledger first (one file, the longest job), then each set's parts; and the kept parts."""
    jobs: list[tuple] = []
    if cfg.dedup.method != "none":
        jobs.append((ledger_task, "ledger", None, (str(work), [s["index"] for s in summaries])))
    kept_parts = 0
    for kind, counts in lines.items():
        parts, plan = plan_parts(counts, cfg.docs_per_part)
        kept_parts = parts if kind == "kept" else kept_parts
        for p0, p1, sources in plan:
            sources = [(summaries[j]["index"], skip, take) for j, skip, take in sources]
            plan = f"{cfg.docs_format} {kind} {p0}-{p1} of {parts} by {cfg.docs_per_part}"
            jobs.append((part_task, f"parts-{kind}-{p0:05d}", plan,
                         (str(work), cfg.docs_format, kind, cfg.docs_per_part, parts, p0, p1, sources)))
    return jobs, kept_parts


def _commit_files(folder: Path, out: Path, stems: list[str]) -> dict[str, dict[str, Any]]:
    """The parts and the ledger renamed into the staging folder; {name: {size, sha256}} for its manifest."""
    hashed = {}
    made: set[Path] = set()
    for stem in stems:
        for name, rec in read_marker(folder, stem)["files"].items():
            final = out / name.removeprefix(f"{OUT}/")
            if final.parent not in made:
                final.parent.mkdir(parents=True, exist_ok=True)
                made.add(final.parent)
            os.replace(folder / name, final)
            hashed[final.relative_to(out).as_posix()] = {"size": rec["size"], "sha256": rec["sha256"]}
    for parent in made:
        fsync_dir(parent)
    return hashed


def _stats(work: Path, summaries: list[dict[str, Any]], out: Path, cfg: DataConfig, verdicts: Any,
           weights: int | None, totals: Totals, kept_parts: int) -> dict[str, Any]:
    """stats.json's fields from the tasks' markers, and the per-source tables (streamed: one task's groups at a
    time, then `SpilledCounts`'s bound)."""
    folder = work / MERGE_DIR
    by_group = SpilledCounts(work / "composition", ("documents", "chars"))
    with TableWriter(out / TABLES["by_source"]) as by_input:
        row: dict[str, Any] = {}
        for s, (source, *counts) in zip(summaries, totals.by_task):  # an input's tasks are consecutive
            if row.get("source") != source:
                if row:
                    by_input.add(row)
                row = {"source": source, "read": 0, "kept": 0, "rejected": 0}
            for k, n in zip(("read", "kept", "rejected"), counts):
                row[k] += n
            for group, (docs, chars) in json.loads((folder / f"task-{s['index']:05d}.groups.json").read_text()):
                by_group.add(group, docs, chars)
        if row:
            by_input.add(row)
    tables = {"by_source": by_input.rows,
              "composition_by_source": write_table(out / TABLES["composition_by_source"], composition_rows(by_group))}
    if weights is not None:
        os.replace(work / TABLES["source_weights"], out / TABLES["source_weights"])
        tables["source_weights"] = weights
    counts = _counts(summaries, totals.kept, totals.reasons, totals.langs)
    steps = counts.pop("steps")
    return {**counts, "kept_chars": totals.chars, **totals.shape.report(),
            "edits": dict(sorted(totals.edits.items())), "composition": {"by_lang": totals.composition.report()},
            "tables": {name: {"file": TABLES[name], "rows": n} for name, n in tables.items()},
            "parts": kept_parts, "dedup": verdicts.stats(),
            "timings_s": {"steps": {**{k: round(steps[k], 3) for k in STEPS},
                                    "dedup": round(totals.dedup_s + verdicts.seconds + steps["signatures"], 3)}}}


def _counts(summaries: list[dict[str, Any]], kept: int, reasons: Counter[str], langs: Counter[str]) -> dict[str, Any]:
    """stats.json's counts of files, errors, cuts, records, documents and reasons (`read = kept + rejected`), and
    the tasks' seconds by step ("steps", for the timings)."""
    rejected = sum(reasons.values())
    read = sum(s["documents"] for s in summaries)
    assert read == kept + rejected, "accounting broke: every document must be kept or rejected"
    stages: Counter[str] = Counter()
    for reason, n in reasons.items():
        stages[reason.split("/")[0]] += n
    return {
        **_task_totals(summaries),
        "documents": {"read": read, "kept": kept, "rejected": rejected},
        "rejected_by_reason": dict(sorted(reasons.items())),
        "rejected_by_stage": dict(sorted(stages.items())),
        "kept_by_lang": dict(sorted(langs.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def _task_totals(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """What the tasks' summaries add up to: the stats' files, file_errors, truncated and warc_records, and the
    steps' seconds ("steps", for the timings)."""
    by_type: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    for s in summaries:
        by_type.update(s["records_by_type"])
        steps.update(s["steps_s"])
    errors: dict[str, str] = {}
    for s in summaries:
        if s["error"]:
            errors.setdefault(s["source"], s["error"])
    return {
        "files": len({s["source"] for s in summaries}),
        "file_errors": [{"source": src, "error": err} for src, err in errors.items()],
        "truncated": [
            {"source": s["source"], "offset": s["truncated_at"]} for s in summaries if s["truncated_at"] is not None
        ],
        "warc_records": {"total": sum(by_type.values()), "by_type": dict(sorted(by_type.items()))},
        "steps": steps,
    }
