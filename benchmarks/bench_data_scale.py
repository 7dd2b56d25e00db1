"""Data to shards at N and 4N documents: peak memory, manifest size, time and dedup quality; 1 vs 2 workers.

A synthetic English-like JSONL corpus (5,000 documents a file, 150-400 words each, sentences that pass
every default gate) with planted duplicates, each placed after its original in canonical order:
- near copies (8% of the corpus, NEAR=0.4 for 40%: issue 44's mix, where the removed documents are a large share
  of the corpus and grow 4x from N to 4N with it): words of an earlier document replaced until the word 5-gram
  Jaccard is about a target drawn from 0.78-0.97 (measured exactly and kept as the truth);
- chains (1%): C, and A and B each a near copy of C (Jaccard ~0.86) but not of each other (~0.72),
  in the order A < B < C, so B's only confirmed pair is with the later C; B and C must go;
- exact copies (1%): the same text with changed spacing.
Truth: a planted copy must go when its Jaccard to its original is >= 0.8 and both reached dedup (some
synthetic pages fail language ID); copies below 0.8 are left out of both counts; every other
document must stay. Recall = planted copies removed / planted copies;
precision = planted copies removed / documents dedup removed. Recall is also given for Jaccard 0.80-0.92.

`kiln run CONFIG --until pack` runs in a fresh process for N and 4N documents (2 workers), and for N
with 1 worker. Peak RSS: the run's own VmHWM (the driver) and the largest ru_maxrss of its waited-for
children (pool workers of the data and dedup stages, pack's encoders; an upper bound: a spawned encoder's
ru_maxrss starts from the driver's size when it was started). The corpus is built in a process of its own.
The tokenizer samples
`tokenizer.max_docs` = min(20,000, N / 2) documents at both sizes (its memory is bounded by that, by design),
and pack writes shards of the default 65,536 samples of 1,025 tokens (SHARD_SAMPLES=... to change it; pack
streams each shard to disk, so its memory does not depend on the shard size). CPU seconds are user + sys of
the run and of all its waited-for children (pool workers, encoders); the load average is printed beside them,
since on a shared machine wall times are noisy.

The quality gates are off (GATES=on turns the defaults on); language ID, the basic gates (length,
letters, repeated lines), exact and near-duplicate dedup run.

    N=50000 python -m benchmarks data_scale          # N >= 50,000 for the issue's figures; smaller to try it
    N=6250 ONE_WORKER=off python -m benchmarks data_scale   # N and 4N only: CPU by stage, quickly
    N=6250 PROFILE=on python -m benchmarks data_scale       # one worker under cProfile: own time 4N / N
    N=50000 SIZES=N THREADS=workers python -m benchmarks data_scale  # N at 2 and 1 workers, tokenizers' threads
                                                                     # pinned to the workers
    N=50000 HOST_DOCS=25 ONE_WORKER=off python -m benchmarks data_scale  # source_key=host, a host every 25
                                                                         # documents: the sources grow with N
    N=100000 ONE_FILE=jsonl python -m benchmarks data_scale     # the corpus as ONE file (or ONE_FILE=parquet,
                                                                 # row groups of ROW_GROUP=2000 rows)
    N=25000 NEAR=0.4 python -m benchmarks data_scale  # issue 44: 40% near copies; every process's peak RSS 4N / N,
                                                      # the merge step on 1 and 2 workers; the dedup budgets at
                                                      # N / 4 keys and N pairs (BUDGETS, below)

ONE_FILE: the corpus is a single JSONL (or Parquet) file, which the data stage cuts into tasks
(data.task_bytes, the default 32 MB). N and 4N with 2 workers, N with 1 worker and N on Ray (2 CPUs; RAY=off
leaves it out); the docs (stats.json's timings aside) and the shards (manifest's fingerprint aside: it names the
docs manifest, which hashes stats.json) of every N run are compared byte for byte. Each run also gives the
largest process (/usr/bin/time -v over the run and its children, benchmarks/_proctree.py; Ray's workers are
polled from /proc) and the data tasks' CPU seconds by worker process (stats.json
`timings_s.task_cpu_by_worker`): the second worker's share says whether both were busy.

With `workers: 1`, pack encodes in the driver and the tokenizers library (Rust, rayon) trains and encodes on
every core, so a "1 worker" run already uses the machine's 2 cores in those stages. THREADS=workers sets
RAYON_NUM_THREADS to the run's worker count, so 1 worker is one core throughout and 1 -> 2 workers measures
how the whole flow scales with the cores it is given. SIZES=N leaves out the 4N run.

The last lines give issue 44's targets: the data stage's driver (VmHWM when the stage ends) and its
workers (the largest ru_maxrss of the pools' processes that ended by then: the data, dedup stage, verdicts,
profile and merge tasks) at 4N / N (<= 1.05 and <= 1.1), and the merge step (the merge tasks and the part jobs,
stats.json `timings_s.merge_steps`) on 2 workers against 1 (>= 1.7).

Each run also reports its CPU seconds by stage (stats.json `timings_s.cpu` for the data stage's four
steps; the tokenizer and pack stages timed around `kiln.flow.STAGES`) and their 4N / N ratios: a stage
whose ratio is well above 4 does work that grows faster than the corpus.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
N = int(os.environ.get("N", "50000"))
FILE_DOCS = int(os.environ.get("FILE_DOCS", max(500, min(5000, N // 10))))  # 5,000 a file (a task) from N = 50,000 on
# HOST_DOCS=k: k documents a URL host and data.distribution.source_key=host, so the sources grow with the corpus
# (as a crawl's hosts do); FILE_DOCS=k grows the files (source_key=file, the default) the same way.
HOST_DOCS = int(os.environ.get("HOST_DOCS", "0"))
NEAR = float(os.environ.get("NEAR", "0.08"))  # the corpus's share of planted near copies
ONE_FILE = os.environ.get("ONE_FILE", "")  # jsonl | parquet: the whole corpus in one file
ROW_GROUP = int(os.environ.get("ROW_GROUP", "2000"))  # ONE_FILE=parquet: rows a row group (~4 MB of text)
TOKENIZER_DOCS = min(20_000, N // 2)  # the same sample size at N and 4N
SHARD_SAMPLES = int(os.environ.get("SHARD_SAMPLES", "65536"))  # pack.samples_per_shard's default
# The dedup stages' memory budgets (data.dedup.bucket_docs: keys a band or exact task holds; verdict_pairs: pairs the
# verdicts task holds): their defaults (2,000,000 each) are sized for a crawl and are never reached at N = 50,000,
# where every task would hold the whole corpus and grow with it. BUDGETS=on (the default with NEAR) sets them to
# N / 4 keys and N pairs, the same at N and 4N, so both runs are past them as a dump is past the defaults: what
# stays flat is then the design's bound, not a corpus too small to reach it.
BUDGETS = os.environ.get("BUDGETS", "on" if NEAR != 0.08 else "off") == "on"
DEDUP = {"dedup": {"bucket_docs": max(1000, N // 4), "verdict_pairs": N}} if BUDGETS else {}
# Quality gates off unless GATES=on: what this measures grows with the corpus (dedup, manifest, pack), and on
# a 2-core machine shared with other jobs the gates (the largest per-document cost) would stretch 4N past an hour.
GATES = {} if os.environ.get("GATES") == "on" else {
    "quality": {k: {"enabled": False} for k in ("gopher_quality", "gopher_repetition", "c4", "fineweb", "noise",
                                                "residue", "pii")}}
# The distribution gate's profile is sources x vocabulary in the driver (one source per input file here, so 4x
# at 4N): DISTRIBUTION=off leaves it out to measure the rest.
if os.environ.get("DISTRIBUTION") == "off":
    GATES["distribution"] = {"enabled": False}
STOP = [
    "the",
    "be",
    "to",
    "of",
    "and",
    "that",
    "have",
    "with",
    "a",
    "in",
    "is",
    "it",
    "for",
    "on",
    "as",
    "was",
    "at",
    "by",
    "this",
    "from",
]
SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ea", "ou")]

_CHILD = r"""
import json, os, resource, sys, time
import kiln.flow
from kiln.cli import main
from kiln.data.pipeline import cpu_seconds
stages = {}  # each stage's wall and CPU seconds (CPU: this process and its pools' ended workers)
def timed(name, stage):
    def run(cfg, log):
        t, c = time.perf_counter(), cpu_seconds()
        try:
            return stage(cfg, log)
        finally:
            hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
            kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the pools' ended workers so far
            stages[name] = {"wall_s": time.perf_counter() - t, "cpu_s": cpu_seconds() - c, "peak_mb": hwm / 1024,
                            "workers_mb": kids / 1024}
    return run
