"""Read WARC files with FastWARC, keeping each response's provenance.

A truncated file keeps every record before the cut; the cut record (if FastWARC
yields it) is rejected as `unreadable`, and the cut itself is reported with the
file and offset. A file that is not a WARC raises `KilnError` naming it.

A gzipped WARC with one member per record (the norm: it is what makes Common
Crawl's range requests work) can be read in byte ranges: a range owns the
records whose gzip member starts inside it, so ranges that tile the file read
every record exactly once, and several workers can share one large file.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import IO, Any, Iterator

from fastwarc.warc import ArchiveIterator, WarcRecordType

from kiln.data.document import Document, ReadReport
from kiln.data.sources import StorageWatch, input_size, open_input
from kiln.errors import KilnError

__all__ = ["ReadReport", "read_warc", "splittable", "find_member"]

_GZIP_MAGIC = b"\x1f\x8b\x08"


def _member_is_complete(f: IO[bytes], offset: int) -> tuple[bool, int]:
    """Decompress the gzip member at `offset`; return (ended cleanly, bytes it spans)."""
    f.seek(offset)
    d = zlib.decompressobj(31)
    consumed = 0
    while not d.eof and (chunk := f.read(1 << 16)):
        d.decompress(chunk)
        consumed += len(chunk) - len(d.unused_data)
    return d.eof, consumed


def _starts_warc_member(f: IO[bytes], offset: int) -> bool:
    """Does a gzip member that decompresses to a WARC header start at `offset`?"""
    f.seek(offset)
    try:
        return zlib.decompressobj(31).decompress(f.read(1 << 14), 8).startswith(b"WARC/")
    except zlib.error:
        return False


def find_member(f: IO[bytes], start: int, end: int) -> int | None:
    """Offset of the first WARC gzip member in [start, end), or None.

    The gzip magic can occur inside compressed data by chance; a candidate counts only
    when it inflates to a WARC header, which chance bytes do not.
    """
    pos = start
    while pos < end:
        f.seek(pos)
        block = f.read(min(1 << 20, end - pos) + len(_GZIP_MAGIC) - 1)
        if not block:
            return None
        at = block.find(_GZIP_MAGIC)
        while at != -1 and pos + at < end:
            if _starts_warc_member(f, pos + at):
                return pos + at
            at = block.find(_GZIP_MAGIC, at + 1)
        pos += max(len(block) - len(_GZIP_MAGIC) + 1, 1)
    return None


def splittable(source: str, storage_options: dict[str, Any] | None = None) -> bool:
    """A gzipped WARC whose first record is its own member (so members mark record starts)."""
    with open_input(source, storage_options) as f:
        if f.read(3) != _GZIP_MAGIC:
            return False
        complete, span = _member_is_complete(f, 0)
        return complete and span < input_size(source, storage_options) and _starts_warc_member(f, span)


def _record_id(raw: str | None, source: str, offset: int) -> str:
    if raw:
        return raw.strip("<>").removeprefix("urn:uuid:")
    return f"{Path(source).name}@{offset}"


def read_warc(source: str | Path, report: ReadReport, start: int = 0, end: int | None = None,
              storage_options: dict[str, Any] | None = None) -> Iterator[Document]:
    """Yield one Document per response record whose member starts in [start, end), in file order."""
    source = str(source)
    size = input_size(source, storage_options)
    last_range = end is None or end >= size
    with open_input(source, storage_options) as f:
        gzipped = f.read(2) == b"\x1f\x8b"
        first = start if start == 0 else find_member(f, start, min(end or size, size))
        if first is None:
            return
        f.seek(first)
        yield from _read_records(f, source, report, size, end, gzipped and last_range)


def _read_records(f: IO[bytes], source: str, report: ReadReport, size: int, end: int | None, check_tail: bool) -> Iterator[Document]:
    pending: Document | None = None  # a record's compressed length is known when the next starts
    last_offset = None
    watch = StorageWatch(f)
    try:
        for rec in ArchiveIterator(watch, parse_http=True):
            if end is not None and rec.stream_pos >= end:
                if pending is not None:
                    pending.length = rec.stream_pos - pending.offset
                    yield pending
                return  # the next range owns this record
            report.count(str(rec.record_type).rsplit(".", 1)[-1])
            if pending is not None:
                pending.length = rec.stream_pos - pending.offset
                yield pending
                pending = None
            last_offset = rec.stream_pos
            if rec.record_type != WarcRecordType.response:
                continue
            pending = _response(rec, source)
    except OSError as exc:
        if watch.error is not None:
            raise watch.error from None
        if last_offset is None:
            raise KilnError(f"{source}: not a readable WARC file ({exc}); check the path and format") from None
        report.truncated_at = last_offset  # damage after the last good record
    if pending is not None:
        pending.length = size - pending.offset
    if check_tail and last_offset is not None and report.truncated_at is None:
        complete, span = _member_is_complete(f, last_offset)
        if not complete:
            report.truncated_at = last_offset
            if pending is not None and pending.offset == last_offset and pending.rejection is None:
                pending.reject("read", "unreadable", error=f"truncated gzip member at offset {last_offset}")
        elif last_offset + span < size:
            report.truncated_at = last_offset + span  # a cut member FastWARC could not even start
    if last_offset is None and size > 0:
        raise KilnError(f"{source}: holds no WARC records; is it a WARC file?")
    if pending is not None:
        yield pending


def _response(rec, source: str) -> Document:
    raw_id = rec.headers.get("WARC-Record-ID")
    doc = Document(
        id=_record_id(raw_id, source, rec.stream_pos), source=source, offset=rec.stream_pos, length=0,
        url=rec.headers.get("WARC-Target-URI"), date=rec.headers.get("WARC-Date"), record_id=raw_id,
    )
    try:
        doc.payload = rec.reader.read()
        doc.content_type = rec.http_headers.get("Content-Type") if rec.http_headers else None
    except Exception as exc:  # a damaged body must cost one record, not the file
        doc.reject("read", "unreadable", error=str(exc)[:200])
    else:
        if not rec.is_http or doc.url is None:
            doc.reject("read", "unreadable", error="record header or HTTP header missing or cut")
    return doc
