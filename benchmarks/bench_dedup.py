"""Near-duplicate dedup: Kiln's MinHash (and SimHash) vs datatrove's MinHash, and precision/recall.

Corpus: DOCS documents built with planted copies (as tests/test_dedup.py does): originals, near
copies with word 5-gram Jaccard 0.8-0.97 (must go), and pairs sharing half their words (Jaccard
~1/3, must stay). Timed: signatures + candidate search + clustering, one core, medians of RUNS.
Kiln's MinHash uses 20 bands x 6 rows and confirms candidates by exact Jaccard; datatrove's its
FineWeb setting (14 x 8, no confirmation): MinhashDedupSignature -> Buckets -> Cluster on a
one-worker LocalPipelineExecutor reading the same documents from JSONL.

    DATATROVE_PYTHON=/path/to/venv/bin/python python -m benchmarks dedup
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import _datatrove
from kiln.config import DedupConfig
from kiln.data.dedup import near_dedup
from kiln.data.dedup.shingles import jaccard, shingle_hashes

DOCS = int(os.environ.get("DOCS", "4000"))
RUNS = int(os.environ.get("RUNS", "3"))
VOCAB = [f"{a}{b}{c}" for a in "bcdfghklmnprstvz" for b in ("ai", "eo", "ul", "ix", "an", "or", "em", "us") for c in "aeiou"]

PEER = r'''
import json, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupSignature
from datatrove.pipeline.readers import JsonlReader

args = json.loads(sys.argv[1])
tmp = args["tmp"]
stages = [
    [JsonlReader(args["folder"]), MinhashDedupSignature(output_folder=tmp + "/sigs")],
    [MinhashDedupBuckets(input_folder=tmp + "/sigs", output_folder=tmp + "/buckets")],
    [MinhashDedupCluster(input_folder=tmp + "/buckets", output_folder=tmp + "/remove")],
]
t0 = time.perf_counter()
for i, pipeline in enumerate(stages):
    tasks = 14 if i == 1 else 1  # the bucket stage runs one task per band
    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=f"{tmp}/logs{i}").run()
print(json.dumps({"seconds": time.perf_counter() - t0}))
'''


def planted(seed: int = 0) -> tuple[list[tuple[str, str]], set[str], set[str]]:
    rng = random.Random(seed)
    words = lambda n: [rng.choice(VOCAB) for _ in range(n)]  # noqa: E731
    docs, must_go, must_stay = [], set(), set()
    n_orig = DOCS // 2
    bases = [words(rng.randint(150, 400)) for _ in range(n_orig)]
    docs += [(f"orig-{i}", " ".join(w)) for i, w in enumerate(bases)]
    must_stay |= {d for d, _ in docs}
    for k in range(DOCS // 4):
        out = list(bases[k])
        base = shingle_hashes(" ".join(out))
        target = rng.uniform(0.8, 0.97)
        while jaccard(base, shingle_hashes(" ".join(out))) > target + 0.03:
            out[rng.randrange(len(out))] = rng.choice(VOCAB) + "x"
        docs.append((f"near-{k}", " ".join(out)))
        must_go.add(f"near-{k}")
    for k in range(DOCS // 8):
        a = words(300)
        b = a[:150] + words(150)
        docs += [(f"half-a-{k}", " ".join(a)), (f"half-b-{k}", " ".join(b))]
        must_stay |= {f"half-a-{k}", f"half-b-{k}"}
    return docs, must_go, must_stay


def kiln_once(docs, method: str) -> tuple[float, dict, int]:
    t0 = time.perf_counter()
    index = near_dedup(DedupConfig(method=method))
    for doc_id, text in docs:
        index.add(doc_id, text)
    removed = index.duplicates()
    return time.perf_counter() - t0, removed, index.index_bytes()


def main() -> None:
    docs, must_go, must_stay = planted()
    print(f"corpus     {len(docs)} docs: {len(must_go)} planted near copies, {len(must_stay)} that must stay")
    rates = {}
    for method in ("minhash", "simhash"):
        runs = [kiln_once(docs, method) for _ in range(RUNS)]
        _, removed, nbytes = runs[0]
        rates[method] = statistics.median(len(docs) / s for s, _, _ in runs)
        tp = len(removed.keys() & must_go)
        print(f"kiln {method}  median {rates[method]:8.1f} docs/s per core  precision {tp / max(len(removed), 1):.3f}  "
              f"recall {tp / len(must_go):.3f}  false removals {len(removed.keys() & must_stay) / len(must_stay):.4f}  "
              f"index {nbytes / len(docs):.0f} B/doc in RAM")
    if not _datatrove.python():
        print("datatrove  skipped: set DATATROVE_PYTHON to a python with datatrove 0.10.1")
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "jsonl"
        folder.mkdir()
        with open(folder / "docs.jsonl", "w") as f:
            for doc_id, text in docs:
                f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
        peer = [_datatrove.run(PEER, {"folder": str(folder)})["seconds"] for _ in range(RUNS)]
    peer_rate = statistics.median(len(docs) / s for s in peer)
    print(f"datatrove minhash  median {peer_rate:8.1f} docs/s per core  (runs: {[round(len(docs) / s, 1) for s in peer]})")
    print(f"ratio      kiln minhash / datatrove minhash = {rates['minhash'] / peer_rate:.1f}x")


if __name__ == "__main__":
    main()