kiln.flow.STAGES.update({name: timed(name, stage) for name, stage in kiln.flow.STAGES.items()})
import kiln.data.pipeline, kiln.shards.pack
from pathlib import Path
work_mb = {}  # each stage's work folder when it is complete: the data stage's as the merge starts, pack's tasks
def du(folder):
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) / 1e6
def measured(name, fn, folder):
    def run(*args, **kw):
        work_mb[name] = du(folder(args))
        return fn(*args, **kw)
    return run
kiln.data.pipeline._merge = measured("data", kiln.data.pipeline._merge, lambda a: a[0])
kiln.shards.pack.assemble = measured("pack", kiln.shards.pack.assemble, lambda a: a[0][0][0].parent)
t0, load0 = time.perf_counter(), os.getloadavg()[0]
rc = main(["run", sys.argv[1], "--until", "pack"])
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forked parent's image, so a child of a
# large process would report the parent's size (the earlier 584 MB "driver" was the benchmark's own corpus).
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"rc": rc, "wall_s": time.perf_counter() - t0, "load": [load0, os.getloadavg()[0]],
                  "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "driver_rss_mb": hwm / 1024, "worker_rss_mb": kids.ru_maxrss / 1024, "stages": stages,
                  "work_mb": work_mb}))
"""


def vocabulary(rng: np.random.Generator, n: int = 3000) -> np.ndarray:
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))))
    return np.array(sorted(words))


class Corpus:
    """The documents as word arrays, rendered into sentences of 8-20 words."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = vocabulary(self.rng)
        self.stop = np.array(STOP)

    def words(self, n: int) -> np.ndarray:
        content = self.vocab[self.rng.integers(0, len(self.vocab), n)]
        stops = self.stop[self.rng.integers(0, len(self.stop), n)]
        return np.where(self.rng.random(n) < 0.3, stops, content)

    def render(self, words: np.ndarray) -> str:
        """Sentences of 8-20 words, four to a paragraph; the cuts depend on the length alone, so a copy with
        words replaced keeps its original's sentence ends."""
        out, i, rng = [], 0, np.random.default_rng(len(words))
        while i < len(words):
            k = int(rng.integers(8, 21))
            sentence = " ".join(words[i:i + k].tolist())
            out.append(sentence[:1].upper() + sentence[1:] + ".")
            i += k
        paragraphs = [" ".join(out[j:j + 4]) for j in range(0, len(out), 4)]
        return "\n\n".join(paragraphs)

    def edit(self, words: np.ndarray, target: float) -> np.ndarray:
        """Replace about as many words as take the 5-gram Jaccard to `target` (each replacement changes up to
        five shingles: J = (S - d) / (S + d) for d changed shingles)."""
        d = len(words) * (1 - target) / (1 + target)
        k = max(1, round(d / 5))
        out = words.copy()
        at = self.rng.choice(len(words), size=k, replace=False)
        out[at] = self.vocab[self.rng.integers(0, len(self.vocab), k)]
        return out


