"""Deduplication, global over the kept documents in the stage's canonical order.

The data stage runs it as partitioned stages: signatures.py (made in each data task), stages.py (exact dedup
by key range, band buckets confirmed, the verdicts), clusters.py (clusters, survivors, the ledger), index.py
(`data.dedup.index`); minhash.py, simhash.py, shingles.py and exact.py hold the hashing both use. What this
module exports are the same methods as in-memory indexes over one stream (every signature held in one
process), which the stage does not use; tests/test_dedup.py checks the hashing and confirmation through them:
- `ExactDedup` (exact.py): xxh3-128 of normalised text, streaming; the first seen survives.
- `MinHashDedup` (minhash.py) and `SimHashDedup` (simhash.py): near duplicates. Both take
  `add(doc_id, text)` for every document that survived exact dedup, then `ledger()` (one row
  per removed document: cluster, survivor, member, similarity) or `duplicates()`
  ({removed id: (survivor id, similarity)}). The survivor is the cluster's first document.
- `near_dedup(cfg)` builds the one `data.dedup.method` asks for (None for `none`);
  `near_duplicate_ledger` indexes a stream's kept documents by position and returns the ledger;
  `write_ledger` writes the rows as docs/dedup_ledger.jsonl.zst; `drop_near_duplicates` then
  rejects the ledger's members in a second pass over the same stream (reason `near_duplicate`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from kiln.data.dedup.clusters import LEDGER, write_ledger
from kiln.data.dedup.exact import ExactDedup, text_key
from kiln.data.dedup.minhash import MinHashDedup
from kiln.data.dedup.simhash import SimHashDedup
from kiln.data.document import Document

__all__ = ["LEDGER", "ExactDedup", "MinHashDedup", "SimHashDedup", "drop_near_duplicates", "near_dedup",
           "near_duplicate_ledger", "text_key", "write_ledger"]


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
