"""Shards for other trainers (`pack.format: megatron | olmo-core`): every document whole, one token file a split.

The pack tasks (pack.py) write, per split and shard group, a task-local `tokens.bin` (the documents' ids + EOS
back to back, in the format's dtype), `tokens.len` (each document's token count, <u4) and the provenance side
file `tokens.docs.jsonl.zst` (provenance.py's rows, one a document, in order). The final step (`concatenate`, on
the driver) streams the tasks' files, in task order, into the split's files:

megatron   `{split}/{prefix}tokens.bin` + `.idx`: Megatron-LM's indexed dataset as megatron-core's
           IndexedDatasetBuilder writes it with one add_item + end_document a document. `.bin` the tokens, uint16
           when the vocabulary is < 65500, else int32 (its DType.optimal_dtype); `.idx` b"MMIDIDX\\0\\0", <Q 1,
           <B the dtype's code, <Q N, <Q N + 1, the N sequence lengths (int32), their byte offsets in `.bin`
           (int64), the document indices 0..N (int64). Entry i is document i. Megatron: `--data-path .../tokens`.
olmo-core  `{split}/{prefix}tokens.npy`: raw tokens (no .npy header; OLMo-core memory-maps them) of the smallest
           of uint8/16/32 that holds vocab - 1 (its NumpyDatasetConfig.get_dtype), each document ending with EOS
           (the boundaries its loaders infer), and `tokens.csv.gz`, a `start,end,id` row a document (the metadata
           its iter_document_indices reads), gzip with mtime 0.

Either way `{split}/{prefix}tokens.docs.jsonl.zst` is the provenance (row i: entry i, `doc` its place in the
docs folder), and manifest.json (`format`) lists every file with its sha256 and each split's token file, so
`kiln shards verify` (`verify`) and `kiln shards inspect` (`document_provenance`) read them. kiln train does not.
Memory: a 1 MiB copy buffer and one task's document lengths.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from kiln.data.docs import read_part
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import MANIFEST, verify_folder
from kiln.names import listed_name
from kiln.shards.provenance import side_file

STEM = "tokens"
TOKENS = {"megatron": ".bin", "olmo-core": ".npy"}  # the token file's suffix by format
LENGTHS = ".len"  # task-local: each document's token count
META = ".csv.gz"  # olmo-core: each document's start,end,id
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEAD = struct.Struct("<9sQBQQ")  # magic, version 1, dtype code, sequences, documents + 1
MEGATRON_CODES = {"uint8": 1, "int32": 4, "uint16": 8}  # megatron.core.datasets.indexed_dataset.DType
CHUNK = 1 << 20


def token_dtype(fmt: str, vocab_size: int) -> np.dtype:
    """The dtype the format's own tools choose for this vocabulary."""
    if fmt == "megatron":
        return np.dtype("<u2") if vocab_size < 65500 else np.dtype("<i4")
    for dtype in ("u1", "<u2", "<u4"):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise KilnError(f"a vocabulary of {vocab_size} does not fit OLMo-core's uint32 token files")


class DocWriter:
    """One split's (or shard group's) documents in a task, each whole, streamed into its task-local files (the
    counterpart of writer.SplitWriter); nothing is written for a split without documents."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, prefix: str = "") -> None:
        self.folder, self.name, self.dtype = folder, f"{split}/{prefix}{STEM}.bin", dtype
        self.tokens = self.documents = 0

    def _open(self) -> None:
        path = self.folder / self.name
        path.parent.mkdir(parents=True, exist_ok=True)
        self.bin, self.lengths, self.side_raw = (open(p, "wb") for p in (path, path.with_suffix(LENGTHS),
                                                                          side_file(path)))
        self.side = zstandard.ZstdCompressor(level=3).stream_writer(self.side_raw, closefd=False)

    def add(self, ids: np.ndarray, doc: int, provenance: dict[str, Any] | None = None) -> None:
        if not self.documents:
            self._open()
        self.bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self.lengths.write(struct.pack("<I", len(ids)))
        self.side.write((json.dumps({"doc": doc, **(provenance or {}), "tokens": len(ids)}, ensure_ascii=False)
                         + "\n").encode())
        self.tokens += len(ids)
        self.documents += 1

    def close(self) -> dict[str, Any]:
        if self.documents:
            self.side.close()
            for f in (self.bin, self.lengths, self.side_raw):
                f.close()
        return {"files": [self.name] if self.documents else [], "tokens": self.tokens, "samples": self.documents,
                "documents": self.documents, "dropped_tail_tokens": 0, "split_documents": 0, "pad_tokens": 0}


class _Hashed:
    """A file being written, its size and sha256 taken as it goes (write_manifest's `hashed`)."""

    def __init__(self, path: Path) -> None:
        self.path, self.sha, self.size = path, hashlib.sha256(), 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "wb")

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> dict[str, Any]:
        self.f.close()
        return {"size": self.size, "sha256": self.sha.hexdigest()}


