"""`kiln shards inspect DIR --at SEQUENCE_INDEX`: one sample's tokens, decoded, and the documents they came from."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import read_manifest, verify_folder
from kiln.shards.external import document_provenance
from kiln.shards.format import read_index
from kiln.shards.reader import ShardSet
from kiln.shards.provenance import read_rows, side_file
from kiln.tokenizer import load_tokenizer, tokenizer_sha256
from kiln.run_layout import RunLayout


def sample_provenance(folder: Path, split: str, index: int) -> dict[str, Any]:
    """Where sample `index` of `split` lives and, for each document piece in it, the document's provenance.

    `pieces[i]["sample_tokens"]` is the piece's [start, end) within the sample and
    `doc_tokens` the same tokens' [start, end) within the document (EOS counted).
    """
    manifest = read_manifest(Path(folder))
    if manifest.get("format", "kiln") != "kiln":  # Megatron's or OLMo-core's files: a sequence is a document
        return document_provenance(Path(folder), manifest, split, index)
    ss = ShardSet(folder, split)
    if len(ss) == 0:
        raise KilnError(f"{folder}: the {split} split has no sequences (pack.val_fraction 0, or too few tokens); "
                        "nothing to inspect there")
    if not 0 <= index < len(ss):
        raise KilnError(f"{folder}: the {split} split has {len(ss)} sequences; --at must be 0..{len(ss) - 1}")
    shard = int(np.searchsorted(ss.starts, index, side="right") - 1)
    # what is read below, checked first (sha256; small files): a changed index or side file is named, not parsed
    indexes = {Path(n).with_suffix(".idx").as_posix() for n in ss.names[:shard + 1]}
    reads = indexes | {side_file(ss.names[shard]).as_posix()}
    if unlisted := sorted(reads - set(ss.manifest["files"])):
        raise IntegrityError(f"{Path(folder) / unlisted[0]}: not in manifest.json (a folder packed before shards "
                             "carried their provenance beside them?): re-run `kiln pack`")
    try:
        verify_folder(Path(folder), only=reads)
    except IntegrityError as exc:
        raise IntegrityError(f"{exc}; the shards folder changed after `kiln pack` wrote it: re-run `kiln pack`") \
            from None
    L = ss.sample_len
    start = (index - int(ss.starts[shard])) * L
    end = start + L
    before: dict[int, int] = defaultdict(int)  # each document's tokens earlier in the split
    for name in ss.names[:shard]:
        for e in read_index((Path(folder) / name).with_suffix(".idx")):
            before[int(e["doc"])] += int(e["length"])
    documents = read_rows(Path(folder) / side_file(ss.names[shard]))  # this shard's rows only
    pieces = []
    for e in read_index((Path(folder) / ss.names[shard]).with_suffix(".idx")):
        e_start, e_end, doc = int(e["start"]), int(e["start"] + e["length"]), int(e["doc"])
        if e_end <= start or e_start >= end:
            if e_end <= start:
                before[doc] += e_end - e_start
            continue
        lo, hi = max(e_start, start), min(e_end, end)
        meta = documents[doc]
        first = before[doc] + lo - e_start
        pieces.append({"doc": doc, "id": meta["id"], "url": meta.get("url"), "source": meta.get("source"),
                       "offset": meta.get("offset"), "length": meta.get("length"), "doc_total_tokens": meta["tokens"],
                       "sample_tokens": [lo - start, hi - start], "doc_tokens": [first, first + hi - lo]})
    return {"folder": str(folder), "split": split, "index": index, "samples": len(ss), "shard": ss.names[shard],
            "tokenizer_sha256": ss.manifest["tokenizer_sha256"],
            "shard_tokens": [start, end], "tokens": np.asarray(ss.sample(index), dtype=np.int64).tolist(),
            "pieces": pieces}


def inspect_sample(folder: Path, split: str, index: int, tokenizer: Path | None = None) -> dict[str, Any]:
    """sample_provenance plus the decoded text of the sample and of each piece.

    `tokenizer` defaults to the `tokenizer/` folder beside `folder` ({out_dir}/tokenizer).
    """
    info = sample_provenance(folder, split, index)
    tok_path = Path(tokenizer) if tokenizer else RunLayout(Path(folder).parent).tokenizer
    expected = info["tokenizer_sha256"]
    if not tok_path.exists():
        where = "" if tokenizer else " (the default: tokenizer/ beside the shards folder)"
        raise KilnError(f"{tok_path}: no tokenizer there{where}; pass the one these shards were encoded with "
                        f"({expected[:12]}…) with --tokenizer DIR")
    if tokenizer_sha256(tok_path) != expected:
        raise KilnError(f"{tok_path}: not the tokenizer these shards were encoded with ({expected[:12]}…); "
                        "pass the right one with --tokenizer")
    tok = load_tokenizer(tok_path)
    tokens = info["tokens"]
    info["text"] = tok.decode(tokens, skip_special_tokens=False)
    for p in info["pieces"]:
        a, b = p["sample_tokens"]
        p["text"] = tok.decode(tokens[a:b], skip_special_tokens=False)
    return info


def format_inspection(info: dict[str, Any]) -> str:
    lines = [f"{info['folder']} {info['split']} sequence {info['index']} of {info['samples']}: "
             f"{info['shard']} tokens {info['shard_tokens'][0]}..{info['shard_tokens'][1]}"]
    at = 0
    for p in info["pieces"]:
        a, b = p["sample_tokens"]
        if a > at:
            lines.append(f"  tokens {at}-{a}: padding")
        lines.append(f"  tokens {a}-{b}: document {p['doc']} (id {p['id']}), its tokens {p['doc_tokens'][0]}-"
                     f"{p['doc_tokens'][1]} of {p['doc_total_tokens']}")
        lines.append(f"      url {p['url']}")
        lines.append(f"      source {p['source']} offset {p['offset']} length {p['length']}")
        at = b
    if at < len(info["tokens"]):
        lines.append(f"  tokens {at}-{len(info['tokens'])}: padding")
    lines += ["--- decoded ---", info["text"]]
    return "\n".join(lines)
