"""How documents become samples of `sample_len` tokens: `concat` or `best_fit`.

A packer takes each document's tokens (EOS included) in order and hands back
chunks of the split's token stream, each with its index entries
`(start in chunk, length, document)`. Both keep every token of a document in
the stream in the document's own order, so a document's pieces appear in the
shards one after another.

- concat: documents back to back; a document that crosses a sample boundary is
  split. Nothing is wasted but the tail shorter than one sample.
- best_fit: a document longer than a sample fills whole samples of its own and
  its remainder is packed like a short document; short documents are packed,
  a window of `best_fit_window` samples at a time, by best-fit decreasing (the
  longest first, each into the fullest sample it still fits) and never split.
  Gaps are filled with `<|pad|>` (Ding et al. 2024, "Fewer truncations improve
  language modeling").
"""

from __future__ import annotations

import bisect
from typing import Protocol

import numpy as np

from kiln.config import PackConfig

Entry = tuple[int, int, int]  # (start in chunk, length, document ordinal)
Chunk = tuple[np.ndarray, list[Entry]]


class Packer(Protocol):
    split_documents: int  # documents whose tokens land in more than one sample
    pad_tokens: int

    def add(self, ids: np.ndarray, doc: int) -> list[Chunk]: ...

    def finish(self) -> list[Chunk]: ...


class ConcatPacker:
    def __init__(self, sample_len: int) -> None:
        self.sample_len, self.position = sample_len, 0
        self.split_documents = self.pad_tokens = 0

    def add(self, ids: np.ndarray, doc: int) -> list[Chunk]:
        L, start = self.sample_len, self.position
        self.split_documents += start // L != (start + len(ids) - 1) // L
        self.position += len(ids)
        return [(ids, [(0, len(ids), doc)])]

    def finish(self) -> list[Chunk]:
        return []


class BestFitPacker:
    def __init__(self, sample_len: int, window: int, pad_id: int) -> None:
        self.sample_len, self.window_tokens, self.pad_id = sample_len, window * sample_len, pad_id
        self.pieces: list[tuple[np.ndarray, int]] = []
        self.buffered = 0
        self.split_documents = self.pad_tokens = 0

    def add(self, ids: np.ndarray, doc: int) -> list[Chunk]:
        L = self.sample_len
        whole = len(ids) // L * L
        self.split_documents += len(ids) > L
        out: list[Chunk] = [(ids[:whole], [(k, L, doc) for k in range(0, whole, L)])] if whole else []
        if whole < len(ids):
            self.pieces.append((ids[whole:], doc))
            self.buffered += len(ids) - whole
        if self.buffered >= self.window_tokens:
            out += self.finish()
        return out

    def finish(self) -> list[Chunk]:
        """Best-fit decreasing over the buffered pieces; every sample padded to full length."""
        if not self.pieces:
            return []
        L = self.sample_len
        bins: list[list[int]] = []
        room: list[tuple[int, int]] = []  # (free tokens, sample number), sorted: the fullest that fits comes first
        for i in sorted(range(len(self.pieces)), key=lambda i: -len(self.pieces[i][0])):
            n = len(self.pieces[i][0])
            k = bisect.bisect_left(room, (n, -1))
            if k == len(room):
                free, b = L, len(bins)
                bins.append([])
            else:
                free, b = room.pop(k)
            bins[b].append(i)
            if free - n:
                bisect.insort(room, (free - n, b))
        tokens = np.full(len(bins) * L, self.pad_id, dtype=self.pieces[0][0].dtype)
        entries: list[Entry] = []
        for b, members in enumerate(bins):
            at = b * L
            for i in sorted(members):  # within a sample, documents in corpus order
                ids, doc = self.pieces[i]
                tokens[at: at + len(ids)] = ids
                entries.append((at, len(ids), doc))
                at += len(ids)
            self.pad_tokens += (b + 1) * L - at
        self.pieces, self.buffered = [], 0
        return [(tokens, entries)]


def make_packer(cfg: PackConfig, pad_id: int) -> Packer:
    if cfg.mode == "best_fit":
        return BestFitPacker(cfg.seq_len + 1, cfg.best_fit_window, pad_id)
    return ConcatPacker(cfg.seq_len + 1)
