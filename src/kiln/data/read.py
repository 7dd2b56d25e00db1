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

import re
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
        return complete and span < input_size(source, storage_options) and _starts_warc_member(f, span) \
            and _one_record_per_member(f)


def _record_id(raw: str | None, source: str, offset: int) -> str:
    if raw:
        return raw.strip("<>").removeprefix("urn:uuid:")
    return f"{Path(source).name}@{offset}"


def read_warc(source: str | Path, report: ReadReport, start: int = 0, end: int | None = None,
              storage_options: dict[str, Any] | None = None) -> Iterator[Document]:
    """Yield one Document per response record whose member starts in [start, end), in file order.

    A gzipped WARC whose first member holds more than one record (gzipped as one member, for one) has no
    member per record: it is read whole as one decompressed stream, and `offset`/`length` are then the
    record's bytes in the decompressed stream (as for JSONL .gz).
    """
    source = str(source)
    size = input_size(source, storage_options)
    if size == 0:
        raise KilnError(f"{source}: empty file (0 bytes), nothing to read; remove it from the inputs")
    with open_input(source, storage_options) as raw:
        f = StorageWatch(raw)  # every read, the probes' too: a failing storage is retried, never a cut
        gzipped = f.read(2) == b"\x1f\x8b"
        if gzipped and start == 0 and end is None and not _one_record_per_member(f):
            yield from _read_stream(f, source, report)
            return
        first = start if start == 0 else find_member(f, start, min(end or size, size))
        if first is None:
            return
        yield from _read_members(f, source, report, size, first, end, gzipped)


def _one_record_per_member(f: IO[bytes]) -> bool:
    """Does the first gzip member end with its first WARC record? (Reads no more than that record.)"""
    f.seek(0)
    d, out, need = zlib.decompressobj(31), bytearray(), None
    try:
        while not d.eof and (need is None or len(out) <= need + 4):
            chunk = d.unconsumed_tail or f.read(1 << 16)
            if not chunk:
                return True  # cut inside the first record: read by members, which reports the cut
            out += d.decompress(chunk, 1 << 20)
            if need is None and (head := out.find(b"\r\n\r\n")) != -1:
                length = re.search(rb"(?im)^content-length:[ \t]*(\d+)", bytes(out[:head]))
                if not out.startswith(b"WARC/") or length is None:
                    return True  # not a WARC header: the member reader says so
                need = head + 4 + int(length.group(1))
    except zlib.error:
        return True
    return need is None or len(out) <= need + 4  # the record and its closing CRLF CRLF, nothing after


class _Inflating:
    """A gzip file (one member or many) read as its decompressed bytes, for FastWARC: a cut or damaged
    stream ends the data there and says so in `problem`. Memory: one 1 MiB output window."""

    closed = False

    def __init__(self, raw) -> None:
        self.raw, self.d, self.buf, self.pos = raw, zlib.decompressobj(31), b"", 0
        self.problem: str | None = None
        self.ended = False

    def _fill(self, n: int) -> None:
        while len(self.buf) < n and not self.ended:
            if self.d.unconsumed_tail:
                data = self.d.unconsumed_tail
            elif self.d.eof and self.d.unused_data:
                data, self.d = self.d.unused_data, zlib.decompressobj(31)  # the next member
            else:
                data = self.raw.read(1 << 16)
                if not data:
                    self.ended = True
                    if not self.d.eof:
                        self.problem = f"gzip stream cut after {self.pos + len(self.buf)} decompressed bytes"
                    return
                if self.d.eof:
                    self.d = zlib.decompressobj(31)
            try:
                self.buf += self.d.decompress(data, 1 << 20)
            except zlib.error as exc:
                self.ended = True
                self.problem = f"gzip data damaged after {self.pos + len(self.buf)} decompressed bytes ({exc})"

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            out = bytearray()
            while block := self.read(1 << 20):
                out += block
            return bytes(out)
        self._fill(n)
        out, self.buf = self.buf[:n], self.buf[n:]
        self.pos += len(out)
        return out

    def tell(self) -> int:
        return self.pos