def build(folder: Path, n: int, seed: int = 0) -> dict:
    """Write the corpus as JSONL files; returns the truth: {"go": {id: (original, jaccard)}, "unplanned": [...]}."""
    from kiln.data.dedup.shingles import jaccard, shingle_hashes

    c = Corpus(seed)
    rng = c.rng
    n_near, n_chain, n_exact = int(NEAR * n), int(0.01 * n) // 3, int(0.01 * n)
    n_orig = n - n_near - 3 * n_chain - n_exact
    docs: list[tuple[float, str, str]] = []  # (canonical position, id, text)
    originals = []
    for i in range(n_orig):
        w = c.words(int(rng.integers(150, 401)))
        originals.append(w)
        docs.append((float(i), f"d{i}", c.render(w)))
    go, unplanned = {}, []

    def sim(a: str, b: str) -> float:
        return jaccard(shingle_hashes(a), shingle_hashes(b))

    for k in range(n_near):
        o = int(rng.integers(0, n_orig))
        text = c.render(c.edit(originals[o], float(rng.uniform(0.78, 0.97))))
        j = sim(docs[o][2], text)
        (go.__setitem__(f"near{k}", (f"d{o}", j)) if j >= 0.8 else unplanned.append(f"near{k}"))
        docs.append((float(rng.uniform(o + 1, n_orig)), f"near{k}", text))
    for k in range(n_chain):
        base = c.words(int(rng.integers(200, 401)))
        a, b, cc = (c.render(c.edit(base, 0.86)), c.render(c.edit(base, 0.86)), c.render(base))
        at = np.sort(rng.uniform(0, n_orig, 3))
        docs += [(float(at[0]), f"chainA{k}", a), (float(at[1]), f"chainB{k}", b), (float(at[2]), f"chainC{k}", cc)]
        if sim(a, cc) >= 0.8 and sim(b, cc) >= 0.8:
            go[f"chainB{k}"], go[f"chainC{k}"] = (f"chainA{k}", sim(a, b)), (f"chainA{k}", sim(a, cc))
        else:
            unplanned += [f"chainB{k}", f"chainC{k}"]
    for k in range(n_exact):
        o = int(rng.integers(0, n_orig))
        docs.append((float(rng.uniform(o + 1, n_orig)), f"exact{k}", docs[o][2].replace(" ", "  ", 5)))
        go[f"exact{k}"] = (f"d{o}", 1.0)
    docs.sort(key=lambda d: d[0])
    folder.mkdir(parents=True, exist_ok=True)
    if ONE_FILE == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [d for _, d, _ in docs], "text": [t for _, _, t in docs],
                                 "url": [f"https://bench.example/{d}" for _, d, _ in docs]}),
                       folder / "corpus.parquet", row_group_size=ROW_GROUP)
        return {"go": go, "unplanned": unplanned}
    per_file = len(docs) if ONE_FILE else FILE_DOCS
    for f in range(0, len(docs), per_file):
        with open(folder / f"part-{f // per_file:05d}.jsonl", "w") as out:
            for k, (_, doc_id, text) in enumerate(docs[f:f + per_file], start=f):
                host = f"site-{k // HOST_DOCS}.example" if HOST_DOCS else "bench.example"
                out.write(json.dumps({"id": doc_id, "text": text, "url": f"https://{host}/{doc_id}"}) + "\n")
    return {"go": go, "unplanned": unplanned}


