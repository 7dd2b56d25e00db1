"""Encode documents, split train/val by a hash of the document id, pack with EOS into shards.

Documents are joined, each followed by EOS, into one token stream per split;
the stream is cut into samples of `seq_len + 1` tokens (inputs and shifted
targets) and into shards of `samples_per_shard` samples. The tail shorter
than one sample is dropped and counted.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import xxhash

from kiln.config import PackConfig
from kiln.errors import KilnError
from kiln.manifest import staging_dir, write_manifest
from kiln.shards.format import FORMAT_VERSION, IDX_ENTRY, ShardHeader, token_dtype, write_shard
from kiln.tokenizer import eos_id, load_tokenizer, tokenizer_sha256

SPLITS = ("train", "val")


def split_of(doc_id: str, val_fraction: float) -> str:
    """Stable per document: adding documents never moves an existing one to the other split."""
    return "val" if xxhash.xxh64_intdigest(doc_id.encode()) / 2**64 < val_fraction else "train"


class SplitWriter:
    """Accumulates one split's token stream and writes full shards as they fill."""

    def __init__(self, folder: Path, split: str, header: ShardHeader, samples_per_shard: int) -> None:
        self.folder, self.split, self.header = folder / split, split, header
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard_tokens = samples_per_shard * header.sample_len
        self.tokens: list[np.ndarray] = []
        self.entries: list[tuple[int, int, int]] = []
        self.buffered = 0
        self.files: list[str] = []
        self.total_tokens = self.documents = 0
        self.split_docs = 0  # documents whose tokens straddle a sample boundary

    def add(self, ids: np.ndarray, doc: int) -> None:
        self.documents += 1
        start = self.total_tokens + self.buffered
        L = self.header.sample_len
        if start // L != (start + len(ids) - 1) // L:
            self.split_docs += 1
        self.tokens.append(ids)
        self.entries.append((self.buffered, len(ids), doc))
        self.buffered += len(ids)
        while self.buffered >= self.shard_tokens:
            self._write(self.shard_tokens)

    def _write(self, n: int) -> None:
        stream = np.concatenate(self.tokens)
        head, rest = stream[:n], stream[n:]
        index, carry = [], []
        for start, length, doc in self.entries:
            if start < n:
                index.append((start, min(length, n - start), doc))
            if start + length > n:
                cut = max(start, n)
                carry.append((cut - n, start + length - cut, doc))
        name = f"{self.split}/{len(self.files):05d}.bin"
        header = ShardHeader(self.header.token_bytes, self.header.vocab_size, self.header.sample_len, n, self.header.tokenizer_sha256)
        write_shard(self.folder.parent / name, head, header, np.array(index, dtype=IDX_ENTRY))
        self.files.append(name)
        self.total_tokens += n
        self.tokens, self.entries, self.buffered = ([rest] if len(rest) else []), carry, len(rest)

    def close(self) -> dict[str, Any]:
        L = self.header.sample_len
        full = (self.buffered // L) * L
        if full:
            self._write(full)
        return {"files": self.files, "tokens": self.total_tokens, "samples": self.total_tokens // L,
                "documents": self.documents, "dropped_tail_tokens": self.buffered, "split_documents": self.split_docs}


def encode_documents(docs: Iterable[dict], tokenizer, batch: int) -> Iterator[tuple[dict, list[int]]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, batch)):
        for doc, enc in zip(chunk, tokenizer.encode_batch([d["text"] for d in chunk], add_special_tokens=False)):
            yield doc, enc.ids


def pack(docs: Iterable[dict], tokenizer_dir: Path, out: Path, cfg: PackConfig, fingerprint: str = "") -> dict[str, Any]:
    """Encode and pack `docs` into `out` (committed atomically with its manifest). Returns the manifest."""
    tok = load_tokenizer(tokenizer_dir)
    eos = eos_id(tok)
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)
    header = ShardHeader(dtype.itemsize, vocab, cfg.seq_len + 1, 0, tokenizer_sha256(tokenizer_dir))
    documents: list[dict[str, Any]] = []
    with staging_dir(out) as tmp:
        writers = {s: SplitWriter(tmp, s, header, cfg.samples_per_shard) for s in SPLITS}
        for doc, ids in encode_documents(docs, tok, cfg.batch_docs):
            split = split_of(doc["id"], cfg.val_fraction)
            writers[split].add(np.array(ids + [eos], dtype=dtype), len(documents))
            documents.append({"id": doc["id"], "split": split, "source": doc.get("source"),
                              "offset": doc.get("offset"), "length": doc.get("length"), "url": doc.get("url"),
                              "tokens": len(ids) + 1})
        splits = {s: w.close() for s, w in writers.items()}
        if splits["train"]["samples"] == 0:
            raise KilnError(f"too few tokens to fill one training sample of {cfg.seq_len + 1}; lower pack.seq_len or add data")
        packed = sum(s["tokens"] for s in splits.values())
        manifest = write_manifest(
            tmp, stage="pack", fingerprint=fingerprint, format_version=FORMAT_VERSION, dtype=dtype.name,
            vocab_size=vocab, eos_id=eos, tokenizer_sha256=header.tokenizer_sha256, seq_len=cfg.seq_len,
            sample_len=cfg.seq_len + 1, splits=splits,
            packing_efficiency=round(packed / max(packed + sum(s["dropped_tail_tokens"] for s in splits.values()), 1), 6),
            documents=documents,
        )
    return manifest
