"""MinHash dedup: Kiln's stages (what `kiln data` runs on its workers) vs datatrove's 4-stage MinHash.

Corpus: the synthetic corpus of bench_data_scale (DOCS documents in JSONL files of 5,000, planted
near copies at word 5-gram Jaccard 0.78-0.97 measured exactly, chains A < B < C, exact copies),
written once and read by both. Truth as there: a planted copy with Jaccard >= 0.8 must go.
CORPUS=real: real text instead (benchmarks/real_text.py: the Debian documentation and long-pages crawls cut
into ~19,000 documents in 26 languages, their own near copies left out, copies planted the same way; DOCS is
then the corpus's size). Its words are not a 3,000-word vocabulary, so Kiln's per-process cache of token
hashes no longer always hits.

- Kiln: each file is a task: read its JSONL, `Signer` (exact key, MinHash 20 bands x 6 rows) writes the
  task's files beside its outcome (the documents, zstd JSONL); then the exact stage, the band stage, the
  candidates' shingles read again from the outcomes, their confirmation by exact Jaccard >= 0.8 and the
  clusters (`stages.run_stages`), one worker, in a process of its own.
- datatrove 0.10.1 (its own venv, $DATATROVE_PYTHON): JsonlReader -> MinhashDedupSignature (one task
  per file), MinhashDedupBuckets (one task per bucket), MinhashDedupCluster, MinhashDedupFilter (one
  task per file; reads the documents again, writes the kept ones and, through its exclusion writer,
  the removed ones); its default 14 buckets x 8 hashes and 5-grams; LocalPipelineExecutor with one worker
  for each task, so that a run that is stopped resumes at the task it was in (WORK=...); PEER_WORKERS=2 runs
  two of a stage's tasks at once (each still one process on one core, measured alone).
Both run on one core; documents/s per core = documents / CPU seconds (user + sys, getrusage of the
side's process and its waited-for children, measured around the work: robust to other jobs sharing the
machine; wall-clock rates are printed too, datatrove's over the sum of its tasks' wall times), medians of
RUNS (PEER_RUNS for datatrove, which runs in subprocesses of its own while Kiln's runs go on). Recall and
precision against the same truth. SimHash is timed too (Kiln only; METHODS=minhash leaves it out).

A datatrove run at 100,000 documents takes ~19 CPU minutes: give it a WORK folder, which keeps the
corpus, the truth, Kiln's finished runs and datatrove's finished tasks (with their CPU seconds, in
progress.jsonl), and run it in the background; run the same command again to resume after a stop (a new
folder to measure anew).

    DATATROVE_PYTHON=/path/to/venv/bin/python DOCS=100000 RUNS=3 PEER_RUNS=1 PEER_WORKERS=2 WORK=/tmp/kiln-dedup \\
        nohup python -m benchmarks dedup > dedup.log 2>&1 &
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from benchmarks import _datatrove
from benchmarks.bench_data_scale import build

ROOT = Path(__file__).resolve().parents[1]
DOCS = int(os.environ.get("DOCS", "100000"))
RUNS = int(os.environ.get("RUNS", "3"))
PEER_RUNS = int(os.environ.get("PEER_RUNS", str(RUNS)))  # datatrove takes ~19 CPU minutes a run at 100,000 documents
# datatrove's tasks of a stage in this many processes at once: the same CPU seconds a task, in less wall time where
# free cores are there (a kernel that shares the CPU by session, as Linux's autogroup does, gives the session no
# more); Kiln's side stays on one worker
PEER_WORKERS = int(os.environ.get("PEER_WORKERS", "1"))
METHODS = os.environ.get("METHODS", "minhash,simhash").split(",")
CORPUS = os.environ.get("CORPUS", "synthetic")  # or "real": benchmarks/real_text.py

# Each (stage, rank) is one LocalPipelineExecutor run in a worker process, whose CPU seconds are appended to
# progress.jsonl, so a stopped run redoes only the tasks it was in; skip_completed=False: a task not in
# progress.jsonl is measured anew.
PEER = r'''
import glob, gzip, json, os, resource, subprocess, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                              MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

args = json.loads(sys.argv[1])
tmp, files, cfg = args["tmp"], args["files"], MinhashConfig()
NAMES, TASKS = ("signature", "buckets", "cluster", "filter"), (files, cfg.num_buckets, 1, files)


def pipeline(stage):
    return [
        lambda: [JsonlReader(args["folder"]), MinhashDedupSignature(output_folder=tmp + "/sigs", config=cfg)],
        lambda: [MinhashDedupBuckets(input_folder=tmp + "/sigs", output_folder=tmp + "/buckets", config=cfg)],
        lambda: [MinhashDedupCluster(input_folder=tmp + "/buckets", output_folder=tmp + "/remove", config=cfg)],
        lambda: [JsonlReader(args["folder"]), MinhashDedupFilter(input_folder=tmp + "/remove",
                                                                 exclusion_writer=JsonlWriter(tmp + "/removed")),
                 JsonlWriter(tmp + "/kept")],
    ][stage]()


def cpu():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def run_task(stage, rank):
    (me0, kids0), t0 = cpu(), time.perf_counter()
    LocalPipelineExecutor(pipeline=pipeline(stage), tasks=TASKS[stage], local_tasks=1, local_rank_offset=rank,
                          workers=1, skip_completed=False, logging_dir=f"{tmp}/logs{stage}").run()
    (me1, kids1) = cpu()
    row = {"stage": stage, "rank": rank, "cpu": me1 - me0, "children_cpu": kids1 - kids0,
           "wall": time.perf_counter() - t0, "load": os.getloadavg()[0]}
    with open(progress, "a") as f:  # one short line in append mode: workers do not interleave
        f.write(json.dumps(row) + "\n")
    print(f"datatrove {NAMES[stage]} task {rank + 1}/{TASKS[stage]}: {row['cpu']:.1f} CPU s "
          f"(+{row['children_cpu']:.2f} in children), load {row['load']:.1f}", file=sys.stderr, flush=True)


def finished():
    return [json.loads(line) for line in open(progress)] if os.path.exists(progress) else []


progress = os.path.join(tmp, "progress.jsonl")
if "run" in args:  # a worker: these tasks, one after the other
    for stage, rank in args["run"]:
        run_task(stage, rank)
    sys.exit()
for stage, tasks in enumerate(TASKS):  # each stage's tasks shared among `workers` processes, stage after stage
    todo = [[stage, r] for r in range(tasks) if not any(d["stage"] == stage and d["rank"] == r for d in finished())]
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps(args | {"run": todo[w::args["workers"]]})])
             for w in range(min(args["workers"], len(todo)))]
    if any([p.wait() for p in procs]):
        sys.exit(f"a datatrove {NAMES[stage]} task failed")
done = finished()
removed = [json.loads(line)["id"] for p in glob.glob(tmp + "/removed/*") for line in gzip.open(p, "rt")]
stages = {name: sum(r["cpu"] + r["children_cpu"] for r in done if r["stage"] == s) for s, name in enumerate(NAMES)}
print(json.dumps({"seconds": sum(r["wall"] for r in done), "cpu": sum(stages.values()), "stages": stages,
                  "children_cpu": sum(r["children_cpu"] for r in done), "removed": removed}))
'''

# Kiln's side in a process of its own, like datatrove's, so getrusage counts its work alone.
KILN = r'''
import sys
from benchmarks.bench_dedup import kiln_once
kiln_once(*sys.argv[1:])
'''


def cpu_seconds() -> float:
    """User + sys seconds of this process and its waited-for children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def kiln_once(folder: str, work: str, method: str) -> None:
    """Kiln's dedup of the JSONL files in `folder`; prints {"seconds", "cpu", "removed": [ids]} as JSON."""
    import time

    from kiln.config import DedupConfig
    from kiln.data.dedup.signatures import Signer
    from kiln.data.dedup.stages import dedup_layout, run_stages
    import zstandard

    from kiln.data.pipeline import OUTCOME_LEVEL
    from kiln.manifest import write_atomic, writing_atomic

    cfg, work = DedupConfig(method=method), Path(work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    summaries, ids = [], []
    for t, path in enumerate(sorted(Path(folder).glob("*.jsonl"))):
        signer = Signer(cfg)
        with open(path) as f, writing_atomic(work / f"task-{t:05d}.jsonl.zst") as out, \
                zstandard.ZstdCompressor(level=OUTCOME_LEVEL).stream_writer(out, closefd=False) as outcome:
            for line in f:  # the task's outcome as a data task writes it: the stages read candidates' text there
                rec = json.loads(line)
                signer.add(rec["id"], rec["text"])
                ids.append(rec["id"])
                outcome.write((json.dumps({"id": rec["id"], "text": rec["text"]}, ensure_ascii=False) + "\n").encode())
        for suffix, blob in signer.files().items():
            write_atomic(work / f"task-{t:05d}.{suffix}", blob)
        summaries.append({"index": t, "kept": len(signer.ids)})
    verdicts = run_stages(dedup_layout(work, summaries, cfg), workers=1)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    removed = sorted(ids[q] for q in verdicts.removed().tolist())
    print(json.dumps({"seconds": seconds, "cpu": cpu, "removed": removed}))


def kiln_run(folder: Path, work: Path, method: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", KILN, str(folder), str(work), method], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def kiln_runs(folder: Path, root: Path, method: str) -> list[dict]:
    """RUNS of Kiln's dedup; each run's result is kept in `root`, so a resumed benchmark does not redo it."""
    runs = []
    for k in range(RUNS):
        result = root / f"kiln-{method}-{k}.json"
        if not result.exists():
            result.write_text(json.dumps(kiln_run(folder, root / "kiln", method)))
        runs.append(json.loads(result.read_text()))
    return runs


def quality(removed: set[str], truth: dict) -> tuple[float, float, float, float]:
    """(recall, precision) by the truth, whose survivor is the earliest document of its group (Kiln's canonical
    order); then the same with any one survivor a group: a peer that keeps a later copy instead is not marked down.
    Groups: the planted copies joined to their originals (a chain A < B < C is one group of three)."""
    go, unplanned = truth["go"], set(truth["unplanned"])
    hit, judged = removed & go.keys(), removed - unplanned
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for copy, (original, _) in go.items():
        parent[root(copy)] = root(original)
    groups: dict[str, set[str]] = {}
    for x in parent:
        groups.setdefault(root(x), set()).add(x)
    any_hit = sum(min(len(g & removed), len(g) - 1) for g in groups.values())  # a whole group removed: one too many
    return (len(hit) / len(go), len(hit) / max(len(judged), 1), any_hit / len(go), any_hit / max(len(judged), 1))


def corpus(root: Path) -> tuple[Path, dict]:
    """The corpus under `root` (DOCS synthetic documents, or CORPUS=real's) and its truth, built unless a
    finished one is there; the truth's "documents" is the corpus's size."""
    name = "real" if CORPUS == "real" else str(DOCS)
    folder, truth_path = root / f"corpus-{name}", root / f"truth-{name}.json"
    if not truth_path.exists():  # written last: a corpus without it was interrupted
        shutil.rmtree(folder, ignore_errors=True)
        if CORPUS == "real":
            from benchmarks.real_text import build as build_real

            truth = build_real(folder)
        else:
            truth = build(folder, DOCS) | {"documents": DOCS}
        truth_path.with_suffix(".part").write_text(json.dumps(truth))
        truth_path.with_suffix(".part").rename(truth_path)
    return folder, json.loads(truth_path.read_text())


def text_megabytes(folder: Path) -> float:
    """MB of text (UTF-8) in the corpus's documents."""
    return sum(len(json.loads(line)["text"].encode()) for p in sorted(folder.glob("*.jsonl")) for line in open(p)) / 1e6


def report(name: str, runs: list[dict], truth: dict, megabytes: float) -> float:
    docs = truth["documents"]
    rate = statistics.median(docs / r["cpu"] for r in runs)
    recall, precision, any_recall, any_precision = quality(set(runs[0]["removed"]), truth)
    print(f"{name:28} median {rate:8.1f} docs/s per core (CPU), {rate * megabytes / docs:.2f} MB of text/s  "
          f"recall {recall:.4f}  precision {precision:.4f}  "
          f"(any survivor: {any_recall:.4f}, {any_precision:.4f})  (runs, CPU s: {[round(r['cpu'], 1) for r in runs]}; "
          f"wall docs/s: {[round(docs / r['seconds'], 1) for r in runs]}; load {os.getloadavg()[0]:.1f})", flush=True)
    return rate


def main() -> None:
    work = os.environ.get("WORK")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dedup-") as tmp:
        root = Path(work) if work else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        folder, truth = corpus(root)
        files, megabytes = len(list(folder.glob("*.jsonl"))), text_megabytes(folder)
        near = sum(k.startswith("near") for k in truth["go"])
        print(f"corpus     {CORPUS}, {truth['documents']:,} docs in {files} files: {len(truth['go'])} planted copies "
              f"to remove ({near} near, "
              f"{len(truth['go']) - near} chain and exact), {len(truth['unplanned'])} below Jaccard 0.8 not judged; "
              f"{megabytes:.1f} MB of text; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        peer: list[dict] = []
        thread = None
        if _datatrove.python():
            def peers() -> None:
                for k in range(PEER_RUNS):
                    peer_work = root / f"datatrove-{k}"
                    peer_work.mkdir(exist_ok=True)
                    args = {"folder": str(folder), "files": files, "workers": PEER_WORKERS}
                    peer.append(_datatrove.run(PEER, args, work=peer_work))

            thread = threading.Thread(target=peers)
            thread.start()
        rates = {m: report(f"kiln {m}", kiln_runs(folder, root, m), truth, megabytes) for m in METHODS}
        if thread is None:
            print("datatrove  skipped: set DATATROVE_PYTHON to a python with datatrove 0.10.1")
            return
        thread.join()
        if len(peer) < PEER_RUNS:
            raise RuntimeError("the datatrove run failed (see above); run the same command again to resume it")
        print("datatrove CPU s by stage (median run):",
              {k: round(statistics.median(r["stages"][k] for r in peer), 1) for k in peer[0]["stages"]},
              f"of which children (its executor's Manager process) {peer[0]['children_cpu']:.1f}")
        peer_rate = report("datatrove minhash (4 stages)", peer, truth, megabytes)
        if "minhash" in rates:
            print(f"ratio      kiln minhash / datatrove minhash = {rates['minhash'] / peer_rate:.1f}x per core")


if __name__ == "__main__":
    main()