def _read_stream(f: IO[bytes], source: str, report: ReadReport) -> Iterator[Document]:
    """A gzipped WARC without a member per record, as one decompressed stream (offsets into it)."""
    watch = StorageWatch(f)
    f.seek(0)
    plain = _Inflating(watch)
    pending: Document | None = None
    last_offset = None
    try:
        for rec in ArchiveIterator(plain, parse_http=True):
            report.count(str(rec.record_type).rsplit(".", 1)[-1])
            if pending is not None:
                pending.length = rec.stream_pos - pending.offset
                yield pending
                pending = None
            last_offset = rec.stream_pos
            if rec.record_type == WarcRecordType.response:
                pending = _response(rec, source)
    except OSError as exc:
        if watch.error is not None:
            raise watch.error from None
        plain.problem = plain.problem or str(exc)
    if last_offset is None:
        raise _not_a_warc(source, plain.problem)
    if plain.problem:
        report.truncated_at = last_offset  # the record it cut may be short: never kept
        if pending is not None and pending.offset == last_offset and pending.rejection is None:
            pending.reject("read", "unreadable", error=plain.problem)
    if pending is not None:
        pending.length = plain.pos - pending.offset
        yield pending


def _read_members(f: IO[bytes], source: str, report: ReadReport, size: int, pos: int, end: int | None,
                  gzipped: bool) -> Iterator[Document]:
    """Records from `pos` on, a gzip member each; damage resynchronises at the next member that inflates to a
    WARC record, the damaged bytes between being one `read/unreadable` rejection with their byte range.

    A range [start, end) owns the records whose member starts in it, and the damage that starts in it.
    """
    limit = size if end is None else min(end, size)
    watch = StorageWatch(f)
    started = False  # read any record at all
    while True:
        f.seek(pos)
        pending: Document | None = None  # a record's compressed length is known when the next starts
        last_offset = error = None
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
                last_offset, started = rec.stream_pos, True
                if rec.record_type == WarcRecordType.response:
                    pending = _response(rec, source)
        except OSError as exc:
            if watch.error is not None:
                raise watch.error from None
            error = exc
        if not gzipped:  # a plain WARC has no members to resynchronise at: damage ends it
            if not started:
                raise _not_a_warc(source, error)
            if error is not None:
                report.truncated_at = last_offset
            if pending is not None:
                pending.length = size - pending.offset
                yield pending
            return
        # Where the good data ends: after the last record's member, or at it when that member is cut or damaged.
        damage = pos
        if last_offset is not None:
            complete, span = _member_is_complete(f, last_offset)
            damage = last_offset + span if complete else last_offset
        if damage >= size or (damage >= limit and find_member(f, damage, size) == damage):
            if pending is not None:  # a clean end of the file, or of the range (the next one starts at `damage`)
                pending.length = damage - pending.offset
                yield pending
            if not started:
                raise KilnError(f"{source}: holds no WARC records; is it a WARC file?")
            return
        resume = find_member(f, damage + 1, size)
        stop = size if resume is None else resume
        if pending is not None:
            own = pending.offset == damage  # the record's own member is the damaged one
            pending.length = (stop if own else damage) - pending.offset
            if own and pending.rejection is None:
                pending.reject("read", "unreadable", error=f"damaged or cut gzip member at offset {damage}")
            yield pending
            if own:
                damage = stop
        if resume is None:
            if not started:
                raise _not_a_warc(source, error)
            report.truncated_at = last_offset if damage == stop and last_offset is not None else damage
            return
        if damage < stop:
            span = Document(id=f"{Path(source).name}@{damage}", source=source, offset=damage, length=stop - damage)
            yield span.reject("read", "unreadable", bytes=[damage, stop],
                              error=f"damaged gzip data ({error or 'not a WARC record'}); resumed at the next record")
        if resume >= limit:
            return
        pos = resume


def _not_a_warc(source: str, problem: object) -> KilnError:
    name = source.lower().removesuffix(".gz")
    hint = "" if name.endswith((".warc", ".arc")) else (
        " (a file not named .jsonl/.ndjson/.json[.gz|.zst] or .parquet is read as WARC: name it by its format)")
    return KilnError(f"{source}: not a readable WARC file ({problem or 'no WARC records'}); check the path and "
                     f"format{hint}")


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
