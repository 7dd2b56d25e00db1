"""`kiln data explain DOC_ID_OR_URL --out DIR`: where a document came from and what happened to it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterator

from kiln.data.document import SCORE_FIELDS
from kiln.data.pipeline import read_part
from kiln.errors import KilnError
from kiln.manifest import read_manifest

_PROVENANCE = ("source", "offset", "length", "record_id", "url", "date", "content_type")


def _records(folder: Path, outcome: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for part in sorted(folder.glob("part-*.jsonl.zst")):
        name = part.relative_to(folder.parent if outcome == "rejected" else folder).as_posix()
        for rec in read_part(part):
            yield outcome, rec | {"part": name}


def find(key: str, docs_dir: Path) -> list[dict[str, Any]]:
    """Every outcome whose id, WARC-Record-ID or URL is `key` (a URL can have been crawled twice)."""
    docs_dir = Path(docs_dir)
    read_manifest(docs_dir)  # a folder `kiln data` committed, or a clear error
    found = []
    for outcome, rec in itertools.chain(_records(docs_dir, "kept"), _records(docs_dir / "rejects", "rejected")):
        if key in (rec.get("id"), rec.get("record_id"), rec.get("url")):
            found.append(rec | {"outcome": outcome})
    if not found:
        raise KilnError(f"{docs_dir}: no document with id, WARC-Record-ID or URL {key!r}; "
                        "ids are in part-*.jsonl.zst and rejects/part-*.jsonl.zst")
    return found


def describe(rec: dict[str, Any]) -> str:
    lines = [f"document {rec['id']}"]
    lines += [f"  {k + ':':<13} {rec[k]}" for k in _PROVENANCE if rec.get(k) is not None]
    if rec["outcome"] == "kept":
        lines.append(f"  {'outcome:':<13} kept in {rec['part']} (lang {rec.get('lang')}, score {rec.get('lang_score')}, "
                     f"{len(rec.get('text') or '')} chars)")
        lines += [f"  {k + ':':<13} {rec[k]}" for k in SCORE_FIELDS if rec.get(k) is not None]
    else:
        lines.append(f"  {'outcome:':<13} dropped by {rec['stage']}: {rec['reason']} (in {rec['part']})")
        lines += [f"    {k} = {json.dumps(v, ensure_ascii=False)}" for k, v in (rec.get("signals") or {}).items()]
    return "\n".join(lines)


def explain(key: str, docs_dir: Path) -> str:
    return "\n\n".join(describe(rec) for rec in find(key, docs_dir))
