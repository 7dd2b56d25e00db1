"""One split's token stream written to shards as it arrives: nothing buffers a whole shard.

`SplitWriter` takes the packer's chunks (tokens with their index entries) and streams them into the
current shard's three files: `.bin` tokens, `.idx` entries and the `.docs.jsonl.zst` provenance rows
(format.py, provenance.py). Both headers are written as placeholders and filled in when the shard
closes, once its token and entry counts are known. Only whole samples are written: up to one sample
less one token waits for the next chunk, and what is left at the end (the concat tail shorter than a
sample) is dropped and counted, never written.

Memory: the packer's chunk and less than one sample of held tokens, a batch of at most `IDX_BATCH`
index entries, and the provenance of the documents whose tokens are not all written yet (one, or a
best-fit window's). None of it grows with the corpus or with `pack.samples_per_shard`.

The files are byte for byte those of writing each shard at once, except the provenance file's zstd
frame (streamed, so it does not record its content size); its rows are the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from kiln.shards.format import BIN_HEADER, FORMAT_VERSION, IDX_ENTRY, IDX_HEADER, IDX_MAGIC, ShardHeader, token_dtype
from kiln.shards.packing import Entry, Packer
from kiln.shards.provenance import side_file

IDX_BATCH = 1 << 16  # index entries held before they go to the .idx file
Piece = tuple[int, int, int, bool]  # (start, length, doc, continues the entry before it)


class ShardFile:
    """One shard being written: tokens, index entries and provenance rows appended as they come."""

    def __init__(self, path: Path, header: ShardHeader) -> None:
        self.path, self.header = path, header
        self.dtype = token_dtype(header.vocab_size)
        self.bin = open(path, "wb")
        self.bin.write(b"\0" * BIN_HEADER.size)
        self.idx = open(path.with_suffix(".idx"), "wb")
        self.idx.write(b"\0" * IDX_HEADER.size)
        self.side_raw = open(side_file(path), "wb")
        self.side = zstandard.ZstdCompressor(level=3).stream_writer(self.side_raw, closefd=False)
        self.tokens = self.entries = 0
        self.batch: list[Entry] = []
        self.open: list[int] | None = None  # the last entry, still extendable by a continuation

    def write(self, tokens: np.ndarray, pieces: list[Piece], rows: SplitWriter) -> None:
        """Append `tokens`; `pieces` are their entries (start relative to `tokens`)."""
        self.bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        for start, length, doc, continues in pieces:
            at = self.tokens + start
            o = self.open
            if continues and o is not None and o[2] == doc and o[0] + o[1] == at:
                o[1] += length  # the same entry, cut only by where a write ended
            else:
                self._close_entry()
                self.open = [at, length, doc]
            rows.written(doc, length, self)
        self.tokens += len(tokens)

    def row(self, row: dict[str, Any]) -> None:
        self.side.write((json.dumps(row, ensure_ascii=False) + "\n").encode())

    def _close_entry(self) -> None:
        if self.open is not None:
            self.batch.append(tuple(self.open))
            self.open = None
            if len(self.batch) >= IDX_BATCH:
                self._flush_entries()

    def _flush_entries(self) -> None:
        self.idx.write(np.array(self.batch, dtype=IDX_ENTRY).tobytes())
        self.entries += len(self.batch)
        self.batch = []

    def close(self) -> None:
        self._close_entry()
        self._flush_entries()
        h = self.header
        self.bin.seek(0)
        self.bin.write(ShardHeader(h.token_bytes, h.vocab_size, h.sample_len, self.tokens, h.tokenizer_sha256).pack())
        self.idx.seek(0)
        self.idx.write(IDX_HEADER.pack(IDX_MAGIC, FORMAT_VERSION, 0, self.entries))
        self.side.close()
        for f in (self.bin, self.idx, self.side_raw):
            f.close()


class SplitWriter:
    """Accumulates one split's token stream from its packer and streams it into shards of
    `samples_per_shard` samples (see the module docstring for what it holds)."""

    def __init__(self, folder: Path, split: str, header: ShardHeader, samples_per_shard: int, packer: Packer,
                 prefix: str = "") -> None:
        self.folder, self.split, self.header, self.packer = folder / split, split, header, packer
        self.prefix = prefix  # a shard group's files: {split}/{prefix}NNNNN.bin
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard_tokens = samples_per_shard * header.sample_len
        self.held: list[np.ndarray] = []  # tokens not written yet: less than one sample between chunks
        self.held_pieces: list[Piece] = []  # their entries, start relative to the held tokens
        self.buffered = 0
        self.shard: ShardFile | None = None
        self.files: list[str] = []
        self.total_tokens = self.documents = 0
        self.pending: dict[int, dict[str, Any]] = {}  # provenance of documents with tokens still to write
        self.unwritten: dict[int, int] = {}
        self.row_in: dict[int, int] = {}  # document -> the shard (its number in `files`) that has its row

    def add(self, ids: np.ndarray, doc: int, provenance: dict[str, Any] | None = None) -> None:
        self.documents += 1
        self.pending[doc] = {"doc": doc, **(provenance or {}), "tokens": len(ids)}
        self.unwritten[doc] = len(ids)
        for chunk, entries in self.packer.add(ids, doc):
            self._append(chunk, entries)

    def _append(self, tokens: np.ndarray, entries: list[Entry]) -> None:
        self.held.append(tokens)
        self.held_pieces += [(self.buffered + start, length, doc, False) for start, length, doc in entries]
        self.buffered += len(tokens)
        L = self.header.sample_len
        if self.buffered >= L:
            self._write((self.buffered // L) * L)

    def _write(self, n: int) -> None:
        """Write the first `n` held tokens (whole samples), cutting shards where they fill."""
        stream = self.held[0] if len(self.held) == 1 else np.concatenate(self.held)
        at = 0
        while at < n:
            if self.shard is None:
                name = f"{self.split}/{self.prefix}{len(self.files):05d}.bin"
                self.files.append(name)
                self.shard = ShardFile(self.folder.parent / name, self.header)
            k = min(n - at, self.shard_tokens - self.shard.tokens)
            self.shard.write(stream[at:at + k], _cut(self.held_pieces, at, at + k), self)
            at += k
            if self.shard.tokens == self.shard_tokens:
                self._close_shard()
        rest = stream[n:]
        self.held = [rest] if len(rest) else []
        self.held_pieces = _cut(self.held_pieces, n, None)
        self.buffered = len(rest)

    def written(self, doc: int, length: int, shard: ShardFile) -> None:
        """`length` tokens of `doc` went into `shard`: its provenance row there once, dropped when all are written."""
        number = len(self.files) - 1
        if self.row_in.get(doc) != number:
            self.row_in[doc] = number
            shard.row(self.pending[doc])
        self.unwritten[doc] -= length
        if not self.unwritten[doc]:
            del self.unwritten[doc], self.pending[doc], self.row_in[doc]

    def _close_shard(self) -> None:
        self.total_tokens += self.shard.tokens
        self.shard.close()
        self.shard = None

    def close(self) -> dict[str, Any]:
        for chunk, entries in self.packer.finish():
            self._append(chunk, entries)
        if self.shard is not None:
            self._close_shard()
        L = self.header.sample_len
        return {"files": self.files, "tokens": self.total_tokens, "samples": self.total_tokens // L,
                "documents": self.documents, "dropped_tail_tokens": self.buffered,
                "split_documents": self.packer.split_documents, "pad_tokens": self.packer.pad_tokens}


def _cut(pieces: list[Piece], lo: int, hi: int | None) -> list[Piece]:
    """The pieces' parts inside [lo, hi) (hi None: to the end), start relative to lo; a part that begins
    after its piece does continues it."""
    out = []
    for start, length, doc, continues in pieces:
        end = start + length
        a, b = max(start, lo), end if hi is None else min(end, hi)
        if a < b:
            out.append((a - lo, b - a, doc, continues or a > start))
    return out