def build_to(corpus: str, n: str, truth: str) -> None:
    Path(truth).write_text(json.dumps(build(Path(corpus), int(n))))


def write_config(corpus: Path, out: Path, workers: int, executor: str = "local") -> Path:
    config = out.parent / f"{out.name}.yaml"
    pattern = "*.parquet" if ONE_FILE == "parquet" else "*.jsonl"
    config.write_text(json.dumps({  # JSON is YAML
        "out_dir": str(out), "seed": 1,
        "data": {"inputs": [str(corpus / pattern)], "workers": workers, "executor": executor, **GATES, **DEDUP,
                 **({"distribution": {**GATES.get("distribution", {}), "source_key": "host"}} if HOST_DOCS else {})},
        "tokenizer": {"vocab_size": 4096, "max_docs": TOKENIZER_DOCS},
        "pack": {"seq_len": 1024, "samples_per_shard": SHARD_SAMPLES, "workers": workers, "executor": executor}}))
    return config


def run(corpus: Path, out: Path, workers: int, executor: str = "local") -> dict:
    from benchmarks import _proctree

    config = write_config(corpus, out, workers, executor)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_AUTH_MODE": "disabled"}
    if os.environ.get("THREADS") == "workers":  # see the docstring: rayon's pool sized like the process pools
        env["RAYON_NUM_THREADS"] = str(workers)
    done = _proctree.run([sys.executable, "-c", _CHILD, str(config)], env=env, cwd=ROOT)
    if done.rc:
        raise RuntimeError(f"kiln run failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["largest_mb"] = done.largest_mb  # /usr/bin/time -v's, and every process polled (Ray's workers too)
    stats = json.loads((out / "docs" / "stats.json").read_text())
    result["manifest_bytes"] = (out / "shards" / "manifest.json").stat().st_size
    result["data_s"] = sum(stats["timings_s"][k] for k in ("process", "dedup_stages", "profiles", "merge"))
    result["stats"] = stats
    result["cpu_by_stage"] = {**stats["timings_s"]["cpu"],
                              **{k: result["stages"][k]["cpu_s"] for k in ("tokenizer", "pack")}}
    workers_cpu = list(stats["timings_s"].get("task_cpu_by_worker", {}).values())
    result["second_share"] = workers_cpu[1] / sum(workers_cpu) if len(workers_cpu) > 1 else 0.0
    result["task_cpu"] = workers_cpu
    result["digest"] = digest(out)
    return result


def digest(out: Path) -> str:
    """The sha256 of what a run produced: the docs (stats.json's timings and task counts aside) and the shards
    (their manifest's fingerprint aside: it names the docs manifest, which hashes stats.json)."""
    import hashlib

    h = hashlib.sha256()
    for folder in ("docs", "shards"):
        for path in sorted((out / folder).rglob("*")):
            if not path.is_file():
                continue
            data = path.read_bytes()
            if path.name in ("stats.json", "manifest.json"):
                rec = json.loads(data)
                for key in ("timings_s", "tasks", "tasks_resumed", "dedup_tasks", "fingerprint", "files"):
                    rec.pop(key, None)
                data = json.dumps(rec, sort_keys=True).encode()
            h.update(path.relative_to(out).as_posix().encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


STAGE_NAMES = ("process", "dedup_stages", "profiles", "merge", "tokenizer", "pack")


def cpu_line(r: dict) -> str:
    """CPU seconds per stage: data tasks / dedup stages / profiles / merge / tokenizer / pack."""
    return " / ".join(f"{r['cpu_by_stage'][k]:.1f}" for k in STAGE_NAMES)


def score(out: Path, truth: dict) -> dict:
    from kiln.data.docs import read_part

    removed, filtered = set(), set()  # by dedup; by an earlier stage (language ID, gates)
    for part in sorted((out / "docs" / "rejects").glob("part-*.jsonl.zst")):
        for r in read_part(part):
            (removed if r["stage"] == "dedup" else filtered).add(r["id"])

    def reached_dedup(k: str, original: str) -> bool:  # a chain needs all three of its documents
        chain = [f"chain{x}{k[6:]}" for x in "ABC"] if k.startswith("chain") else [k, original]
        return not filtered.intersection(chain)

    go = {k: v for k, v in truth["go"].items() if reached_dedup(k, v[0])}
    unplanned = set(truth["unplanned"]) | (truth["go"].keys() - go.keys())
    hit = removed & go.keys()
    judged = removed - unplanned
    band = {k for k, (_, j) in go.items() if 0.8 <= j <= 0.92}
    return {"recall": len(hit) / len(go), "precision": len(hit) / max(len(judged), 1),
            "recall_0.80_0.92": len(hit & band) / max(len(band), 1), "planted": len(go), "removed": len(removed)}


def corpus_of(tmp: Path, n: int) -> tuple[Path, dict]:
    """The corpus of n documents under tmp (built once, in a process of its own: see _CHILD) and its truth."""
    corpus = tmp / (f"corpus-{n}-{ONE_FILE or FILE_DOCS}-{HOST_DOCS}" + (f"-near{NEAR}" if NEAR != 0.08 else ""))
    if not corpus.exists():
        code = "import sys; from benchmarks.bench_data_scale import build_to; build_to(*sys.argv[1:])"
        subprocess.run([sys.executable, "-c", code, str(corpus), str(n), str(corpus) + ".truth.json"],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return corpus, json.loads(Path(str(corpus) + ".truth.json").read_text())


_PROFILE_CHILD = r"""
import cProfile, sys, time
from kiln.cli import main
profile = cProfile.Profile(time.process_time)  # CPU, not wall: the machine is shared
profile.runcall(main, ["run", sys.argv[1], "--until", "pack"])
profile.dump_stats(sys.argv[2])
"""


def profile() -> None:
    """PROFILE=on: `kiln run --until pack` at N and 4N on one worker (every stage in one process) under
    cProfile, in CPU time; prints the functions with the most own time at 4N beside their 4N / N ratio. Linear work
    shows ~4x; a function well above is doing work that grows faster than the corpus."""
    import pstats

    with tempfile.TemporaryDirectory(prefix="kiln-bench-scale-") as tmp:
        tmp = Path(tmp)
        own: dict[str, dict] = {}
        for label, n in (("N", N), ("4N", 4 * N)):
            corpus, _ = corpus_of(tmp, n)
            out = tmp / f"out-{n}"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", _PROFILE_CHILD, str(write_config(corpus, out, 1)), str(tmp / label)],
                           check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                           capture_output=True)
            print(f"{label}: {n:,} documents profiled in {time.perf_counter() - t0:.0f} s", flush=True)
            own[label] = {f"{Path(f).name}:{line}:{fn}": (tt, nc) for (f, line, fn), (_, nc, tt, _, _)
                          in pstats.Stats(str(tmp / label)).stats.items()}
            shutil.rmtree(out, ignore_errors=True)
    total = {k: sum(tt for tt, _ in v.values()) for k, v in own.items()}
    print(f"own CPU time: N {total['N']:.1f} s, 4N {total['4N']:.1f} s ({total['4N'] / total['N']:.2f}x)")
    print(f"{'function':<72} {'4N s':>8} {'N s':>8} {'ratio':>6} {'calls 4N/N':>10}")
    for name, (tt, nc) in sorted(own["4N"].items(), key=lambda kv: -kv[1][0])[:40]:
        tt1, nc1 = own["N"].get(name, (0.0, 0))
        print(f"{name[-72:]:<72} {tt:8.2f} {tt1:8.2f} {tt / max(tt1, 1e-9):6.2f} {nc / max(nc1, 1):10.2f}")


def main() -> None:
    if os.environ.get("PROFILE") == "on":
        return profile()
    rows = {}
    runs = [("N", N, 2, "local")] + ([] if os.environ.get("SIZES") == "N" else [("4N", 4 * N, 2, "local")])
    runs += [] if os.environ.get("ONE_WORKER") == "off" else [("N, 1 worker", N, 1, "local")]
    runs += [("N, Ray", N, 2, "ray")] if ONE_FILE and os.environ.get("RAY") != "off" else []
    keep = os.environ.get("BENCH_DIR")  # corpora kept there (a 4N corpus takes minutes to build)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-scale-") as tmp:
        tmp = Path(keep or tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        for label, n, workers, executor in runs:
            t0 = time.perf_counter()
            corpus, truth = corpus_of(tmp, n)
            built = time.perf_counter() - t0
            out = tmp / f"out-{corpus.name}-{workers}-{executor}"  # BENCH_DIR may hold runs of other corpora
            shutil.rmtree(out, ignore_errors=True)
            r = run(corpus, out, workers, executor) | score(out, truth)
            rows[label] = r
            t = r["stats"]["timings_s"]
            print(f"{label:>12}: {n:,} docs, {workers} worker(s): {r['wall_s']:.1f} s, {r['cpu_s']:.1f} CPU s, load "
                  f"{r['load'][0]:.1f}-{r['load'][1]:.1f} (data {t['process']:.1f} + dedup "
                  f"stages {t['dedup_stages']:.1f} + profiles {t['profiles']:.1f} + merge {t['merge']:.1f}, then "
                  f"tokenizer and pack {r['wall_s'] - r['data_s']:.1f}), "
                  f"driver {r['driver_rss_mb']:.0f} MB (in the data stage {r['stages']['data']['peak_mb']:.0f}), "
                  f"workers {r['worker_rss_mb']:.0f} MB, largest process {r['largest_mb']:.0f} MB, work folders "
                  f"{' / '.join(f'{k} {v:.0f} MB' for k, v in r.get('work_mb', {}).items())}, "
                  f"{r['stats']['tasks']} data tasks, their CPU s by worker "
                  f"{' + '.join(f'{c:.0f}' for c in r['task_cpu'])} (second's share {r['second_share']:.2f}), "
                  f"manifest {r['manifest_bytes']:,} B, recall {r['recall']:.4f} (0.80-0.92: "
                  f"{r['recall_0.80_0.92']:.4f}), precision {r['precision']:.4f} [{r['planted']} planted, "
                  f"{r['removed']} removed; corpus built in {built:.0f} s]; CPU s by stage (data tasks / dedup "
                  f"stages / profiles / merge / tokenizer / pack): {cpu_line(r)}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    at_n = {label: r["digest"] for label, r in rows.items() if label.startswith("N")}
    print(f"docs and shards at N identical across {', '.join(at_n)}: {len(set(at_n.values())) == 1}")
    one, four = rows["N"], rows.get("4N")
    if four is None:  # SIZES=N: the one size's per-process peaks and scratch (the long run at 10^6 documents)
        data = one["stages"]["data"]
        print(f"at N: the data stage's driver {data['peak_mb']:.0f} MB, its workers {data['workers_mb']:.0f} MB; "
              f"scratch a document: data work folder {1e3 * one['work_mb']['data'] / N:.2f} KB, pack's "
              f"{1e3 * one['work_mb']['pack'] / N:.2f} KB")
        if "N, 1 worker" in rows:
            print(f"1 -> 2 workers at N: {rows['N, 1 worker']['wall_s'] / one['wall_s']:.2f}x speed-up end to end")
        return
    rss = max(four["driver_rss_mb"], four["worker_rss_mb"]) / max(one["driver_rss_mb"], one["worker_rss_mb"])
    ratio = {k: four[k] / one[k] for k in ("driver_rss_mb", "worker_rss_mb", "manifest_bytes", "wall_s", "cpu_s",
                                           "largest_mb")}
    data_peak = four["stages"]["data"]["peak_mb"] / one["stages"]["data"]["peak_mb"]
    print(f"4N / N: largest process RSS {rss:.2f}x ((/usr/bin/time -v and /proc: {ratio['largest_mb']:.2f}x; target "
          f"<= 1.25), driver {ratio['driver_rss_mb']:.2f}x (in the data stage {data_peak:.2f}x), "
          f"workers {ratio['worker_rss_mb']:.2f}x; manifest {ratio['manifest_bytes']:.2f}x (<= 1.25); "
          f"time {ratio['wall_s']:.2f}x (<= 4.6), CPU {ratio['cpu_s']:.2f}x")
    print("4N / N CPU seconds by stage: " + ", ".join(
        f"{k} {four['cpu_by_stage'][k] / max(one['cpu_by_stage'][k], 1e-9):.2f}x" for k in STAGE_NAMES))
    data = {k: four["stages"]["data"][k] / one["stages"]["data"][k] for k in ("peak_mb", "workers_mb")}
    print(f"4N / N peak RSS in the data stage ({one['removed']:,} -> {four['removed']:,} removed by dedup): driver "
          f"{data['peak_mb']:.2f}x ({one['stages']['data']['peak_mb']:.0f} -> {four['stages']['data']['peak_mb']:.0f} "
          f"MB; target <= 1.05), its workers, the verdicts task's included, {data['workers_mb']:.2f}x "
          f"({one['stages']['data']['workers_mb']:.0f} -> {four['stages']['data']['workers_mb']:.0f} MB; <= 1.1)")
    if "N, 1 worker" in rows:
        single = rows["N, 1 worker"]
        print(f"1 -> 2 workers at N: {single['wall_s'] / one['wall_s']:.2f}x speed-up end to end (target >= 1.7)")
        m1, m2 = (merge_step(r) for r in (single, one))
        c1, c2 = (r["stats"]["timings_s"]["merge_steps"]["commit"] for r in (single, one))
        print(f"the merge step at N (merge tasks + part jobs): 1 worker {m1:.2f} s, 2 workers {m2:.2f} s: "
              f"{m1 / m2:.2f}x (target >= 1.7); the merge's CPU s {single['cpu_by_stage']['merge']:.2f} / "
              f"{one['cpu_by_stage']['merge']:.2f}, the driver's commit after it {c1:.2f} / {c2:.2f} s")


def merge_step(r: dict) -> float:
    """The merge step's wall seconds: its tasks and part jobs (stats.json `timings_s.merge_steps`)."""
    steps = r["stats"]["timings_s"]["merge_steps"]
    return steps["tasks"] + steps["parts"]


if __name__ == "__main__":
    main()
