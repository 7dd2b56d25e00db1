"""A docs folder's per-source tables: side files beside stats.json, written and read one row at a time.

A crawl keyed by `data.distribution.source_key=host` has a source per site (tens of millions), and a dump has
an input per WARC file, so no table with a row per source lives in stats.json, the manifest or a process's
memory. Each is a zstd JSON-lines file in the docs folder, one row per source:

- `by_source.jsonl.zst`: per input file (in input order): `source, read, kept, rejected`;
- `composition_by_source.jsonl.zst`: per source group (the distribution gate's source): `source, documents,
  chars, doc_share, char_share` of the kept documents;
- `source_weights.jsonl.zst`: per source group (the distribution gate on): `source, docs, z, weight`.

The docs manifest's `tables` maps each name to its file and row count; a file is hashed in the manifest like
every other, and a reader (`rows`) takes only a plain file name the manifest lists, and checks the file's
sha256 when it has streamed it. A docs folder written before the tables (stats.json held them inline) reads
the same through `rows`. Readers: the report (the first rows, the largest sources by a bounded heap),
`kiln data explain` (one source's row), pack (the sources weighted below 1).
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import pickle
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

import zstandard

from kiln.errors import IntegrityError, KilnError
from kiln.data.vouch import HashingReader
from kiln.manifest import MANIFEST, read_manifest, writing_atomic

TABLES = {"by_source": "by_source.jsonl.zst", "composition_by_source": "composition_by_source.jsonl.zst",
          "source_weights": "source_weights.jsonl.zst"}


class TableWriter:
    """Rows streamed into a zstd JSON-lines file that appears whole when the `with` block ends (an error
    leaves no file). Memory: a compression window."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = Path(path), 0

    def __enter__(self) -> "TableWriter":
        self._atomic = writing_atomic(self.path)
        self._zw = zstandard.ZstdCompressor(level=3).stream_writer(self._atomic.__enter__(), closefd=False)
        return self

    def add(self, row: dict[str, Any]) -> None:
        self._zw.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
        self.rows += 1

    def __exit__(self, *exc) -> bool:
        self._zw.close()
        return bool(self._atomic.__exit__(*exc))


