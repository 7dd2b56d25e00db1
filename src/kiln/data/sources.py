"""Where input records come from: local paths or any fsspec URL, in three formats.

- WARC (`.warc`, `.warc.gz`, and anything not named below): `kiln.data.read`.
- JSONL (`.jsonl`, `.ndjson`, `.json`, each optionally `.gz` or `.zst`): one JSON object a
  line; the text, id and URL come from `data.text_field`, `data.id_field`, `data.url_field`.
- Parquet (`.parquet`): the same three columns.
- Arrow IPC (`.arrow`, as `datasets.save_to_disk` writes): the same columns, one record batch at a time.
  A folder written by `datasets.save_to_disk` or downloaded from the Hub expands to its files (`kiln.data.hub`).

Provenance for JSONL is the line's byte offset and length in the decompressed stream;
for Parquet, the row index (length 1). A line that is not JSON, or has no string in
the text field, is a `read/invalid_json` or `read/missing_text` rejection: the rest of
the file goes on.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import zlib
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import zstandard

from kiln.data.document import Document, ReadReport, missing_group
from kiln import storage
from kiln.errors import KilnError
from kiln.storage import StorageUnreachable, filesystem, remote_call, unreachable

_JSONL = (".jsonl", ".ndjson", ".json")


def is_url(source: str) -> bool:
    """An input read through fsspec: a URL other than file:// (a local path however it is spelled)."""
    return storage.is_url(source) and not source.startswith("file://")


def open_input(source: str, storage_options: dict[str, Any] | None = None) -> IO[bytes]:
    """A seekable binary file object for a local path or an fsspec URL."""
    if not is_url(source):
        return open(source.removeprefix("file://"), "rb")
    fs, path = filesystem(source, storage_options)
    try:
        with remote_call(source):
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
        except Exception as exc:  # a filesystem library's own error type for a failed read (class docstring)
            self.error = unreachable(exc, getattr(self.f, "full_name", "the input")) or (
                exc if isinstance(exc, OSError) else StorageReadError(f"{type(exc).__name__}: {exc}"))
            raise self.error from (None if self.error is exc else exc)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()


def input_size(source: str, storage_options: dict[str, Any] | None = None) -> int:
    if not is_url(source):
        return os.path.getsize(source.removeprefix("file://"))
    fs, path = filesystem(source, storage_options)
    with remote_call(source):
        return int(fs.size(path))


def input_identity(source: str, storage_options: dict[str, Any] | None = None) -> tuple[str, int, str]:
    """(source, size, version): what a resumed run checks to know the input did not change."""
    if not is_url(source):
        st = os.stat(source.removeprefix("file://"))
        return (source, st.st_size, str(st.st_mtime_ns))
    fs, path = filesystem(source, storage_options)
    with remote_call(source):
        info = fs.info(path)
    version = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
    return (source, int(info["size"]), str(version))


