"""MinHash dedup: Kiln's stages (what `kiln data` runs on its workers) vs datatrove's 4-stage MinHash.

Corpus: the synthetic corpus of bench_data_scale (DOCS documents in JSONL files of 5,000, planted
near copies at word 5-gram Jaccard 0.78-0.97 measured exactly, chains A < B < C, exact copies),
written once and read by both. Truth as there: a planted copy with Jaccard >= 0.8 must go.

- Kiln: each file is a task: read its JSONL, `Signer` (exact key, MinHash 20 bands x 6 rows,
  shingles) writes the task's files; then the exact stage, the band stage (candidates confirmed by
  exact Jaccard >= 0.8) and the clusters (`stages.run_stages`), one worker, in this process.
- datatrove 0.10.1 (its own venv, $DATATROVE_PYTHON): JsonlReader -> MinhashDedupSignature,
  MinhashDedupBuckets (one task per bucket), MinhashDedupCluster, MinhashDedupFilter (reads the
  documents again, writes the kept ones and, through its exclusion writer, the removed ones); its
  default 14 buckets x 8 hashes and 5-grams; LocalPipelineExecutor with one worker.
Both run end to end in one process on one core; documents/s per core = documents / the process's CPU
seconds (robust to other jobs sharing the machine; wall-clock rates are printed too), medians of RUNS
(PEER_RUNS for datatrove, which runs in a subprocess while Kiln's runs go on). Recall and precision
against the same truth. SimHash is timed too (Kiln only; METHODS=minhash leaves it out).

    DATATROVE_PYTHON=/path/to/venv/bin/python DOCS=100000 RUNS=3 python -m benchmarks dedup
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import _datatrove
from benchmarks.bench_data_scale import build
from kiln.config import DedupConfig

DOCS = int(os.environ.get("DOCS", "100000"))
RUNS = int(os.environ.get("RUNS", "3"))
PEER_RUNS = int(os.environ.get("PEER_RUNS", str(RUNS)))  # datatrove takes minutes a run at 100,000 documents
METHODS = os.environ.get("METHODS", "minhash,simhash").split(",")

PEER = r'''
import json, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                              MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

args = json.loads(sys.argv[1])
tmp, cfg = args["tmp"], MinhashConfig()
stages = [
    [JsonlReader(args["folder"]), MinhashDedupSignature(output_folder=tmp + "/sigs", config=cfg)],
    [MinhashDedupBuckets(input_folder=tmp + "/sigs", output_folder=tmp + "/buckets", config=cfg)],
    [MinhashDedupCluster(input_folder=tmp + "/buckets", output_folder=tmp + "/remove", config=cfg)],
    [JsonlReader(args["folder"]), MinhashDedupFilter(input_folder=tmp + "/remove",
                                                     exclusion_writer=JsonlWriter(tmp + "/removed")),
     JsonlWriter(tmp + "/kept")],
]
t0 = time.perf_counter()
for i, pipeline in enumerate(stages):
    tasks = cfg.num_buckets if i == 1 else 1  # the bucket stage runs one task per bucket
    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=f"{tmp}/logs{i}").run()
seconds, cpu = time.perf_counter() - t0, time.process_time()
import gzip, glob
removed = [json.loads(line)["id"] for p in glob.glob(tmp + "/removed/*") for line in gzip.open(p, "rt")]
print(json.dumps({"seconds": seconds, "cpu": cpu, "removed": removed}))
'''


def kiln_once(folder: Path, work: Path, cfg: DedupConfig) -> tuple[float, float, set[str]]:
    """(wall seconds, CPU seconds, removed ids)."""
    from kiln.data.dedup.stages import Signer, dedup_layout, run_stages
    from kiln.manifest import write_atomic

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0, c0 = time.perf_counter(), time.process_time()
    summaries, ids = [], []
    for t, path in enumerate(sorted(folder.glob("*.jsonl"))):
        signer = Signer(cfg)
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                signer.add(rec["id"], rec["text"])
                ids.append(rec["id"])
        for suffix, blob in signer.files().items():
            write_atomic(work / f"task-{t:05d}.{suffix}", blob)
        summaries.append({"index": t, "kept": len(signer.ids)})
    verdicts = run_stages(dedup_layout(work, summaries, cfg), workers=1)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return seconds, cpu, {ids[q] for q in verdicts.exact.keys() | verdicts.near.keys()}


def quality(removed: set[str], truth: dict) -> tuple[float, float]:
    go, unplanned = truth["go"].keys(), set(truth["unplanned"])
    hit = removed & go
    return len(hit) / len(go), len(hit) / max(len(removed - unplanned), 1)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dedup-") as tmp:
        folder = Path(tmp) / "jsonl"
        truth = build(folder, DOCS)
        near = sum(k.startswith("near") for k in truth["go"])
        print(f"corpus     {DOCS:,} docs: {len(truth['go'])} planted copies to remove ({near} near, "
              f"{len(truth['go']) - near} chain and exact), {len(truth['unplanned'])} below Jaccard 0.8 not judged")
        peer: list[dict] = []
        thread = None
        if _datatrove.python():
            thread = threading.Thread(target=lambda: peer.extend(_datatrove.run(PEER, {"folder": str(folder)})
                                                                 for _ in range(PEER_RUNS)))
            thread.start()
        rates = {}
        for method in METHODS:
            runs = [kiln_once(folder, Path(tmp) / "work", DedupConfig(method=method)) for _ in range(RUNS)]
            rates[method] = statistics.median(DOCS / c for _, c, _ in runs)
            recall, precision = quality(runs[0][2], truth)
            print(f"kiln {method:8} median {rates[method]:8.1f} docs/s per core (CPU)  recall {recall:.4f}  precision "
                  f"{precision:.4f}  (runs, CPU: {[round(DOCS / c, 1) for _, c, _ in runs]}; wall: "
                  f"{[round(DOCS / w, 1) for w, _, _ in runs]})", flush=True)
        if thread is None:
            print("datatrove  skipped: set DATATROVE_PYTHON to a python with datatrove 0.10.1")
            return
        thread.join()
    if not peer:
        raise RuntimeError("the datatrove run failed (see above)")
    peer_rate = statistics.median(DOCS / r["cpu"] for r in peer)
    recall, precision = quality(set(peer[0]["removed"]), truth)
    print(f"datatrove minhash (4 stages) median {peer_rate:8.1f} docs/s per core (CPU)  recall {recall:.4f}  precision "
          f"{precision:.4f}  (runs, CPU: {[round(DOCS / r['cpu'], 1) for r in peer]}; wall: "
          f"{[round(DOCS / r['seconds'], 1) for r in peer]})")
    print(f"ratio      kiln minhash / datatrove minhash = {rates['minhash'] / peer_rate:.1f}x per core")


if __name__ == "__main__":
    main()
