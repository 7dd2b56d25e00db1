"""Deduplication as in-memory indexes over one stream (every signature held in one process): what the tests check
the hashing and confirmation through; the data stage runs the partitioned stages (stages.py) instead.
`near_dedup(cfg)` builds the index `data.dedup.method` asks for; `near_duplicate_ledger` indexes a stream's kept
documents and returns the ledger; `drop_near_duplicates` rejects the ledger's members in a second pass."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from kiln.data.dedup.minhash import MinHashDedup
from kiln.data.dedup.simhash import SimHashDedup
from kiln.data.document import Document


def near_dedup(cfg, spill_dir: str | None = None) -> "MinHashDedup | SimHashDedup | None":
    """The near-duplicate index `cfg` (a DedupConfig) asks for; `spill_dir` holds MinHash's shingle file."""
    if cfg.method == "minhash":
        return MinHashDedup(cfg.bands, cfg.rows, cfg.threshold, cfg.ngram, cfg.tokens, cfg.seed, spill_dir)
    if cfg.method == "simhash":
        return SimHashDedup(cfg.hamming, cfg.ngram, cfg.tokens)
    return None


def near_duplicate_ledger(index: "MinHashDedup | SimHashDedup", docs: Iterable[Document]) -> list[dict[str, Any]]:
    """Index the kept documents of `docs` and return the ledger, naming documents by id and each member
    by its `position` among the kept documents. The index is keyed by position, not id: ids taken from
    a JSONL/Parquet field can repeat across files, and two documents must never share a verdict."""
    for doc in docs:
        if doc.rejection is None:
            index.add(doc.id, doc.text or "")
    return index.ledger()


def drop_near_duplicates(docs: Iterator[Document], ledger: list[dict[str, Any]]) -> Iterator[Document]:
    """Reject every kept document the ledger names as a member (by position; the same stream the ledger
    was built from), pointing at its survivor."""
    removed = {row["position"]: row for row in ledger}
    kept = 0
    for doc in docs:
        if doc.rejection is None:
            row = removed.get(kept)
            kept += 1
            if row is not None:
                doc.reject("dedup", "near_duplicate", duplicate_of=row["survivor"], similarity=row["similarity"],
                           cluster=row["cluster"])
        yield doc
