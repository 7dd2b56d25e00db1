"""Where input records come from: local paths or any fsspec URL, in three formats.

- WARC (`.warc`, `.warc.gz`, and anything not named below): `kiln.data.read`.
- JSONL (`.jsonl`, `.ndjson`, `.json`, each optionally `.gz` or `.zst`): one JSON object a
  line; the text, id and URL come from `data.text_field`, `data.id_field`, `data.url_field`.
- Parquet (`.parquet`): the same three columns.

Provenance for JSONL is the line's byte offset and length in the decompressed stream;
for Parquet, the row index (length 1). A line that is not JSON, or has no string in
the text field, is a `read/invalid_json` or `read/missing_text` rejection: the rest of
the file goes on.
"""

from __future__ import annotations

import glob
import json
import os
import re
import zlib
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import zstandard

from kiln.data.document import Document, ReadReport
from kiln.errors import KilnError

_JSONL = (".jsonl", ".ndjson", ".json")


def is_url(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def _filesystem(source: str, storage_options: dict[str, Any]):
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source, **storage_options)
    except (ImportError, ValueError) as exc:  # s3:// without s3fs installed; a scheme fsspec does not know
        raise KilnError(f"{source}: no filesystem for this URL ({exc}); check the scheme, or install the extra, "
                        f"e.g. pip install 'kiln-lm[s3]'") from None
    return fs, path


def open_input(source: str, storage_options: dict[str, Any] | None = None) -> IO[bytes]:
    """A seekable binary file object for a local path or an fsspec URL."""
    if not is_url(source):
        return open(source.removeprefix("file://"), "rb")
    fs, path = _filesystem(source, storage_options or {})
    try:
        return fs.open(path, "rb")
    except FileNotFoundError:
        raise KilnError(f"{source}: no such object; check the URL and data.storage_options") from None


class StorageReadError(OSError):
    """A read from the storage failed with an error that is not an OSError (aiohttp's, from fsspec's HTTP)."""


class StorageWatch:
    """A file that remembers an error of its own reads. FastWARC raises OSError, and pyarrow an error of its
    own, both for damage in the data and for the storage failing under them; only damage is a cut that
    keeps what came before. A failed read is re-raised as an OSError, and the task is read again
    (pipeline.run_task)."""

    closed = False  # pyarrow asks

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.error = f, None

    def read(self, n: int = -1) -> bytes:
        try:
            return self.f.read(n)
        except OSError as exc:
            self.error = exc
            raise
        except Exception as exc:
            self.error = StorageReadError(f"{type(exc).__name__}: {exc}")
            raise self.error from exc

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()


def input_size(source: str, storage_options: dict[str, Any] | None = None) -> int:
    if not is_url(source):
        return os.path.getsize(source.removeprefix("file://"))
    fs, path = _filesystem(source, storage_options or {})
    return int(fs.size(path))


def input_identity(source: str, storage_options: dict[str, Any] | None = None) -> tuple[str, int, str]:
    """(source, size, version): what a resumed run checks to know the input did not change."""
    if not is_url(source):
        st = os.stat(source.removeprefix("file://"))
        return (source, st.st_size, str(st.st_mtime_ns))
    fs, path = _filesystem(source, storage_options or {})
    info = fs.info(path)
    version = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
    return (source, int(info["size"]), str(version))


