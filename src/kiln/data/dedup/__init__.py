"""Deduplication, global over the kept documents in the stage's canonical order.

The data stage runs it as partitioned stages: signatures.py (made in each data task), stages.py (exact dedup
by key range, band buckets confirmed, the verdicts), clusters.py (clusters, survivors, the ledger), index.py
(`data.dedup.index`); minhash.py, simhash.py, shingles.py and exact.py hold the hashing both use. What this
package exports are the same methods as in-memory indexes over one stream (memory.py) (every signature held in one
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

from kiln.data.dedup.clusters import LEDGER, write_ledger
from kiln.data.dedup.exact import ExactDedup, text_key
from kiln.data.dedup.memory import drop_near_duplicates, near_dedup, near_duplicate_ledger
from kiln.data.dedup.minhash import MinHashDedup
from kiln.data.dedup.simhash import SimHashDedup

__all__ = ["LEDGER", "ExactDedup", "MinHashDedup", "SimHashDedup", "drop_near_duplicates", "near_dedup",
           "near_duplicate_ledger", "text_key", "write_ledger"]
