"""The data stage: files -> read -> extract -> language -> quality gates -> exact dedup -> docs/.

Each input file is one task, run in a process pool. A task writes its outcomes
(kept and rejected documents, in file order) to a work folder with a completion
marker, so a killed run redoes only unfinished files. The merge then reads the
tasks in input order, deduplicates globally and writes the parts: the output is
byte-identical whatever the number of workers.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import zstandard

from kiln.config import DataConfig
from kiln.data.dedup import ExactDedup
from kiln.data.document import Document
from kiln.data.extract import extract
from kiln.data.gates import apply_gates, default_gates
from kiln.data.language import identify_language
from kiln.data.read import ReadReport, read_warc
from kiln.errors import KilnError
from kiln.manifest import staging_dir, write_atomic, write_manifest


def expand_inputs(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise KilnError(f"input {pattern!r} matches no file; check the path or glob")
        for m in matches:
            if not Path(m).is_file():
                raise KilnError(f"input {m} does not exist or is not a file")
            files.append(Path(m))
    if not files:
        raise KilnError("no input files given; pass WARC files or set data.inputs in the config")
    return files


def fingerprint(files: list[Path], cfg: DataConfig) -> str:
    """What the output depends on: each file's path, size and mtime, and the data settings."""
    settings = cfg.model_dump(mode="json", exclude={"inputs", "workers"})
    ident = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(json.dumps([ident, settings], sort_keys=True).encode()).hexdigest()[:16]


# --- one task: one input file ----------------------------------------------------------------

def process_file(path: Path, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
    docs = read_warc(path, report)
    docs = extract(docs, cfg.max_page_bytes)
    docs = identify_language(docs, cfg.languages, cfg.lang_threshold, cfg.lang_max_chars)
    return apply_gates(docs, default_gates(cfg))


def _run_task(args: tuple[int, str, DataConfig, str]) -> dict[str, Any]:
    index, path, cfg, work = args
    out = Path(work) / f"task-{index:05d}.jsonl.zst"
    report = ReadReport()
    t0 = time.perf_counter()
    buf = io.BytesIO()
    error = None
    with zstandard.ZstdCompressor(level=3).stream_writer(buf, closefd=False) as zw:
        try:
            for doc in process_file(Path(path), cfg, report):
                rec = doc.kept_record() if doc.rejection is None else doc.reject_record() | {"text": doc.text}
                zw.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
        except KilnError as exc:
            error = str(exc)
    write_atomic(out, buf.getvalue())
    summary = {"index": index, "source": path, "records_by_type": report.records_by_type,
               "truncated_at": report.truncated_at, "error": error, "seconds": round(time.perf_counter() - t0, 3)}
    write_atomic(Path(work) / f"task-{index:05d}.done.json", json.dumps(summary))
    return summary


def _read_task(work: Path, index: int) -> Iterator[dict[str, Any]]:
    with open(work / f"task-{index:05d}.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            yield json.loads(line)


# --- the stage ------------------------------------------------------------------------------

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


def run_data(inputs: list[str], out: Path, cfg: DataConfig, workers: int | None = None, progress=None) -> dict[str, Any]:
    """Process `inputs` into the docs folder `out` (committed atomically). Returns stats."""
    files = expand_inputs(inputs)
    fp = fingerprint(files, cfg)
    work = out.parent / f".{out.name}-work-{fp}"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    todo = [(i, str(f), cfg, str(work)) for i, f in enumerate(files) if not (work / f"task-{i:05d}.done.json").exists()]
    workers = min(workers or cfg.workers, max(len(todo), 1))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            for summary in pool.map(_run_task, todo):
                progress and progress(summary)
    else:
        for task in todo:
            summary = _run_task(task)
            progress and progress(summary)
    t_process = time.perf_counter() - t0

    summaries = [json.loads((work / f"task-{i:05d}.done.json").read_text()) for i in range(len(files))]
    with staging_dir(out) as tmp:
        stats = _merge(work, summaries, tmp, cfg)
        stats["timings_s"] = {"process": round(t_process, 3), "merge": round(time.perf_counter() - t0 - t_process, 3)}
        stats["tasks_resumed"] = len(files) - len(todo)
        write_atomic(tmp / "stats.json", json.dumps(stats, indent=1, ensure_ascii=False))
        write_manifest(tmp, stage="data", fingerprint=fp, inputs=[str(f) for f in files],
                       documents=stats["documents"]["kept"])
    shutil.rmtree(work, ignore_errors=True)
    return stats


def _merge(work: Path, summaries: list[dict[str, Any]], out: Path, cfg: DataConfig) -> dict[str, Any]:
    kept_w, rej_w = PartWriter(out, cfg.docs_per_part), PartWriter(out / "rejects", cfg.docs_per_part)
    dedup = ExactDedup()
    reasons: Counter[str] = Counter()
    langs: Counter[str] = Counter()
    by_type: Counter[str] = Counter()
    read = kept = chars = 0
    for s in summaries:
        by_type.update(s["records_by_type"])
        for rec in _read_task(work, s["index"]):
            read += 1
            if "reason" not in rec:  # kept so far; dedup is the last, global step
                doc = Document(**{k: rec[k] for k in ("id", "source", "offset", "length", "url", "date", "text", "lang", "lang_score")})
                next(dedup(iter([doc])))
                if doc.rejection is None:
                    kept_w.add(rec)
                    kept += 1
                    chars += len(rec["text"])
                    langs[rec["lang"]] += 1
                    continue
                rec = doc.reject_record()
            rec.pop("text", None)
            rej_w.add(rec)
            reasons[f"{rec['stage']}/{rec['reason']}"] += 1
    kept_w.flush()
    rej_w.flush()
    rejected = sum(reasons.values())
    assert read == kept + rejected, "accounting broke: every document must be kept or rejected"
    return {
        "files": len(summaries),
        "file_errors": [{"source": s["source"], "error": s["error"]} for s in summaries if s["error"]],
        "truncated": [{"source": s["source"], "offset": s["truncated_at"]} for s in summaries if s["truncated_at"] is not None],
        "warc_records": {"total": sum(by_type.values()), "by_type": dict(sorted(by_type.items()))},
        "documents": {"read": read, "kept": kept, "rejected": rejected},
        "rejected_by_reason": dict(sorted(reasons.items())),
        "kept_by_lang": dict(sorted(langs.items(), key=lambda kv: (-kv[1], kv[0]))),
        "kept_chars": chars,
        "parts": kept_w.parts,
    }


def read_docs(folder: Path) -> Iterator[dict[str, Any]]:
    """Kept documents of a docs folder, in order."""
    parts = sorted(Path(folder).glob("part-*.jsonl.zst"))
    if not parts:
        raise KilnError(f"{folder}: no part-*.jsonl.zst files; run `kiln data` first")
    for part in parts:
        with open(part, "rb") as f:
            for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
                if line.strip():
                    yield json.loads(line)
