"""`kiln data explain DOC_ID_OR_URL --out DIR`: where a document came from and what happened to it."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any, Iterator

from kiln.data.document import SCORE_FIELDS
from kiln.data.docs import part_names, part_records
from kiln.data.tables import check_table_names
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import MANIFEST, read_manifest, verify_folder

_PROVENANCE = ("source", "offset", "length", "record_id", "url", "date", "content_type")


_CHANGED = "the docs folder changed after `kiln data` wrote it, run `kiln data` again"


def _parts(docs_dir: Path) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The manifest's files and (outcome, name) of every kept and rejects part it lists, each checked to be
    there with its size."""
    manifest = read_manifest(docs_dir)  # a folder Kiln committed, or a clear error
    if manifest.get("stage") not in (None, "data"):  # the shards or the tokenizer given for the docs
        raise KilnError(f"{docs_dir}: a `kiln {manifest['stage']}` output, not a docs folder; give the folder "
                        "`kiln data` wrote ({out_dir}/docs) with --out")
    check_table_names(docs_dir, manifest)
    files = manifest["files"]
    names = [(outcome, name) for outcome, kind in (("kept", "kept"), ("rejected", "rejects"))
             for name in part_names(files, kind)]
    try:
        verify_folder(docs_dir, deep=False, only={name for _, name in names})
    except IntegrityError as exc:
        raise IntegrityError(f"{exc}; {_CHANGED}") from None
    return files, names


def _records(docs_dir: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every kept and rejected record, each part checked against its sha256 in the manifest before it is parsed.
    Memory: one part's compressed bytes."""
    files, names = _parts(docs_dir)
    for outcome, name in names:
        path = docs_dir / name
        data = path.read_bytes()
        if (digest := hashlib.sha256(data).hexdigest()) != files[name]["sha256"]:
            raise IntegrityError(f"{path}: sha256 {digest[:16]}… != {MANIFEST}; {_CHANGED}")
        yield from ((outcome, rec | {"part": name}) for rec in part_records(path, io.BytesIO(data)))


_AT_LINE = re.compile(r"^(?P<path>.+):(?P<where>\d+|row\d+)$")


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def _line_offset(path: str, line: int) -> int | None:
    """Byte offset (in the decompressed stream) where line `line` (1-based) of a local JSONL file starts.
    Reads at most `line` lines."""
    from kiln.data.sources import _lines, open_input

    if not Path(path).is_file():
        return None
    offset = 0
    with open_input(path, None) as f:
        for number, (_, length) in enumerate(_lines(f, path), 1):
            if number == line:
                return offset
            offset += length
    return None


def _at_line(key: str) -> Any:
    """For 'PATH:LINE' (or 'PATH:rowN' of a Parquet file), a test on a record's provenance; else None.
    A record whose own id field was used is found by its source and byte offset."""
    m = _AT_LINE.match(key)
    if not m:
        return None
    path, where = m["path"], m["where"]
    basename_id = f"{Path(path).name}:{where}"
    offset = _line_offset(path, int(where)) if where.isdigit() and not path.endswith(".parquet") else None
    row = int(where[3:]) if where.startswith("row") else None

    def matches(rec: dict[str, Any]) -> bool:
        src = str(rec.get("source") or "")
        if not (_same_file(src, path) or Path(src).name == Path(path).name):
            return False
        if rec.get("id") == basename_id:
            return True
        at = offset if row is None else row
        return at is not None and rec.get("offset") == at and _same_file(src, path)

    return matches


def find(key: str, docs_dir: Path) -> list[dict[str, Any]]:
    """Every outcome whose id, WARC-Record-ID or URL is `key` (a URL can have been crawled twice); a key
    of the form PATH:LINE (what a user copies from an editor) finds that line of that input file."""
    docs_dir = Path(docs_dir)
    at_line = _at_line(key)
    found = []
    for outcome, rec in _records(docs_dir):
        if key in (rec.get("id"), rec.get("record_id"), rec.get("url")) or (at_line and at_line(rec)):
            found.append(rec | {"outcome": outcome})
    if not found:
        raise KilnError(f"{docs_dir}: no document with id, WARC-Record-ID or URL {key!r}; "
                        "ids are in the kept and rejects parts (part-*.jsonl.zst or data/*.parquet, rejects/), or give "
                        "FILE:LINE of an input")
    return found


def describe(rec: dict[str, Any]) -> str:
    lines = [f"document {rec['id']}"]
    lines += [f"  {k + ':':<13} {rec[k]}" for k in _PROVENANCE if rec.get(k) is not None]
    if rec["outcome"] == "kept":
        lines.append(
            f"  {'outcome:':<13} kept in {rec['part']} (lang {rec.get('lang')}, score {rec.get('lang_score')}, "
            f"{len(rec.get('text') or '')} chars)"
        )
        lines += [f"  {k + ':':<13} {rec[k]}" for k in SCORE_FIELDS if rec.get(k) is not None]
    else:
        lines.append(f"  {'outcome:':<13} dropped by {rec['stage']}: {rec['reason']} (in {rec['part']})")
        lines += [f"    {k} = {json.dumps(v, ensure_ascii=False)}" for k, v in (rec.get("signals") or {}).items()]
    return "\n".join(lines)


def explain(key: str, docs_dir: Path) -> str:
    return "\n\n".join(describe(rec) + _weight(rec, docs_dir) for rec in find(key, docs_dir))


def _weight(rec: dict[str, Any], docs_dir: Path) -> str:
    """A kept document's source group and the sampling weight the distribution gate gave it (one scan of the
    source_weights table, `kiln.data.tables`; nothing when the gate was off)."""
    from kiln.data.tables import row_of

    group = rec.get("source_group")
    if rec["outcome"] != "kept" or group is None or (row := row_of(Path(docs_dir), "source_weights", group)) is None:
        return ""
    return f"\n  {'source group:':<13} {group} (sampling weight {row.get('weight')}, z {row.get('z')})"