def write_table(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write `rows` as a table file; returns how many."""
    with TableWriter(path) as writer:
        for row in rows:
            writer.add(row)
    return writer.rows


def check_table_names(docs_dir: Path, manifest: dict[str, Any]) -> None:
    """Every table a docs folder names, in its manifest's and in stats.json's `tables`, must be a plain name the
    manifest lists with its size and sha256 (`kiln.names.listed_name`); else one IntegrityError naming the file
    and the entry. Every reader of a docs folder calls it (`DocsReader.parts`, `kiln data explain`), so a name
    that leaves the folder is refused even by a reader that never opens the table."""
    from kiln.names import listed_name

    docs_dir, files = Path(docs_dir), manifest["files"]
    holders: list[tuple[Path, Any]] = [(docs_dir / MANIFEST, manifest.get("tables"))]
    if "stats.json" in files:
        stats = listed_name(docs_dir, "stats.json", files, docs_dir / MANIFEST)
        try:
            holders.append((stats, json.loads(stats.read_text(encoding="utf-8")).get("tables")))
        except (OSError, ValueError, AttributeError) as exc:
            raise IntegrityError(f"{stats}: not readable JSON ({type(exc).__name__}); run `kiln data` again") from None
    for where, tables in holders:
        if tables is None:
            continue
        if not isinstance(tables, dict):
            raise IntegrityError(f"{where}: 'tables' is not an object; the docs folder is corrupt, run `kiln data` "
                                 "again")
        for entry in tables.values():
            listed_name(docs_dir, entry.get("file") if isinstance(entry, dict) else entry, files, where)


def _plain(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def rows(docs_dir: Path, table: str) -> Iterator[dict[str, Any]]:
    """The rows of one table of a docs folder, streamed; its sha256 is checked against the manifest when it has
    been read. Nothing when the folder has no such table (the distribution gate off)."""
    docs_dir = Path(docs_dir)
    manifest = read_manifest(docs_dir)
    tables = manifest.get("tables")
    if tables is None:  # written before the tables: stats.json holds them inline
        yield from _inline(docs_dir, table)
        return
    entry = tables.get(table) if isinstance(tables, dict) else None
    if entry is None:
        return
    name = entry.get("file") if isinstance(entry, dict) else None
    listed = manifest["files"].get(name) if _plain(name) else None
    if not isinstance(listed, dict):
        raise IntegrityError(f"{docs_dir / MANIFEST}: table {table!r} names {name!r}, not a file the manifest lists "
                             f"in the folder; the folder is corrupt, run `kiln data` again")
    path = docs_dir / name
    sha = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(HashingReader(f, sha)),
                                         encoding="utf-8"):
                if line.strip():
                    yield json.loads(line)
            while block := f.read(1 << 20):
                sha.update(block)
    except FileNotFoundError:
        raise IntegrityError(f"{path}: listed in {MANIFEST} but missing; run `kiln data` again") from None
    except (zstandard.ZstdError, ValueError) as exc:
        raise IntegrityError(f"{path}: cannot be read ({str(exc)[:120]}); run `kiln data` again") from None
    if sha.hexdigest() != listed.get("sha256"):
        raise IntegrityError(f"{path}: sha256 differs from {MANIFEST}; the docs folder changed after `kiln data` "
                             f"wrote it, run `kiln data` again")


def _inline(docs_dir: Path, table: str) -> Iterator[dict[str, Any]]:
    stats_path = docs_dir / "stats.json"
    if not stats_path.is_file():
        return
    try:
        stats = json.loads(stats_path.read_text())
    except ValueError:
        raise KilnError(f"{stats_path}: not valid JSON; run `kiln data` again") from None
    found = (stats.get("composition") or {}).get("by_source") if table == "composition_by_source" \
        else stats.get(table)
    for source, row in (found or {}).items():
        yield {"source": source, **row}


def row_of(docs_dir: Path, table: str, source: str) -> dict[str, Any] | None:
    """One source's row (a scan of the table: memory one row)."""
    return next((row for row in rows(docs_dir, table) if row["source"] == source), None)


def largest(docs_dir: Path, table: str, key: str, n: int) -> list[dict[str, Any]]:
    """The `n` rows with the largest `key`, largest first (ties by source): a heap of n rows."""
    return heapq.nsmallest(n, rows(docs_dir, table), key=lambda r: (-r[key], r["source"]))


def down_weighted(docs_dir: Path) -> dict[str, dict[str, Any]]:
    """{source: row} of the sources the distribution gate weighted below 1 (what pack groups: memory, their
    rows; the others weigh 1)."""
    return {row["source"]: row for row in rows(docs_dir, "source_weights") if row.get("weight", 1.0) < 1.0}


# --- counting per source, spilled -------------------------------------------------------------------

PARTITIONS = 64


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


class SpilledCounts:
    """Sums of a few counters per source (documents and characters of the kept ones, say) over a stream of
    documents, with memory bounded in the number of sources: counts are held for at most `HELD` sources, then
    appended to one of PARTITIONS files by a hash of the source; `rows` adds up one partition at a time, at most
    `AT_ONCE` sources in memory (a larger partition is read once per slice of its sources). Rows come out in
    partition order, each source once, the same for any number of workers (the stream's order is fixed)."""

    HELD = 4096
    AT_ONCE = 65536

    def __init__(self, folder: Path, fields: tuple[str, ...]) -> None:
        self.folder, self.fields = Path(folder), fields
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("counts-*.pkl"):
            stale.unlink()
        self.held: dict[str, list[int]] = {}
        self.spilled = [0] * PARTITIONS  # rows appended per partition: an upper bound of its sources
        self.totals = [0] * len(fields)

    def add(self, source: str, *values: int) -> None:
        row = self.held.get(source)
        if row is None:
            if len(self.held) >= self.HELD:
                self._spill()
            row = self.held[source] = [0] * len(self.fields)
        for k, v in enumerate(values):
            row[k] += v
            self.totals[k] += v

    def _path(self, q: int) -> Path:
        return self.folder / f"counts-{q:03d}.pkl"

    def _spill(self) -> None:
        by_partition: dict[int, list] = {}
        for source, row in self.held.items():
            by_partition.setdefault(_crc(source) % PARTITIONS, []).append((source, row))
        for q, pieces in sorted(by_partition.items()):
            with open(self._path(q), "ab") as out:
                pickle.dump(pieces, out, protocol=pickle.HIGHEST_PROTOCOL)
            self.spilled[q] += len(pieces)
        self.held = {}

    def rows(self) -> Iterator[dict[str, Any]]:
        """{"source", field: sum, ...} for every source, partition by partition; the spill files go as read."""
        self._spill()
        for q in range(PARTITIONS):
            slices = -(-self.spilled[q] // self.AT_ONCE)
            for k in range(slices):
                sums: dict[str, list[int]] = {}
                for pieces in read_frames(self._path(q)):
                    for source, row in pieces:
                        if slices > 1 and _crc(source) // PARTITIONS % slices != k:
                            continue
                        into = sums.setdefault(source, [0] * len(row))
                        for i, v in enumerate(row):
                            into[i] += v
                for source, row in sums.items():
                    yield {"source": source, **dict(zip(self.fields, row))}
            self._path(q).unlink(missing_ok=True)


def read_frames(path: Path) -> Iterator[Any]:
    """The pickled pieces appended to a spill file, in order (nothing when it does not exist)."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        while True:
            try:
                yield pickle.load(f)
            except EOFError:
                return


def composition_rows(counts: SpilledCounts) -> Iterator[dict[str, Any]]:
    """`composition_by_source` rows from counts of (documents, chars), with each source's shares."""
    docs, chars = counts.totals
    for row in counts.rows():
        yield {**row, "doc_share": round(row["documents"] / max(docs, 1), 4),
               "char_share": round(row["chars"] / max(chars, 1), 4)}


class InputCounts:
    """`by_source` rows (read, kept, rejected per input file) from documents that come input by input, in input
    order: one input's counts held at a time; an input with no document still gets its row."""

    def __init__(self, inputs: Iterable[str], writer: TableWriter) -> None:
        self.inputs, self.writer = iter(inputs), writer
        self.current: str | None = None
        self.counts: Counter[str] = Counter()

    def add(self, source: str, kept: bool) -> None:
        while source != self.current:
            self._flush()
            self.current = next(self.inputs)  # StopIteration: a document of no input, a broken stream
        self.counts["read"] += 1
        self.counts["kept" if kept else "rejected"] += 1

    def _flush(self) -> None:
        if self.current is not None:
            self.writer.add({"source": self.current, **{k: self.counts[k] for k in ("read", "kept", "rejected")}})
        self.current, self.counts = None, Counter()

    def close(self) -> None:
        self._flush()
        for source in self.inputs:
            self.writer.add({"source": source, "read": 0, "kept": 0, "rejected": 0})


def table(docs_dir: Path, name: str) -> dict[str, dict[str, Any]]:
    """A whole table as {source: row without its name}: for small corpora, tools and tests (memory: every row)."""
    return {row.pop("source"): row for row in rows(docs_dir, name)}
