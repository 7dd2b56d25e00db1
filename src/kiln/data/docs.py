"""The docs/ format, in one of two layouts (data.docs_format), written by `DocsWriters` and read back by
`DocsReader` / `read_docs` (verified against the manifest without a second pass) and `part_records`. The
pipeline writes it; the tokenizer, pack, explain, the classifier, ablate and the report read it, through this
module only.
- jsonl (the default): part-NNNNN.jsonl.zst files of JSON records (kept documents; rejects/ and review/ the same).
- parquet, the Hub's layout: data/train-NNNNN-of-MMMMM.parquet (kept), rejects/rejects-NNNNN-of-MMMMM.parquet,
  review/review-NNNNN-of-MMMMM.parquet, fixed columns (`KEPT_SCHEMA`, `REJECT_SCHEMA`: a record's fields, dicts
  as JSON text), and a README.md dataset card whose `configs` name each set, so the folder loads with
  `datasets.load_dataset("parquet", data_dir=DOCS/data)` or `load_dataset(DOCS)` and pushes as a dataset repo
  as is. The total MMMMM is known once the merge has written every part: parts are written as
  `STEM-NNNNN.partial` and named in `close`. A row read back is the JSONL record it stands for (`_record`).

Iterating `DocsReader(folder)` first checks that every part the manifest lists is there with its size (a
deleted or cut part stops here, before the first document is handed out); while the documents stream, each part's
bytes are hashed, and a part whose sha256 differs from the manifest raises `IntegrityError` when its
last record has been read, before the caller commits anything. Memory: one decompression window.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import zstandard

from kiln.data.document import SCORE_FIELDS
from kiln.errors import ConfigError, IntegrityError, KilnError
from kiln.manifest import MANIFEST, read_manifest, sha256_file
from kiln.data.tables import check_table_names
from kiln.data.vouch import HashingReader

PART = re.compile(r"^part-\d+\.jsonl\.zst$")
PARQUET_PART = re.compile(r"^(data/train|rejects/rejects|review/review)-\d{5,}-of-\d{5,}\.parquet$")
FORMATS = ("jsonl", "parquet")
SETS = {"kept": ("", "data/train"), "rejects": ("rejects/", "rejects/rejects"), "review": ("review/", "review/review")}


def part_names(files: Iterable[str], kind: str = "kept") -> list[str]:
    """The parts of one set (kept, rejects, review) among a docs manifest's names, in order, in either layout."""
    prefix, stem = SETS[kind]
    return sorted(n for n in files if (n.startswith(prefix) and PART.match(n[len(prefix):]))
                  or ((m := PARQUET_PART.match(n)) and m[1] == stem))


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
                            f"or data/train-*.parquet with a {MANIFEST}); run `kiln data` first")
        manifest = read_manifest(self.folder)
        check_table_names(self.folder, manifest)
        parts = part_names(manifest["files"])
        if not parts:
            raise KilnError(f"{self.folder}: no part-*.jsonl.zst or data/train-*.parquet files; run `kiln data` first")
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
        """One part's records (a pack task reads its own parts), its sha256 checked when the last is read (a
        Parquet part's before the first: its reader seeks)."""
        path = self.folder / name
        with open(path, "rb") as f:
            if name.endswith(".parquet"):
                digest = sha256_file(path)
                if digest == sha256:
                    yield from part_records(path, f)
            else:
                raw = HashingReader(f, hashlib.sha256())
                yield from part_records(path, raw)
                digest = raw.finish()
        if digest != sha256:
            raise IntegrityError(f"{path}: sha256 {digest[:16]}… != {MANIFEST}; the docs folder changed after "
                                 f"`kiln data` wrote it, run `kiln data` again")