def expand_inputs(patterns: list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """Paths, globs and URLs (globs work in URLs too) -> input files, each glob sorted; a relative local path is
    made absolute (against the working directory), as a config file's are (`config.PATH_KEYS`)."""
    files: list[str] = []
    for pattern in patterns:
        if is_url(pattern):
            fs, path = filesystem(pattern, storage_options)
            protocol = pattern.split("://", 1)[0]
            try:
                with remote_call(pattern):  # a literal URL by info, not isfile: isfile takes any failure for "no"
                    matches = sorted(fs.glob(path)) if glob.has_magic(path) else _object(fs, path)
            except StorageUnreachable:
                raise
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
        literal = not glob.has_magic(pattern) or os.path.lexists(pattern.removeprefix("file://"))
        matches = [pattern] if literal else sorted(glob.glob(pattern))  # a file named with [brackets] is itself
        if not matches:
            raise KilnError(f"input {pattern!r} matches no file; check the path or glob")
        for m in matches:
            local = Path(m.removeprefix("file://"))
            _check_local_name(m, local)
            if local.is_dir():  # a datasets.save_to_disk or Hub dataset folder: its data files (kiln.data.hub)
                from kiln.data.hub import folder_files

                files += folder_files(Path(os.path.abspath(local)))
                continue
            if not local.is_file():
                raise KilnError(f"input {m} does not exist or is not a file")
            # absolute, as a config's paths are: records name their `source` the same however the run started
            files.append(m if m.startswith("file://") or os.path.isabs(m) else os.path.normpath(os.path.abspath(m)))
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


def _object(fs, path: str) -> list[str]:
    try:
        return [path] if fs.info(path).get("type") == "file" else []
    except FileNotFoundError:
        return []


def _check_local_name(given: str, local: Path) -> None:
    """A local input's name must be one Kiln's records can hold (they name it as `source`, in UTF-8 JSON), and
    a symlink must lead somewhere; a one-line error before any work otherwise."""
    try:
        given.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = os.fsencode(given[exc.start:exc.end])
        raise KilnError(f"input {given!r}: its file name is not valid UTF-8 (byte {byte.hex(' ')}), and each record "
                        "names its source file in UTF-8: rename the file to UTF-8 (e.g. convmv -f latin1 -t utf-8 "
                        "--notest FILE)") from None
    if local.is_symlink() and not local.exists():
        try:
            local.resolve(strict=True)
            why = "a broken symlink"
        except RuntimeError:
            why = "a symlink loop"
        except OSError as exc:
            why = "a symlink loop" if exc.errno == errno.ELOOP else "a broken symlink"
        raise KilnError(f"input {given} is {why} ({local} -> {os.readlink(local)}); point it at the file, or give "
                        "the file itself")


def input_format(source: str) -> str:
    name = source.lower().removesuffix(".gz").removesuffix(".zst")
    if name.endswith(_JSONL):
        return "jsonl"
    if source.lower().endswith(".parquet"):
        return "parquet"
    if source.lower().endswith(".arrow"):
        return "arrow"
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
        doc.source_group = _field(rec, group_field) or missing_group(f"field:{group_field}")
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
        columns = record_columns(source, pf.schema_arrow.names, fields)
        row = rows_before
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=columns,
                                         row_groups=None if row_groups is None else list(row_groups)):
                yield from batch_documents(batch, source, row, fields, max_record_bytes)
                row += batch.num_rows
        except Exception:  # a damaged row group (ArrowInvalid, OSError): keep the rows before it, say where
            if raw.error is not None:
                raise raw.error from None
            report.truncated_at = row


def record_columns(source: str, names: list[str], fields: tuple[str, ...]) -> list[str]:
    """The columns of `fields` (text, id, url, group) a file of columns `names` has; no text column is an error."""
    if fields[0] not in names:
        raise KilnError(f"{source}: no column {fields[0]!r} (data.text_field); columns are {names}")
    return [c for c in dict.fromkeys(fields) if c and c in names]


def batch_documents(batch, source: str, first_row: int, fields: tuple[str, ...],
                    max_record_bytes: int | None) -> Iterator[Document]:
    """The rows of an Arrow record batch (Parquet, Arrow IPC) as Documents, `offset` = the row in the file; a row
    whose text is over `max_record_bytes` (UTF-8) is a `read/too_large` rejection."""
    for row, (rec, size) in enumerate(zip(batch.to_pylist(), _text_bytes(batch, fields[0])), first_row):
        if max_record_bytes is not None and size > max_record_bytes:
            yield Document(id=f"{Path(source).name}:row{row}", source=source, offset=row, length=1).reject(
                "read", "too_large", row=row, bytes=size, limit=max_record_bytes)
        else:
            yield _record_doc(rec, source, row, 1, f"row{row}", fields)


# --- Arrow IPC --------------------------------------------------------------------------------

_ARROW_FILE_MAGIC = b"ARROW1"


def read_arrow(source: str, report: ReadReport, fields: tuple[str, ...],
               storage_options: dict[str, Any] | None = None, max_record_bytes: int | None = None
               ) -> Iterator[Document]:
    """The rows of an Arrow IPC file (stream format, as save_to_disk writes; or the file format), one record batch
    at a time, as Documents with the row index as `offset`. A row whose text is over `max_record_bytes` (UTF-8)
    is `read/too_large`; damage mid-file keeps the rows before it and reports the cut at the row."""
    import pyarrow as pa

    if input_size(source, storage_options) == 0:
        raise KilnError(f"{source}: empty file (0 bytes), nothing to read; remove it from the inputs")
    with open_input(source, storage_options) as f:
        raw = StorageWatch(f)
        try:
            file_format = raw.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC
            raw.seek(0)
            reader = pa.ipc.open_file(raw) if file_format else pa.ipc.open_stream(raw)
        except Exception as exc:  # pyarrow's ArrowInvalid and friends
            if raw.error is not None:
                raise raw.error from None
            raise KilnError(f"{source}: not a readable Arrow IPC file ({exc})") from None
        columns = record_columns(source, reader.schema.names, fields)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if file_format else reader
        row = 0
        try:
            for batch in batches:
                yield from batch_documents(batch.select(columns), source, row, fields, max_record_bytes)
                row += batch.num_rows
        except Exception:  # a cut or damaged stream: keep the rows before it, say where
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
