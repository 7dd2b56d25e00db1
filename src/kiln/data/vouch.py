"""The work folder's one rule: a file counts only when a record written after it vouches for it.

A data task's files are vouched for by its `task-NNNNN.done.json` marker, a dedup stage's results by the
lines of their plan's `results.jsonl`: each holds the file's size and xxh3-128 (`record`, made from the
bytes as they are written). On resume, a file that is missing, cut or changed (`matches` is False) is
redone, never read: the same command resumes onto its own work, or does it again.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import IO, Any

import xxhash

CHUNK = 1 << 20


def record(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "xxh3": xxhash.xxh3_128_hexdigest(data)}


class HashingReader(io.RawIOBase):
    """A read-only binary file that feeds what is read through it to `hasher` (hashlib's or xxhash's), so a
    reader checks a file's hash from the one pass that parses it. `finish()` reads the rest (bytes after a
    compressed frame count too) and returns the hex digest."""

    def __init__(self, f: IO[bytes], hasher: Any) -> None:
        self.f, self.hash = f, hasher

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        data = self.f.read(len(buf))
        self.hash.update(data)
        buf[: len(data)] = data
        return len(data)

    def finish(self) -> str:
        while block := self.f.read(CHUNK):
            self.hash.update(block)
        return self.hash.hexdigest()


class Recording:
    """A binary file being written whose record is taken from the bytes as they pass (no second read)."""

    def __init__(self, f) -> None:
        self.f, self.size, self.hash = f, 0, xxhash.xxh3_128()

    def write(self, data: bytes) -> int:
        self.f.write(data)
        self.hash.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()

    def record(self) -> dict[str, Any]:
        return {"size": self.size, "xxh3": self.hash.hexdigest()}


def matches(path: Path, rec: Any) -> bool:
    """`path` is there with the size and hash of `rec` (memory: one chunk)."""
    try:
        if not isinstance(rec, dict) or path.stat().st_size != rec.get("size"):
            return False
        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
    except OSError:
        return False
    return h.hexdigest() == rec.get("xxh3")