def part_records(path: Path, f: IO[bytes]) -> Iterator[dict[str, Any]]:
    """The records of one docs part (`path` names it and its layout) read from `f`, its bytes; bytes that do not
    parse are an IntegrityError naming it."""
    if str(path).endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        errors: tuple[type[Exception], ...] = (pa.ArrowException, ValueError)
        rows = (_record(row) for batch in pq.ParquetFile(f).iter_batches(batch_size=ROW_GROUP)
                for row in batch.to_pylist())
    else:
        errors = (zstandard.ZstdError, ValueError)  # ValueError: bad JSON or UTF-8
        lines = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f, closefd=False), encoding="utf-8")
        rows = (json.loads(line) for line in lines if line.strip())
    try:
        yield from rows
    except errors as exc:
        raise IntegrityError(f"{path}: cannot be read ({str(exc)[:120]}); the docs folder changed after "
                             f"`kiln data` wrote it, run `kiln data` again") from None


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


def part_lines(path: Path) -> Iterator[bytes]:
    """The lines of one zstd-compressed JSONL file as bytes, unparsed (for a reader that parses only some, or
    copies them), streamed in blocks of a MB."""
    with open(path, "rb") as f:
        yield from io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f), 1 << 20)


class PartWriter:
    """Writes records as part-NNNNN.jsonl.zst files of at most `per_part` records each, streamed through the
    compressor (memory: one record and a compression window, whatever `per_part`), numbered from `first` (a merge
    task writes its run of a set's parts). The folder is a staging folder the caller commits whole; a writer that
    got no record writes one empty part."""

    def __init__(self, folder: Path, per_part: int, first: int = 0) -> None:
        self.folder, self.per_part = folder, per_part
        self.folder.mkdir(parents=True, exist_ok=True)
        self.first, self.parts, self.in_part = first, first, 0
        self._file: IO[bytes] | None = None
        self._writer: Any = None

    def add(self, rec: dict[str, Any]) -> None:
        self.add_line((json.dumps(rec, ensure_ascii=False) + "\n").encode())

    def add_line(self, line: bytes) -> None:
        """One record as its JSON line (what `add` writes for it)."""
        if self._writer is None:
            self._open()
        self._writer.write(line)
        self.in_part += 1
        if self.in_part >= self.per_part:
            self.flush()

    def flush(self) -> None:
        """End the part being written (or write the one empty part of a writer that got no record)."""
        if self._writer is None and self.parts == self.first:
            self._open()
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            self._writer = self._file = None
            self.parts, self.in_part = self.parts + 1, 0

    close = flush

    def _open(self) -> None:
        self._file = open(self.folder / f"part-{self.parts:05d}.jsonl.zst", "wb")
        self._writer = zstandard.ZstdCompressor(level=3).stream_writer(self._file, closefd=False)


# --- the Parquet layout ----------------------------------------------------------------------------------------

ROW_GROUP = 1000  # rows per row group (fixed: the bytes must not depend on how the rows arrived)
JSON_COLUMNS = ("edits", "signals")  # dicts, kept as JSON text
OPTIONAL = ("edits", *SCORE_FIELDS, "source_group")  # a kept record has these keys only when they hold a value


def _schema(kind: str):
    import pyarrow as pa

    s, i, f = pa.string(), pa.int64(), pa.float64()
    if kind == "rejects":
        cols = [("id", s), ("url", s), ("source", s), ("offset", i), ("length", i), ("stage", s), ("reason", s),
                ("signals", s), ("date", s), ("record_id", s), ("content_type", s), ("lang", s), ("chars", i)]
    else:
        cols = [("id", s), ("text", s), ("url", s), ("source", s), ("offset", i), ("length", i), ("lang", s),
                ("lang_score", f), ("date", s), ("record_id", s), ("content_type", s), ("edits", s),
                *((name, f) for name in SCORE_FIELDS), ("source_group", s)]
    return pa.schema(cols)


def _row(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: json.dumps(v, ensure_ascii=False) if k in JSON_COLUMNS and v is not None else v for k, v in rec.items()}