def file_names(fmt: str, name: str) -> list[str]:
    """A split's files by its token file's name: the token file, its index or metadata, its provenance."""
    stem = name.removesuffix(TOKENS[fmt])
    return [name, stem + (".idx" if fmt == "megatron" else META), side_file(name).as_posix()]


def concatenate(parts: list[tuple[Path, str]], out: Path, name: str, fmt: str, dtype: np.dtype) -> dict[str, dict]:
    """The tasks' files of one split or shard group (`parts`: each task's folder and token file, in task order) as
    the split's files under `out`, `name` its token file; returns each file's size and sha256."""
    tokens_name, aside_name, side_name = file_names(fmt, name)
    tokens, side = _Hashed(out / tokens_name), _Hashed(out / side_name)
    rows = zstandard.ZstdCompressor(level=3).stream_writer(side, closefd=False)
    aside = _Hashed(out / aside_name)
    meta = gzip.GzipFile(filename="", mode="wb", fileobj=aside, mtime=0) if fmt == "olmo-core" else None
    lengths, start = [], 0
    for folder, local in parts:
        src = folder / local
        with open(src, "rb") as f:
            while block := f.read(CHUNK):
                tokens.write(block)
        lengths.append(src.with_suffix(LENGTHS))
        with open(side_file(src), "rb") as f:
            for line in io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f)):
                rows.write(line)
                if meta is not None:
                    row = json.loads(line)
                    text = io.StringIO()
                    csv.writer(text, lineterminator="\n").writerow([start, start + row["tokens"], row["id"]])
                    meta.write(text.getvalue().encode())
                    start += row["tokens"]
    rows.close()
    if meta is not None:
        meta.close()
    else:
        _megatron_index(aside, lengths, dtype)
    return {tokens_name: tokens.close(), aside_name: aside.close(), side_name: side.close()}


