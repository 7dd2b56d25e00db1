"""Read WARC files with FastWARC, keeping each response's provenance.

A truncated file keeps every record before the cut; the cut record (if FastWARC
yields it) is rejected as `unreadable`, and the cut itself is reported with the
file and offset. A file that is not a WARC raises `KilnError` naming it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from fastwarc.warc import ArchiveIterator, WarcRecordType

from kiln.data.document import Document
from kiln.errors import KilnError


@dataclass
class ReadReport:
    """What a file held besides documents: other record types, and a cut at the end."""

    records_by_type: dict[str, int] = field(default_factory=dict)
    truncated_at: int | None = None


def _member_is_complete(path: Path, offset: int) -> tuple[bool, int]:
    """Decompress the gzip member at `offset`; return (ended cleanly, bytes it spans)."""
    with open(path, "rb") as f:
        f.seek(offset)
        d = zlib.decompressobj(31)
        consumed = 0
        while not d.eof and (chunk := f.read(1 << 16)):
            d.decompress(chunk)
            consumed += len(chunk) - len(d.unused_data)
        return d.eof, consumed


def _record_id(raw: str | None, source: str, offset: int) -> str:
    if raw:
        return raw.strip("<>").removeprefix("urn:uuid:")
    return f"{Path(source).name}@{offset}"


def read_warc(path: str | Path, report: ReadReport) -> Iterator[Document]:
    """Yield one Document per response record, in file order; fill `report` as it goes."""
    path = Path(path)
    source = str(path)
    gzipped = _is_gzip(path)
    pending: Document | None = None  # a record's compressed length is known when the next starts
    last_offset = None
    try:
        with open(path, "rb") as f:
            for rec in ArchiveIterator(f, parse_http=True):
                kind = str(rec.record_type).rsplit(".", 1)[-1]
                report.records_by_type[kind] = report.records_by_type.get(kind, 0) + 1
                if pending is not None:
                    pending.length = rec.stream_pos - pending.offset
                    yield pending
                    pending = None
                last_offset = rec.stream_pos
                if rec.record_type != WarcRecordType.response:
                    continue
                doc = Document(
                    id=_record_id(rec.headers.get("WARC-Record-ID"), source, rec.stream_pos),
                    source=source, offset=rec.stream_pos, length=0,
                    url=rec.headers.get("WARC-Target-URI"), date=rec.headers.get("WARC-Date"),
                )
                try:
                    doc.payload = rec.reader.read()
                    doc.content_type = rec.http_headers.get("Content-Type") if rec.http_headers else None
                except Exception as exc:  # a damaged body must cost one record, not the file
                    doc.reject("read", "unreadable", error=str(exc)[:200])
                else:
                    if not rec.is_http or doc.url is None:
                        doc.reject("read", "unreadable", error="record header or HTTP header missing or cut")
                pending = doc
    except OSError as exc:
        if last_offset is None:
            raise KilnError(f"{path}: not a readable WARC file ({exc}); check the path and format") from None
        report.truncated_at = last_offset  # damage after the last good record
    if pending is not None:
        pending.length = path.stat().st_size - pending.offset
    if gzipped and last_offset is not None and report.truncated_at is None:
        complete, span = _member_is_complete(path, last_offset)
        if not complete:
            report.truncated_at = last_offset
            if pending is not None and pending.offset == last_offset and pending.rejection is None:
                pending.reject("read", "unreadable", error=f"truncated gzip member at offset {last_offset}")
        elif last_offset + span < path.stat().st_size:
            report.truncated_at = last_offset + span  # a cut member FastWARC could not even start
    if last_offset is None and path.stat().st_size > 0:
        raise KilnError(f"{path}: holds no WARC records; is it a WARC file?")
    if pending is not None:
        yield pending


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"
