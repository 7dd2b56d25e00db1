"""Exact deduplication: xxhash128 of whitespace- and case-normalised text; the first seen survives."""

from __future__ import annotations

from typing import Iterator

import xxhash

from kiln.data.document import Document


def text_key(text: str) -> bytes:
    return spaced_key(spaced_text(text.lower()))


def spaced_key(spaced: bytes) -> bytes:
    """`text_key` of a text whose lower-cased `spaced_text` is `spaced`."""
    return xxhash.xxh3_128_digest(spaced)


def spaced_text(low: str) -> bytes:
    """The words of a lower-cased text joined by single spaces, UTF-8: what its exact key hashes, and where
    shingles.py finds its tokens (made once for both)."""
    return " ".join(low.split()).encode("utf-8", "surrogatepass")


class ExactDedup:
    """Global across files: documents must arrive in the stage's canonical order for determinism."""

    def __init__(self) -> None:
        self.first: dict[bytes, str] = {}

    def __call__(self, docs: Iterator[Document]) -> Iterator[Document]:
        for doc in docs:
            if doc.rejection is None:
                key = text_key(doc.text or "")
                if key in self.first:
                    doc.reject("dedup", "exact_duplicate", duplicate_of=self.first[key])
                else:
                    self.first[key] = doc.id
            yield doc
