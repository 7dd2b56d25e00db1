"""The docs/ format: part-NNNNN.jsonl.zst files of JSON records (kept documents; rejects/ and review/ too),
written by `PartWriter`, read back by `read_part`, and a committed docs folder read by `read_docs`, verified
against its manifest without a second pass. The pipeline writes it; the tokenizer, pack, explain and the
report read it, through this module only.

Iterating `DocsReader(folder)` first checks that every part the manifest lists is there with its size (a
deleted or cut part stops here, before the first document is handed out); while the documents stream, each part's
bytes are hashed, and a part whose sha256 differs from the manifest raises `IntegrityError` when its
last record has been read, before the caller commits anything. Memory: one decompression window.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import zstandard

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import MANIFEST, read_manifest, sha256_file
from kiln.data.tables import check_table_names
from kiln.data.vouch import HashingReader

PART = re.compile(r"^part-\d+\.jsonl\.zst$")


class DocsReader:
    """The kept documents of a docs folder, in order; iterable more than once. `folder` is kept for callers
    that must not write over their input (`kiln.manifest.check_replaceable`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def parts(self) -> tuple[dict[str, Any], list[str]]:
        """The manifest and its part names, after checking each part is there with its size."""
        if not (self.folder / MANIFEST).is_file():
            hint = "" if self.folder.is_dir() else " (no such folder)"
            raise KilnError(f"{self.folder}: no docs folder committed by `kiln data` here{hint} (no part-*.jsonl.zst "
                            f"with a {MANIFEST}); run `kiln data` first")
        manifest = read_manifest(self.folder)
        check_table_names(self.folder, manifest)
        parts = sorted(name for name in manifest["files"] if PART.match(name))
        if not parts:
            raise KilnError(f"{self.folder}: no part-*.jsonl.zst files; run `kiln data` first")
        for name in parts:
            path, size = self.folder / name, manifest["files"][name]["size"]
            if not path.is_file():
                raise IntegrityError(f"{path}: listed in {MANIFEST} but missing; the docs folder is incomplete, "
                                     f"run `kiln data` again")
            if path.stat().st_size != size:
                raise IntegrityError(f"{path}: {path.stat().st_size} bytes, {MANIFEST} says {size}; the docs folder "
                                     f"changed after `kiln data` wrote it, run `kiln data` again")
        return manifest, parts

    def __iter__(self) -> Iterator[dict[str, Any]]:
        manifest, parts = self.parts()
        for name in parts:
            yield from self.part(name, manifest["files"][name]["sha256"])

    def part(self, name: str, sha256: str) -> Iterator[dict[str, Any]]:
        """One part's records (a pack task reads its own parts), its sha256 checked when the last is read."""
        path = self.folder / name
        with open(path, "rb") as f:
            raw = HashingReader(f, hashlib.sha256())
            reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=False)
            try:
                for line in io.TextIOWrapper(reader, encoding="utf-8"):
                    if line.strip():
                        yield json.loads(line)
            except (zstandard.ZstdError, ValueError) as exc:  # ValueError: bad JSON or UTF-8
                raise IntegrityError(f"{path}: cannot be read ({str(exc)[:120]}); the docs folder changed after "
                                     f"`kiln data` wrote it, run `kiln data` again") from None
            digest = raw.finish()
        if digest != sha256:
            raise IntegrityError(f"{path}: sha256 {digest[:16]}… != {MANIFEST}; the docs folder changed after "
                                 f"`kiln data` wrote it, run `kiln data` again")


# stats.json's fields that tell how a run went, not what it made (seconds, worker pids, tasks reused): no
# fingerprint covers them, so the same documents written again are the same docs folder to the later stages.
RUN_FIELDS = ("timings_s", "tasks", "tasks_resumed", "dedup_tasks")


def content_fingerprint(folder: Path) -> str:
    """sha256 of what a committed docs folder holds, what the tokenizer's and the shards' fingerprints depend on:
    its manifest (every part, reject, ledger and table by sha256, the counts) with stats.json's hash replaced
    by stats.json itself without RUN_FIELDS."""
    manifest, path = read_manifest(folder), Path(folder) / "stats.json"
    listed = manifest["files"].get("stats.json")
    if listed is None or not path.is_file() or sha256_file(path) != listed["sha256"]:
        raise IntegrityError(f"{path}: not the stats.json {MANIFEST} lists; the docs folder changed after "
                             f"`kiln data` wrote it, run `kiln data` again")
    stats = {k: v for k, v in json.loads(path.read_text()).items() if k not in RUN_FIELDS}
    view = {**manifest, "files": {**manifest["files"], "stats.json": stats}}
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()


def read_docs(folder: Path) -> Iterable[dict[str, Any]]:
    """Kept documents of a docs folder, in order, verified against its manifest (`DocsReader`)."""
    return DocsReader(folder)


def read_part(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one zstd-compressed JSONL file (a docs part, a rejects part, a task's outcomes), streamed."""
    with open(path, "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            if line.strip():
                yield json.loads(line)


class PartWriter:
    """Writes records as part-NNNNN.jsonl.zst files of at most `per_part` records each, streamed through the
    compressor (memory: one record and a compression window, whatever `per_part`). The folder is a staging
    folder the caller commits whole; a folder with no record gets one empty part."""

    def __init__(self, folder: Path, per_part: int) -> None:
        self.folder, self.per_part = folder, per_part
        self.folder.mkdir(parents=True, exist_ok=True)
        self.parts, self.in_part = 0, 0
        self._file: IO[bytes] | None = None
        self._writer: Any = None

    def add(self, rec: dict[str, Any]) -> None:
        if self._writer is None:
            self._open()
        self._writer.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
        self.in_part += 1
        if self.in_part >= self.per_part:
            self.flush()

    def flush(self) -> None:
        """End the part being written (or write the one empty part of an empty folder)."""
        if self._writer is None and self.parts == 0:
            self._open()
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            self._writer = self._file = None
            self.parts, self.in_part = self.parts + 1, 0

    def _open(self) -> None:
        self._file = open(self.folder / f"part-{self.parts:05d}.jsonl.zst", "wb")
        self._writer = zstandard.ZstdCompressor(level=3).stream_writer(self._file, closefd=False)
