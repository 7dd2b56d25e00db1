"""`make run`'s flow on an idle machine and with two busy loops beside it: the wall time ratio (the target: at
most 1.5x), and what Kiln chose for its threads.

Each run is `kiln run examples/tiny.yaml out_dir=FRESH` in a fresh process (every stage: data, tokenizer, pack,
train; `make run` without its one-time set-up), as a user starts it. A busy run has two `while True: pass`
processes beside it, each in a session of its own (as other programs on a laptop are), started just before
and ended just after it. Runs alternate idle, busy, idle, busy (`lockstep`), so load from other jobs on a
shared machine hits both alike; the load average is sampled every 5 s during each run and its mean printed
beside it. Reported: the median wall time of each condition, the ratio of the medians, and the median of
the paired ratios (each busy run over the idle run before it).

    python -m benchmarks busy_run
    KILN_BENCH_RUNS=2 python -m benchmarks busy_run                         # pairs of runs (default 3)
    KILN_BENCH_OVERRIDES="train.threads=2" python -m benchmarks busy_run    # the old default, 2 threads fixed
    KILN_BENCH_OVERRIDES="train.max_steps=40" python -m benchmarks busy_run # a shorter try
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = os.environ.get("KILN_BENCH_CONFIG", str(ROOT / "examples" / "tiny.yaml"))
RUNS = int(os.environ.get("KILN_BENCH_RUNS", "3"))
OVERRIDES = shlex.split(os.environ.get("KILN_BENCH_OVERRIDES", ""))
BUSY_LOOPS = 2


@contextmanager
def busy_loops(n: int):
    """`n` processes spinning on a core each, in sessions of their own; ended (by pid) on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


@contextmanager
def load_sampler(every: float = 5.0):
    """Samples the 1-minute load average every `every` seconds; yields the list it appends to."""
    samples, stop = [os.getloadavg()[0]], threading.Event()

    def sample() -> None:
        while not stop.wait(every):
            samples.append(os.getloadavg()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def one_run(tmp: Path, name: str, busy: bool) -> dict:
    out = tmp / name
    cmd = [sys.executable, "-m", "kiln", "run", CONFIG, f"out_dir={out}", *OVERRIDES]
    with busy_loops(BUSY_LOOPS if busy else 0), load_sampler() as load:
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in records if r.get("event") == "step" and r.get("step_time_s")]
    stages = dict(re.findall(r"wall time: (\w+)\s+│\s+([^│]+?)\s+│", done.stderr))
    threads = [r["threads"] for r in records if r.get("event") == "threads"]
    return {"busy": busy, "wall_s": wall, "load": statistics.mean(load), "stages": stages,
            "step_s": statistics.median(steps), "threads": threads,
            "choice": next((ln for ln in done.stderr.splitlines() if ln.startswith("train.threads auto:")), "")}


def main() -> None:
    print(f"{RUNS} pairs of `kiln run {Path(CONFIG).name}` {shlex.join(OVERRIDES)}: idle, then with {BUSY_LOOPS} "
          f"busy loops; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-busy-") as tmp:
        for i in range(RUNS):
            for busy in (False, True):
                r = one_run(Path(tmp), f"{i}-{'busy' if busy else 'idle'}", busy)
                runs.append(r)
                print(f"  {'busy' if busy else 'idle'} {i + 1}: {r['wall_s']:.0f} s (stages {r['stages']}), "
                      f"median step {r['step_s']:.3f} s, threads chosen {r['threads']}, mean load {r['load']:.1f}; "
                      f"{r['choice']}", flush=True)
    idle = [r["wall_s"] for r in runs if not r["busy"]]
    busy = [r["wall_s"] for r in runs if r["busy"]]
    paired = [b / a for a, b in zip(idle, busy)]
    print(f"\nidle: median {statistics.median(idle):.0f} s {[round(x) for x in idle]}, mean load "
          f"{statistics.mean(r['load'] for r in runs if not r['busy']):.1f}")
    print(f"busy: median {statistics.median(busy):.0f} s {[round(x) for x in busy]}, mean load "
          f"{statistics.mean(r['load'] for r in runs if r['busy']):.1f}")
    print(f"busy / idle: {statistics.median(busy) / statistics.median(idle):.2f}x (medians), "
          f"{statistics.median(paired):.2f}x (median of paired runs {[round(p, 2) for p in paired]}); target <= 1.5x")
