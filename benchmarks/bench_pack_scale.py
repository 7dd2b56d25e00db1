"""`kiln pack` as tasks at scale: 1 and 2 local workers and Ray give the same bytes; the speed-up; kill -9.

A docs folder of N synthetic English-like documents (bench_data_scale's generator, 150-400 words each, 5,000 a
part as `kiln data` writes them), a byte-level BPE tokenizer of 4,096 trained on 20,000 of them, then
`kiln pack` (seq_len 1024, pack's defaults otherwise: task_parts 2) in a fresh process each time:
- 1 worker and 2 workers, alternated ROUNDS times (lockstep: both see the same load), medians compared;
- Ray, 2 CPUs (RAY=off leaves it out);
- 2 workers killed with SIGKILL (the whole process group) once a third of the tasks have their marker, then the
  same command again.
Every run's folder is compared with the first 1-worker run, every file byte for byte. The tokenizers library's
threads are pinned to the run's workers (RAYON_NUM_THREADS), so 1 worker is one core and 1 -> 2 measures the
tasks' parallelism. CPU seconds per process come from /proc (benchmarks/_proctree.py): the two pool workers'
shares say whether both were busy, whatever the machine's load (printed: the 1-minute load average at the
start and end of each run; on a shared machine the wall-time ratio falls with it, the CPU shares do not).

    N=100000 python -m benchmarks pack_scale
    N=20000 ROUNDS=1 RAY=off python -m benchmarks pack_scale   # a quick look
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _proctree

ROOT = Path(__file__).resolve().parents[1]
N = int(os.environ.get("N", "100000"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
RAY = os.environ.get("RAY", "on") != "off"
PER_PART = 5000

_BUILD = r"""
import sys
from pathlib import Path
import numpy as np
from benchmarks.bench_data_scale import Corpus
from kiln.config import TokenizerConfig
from kiln.data.docs import PartWriter, read_docs
from kiln.manifest import staging_dir, write_manifest
from kiln.tokenizer import train_tokenizer
folder, n = Path(sys.argv[1]), int(sys.argv[2])
c = Corpus(0)
with staging_dir(folder / "docs") as tmp:
    w = PartWriter(tmp, 5000)
    for i in range(n):
        text = c.render(c.words(int(c.rng.integers(150, 401))))
        w.add({"id": f"d{i}", "text": text, "url": f"https://bench.example/{i}", "source": "bench.jsonl",
               "offset": i, "length": 1, "lang": "en", "lang_score": 1.0})
    w.flush()
    write_manifest(tmp, stage="data", documents=n, docs_per_part=5000)
train_tokenizer(read_docs(folder / "docs"), folder / "tokenizer", TokenizerConfig(vocab_size=4096, max_docs=20000), 1)
"""


def build(folder: Path) -> None:
    if not (folder / "tokenizer" / "manifest.json").exists():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        subprocess.run([sys.executable, "-c", _BUILD, str(folder), str(N)], check=True, cwd=ROOT, env=env)


def command(folder: Path, out: Path, workers: int, executor: str = "local") -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "kiln", "pack", str(folder / "docs"), "--tokenizer", str(folder / "tokenizer"),
           "--out", str(out), "pack.seq_len=1024", f"pack.workers={workers}", f"pack.executor={executor}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAYON_NUM_THREADS": str(workers),
           "RAY_AUTH_MODE": "disabled"}
    return cmd, env


def files(folder: Path) -> dict[str, str]:
    """Every file of a folder and its sha256."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def pack_run(folder: Path, out: Path, workers: int, executor: str = "local") -> _proctree.Measured:
    shutil.rmtree(out, ignore_errors=True)
    cmd, env = command(folder, out, workers, executor)
    m = _proctree.run(cmd, env=env, cwd=folder)
    if m.rc:
        raise RuntimeError(f"kiln pack failed:\n{m.stderr[-3000:]}")
    return m


def killed_run(folder: Path, out: Path) -> tuple[int, int, _proctree.Measured]:
    """2 workers killed (SIGKILL to the process group) once a third of the tasks are marked, then run again:
    (tasks marked when killed, tasks in all, the second run)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd, env = command(folder, out, 2)
    parts = len(list((folder / "docs").glob("part-*.jsonl.zst")))
    tasks = -(-parts // 2)
    proc = subprocess.Popen(cmd, env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)

    def marked() -> int:
        return sum(len(list(w.glob("*.done.json"))) for w in out.parent.glob(f".{out.name}-work-*"))

    while marked() < max(1, tasks // 3):
        if proc.poll() is not None:
            raise RuntimeError("the pack to kill ended before a third of its tasks")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    at = marked()
    assert not out.exists(), "a killed pack must not leave a committed folder"
    return at, tasks, pack_run(folder, out, 2)


def shares(m: _proctree.Measured) -> str:
    cpu = m.cpu_of(r"spawn_main|ray::|default_worker")  # the pool's or Ray's worker processes
    total = sum(cpu)
    return "workers " + " + ".join(f"{c:.1f}" for c in cpu[:4]) + f" CPU s (second's share {cpu[1] / total:.2f})" \
        if len(cpu) > 1 and total else "workers: none seen"


def main() -> None:
    root = Path(os.environ.get("BENCH_DIR") or tempfile.mkdtemp(prefix="kiln-bench-pack-"))
    folder = root / f"corpus-{N}"
    t0 = time.perf_counter()
    build(folder)
    print(f"{N:,} documents in {len(list((folder / 'docs').glob('part-*')))} parts, tokenizer trained "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    reference, walls = None, {1: [], 2: []}
    try:
        for r in range(ROUNDS):
            for workers in (1, 2):
                out = folder / f"shards-{workers}"
                m = pack_run(folder, out, workers)
                walls[workers].append(m.wall_s)
                got = files(out)
                reference = reference or got
                same = got == reference
                cpu = sum(p.cpu_s for p in m.procs.values())
                print(f"round {r + 1}, {workers} worker(s): {m.wall_s:.1f} s, CPU {cpu:.1f} s, "
                      f"largest process {m.largest_mb:.0f} MB, load {m.load[0]:.1f}-{m.load[1]:.1f}, "
                      f"{shares(m) if workers == 2 else ''} identical to the first: {same}", flush=True)
                assert same, "the shards differ"
        if RAY:
            m = pack_run(folder, folder / "shards-ray", 2, "ray")
            same = files(folder / "shards-ray") == reference
            print(f"Ray, 2 CPUs: {m.wall_s:.1f} s, largest process {m.largest_mb:.0f} MB, load "
                  f"{m.load[0]:.1f}-{m.load[1]:.1f}, {shares(m)}, identical: {same}", flush=True)
            assert same, "Ray's shards differ"
        at, tasks, m = killed_run(folder, folder / "shards-killed")
        same = files(folder / "shards-killed") == reference
        print(f"kill -9 after {at} of {tasks} tasks, then again: {m.wall_s:.1f} s to finish, identical: {same}",
              flush=True)
        assert same, "the resumed shards differ"
        one, two = statistics.median(walls[1]), statistics.median(walls[2])
        manifest = json.loads((folder / "shards-1" / "manifest.json").read_text())
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        print(f"1 -> 2 workers: {one / two:.2f}x (median of {ROUNDS}: {one:.1f} s and {two:.1f} s; target >= 1.7); "
              f"{tokens / one / 1e6:.2f} M tokens/s on one worker ({tokens:,} tokens)")
    finally:
        if not os.environ.get("BENCH_DIR"):
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
