"""Self-describing token shards: a 64-byte header, then tokens; an index of documents beside each.

`NNNNN.bin`:  magic "KILNTOK\\0", version u32, token bytes u32 (2|4), vocab size u32,
              sample length u32, token count u64, tokenizer sha256 (32 raw bytes),
              then `token count` little-endian uint16/uint32 tokens.
`NNNNN.idx`:  magic "KILNIDX\\0", version u32, reserved u32, entry count u64,
              then entries (start u64, length u32, doc u32): a document's token
              range in the shard and its number (its row in `NNNNN.docs.jsonl.zst`, provenance.py).

A reader checks the header against what it expects (dtype, vocabulary,
tokenizer hash), which is the common silent failure of headerless formats.

`files.jsonl` (`FILES_TABLE`): one row per file of the folder, `{"name", "size", "sha256"}`, a `.bin`'s
with `"in"`: the manifest lists that hold it (`splits.<split>.files`, a shard group's `files`), in their
order. manifest.json lists only this table (its sha256 vouches for every row) and records
`file_table: {"name", "files"}`; its size therefore does not grow with the number of shards.
`kiln.manifest.read_manifest` puts the rows back, so a reader sees `files` and the split lists as when
they were inline (as in folders written before the table, which read as they are).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import IntegrityError
from kiln.manifest import MANIFEST, verify_folder
from kiln.names import listed_name

FORMAT_VERSION = 1
FILES_TABLE = "files.jsonl"  # the folder's files and shard lists, beside manifest.json (module docstring)
BIN_MAGIC, IDX_MAGIC = b"KILNTOK\0", b"KILNIDX\0"
BIN_HEADER = struct.Struct("<8sIIIIQ32s")
IDX_HEADER = struct.Struct("<8sIIQ")
IDX_ENTRY = np.dtype([("start", "<u8"), ("length", "<u4"), ("doc", "<u4")])
assert BIN_HEADER.size == 64 and IDX_HEADER.size == 24


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class ShardHeader:
    token_bytes: int
    vocab_size: int
    sample_len: int
    num_tokens: int
    tokenizer_sha256: str

    def pack(self) -> bytes:
        return BIN_HEADER.pack(BIN_MAGIC, FORMAT_VERSION, self.token_bytes, self.vocab_size, self.sample_len,
                               self.num_tokens, bytes.fromhex(self.tokenizer_sha256))


def write_shard(path: Path, tokens: np.ndarray, header: ShardHeader, index: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(header.pack())
        f.write(tokens.astype(token_dtype(header.vocab_size), copy=False).tobytes())
    with open(path.with_suffix(".idx"), "wb") as f:
        f.write(IDX_HEADER.pack(IDX_MAGIC, FORMAT_VERSION, 0, len(index)))
        f.write(index.astype(IDX_ENTRY, copy=False).tobytes())


def read_header(path: Path) -> ShardHeader:
    with open(path, "rb") as f:
        raw = f.read(BIN_HEADER.size)
    if len(raw) < BIN_HEADER.size:
        raise IntegrityError(f"{path}: shorter than the {BIN_HEADER.size}-byte shard header; the file is cut")
    magic, version, nbytes, vocab, sample_len, ntok, tok_sha = BIN_HEADER.unpack(raw)
    if magic != BIN_MAGIC:
        raise IntegrityError(f"{path}: not a Kiln token shard (magic {magic!r}); was it written by `kiln pack`?")
    if version != FORMAT_VERSION:
        raise IntegrityError(
            f"{path}: shard format version {version}, this Kiln reads {FORMAT_VERSION}; re-run `kiln pack`"
        )
    if nbytes not in (2, 4) or token_dtype(vocab).itemsize != nbytes:
        raise IntegrityError(
            f"{path}: header says {nbytes}-byte tokens for a vocabulary of {vocab}; the header is corrupt"
        )
    header = ShardHeader(nbytes, vocab, sample_len, ntok, tok_sha.hex())
    expected = BIN_HEADER.size + ntok * nbytes
    if path.stat().st_size != expected:
        raise IntegrityError(
            f"{path}: {path.stat().st_size} bytes, header promises {expected}; the file is cut or padded"
        )
    return header


def read_tokens(path: Path, header: ShardHeader | None = None) -> np.ndarray:
    """The token array, memory-mapped; `header` when the caller has read it already."""
    header = header or read_header(path)
    return np.memmap(
        path, dtype=token_dtype(header.vocab_size), mode="r", offset=BIN_HEADER.size, shape=(header.num_tokens,)
    )


def read_index_header(path: Path) -> int:
    """The entry count of an index, after checking its header and that its size holds that many entries."""
    with open(path, "rb") as f:
        raw = f.read(IDX_HEADER.size)
    if len(raw) < IDX_HEADER.size:
        raise IntegrityError(f"{path}: shorter than the index header; the file is cut")
    magic, version, _, count = IDX_HEADER.unpack(raw)
    if magic != IDX_MAGIC or version != FORMAT_VERSION:
        raise IntegrityError(f"{path}: not a Kiln shard index (magic {magic!r}, version {version})")
    if path.stat().st_size != IDX_HEADER.size + count * IDX_ENTRY.itemsize:
        raise IntegrityError(f"{path}: {path.stat().st_size} bytes, header promises {count} entries; the file is cut")
    return count


def read_index(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    if len(raw) < IDX_HEADER.size:
        raise IntegrityError(f"{path}: shorter than the index header; the file is cut")
    magic, version, _, count = IDX_HEADER.unpack_from(raw)
    if magic != IDX_MAGIC or version != FORMAT_VERSION:
        raise IntegrityError(f"{path}: not a Kiln shard index (magic {magic!r}, version {version})")
    if len(raw) != IDX_HEADER.size + count * IDX_ENTRY.itemsize:
        raise IntegrityError(f"{path}: {len(raw)} bytes, header promises {count} entries; the file is cut")
    return np.frombuffer(raw, dtype=IDX_ENTRY, offset=IDX_HEADER.size, count=count)


def verify_shards(folder: Path) -> dict:
    """Sizes, sha256, headers and index consistency; raise IntegrityError naming the first bad file."""
    folder = Path(folder)
    from kiln.shards.provenance import side_file

    manifest = verify_folder(folder)
    if manifest.get("format", "kiln") != "kiln":  # packed for Megatron-LM or OLMo-core
        from kiln.shards.external import verify

        verify(folder, manifest)
        return manifest
    n_docs = int(manifest["documents"])
    for split, info in manifest["splits"].items():
        total = 0
        for name in info["files"]:
            path = listed_name(folder, name, manifest["files"], folder / MANIFEST)
            header = read_header(path)
            if (header.tokenizer_sha256, header.vocab_size, header.sample_len) != (
                    manifest["tokenizer_sha256"], manifest["vocab_size"], manifest["sample_len"]):
                raise IntegrityError(
                    f"{path}: header's tokenizer, vocabulary or sample length differ from manifest.json"
                )
            index = read_index(path.with_suffix(".idx"))
            ends = index["start"] + index["length"]
            if len(index) and (int(ends.max()) > header.num_tokens or int(index["doc"].max()) >= n_docs):
                raise IntegrityError(
                    f"{path.with_suffix('.idx')}: an entry points past the shard's tokens or the document list"
                )
            if (index["length"] == 0).any() or (index["start"][1:] < ends[:-1]).any():
                raise IntegrityError(f"{path.with_suffix('.idx')}: entries are empty, overlap or are out of order")
            if len(index) and side_file(name).as_posix() not in manifest["files"]:
                raise IntegrityError(f"{folder / side_file(name)}: the shard's provenance is not in manifest.json; "
                                     "re-run `kiln pack`")
            total += header.num_tokens
        if total != info["tokens"]:
            raise IntegrityError(f"{folder}/{split}: shards hold {total} tokens, manifest.json says {info['tokens']}")
    return manifest