def _record(row: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row as the JSONL record it stands for: JSON columns parsed, absent optional keys left out."""
    return {k: json.loads(v) if k in JSON_COLUMNS and v is not None else v for k, v in row.items()
            if v is not None or k not in OPTIONAL}


class ParquetPartWriter:
    """One set's Parquet files (`stem`: data/train, rejects/rejects, review/review) of at most `per_part` rows,
    in row groups of ROW_GROUP rows, zstd level 3, no timestamps: the bytes are a function of the rows. Memory:
    one row group's records. `close` names the files STEM-NNNNN-of-MMMMM.parquet (a set with no row gets one
    empty file); with `total` known (a merge task writes the parts `first`... of a set of `total`), they are written
    under those names."""

    def __init__(self, folder: Path, per_part: int, kind: str, first: int = 0, total: int | None = None) -> None:
        self.folder, self.per_part, self.kind, self.total = Path(folder), per_part, kind, total
        self.stem = SETS[kind][1]
        (self.folder / self.stem).parent.mkdir(parents=True, exist_ok=True)
        self.first, self.parts, self.in_part = first, first, 0
        self._rows: list[dict[str, Any]] = []
        self._writer: Any = None

    def _path(self, k: int, total: int | None = None) -> Path:
        total = self.total if total is None else total
        return self.folder / (f"{self.stem}-{k:05d}.partial" if total is None else part_name("parquet", self.kind, k,
                                                                                              total))

    def add_line(self, line: bytes) -> None:
        self.add(json.loads(line))

    def add(self, rec: dict[str, Any]) -> None:
        self._rows.append(_row(rec))
        self.in_part += 1
        if len(self._rows) >= ROW_GROUP or self.in_part >= self.per_part:
            self._write_rows()
        if self.in_part >= self.per_part:
            self._end_part()

    def _write_rows(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:
            self._writer = pq.ParquetWriter(self._path(self.parts), _schema(self.kind), compression="zstd",
                                            compression_level=3, write_statistics=True)
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, _schema(self.kind)), row_group_size=ROW_GROUP)
        self._rows = []

    def _end_part(self) -> None:
        self._write_rows()
        self._writer.close()
        self._writer, self.parts, self.in_part = None, self.parts + 1, 0

    def close(self) -> None:
        """End the last part (or write the one empty part of an empty set), then name every part with the total."""
        if self.in_part or self.parts == self.first:
            self._end_part()
        if self.total is None:
            for k in range(self.parts):
                os.replace(self._path(k), self._path(k, self.parts))


CARD = """---
configs:
{configs}---
# Documents written by `kiln data`

Kept documents in `data/` (the default config) with their provenance (`source`, `offset`, `length`, `record_id`,
`url`, `date`, `content_type`), rejected ones in `rejects/` (`stage`, `reason`, `signals`){review}. `manifest.json`
lists every file's sha256; `stats.json` counts what was read, kept and rejected.
"""


def write_card(out: Path, review: bool) -> None:
    """The README.md dataset card whose configs name each set of a Parquet docs folder."""
    sets = [("default", "data/train-*.parquet"), ("rejects", "rejects/rejects-*.parquet")]
    sets += [("review", "review/review-*.parquet")] if review else []
    configs = "".join(f"- config_name: {name}\n  data_files:\n  - split: train\n    path: {glob}\n"
                      for name, glob in sets)
    text = CARD.format(configs=configs, review=", set aside for review in `review/`" if review else "")
    (Path(out) / "README.md").write_text(text, encoding="utf-8")


def part_name(fmt: str, kind: str, k: int, total: int) -> str:
    """Part k's name (relative to the docs folder) of a set (kept, rejects, review) of `total` parts."""
    prefix, stem = SETS[kind]
    return f"{stem}-{k:05d}-of-{total:05d}.parquet" if fmt == "parquet" else f"{prefix}part-{k:05d}.jsonl.zst"


def set_writer(out: Path, fmt: str, kind: str, per_part: int, first: int = 0, total: int | None = None) -> Any:
    """A writer of one set's parts in layout `fmt` (`add`, `add_line`, `close`), numbered from `first`."""
    if fmt == "parquet":
        return ParquetPartWriter(out, per_part, kind, first, total)
    return PartWriter(Path(out) / SETS[kind][0], per_part, first)


def check_format(fmt: str) -> None:
    """Before any work: the Parquet layout needs pyarrow (the parquet extra)."""
    if fmt == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ModuleNotFoundError:
            from kiln.install import install_hint

            raise ConfigError(f"data.docs_format: parquet needs pyarrow, which is not installed: "
                              f"{install_hint('parquet')}") from None