def _megatron_index(idx: _Hashed, length_files: list[Path], dtype: np.dtype) -> None:
    n = sum(p.stat().st_size // 4 for p in length_files)
    idx.write(MEGATRON_HEAD.pack(MEGATRON_MAGIC, 1, MEGATRON_CODES[dtype.name], n, n + 1))
    for p in length_files:
        idx.write(np.fromfile(p, "<u4").astype("<i4").tobytes())
    at = 0
    for p in length_files:
        ends = np.cumsum(np.fromfile(p, "<u4"), dtype=np.int64) * dtype.itemsize
        idx.write((at + ends - np.diff(ends, prepend=0)).astype("<i8").tobytes())
        at += int(ends[-1]) if len(ends) else 0
    for a in range(0, n + 1, CHUNK):
        idx.write(np.arange(a, min(n + 1, a + CHUNK), dtype="<i8").tobytes())


# --- reading them back (kiln shards verify and inspect) ----------------------------------------------------------

def megatron_lengths(path: Path, dtype: np.dtype) -> np.ndarray:
    """The sequence lengths of a Megatron `.idx`, after checking its header, its size and its offsets against
    `path` (the `.bin`)."""
    idx = path.with_suffix(".idx")
    raw = idx.read_bytes()
    if len(raw) < MEGATRON_HEAD.size:
        raise IntegrityError(f"{idx}: shorter than Megatron's index header; the file is cut")
    magic, version, code, n, docs = MEGATRON_HEAD.unpack_from(raw)
    if (magic, version, code, docs) != (MEGATRON_MAGIC, 1, MEGATRON_CODES.get(dtype.name), n + 1) or \
            len(raw) != MEGATRON_HEAD.size + n * 4 + n * 8 + (n + 1) * 8:
        raise IntegrityError(f"{idx}: not the Megatron index `kiln pack` wrote for {dtype.name} tokens (header "
                             f"{magic!r} v{version} dtype {code}, {n} sequences, {len(raw)} bytes)")
    lengths = np.frombuffer(raw, "<i4", n, MEGATRON_HEAD.size).astype(np.int64)
    pointers = np.frombuffer(raw, "<i8", n, MEGATRON_HEAD.size + 4 * n)
    documents = np.frombuffer(raw, "<i8", n + 1, MEGATRON_HEAD.size + 12 * n)
    ends = np.cumsum(lengths) * dtype.itemsize
    if (pointers != ends - lengths * dtype.itemsize).any() or (documents != np.arange(n + 1)).any() \
            or (lengths <= 0).any() or int(ends[-1] if n else 0) != path.stat().st_size:
        raise IntegrityError(f"{idx}: its sequences do not tile {path.name}; re-run `kiln pack`")
    return lengths


def olmo_lengths(path: Path, dtype: np.dtype, eos: int) -> np.ndarray:
    """The document lengths of an OLMo-core token file's `.csv.gz`, after checking that they tile the file and each
    document ends with EOS (so the boundaries OLMo-core infers from the tokens are the same)."""
    meta = Path(str(path).removesuffix(TOKENS["olmo-core"]) + META)
    with gzip.open(meta, "rt", newline="") as f:
        bounds = np.array([(int(r[0]), int(r[1])) for r in csv.reader(f)], dtype=np.int64).reshape(-1, 2)
    tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
    starts, ends = bounds[:, 0], bounds[:, 1]
    if len(bounds) == 0 or starts[0] != 0 or (starts[1:] != ends[:-1]).any() or (ends <= starts).any() \
            or ends[-1] != len(tokens) or (tokens[ends - 1] != eos).any():
        raise IntegrityError(f"{meta}: its documents do not tile {path.name} each ending with EOS {eos}; "
                             "re-run `kiln pack`")
    return ends - starts


def verify(folder: Path, manifest: dict[str, Any]) -> None:
    """Each split's files against each other and manifest.json (verify_folder has checked their hashes)."""
    fmt, dtype = manifest["format"], np.dtype(manifest["dtype"])
    for split, info in manifest["splits"].items():
        tokens = documents = 0
        for name in info["files"]:
            path, *_ = (listed_name(folder, f, manifest["files"], folder / MANIFEST) for f in file_names(fmt, name))
            lengths = megatron_lengths(path, dtype) if fmt == "megatron" else olmo_lengths(path, dtype,
                                                                                            manifest["eos_id"])
            tokens, documents = tokens + int(lengths.sum()), documents + len(lengths)
        if (tokens, documents) != (info["tokens"], info["documents"]):
            raise IntegrityError(f"{folder}/{split}: files hold {tokens} tokens in {documents} documents, "
                                 f"manifest.json says {info['tokens']} in {info['documents']}")


def document_provenance(folder: Path, manifest: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """`kiln shards inspect --at INDEX` of a megatron or olmo-core folder: document `index` of the split (entry
    `index` of its token files, in the manifest's order), its tokens and its provenance row, shaped as
    inspect.sample_provenance's answer (one piece: the whole document)."""
    info = manifest["splits"].get(split)
    if not info or not info["documents"]:
        raise KilnError(f"{folder}: the {split} split has no documents; nothing to inspect there")
    if not 0 <= index < info["documents"]:
        raise KilnError(f"{folder}: the {split} split has {info['documents']} documents; --at must be 0.."
                        f"{info['documents'] - 1}")
    fmt, dtype, at = manifest["format"], np.dtype(manifest["dtype"]), index
    for name in info["files"]:
        side = side_file(name).as_posix()
        try:
            verify_folder(folder, only={name, side})
        except IntegrityError as exc:
            raise IntegrityError(f"{exc}; the shards folder changed after `kiln pack` wrote it: re-run `kiln pack`") \
                from None
        start = 0
        for row in read_part(folder / side):  # streamed: the rows before it are summed, not held
            if at:
                at, start = at - 1, start + row["tokens"]
                continue
            n = row["tokens"]
            ids = np.memmap(folder / name, dtype=dtype, mode="r")[start:start + n]
            piece = {"doc": row["doc"], "id": row["id"], "url": row.get("url"), "source": row.get("source"),
                     "offset": row.get("offset"), "length": row.get("length"), "doc_total_tokens": n,
                     "sample_tokens": [0, n], "doc_tokens": [0, n]}
            return {"folder": str(folder), "split": split, "index": index, "samples": info["documents"],
                    "shard": name, "format": fmt, "tokenizer_sha256": manifest["tokenizer_sha256"],
                    "shard_tokens": [start, start + n], "tokens": np.asarray(ids, dtype=np.int64).tolist(),
                    "pieces": [piece]}
    raise IntegrityError(f"{folder}: the {split} split's provenance holds fewer than {index + 1} documents, "
                         "manifest.json more; re-run `kiln pack`")
