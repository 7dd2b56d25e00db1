"""What a run of the data stage is made of, below the stage that runs it (pipeline.py) and the parts that need it
(the dedup index names a run by `index_key`; the semantic gate reads tasks to train its vectors):
- `index_key(files, cfg)`: the inputs' identities and the settings that change the output.
- `Task` and `plan_tasks`: one task per input file, or byte ranges of a large gzipped WARC (at record
  boundaries, `data.task_bytes`), numbered in the canonical order.
- `read_task`: a task's documents, read from its input in record order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterator

from kiln.config import DataConfig
from kiln.data.document import Document, ReadReport
from kiln.data.read import read_warc, splittable
from kiln.data.sources import input_format, input_identity, input_size, read_jsonl, read_parquet

# Settings that change how the work runs, never what it outputs (storage_options may hold secrets).
EXECUTION_KEYS = {"inputs", "workers", "executor", "ray_address", "task_bytes", "storage_options"}


def index_key(files: list[str], cfg: DataConfig) -> str:
    """The fingerprint without the index: the name of this run's entry in data.dedup.index."""
    # data.dedup.index is left out: the same run finds its own entry wherever the index folder has moved
    settings = cfg.model_dump(mode="json", exclude={**dict.fromkeys(EXECUTION_KEYS, True),
                                                    "dedup": {"bucket_docs", "index"}})
    ident = [input_identity(str(f), cfg.storage_options) for f in files]
    return hashlib.sha256(json.dumps([ident, settings], sort_keys=True).encode()).hexdigest()[:16]


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


def read_task(task: Task, cfg: DataConfig, report: ReadReport) -> Iterator[Document]:
    kind = input_format(task.source)
    fields = (cfg.text_field, cfg.id_field, cfg.url_field, record_field(cfg.distribution.source_key))
    if kind == "jsonl":
        return read_jsonl(task.source, report, fields, cfg.storage_options, cfg.max_record_bytes)
    if kind == "parquet":
        return read_parquet(task.source, report, fields, cfg.storage_options, cfg.max_record_bytes)
    return read_warc(task.source, report, task.start, task.end, cfg.storage_options)


def record_field(source_key: str) -> str:
    """The JSONL/Parquet field that `field:NAME` names ("" for file and host): the reader keeps its value."""
    return source_key[len("field:"):] if source_key.startswith("field:") else ""