def expand_inputs(patterns: list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """Paths, globs and URLs (globs work in URLs too) -> input files, each glob sorted."""
    files: list[str] = []
    for pattern in patterns:
        if is_url(pattern):
            fs, path = _filesystem(pattern, storage_options or {})
            protocol = pattern.split("://", 1)[0]
            try:
                matches = sorted(fs.glob(path)) if glob.has_magic(path) else ([path] if fs.isfile(path) else [])
            except (OSError, PermissionError) as exc:
                raise KilnError(
                    f"input {pattern}: cannot list it ({exc}); check the URL and data.storage_options"
                ) from None
            if not matches:
                raise KilnError(
                    f"input {pattern!r} matches no object; "
                    "check the URL (and data.storage_options for credentials/endpoint)"
                )
            files += [f"{protocol}://{m}" for m in matches]
            continue
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise KilnError(f"input {pattern!r} matches no file; check the path or glob")
        for m in matches:
            local = Path(m.removeprefix("file://"))
            if local.is_dir():
                raise KilnError(f"input {m} is a folder; give its files or a glob, e.g. "
                                f"'{(local / '*.warc.gz').as_posix()}' or '{(local / '*.jsonl').as_posix()}'")
            if not local.is_file():
                raise KilnError(f"input {m} does not exist or is not a file")
            files.append(m)
    if not files:
        raise KilnError("no input files given; pass WARC/JSONL/Parquet files or set data.inputs in the config")
    seen: dict[str, str] = {}
    for f in files:
        key = f if is_url(f) else str(Path(f.removeprefix("file://")).resolve())
        if key in seen:
            how = f"as {seen[key]!r} and {f!r}" if seen[key] != f else f"{f!r} twice"
            raise KilnError(f"input {f} is given twice ({how}, from the paths or globs given); list each input once")
        seen[key] = f
    return files


def input_format(source: str) -> str:
    name = source.lower().removesuffix(".gz").removesuffix(".zst")
    if name.endswith(_JSONL):
        return "jsonl"
    if source.lower().endswith(".parquet"):
        return "parquet"
    return "warc"


# --- JSONL ----------------------------------------------------------------------------------

def _chunks(raw: IO[bytes], source: str, size: int = 1 << 16) -> Iterator[bytes]:
    """The decompressed stream in pieces, every byte out before a cut is noticed (then EOFError).

    Decompressor objects rather than GzipFile: GzipFile drops the data of the read that hits a cut.
    Concatenated members (gzip) and frames (zstd) are read one after another.
    """
    name = source.lower()
    if name.endswith(".gz"):
        new = lambda: zlib.decompressobj(31)  # noqa: E731
    elif name.endswith(".zst"):
        new = zstandard.ZstdDecompressor().decompressobj
    else:
        while block := raw.read(size):
            yield block
        return
    d, pending = new(), False
    while block := raw.read(size):
        while block:
            yield d.decompress(block)
            pending = not d.eof
            block = d.unused_data if d.eof else b""
            if d.eof:
                d = new()
    if pending:
        raise EOFError("compressed stream ends inside a member")


def _lines(raw: IO[bytes], source: str, max_bytes: int | None = None) -> Iterator[tuple[bytes | None, int]]:
    """Each line of the (decompressed) file, with its newline, and its length: `split_lines` of `_chunks`."""
    return split_lines(_chunks(raw, source), max_bytes)


def split_lines(chunks: Iterable[bytes], max_bytes: int | None = None) -> Iterator[tuple[bytes | None, int]]:
    """Each line (with its newline) of a stream given in pieces, and its length, in time linear in the input.
    A line longer than `max_bytes` comes as (None, length) and is never held whole: memory stays under
    max_bytes + a piece."""
    carry: list[bytes] = []  # the pieces of a line that spans chunks
    held, over = 0, False

    def line(last: bytes) -> tuple[bytes | None, int]:
        length = held + len(last)
        if over or (max_bytes is not None and length > max_bytes):
            return None, length
        return (b"".join(carry) + last if carry else last), length

    for chunk in chunks:
        pieces = chunk.split(b"\n")
        if len(pieces) > 1:
            yield line(pieces[0] + b"\n")
            for piece in pieces[1:-1]:
                too_long = max_bytes is not None and len(piece) >= max_bytes
                yield (None, len(piece) + 1) if too_long else (piece + b"\n", len(piece) + 1)
            carry, held, over = [], 0, False
        tail = pieces[-1]
        held += len(tail)
        if not over and tail:
            carry.append(tail)
            over = max_bytes is not None and held > max_bytes
            if over:
                carry = []
    if held:
        yield line(b"")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
    """`text` with lone surrogates (JSON allows `"\\ud800"`; no UTF-8 encoder, tokenizer or fastText takes them)
    replaced by U+FFFD, as invalid UTF-8 bytes are when a page is decoded. ASCII (most text) costs one C scan."""
    if text.isascii():
        return text
    return _SURROGATE.sub("\ufffd", text)


def _field(rec: dict[str, Any], name: str) -> str | None:
    value = rec.get(name)
    return None if value is None or value == "" else _valid_unicode(str(value))


def _record_doc(rec: Any, source: str, offset: int, length: int, where: str, fields: tuple[str, ...]) -> Document:
    """A JSONL line or Parquet row -> a Document (rejected when it has no text)."""
    text_field, id_field, url_field, group_field = (*fields, "")[:4]
    doc = Document(
        id=f"{Path(source).name}:{where}", source=source, offset=offset, length=length, content_type="text/plain"
    )
    if not isinstance(rec, dict):
        return doc.reject("read", "invalid_json", error=f"a JSON {type(rec).__name__}, not an object")
    raw_id = _field(rec, id_field)
    doc.id, doc.record_id, doc.url = raw_id or doc.id, raw_id, _field(rec, url_field)
    if group_field:  # data.distribution.source_key field:NAME; a record without it is its own source
        doc.source_group = _field(rec, group_field) or f"(no {group_field})"
    text = rec.get(text_field)
    if not isinstance(text, str):
        return doc.reject(
            "read", "missing_text", field=text_field, found=type(text).__name__ if text_field in rec else "absent"
        )
    doc.text = _valid_unicode(text)
    return doc


_MAGIC = {".gz": (b"\x1f\x8b", "gzip"), ".zst": (b"\x28\xb5\x2f\xfd", "zstd")}


def _check_compression(source: str, head: bytes) -> None:
    """A JSONL file whose first bytes say another compression than its name: a file error naming both, not a
    file read as nothing (a .gz that is plain text) or as lines of binary (a gzip file named .jsonl)."""
    named = next((s for s in _MAGIC if source.lower().endswith(s)), "")
    found = next((s for s, (magic, _) in _MAGIC.items() if head.startswith(magic)), "")
    if head[1:4] == b"\x2a\x4d\x18" and head[:1] and head[0] & 0xF0 == 0x50:  # a zstd skippable frame first
        found = ".zst"
    if named == found:
        return
    name = Path(source).name
    said = f"named {named}" if named else "not named .gz or .zst"
    what = f"{_MAGIC[found][1]} data" if found else f"not {_MAGIC[named][1]} data (it starts with {head!r})"
    raise KilnError(f"{source}: {said} but is {what}; rename it {name[:len(name) - len(named)]}{found} "
                    "(Kiln picks the decompression by the name)")


def read_jsonl(
    source: str,
    report: ReadReport,
    fields: tuple[str, ...],
    storage_options: dict[str, Any] | None = None,
    max_record_bytes: int | None = None,
    start: int = 0,
    end: int | None = None,
    lines_before: int = 0,
) -> Iterator[Document]:
    """A JSONL file's records; with `start`/`end` (a plain file's byte range, kiln.data.plan), the lines that
    start in [start, end), numbered after the `lines_before` newlines of the file before `start`."""
    if input_size(source, storage_options) == 0:
        raise KilnError(f"{source}: empty file (0 bytes), nothing to read; remove it from the inputs")
    with open_input(source, storage_options) as f:
        if start == 0:
            _check_compression(source, f.read(4))
            offset = 0
        else:
            offset, skipped = _next_line_start(f, start)
            lines_before += skipped
        f.seek(offset)
        yield from jsonl_records(_chunks(StorageWatch(f), source), source, report, fields, max_record_bytes,
                                 offset, lines_before, end)


def _next_line_start(f: IO[bytes], start: int) -> tuple[int, int]:
    """(where the first line starting at or after `start` begins, 1 when a newline at or after `start` was
    passed to get there, else 0). Reads from start - 1 to that newline, a block at a time."""
    pos = start - 1
    f.seek(pos)
    first = True
    while block := f.read(1 << 20):
        at = block.find(b"\n")
        if at != -1:
            return pos + at + 1, int(not (first and at == 0))
        pos += len(block)
        first = False
    return pos, 0


def jsonl_records(chunks: Iterable[bytes], source: str, report: ReadReport, fields: tuple[str, ...],
                  max_record_bytes: int | None, offset: int = 0, lines_before: int = 0,
                  end: int | None = None) -> Iterator[Document]:
    """Documents of the JSONL lines in `chunks` (the decompressed stream from byte `offset` of the file, at a line
    start, `lines_before` lines into it), up to the first line that starts at or after `end`. A cut or damaged
    .gz/.zst keeps every line before it and says where (`report.truncated_at`)."""
    try:
        for number, (line, length) in enumerate(split_lines(chunks, max_record_bytes), lines_before + 1):
            start = offset
            if end is not None and start >= end:
                return  # the next range owns this line
            offset += length
            if line is None:
                yield Document(
                    id=f"{Path(source).name}:{number}", source=source, offset=start, length=length
                ).reject("read", "too_large", line=number, bytes=length, limit=max_record_bytes)
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as exc:  # also invalid UTF-8, and nesting deeper than Python's
                # stack (a line of 100,000 "[": one bad record, not the end of the run)
                yield Document(
                    id=f"{Path(source).name}:{number}", source=source, offset=start, length=length
                ).reject("read", "invalid_json", line=number, error=str(exc)[:200])
                continue
            yield _record_doc(rec, source, start, length, str(number), fields)
    except (EOFError, zlib.error, zstandard.ZstdError):  # a cut or damaged .gz/.zst: keep every line
        report.truncated_at = offset  # before it, say where. (An OSError is the storage failing, not the
        # data: it propagates, and the task is read again; see pipeline.run_task.)


# --- Parquet --------------------------------------------------------------------------------

def read_parquet(
    source: str,
    report: ReadReport,
    fields: tuple[str, ...],
    storage_options: dict[str, Any] | None = None,
    max_record_bytes: int | None = None,
    row_groups: range | None = None,
    rows_before: int = 0,
) -> Iterator[Document]:
    """Rows as Documents; a row whose text is over `max_record_bytes` (UTF-8) is a `read/too_large` rejection.
    `row_groups`: only those (kiln.data.plan), whose first row is row `rows_before` of the file."""
    import pyarrow.parquet as pq

    with open_input(source, storage_options) as f:
        raw = StorageWatch(f)
        try:
            pf = pq.ParquetFile(raw)
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends
            if raw.error is not None:
                raise raw.error from None
            raise KilnError(f"{source}: not a readable Parquet file ({exc})") from None
        names = pf.schema_arrow.names
        if fields[0] not in names:
            raise KilnError(f"{source}: no column {fields[0]!r} (data.text_field); columns are {names}")
        columns = [c for c in dict.fromkeys(fields) if c and c in names]
        row = rows_before
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=columns,
                                         row_groups=None if row_groups is None else list(row_groups)):
                for rec, size in zip(batch.to_pylist(), _text_bytes(batch, fields[0])):
                    if max_record_bytes is not None and size > max_record_bytes:
                        yield Document(id=f"{Path(source).name}:row{row}", source=source, offset=row, length=1).reject(
                            "read", "too_large", row=row, bytes=size, limit=max_record_bytes)
                    else:
                        yield _record_doc(rec, source, row, 1, f"row{row}", fields)
                    row += 1
        except Exception:  # a damaged row group (ArrowInvalid, OSError): keep the rows before it, say where
            if raw.error is not None:
                raise raw.error from None
            report.truncated_at = row


def _text_bytes(batch, column: str) -> list[int]:
    """Each row's text size in UTF-8 bytes, from Arrow's offsets (0 for a null or a non-string column)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = batch.column(column)
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
        return [0] * len(text)
    return pc.binary_length(text).fill_null(0).to_pylist()
