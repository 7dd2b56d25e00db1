"""Per-shard provenance: which documents a shard's tokens came from, beside the shard, not in the manifest.

`{split}/NNNNN.docs.jsonl.zst` (zstd JSON lines, hashed in manifest.json like every file) has one row per
document with tokens in shard NNNNN, in the order they first appear there: `doc` (the number the
`.idx` entries carry: the document's place in pack order, both splits counted), `id, split, source,
offset, length, url` (back to the WARC record or JSONL line) and `tokens` (its tokens, EOS counted).
A document whose tokens run over into the next shard has a row in each. `manifest.json` therefore
keeps a size independent of the document count, and nothing on the training path opens these files:
`kiln shards inspect` reads the one shard it needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import zstandard

SUFFIX = ".docs.jsonl.zst"
FIELDS = ("id", "split", "source", "offset", "length", "url", "tokens")


def side_file(shard: Path | str) -> Path:
    """`train/00003.bin` -> `train/00003.docs.jsonl.zst`."""
    shard = Path(shard)
    return shard.with_name(shard.stem + SUFFIX)


def write_rows(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    Path(path).write_bytes(zstandard.ZstdCompressor(level=3).compress(data))


def read_rows(path: Path) -> dict[int, dict[str, Any]]:
    """{doc: row} of one shard's side file (memory: that shard's documents)."""
    from kiln.data.docs import read_part

    return {row["doc"]: row for row in read_part(Path(path))}


def documents(folder: Path | str, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every document's row, in pack order, from all side files. Holds the whole map: for tools and tests
    on small folders, never for the training path."""
    out: dict[int, dict[str, Any]] = {}
    for info in manifest["splits"].values():
        for name in info["files"]:
            out.update(read_rows(Path(folder) / side_file(name)))
    return [out[k] for k in sorted(out)]
