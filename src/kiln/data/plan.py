"""What a run of the data stage is made of, below the stage that runs it (pipeline.py) and the parts that need it
(the dedup index names a run by `index_key`; the semantic gate reads tasks to train its vectors):
- `index_key(files, cfg)`: the inputs' identities and the settings that change the output.
- `Task`, `plan_tasks` and `read_task`: every input file cut into pieces by one mechanism, each piece read on its
  own, numbered in the canonical order.

A task is one piece of one input file: its records, in file order, with provenance as a read of the whole
file gives it (source, byte offset / row, line number), so the output never depends on the cut. How a file
is cut depends on its format, its bytes and `data.task_bytes`, never on the number of workers or the engine.

A format plugs in as an `InputFormat` in `FORMATS` (picked by `sources.input_format`), with three methods:
- `survey(file, cfg, spool)`: the jobs that find where `file` (an `InputFile`: its index, name, size) can
  be cut, each a picklable argument of the format's `probe`; they run on the engine's workers, all files'
  at once (`plan_tasks`). None when the file is one task anyway (not above task_bytes).
- `cut(file, cfg, found)`: the pieces, in file order, from the probes' results (in survey order).
- `read(task, cfg, report)`: the documents of one piece.
The formats:
- WARC, gzipped with a member per record: byte ranges of task_bytes; a range owns the records whose gzip
  member starts in it (`read.read_warc`). Probe: `read.splittable`.
- JSONL, plain: byte ranges of task_bytes; a range owns the lines that start in it. Probe: one per range,
  counting its newlines, so each range knows how many lines come before it (the ids FILE:LINE and the `line`
  signals are those of a whole read) and the first range checks that the file is not compressed after all.
- JSONL, .gz/.zst: a compressed stream cannot be entered in the middle, so one probe per file reads it once,
  start to end, and writes it back into the work folder's spool/ as zstd chunks of about task_bytes of whole
  lines (`spool`), each with its decompressed offset and lines before it; every chunk is a task. A cut or
  damaged stream ends the last chunk after its last whole line and that chunk reports the cut, as a whole
  read does. Memory: one decompression window; disk: about the file again, until the stage ends. A spooled
  chunk counts only with its record (size, xxh3) in its file's spool index; a task reading a chunk that no
  longer matches stops the run and removes the index, so the next run spools that file again.
- Parquet: runs of whole row groups holding about task_bytes (uncompressed, from the footer, as JSONL's are
  decompressed bytes); a row group is the smallest piece, so the writer's row group size bounds a task's
  memory. Probe: the footer.
A file the probe finds unreadable (empty, compressed otherwise than its name says, no text column) is one
task, whose read reports the error as before.
- Arrow IPC (`.arrow`, a `datasets.save_to_disk` shard): one task per file, read one record batch at a time
  (record-batch runs from the file's footer would cut it further: a class with these methods).
A new format is a class with these methods in FORMATS and a name `input_format` returns.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import xxhash
import zstandard

from kiln.config import DataConfig
from kiln.data.document import Document, ReadReport
from kiln.data.read import read_warc, splittable
from kiln.data.sources import (
    StorageWatch,
    _check_compression,
    _chunks,
    input_format,
    input_identity,
    input_size,
    jsonl_records,
    open_input,
    read_jsonl,
    read_arrow,
    read_parquet,
    unreachable,
)
from kiln.data.vouch import HashingReader, Recording, matches
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import is_disk_full

# Settings that change how the work runs, never what it outputs (storage_options may hold secrets).
EXECUTION_KEYS = {"inputs", "workers", "executor", "ray_address", "ray_connect_timeout_s", "task_bytes",
                  "storage_options", "remember_texts"}
SPOOL = "spool"  # in the work folder: FFFFF-CCCCC.jsonl.zst chunks and FFFFF.json, the index vouching for them
READ_ATTEMPTS = 3


def index_key(files: list[str], cfg: DataConfig) -> str:
    """The fingerprint without the index: the name of this run's entry in data.dedup.index."""
    # data.dedup.index is left out: the same run finds its own entry wherever the index folder has moved
    settings = cfg.model_dump(mode="json", exclude={**dict.fromkeys(EXECUTION_KEYS, True),
                                                    "dedup": {"bucket_docs", "verdict_pairs", "index"},
                                                    "docs_format": True})
    ident = [input_identity(str(f), cfg.storage_options) for f in files]
    return hashlib.sha256(json.dumps([ident, settings], sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Task:
    index: int  # position in the canonical order
    source: str
    start: int = 0  # the piece, in its format's unit: bytes [start, end) of a WARC or plain JSONL file,
    end: int | None = None  # row groups [start, end) of a Parquet file; None: to the end
    bytes: int = 0  # input bytes it covers (for the progress bar)
    before: int = 0  # records of the file before the piece: JSONL newlines, Parquet rows
    chunk: dict[str, Any] | None = field(default=None, hash=False)  # a spooled chunk's record (see `spool`)

    @property
    def name(self) -> str:
        return f"task-{self.index:05d}"


@dataclass(frozen=True)
class InputFile:
    index: int  # among the stage's inputs
    source: str
    size: int


Piece = dict[str, Any]  # Task fields but index and source


class InputFormat(Protocol):
    def survey(self, file: InputFile, cfg: DataConfig, spool: Path | None) -> list[Any]: ...

    def probe(self, job: Any) -> Any: ...

    def cut(self, file: InputFile, cfg: DataConfig, found: list[Any]) -> list[Piece]: ...

    def read(self, task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]: ...


def _whole(file: InputFile) -> list[Piece]:
    return [{"bytes": file.size}]


def _ranges(size: int, step: int) -> list[tuple[int, int | None]]:
    return [(a, None if a + step >= size else a + step) for a in range(0, size, step)]


def _fields(cfg: DataConfig) -> tuple[str, ...]:
    return cfg.text_field, cfg.id_field, cfg.url_field, record_field(cfg.distribution.source_key)


class Warc:
    def survey(self, file: InputFile, cfg: DataConfig, spool: Path | None) -> list[Any]:
        return [(file.source, cfg.storage_options)] if file.size > cfg.task_bytes else []

    def probe(self, job: tuple[str, dict]) -> bool:
        return splittable(*job)

    def cut(self, file: InputFile, cfg: DataConfig, found: list[Any]) -> list[Piece]:
        if not (found and found[0]):
            return _whole(file)
        return [{"start": a, "end": b, "bytes": (b or file.size) - a} for a, b in _ranges(file.size, cfg.task_bytes)]

    def read(self, task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
        return read_warc(task.source, report, task.start, task.end, cfg.storage_options)


class Jsonl:
    """Plain: byte ranges, each probe counting its range's newlines. Compressed: spooled chunks (`spool`)."""

    # A compressed file of task_bytes / SPOOL_FROM or more is spooled (text compresses 3-5x, so its stream is
    # about task_bytes or longer); a smaller one is one task. A stream that fits one chunk is read in place.
    SPOOL_FROM = 4

    def survey(self, file: InputFile, cfg: DataConfig, spool: Path | None) -> list[Any]:
        if _compressed(file.source):
            if spool is None or file.size < cfg.task_bytes // self.SPOOL_FROM:
                return []
            return [("spool", file, cfg.storage_options, str(spool), cfg.task_bytes)]
        if file.size <= cfg.task_bytes:
            return []
        return [("count", file.source, cfg.storage_options, a, b) for a, b in _ranges(file.size, cfg.task_bytes)]

    def probe(self, job: tuple) -> Any:
        if job[0] == "spool":
            return spool(*job[1:])
        return _count_newlines(*job[1:])

    def cut(self, file: InputFile, cfg: DataConfig, found: list[Any]) -> list[Piece]:
        if not found or any(r is None for r in found):
            return _whole(file)
        if _compressed(file.source):
            return [{"start": k, "bytes": c["size"], "before": c["lines"], "chunk": c} for k, c in enumerate(found[0])]
        pieces, before = [], 0
        for (a, b), newlines in zip(_ranges(file.size, cfg.task_bytes), found):
            pieces.append({"start": a, "end": b, "bytes": (b or file.size) - a, "before": before})
            before += newlines
        return pieces

    def read(self, task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
        if task.chunk is not None:
            return _read_chunk(task, cfg, report)
        return read_jsonl(task.source, report, _fields(cfg), cfg.storage_options, cfg.max_record_bytes,
                          task.start, task.end, task.before)


class Parquet:
    def survey(self, file: InputFile, cfg: DataConfig, spool: Path | None) -> list[Any]:
        return [(file.source, cfg.storage_options, cfg.text_field)] if file.size > cfg.task_bytes else []

    def probe(self, job: tuple[str, dict, str]) -> list[tuple[int, int]] | None:
        """Each row group's (rows, bytes uncompressed, as a task holds them), or None when the file is to be read
        whole (it will say why)."""
        import pyarrow.parquet as pq

        source, storage_options, text_field = job
        with open_input(source, storage_options) as f:
            raw = StorageWatch(f)
            try:
                meta = pq.ParquetFile(raw).metadata
                if text_field not in meta.schema.to_arrow_schema().names:
                    return None
                return [(meta.row_group(g).num_rows, meta.row_group(g).total_byte_size)
                        for g in range(meta.num_row_groups)]
            except Exception:
                if raw.error is not None:
                    raise raw.error from None
                return None

    def cut(self, file: InputFile, cfg: DataConfig, found: list[Any]) -> list[Piece]:
        groups = found[0] if found else None
        if not groups:
            return _whole(file)
        pieces: list[Piece] = []
        first = rows_before = held = 0
        for g, (rows, size) in enumerate(groups):
            held += size
            if held >= cfg.task_bytes or g == len(groups) - 1:
                pieces.append({"start": first, "end": g + 1, "bytes": held, "before": rows_before})
                rows_before += sum(r for r, _ in groups[first:g + 1])
                first, held = g + 1, 0
        return pieces if len(pieces) > 1 else _whole(file)

    def read(self, task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
        groups = None if task.end is None else range(task.start, task.end)
        return read_parquet(task.source, report, _fields(cfg), cfg.storage_options, cfg.max_record_bytes,
                            groups, task.before)


class Arrow:
    """An Arrow IPC file (a `datasets.save_to_disk` shard, ~500 MB by default): one task, read one record batch
    at a time (its memory is one batch, whatever the file's size)."""

    def survey(self, file: InputFile, cfg: DataConfig, spool: Path | None) -> list[Any]:
        return []

    def probe(self, job: Any) -> Any:
        raise AssertionError("an Arrow file has nothing to probe")

    def cut(self, file: InputFile, cfg: DataConfig, found: list[Any]) -> list[Piece]:
        return _whole(file)

    def read(self, task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
        return read_arrow(task.source, report, _fields(cfg), cfg.storage_options, cfg.max_record_bytes)


FORMATS: dict[str, InputFormat] = {"warc": Warc(), "jsonl": Jsonl(), "parquet": Parquet(), "arrow": Arrow()}


def read_task(task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
    return FORMATS[input_format(task.source)].read(task, cfg, report)


# --- planning -----------------------------------------------------------------------------------

def plan_tasks(files: list[str], cfg: DataConfig, work: Path | None = None, workers: int = 1) -> list[Task]:
    """Every input's pieces as tasks, in input order then file order. The probes run on the engine (`workers`
    of `cfg.executor`: call inside `executor.engine` to keep one Ray session); without a work folder, a
    compressed JSONL file is one task (nowhere to spool it)."""
    from kiln.tasks.executor import run_tasks

    inputs = [InputFile(i, source, input_size(source, cfg.storage_options)) for i, source in enumerate(files)]
    spool_dir = None if work is None else Path(work) / SPOOL
    jobs = [(input_format(f.source), f.index, k, f.source, job)
            for f in inputs for k, job in enumerate(FORMATS[input_format(f.source)].survey(f, cfg, spool_dir))]
    found: dict[int, dict[int, Any]] = {}
    for index, k, result in run_tasks(probe, jobs, workers, cfg.executor, cfg.ray_address):
        found.setdefault(index, {})[k] = result
    tasks: list[Task] = []
    for f in inputs:
        results = [found[f.index][k] for k in sorted(found.get(f.index, {}))]
        for piece in FORMATS[input_format(f.source)].cut(f, cfg, results):
            tasks.append(Task(len(tasks), f.source, **piece))
    return tasks


def probe(job: tuple[str, int, int, str, Any]) -> tuple[int, int, Any]:
    """One survey job, on a worker: (file index, job number, the format's probe result). A storage error is
    tried again, as a task's read is (pipeline.run_task)."""
    kind, index, k, source, args = job
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            return index, k, FORMATS[kind].probe(args)
        except Exception as exc:  # as run_task: a server that cannot be reached and a full disk stop at once
            if (error := unreachable(exc, source)) is not None:
                raise error from None
            if not isinstance(exc, OSError) or is_disk_full(exc):
                raise
            if attempt == READ_ATTEMPTS:
                raise KilnError(f"{source}: reading failed {READ_ATTEMPTS} times while planning its tasks ({exc}); "
                                f"fix the storage or network and run the same command again") from None
            time.sleep(0.5 * 2 ** attempt)
    raise AssertionError("unreachable")


# --- JSONL ------------------------------------------------------------------------------------------

def _compressed(source: str) -> bool:
    return source.lower().endswith((".gz", ".zst"))


def _count_newlines(source: str, storage_options: dict, start: int, end: int | None) -> int | None:
    """Newlines in bytes [start, end) of a plain JSONL file (None when it must be read whole: its first bytes
    say it is compressed, which its one task then reports)."""
    with open_input(source, storage_options) as f:
        if start == 0:
            try:
                _check_compression(source, f.read(4))
            except KilnError:
                return None
        f.seek(start)
        count, left = 0, None if end is None else end - start
        while block := f.read(1 << 20 if left is None else min(1 << 20, left)):
            count += block.count(b"\n")
            if left is not None:
                left -= len(block)
        return count


class _Chunk:
    """One spooled chunk being written: zstd, its decompressed bytes counted, its record taken as it is written."""

    def __init__(self, path: Path, offset: int, lines: int) -> None:
        self.path, self.offset, self.lines, self.bytes = path, offset, lines, 0
        self.raw = open(path, "wb")
        self.out = Recording(self.raw)
        self.zw = zstandard.ZstdCompressor(level=1).stream_writer(self.out, closefd=False)

    def add(self, data: bytes) -> None:
        self.zw.write(data)
        self.bytes += len(data)

    def close(self, valid: int | None = None) -> dict[str, Any]:
        self.zw.close()
        self.raw.flush()
        os.fsync(self.raw.fileno())
        self.raw.close()
        return {"path": str(self.path), "offset": self.offset, "lines": self.lines,
                "bytes": self.bytes if valid is None else valid, **self.out.record()}


def spool(file: InputFile, storage_options: dict, folder: str, task_bytes: int) -> list[dict[str, Any]] | None:
    """A compressed JSONL file decompressed once and written back as chunks of whole lines, each about
    `task_bytes` decompressed (the first line end past task_bytes closes a chunk); returns the chunks' records
    (path, offset and lines before it in the decompressed stream, `bytes` to read, size and xxh3 of the
    file; the last one's `truncated_at` when the stream is cut), or None to read the file whole (it is
    unreadable, which its one task reports, or it fits one chunk). An index of the records, written after
    the chunks, lets a re-run reuse them."""
    folder_path = Path(folder)
    folder_path.mkdir(parents=True, exist_ok=True)
    index = folder_path / f"{file.index:05d}.json"
    if (done := _spooled(index)) is not None:
        return done["chunks"]
    for stale in folder_path.glob(f"{file.index:05d}-*"):
        stale.unlink()
    try:
        chunks = _write_chunks(file, storage_options, folder_path, task_bytes)
    except OSError as exc:
        if is_disk_full(exc):  # no partial chunk stays on the full disk: the next run spools this file afresh
            for partial in folder_path.glob(f"{file.index:05d}-*"):
                partial.unlink(missing_ok=True)
        raise
    if chunks is None:
        return None
    if len(chunks) <= 1:
        for c in chunks:
            Path(c["path"]).unlink()
        return None
    from kiln.manifest import write_atomic

    write_atomic(index, json.dumps({"source": file.source, "chunks": chunks}))
    return chunks


def _write_chunks(file: InputFile, storage_options: dict, folder_path: Path, task_bytes: int
                  ) -> list[dict[str, Any]] | None:
    """spool's chunks of `file` written into `folder_path`; None when it is not compressed as its name says."""
    chunks: list[dict[str, Any]] = []
    with open_input(file.source, storage_options) as f:
        try:
            _check_compression(file.source, f.read(4))
        except KilnError:
            return None
        f.seek(0)
        chunk: _Chunk | None = None
        offset = lines = line_end = 0  # decompressed bytes and newlines so far; where the last whole line ends
        truncated = False
        try:
            for block in _chunks(StorageWatch(f), file.source):
                while block:
                    if chunk is None:
                        chunk = _Chunk(folder_path / f"{file.index:05d}-{len(chunks):05d}.jsonl.zst", offset, lines)
                    cut = block.find(b"\n", max(task_bytes - chunk.bytes - 1, 0)) + 1
                    piece, block = (block, b"") if cut == 0 else (block[:cut], block[cut:])
                    chunk.add(piece)
                    if (newlines := piece.count(b"\n")):
                        lines += newlines
                        line_end = offset + piece.rindex(b"\n") + 1
                    offset += len(piece)
                    if cut:
                        chunks.append(chunk.close())
                        chunk = None
        except (EOFError, zlib.error, zstandard.ZstdError):
            truncated = True
        if chunk is not None:
            chunks.append(chunk.close(valid=line_end - chunk.offset if truncated else None))
    if truncated and chunks:
        chunks[-1]["truncated_at"] = line_end
    return chunks


def _spooled(index: Path) -> dict[str, Any] | None:
    """The spool index of an earlier run, when every chunk it names still matches its record."""
    try:
        done = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(done, dict) and isinstance(done.get("chunks"), list) and all(
        isinstance(c, dict) and matches(Path(c.get("path", "")), c) for c in done["chunks"])
    return done if ok else None


def _read_chunk(task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
    """A spooled chunk's lines, with the provenance of their place in the original file; the chunk's xxh3 is
    checked when it has been read, and a chunk that changed since it was spooled stops the task (and makes the
    next run spool its file again)."""
    chunk = task.chunk
    path = Path(chunk["path"])
    with open(path, "rb") as raw:
        hashing = HashingReader(raw, xxhash.xxh3_128())
        reader = zstandard.ZstdDecompressor().stream_reader(hashing, closefd=False)
        yield from jsonl_records(_limited(reader, chunk["bytes"]), task.source, report, _fields(cfg),
                                 cfg.max_record_bytes, chunk["offset"], chunk["lines"])
        digest = hashing.finish()
    if path.stat().st_size != chunk["size"] or digest != chunk["xxh3"]:
        (path.parent / f"{path.name.split('-')[0]}.json").unlink(missing_ok=True)
        raise IntegrityError(f"{path}: this spooled piece of {task.source} changed after it was written; run the "
                             f"same command again (it spools the file again)")
    if chunk.get("truncated_at") is not None:
        report.truncated_at = chunk["truncated_at"]


def _limited(reader, n: int) -> Iterator[bytes]:
    while n > 0 and (block := reader.read(min(1 << 16, n))):
        n -= len(block)
        yield block


def record_field(source_key: str) -> str:
    """The JSONL/Parquet field that `field:NAME` names ("" for file and host): the reader keeps its value."""
    return source_key[len("field:"):] if source_key.startswith("field:") else ""
