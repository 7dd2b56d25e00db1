"""`kiln data` scaling and memory: documents/s with 1 and 2 workers; peak RSS per worker for 1x and 4x input.

Input: copies of the bundled sample crawl (120 pages each, 8 languages), every default gate
and exact dedup. Each measurement runs in a fresh process; documents/s is documents read
divided by the wall time of `run_data` (read, extract, language, gates, merge), median of
`REPEATS` runs. Peak RSS per worker is the largest ru_maxrss of the pool's worker processes
(RUSAGE_CHILDREN of the process that ran the pool).

    python -m benchmarks data_scaling
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sample.warc.gz"
REPEATS = 3

_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from kiln.config import DataConfig
from kiln.data.pipeline import run_data
inputs, out, workers = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
stats = run_data(inputs, out, DataConfig(workers=workers))
wall = time.perf_counter() - t0
print(json.dumps({"docs": stats["documents"]["read"], "wall_s": wall,
                  "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _inputs(folder: Path, copies: int) -> list[str]:
    paths = []
    for i in range(copies):
        p = folder / f"crawl-{i:02d}.warc.gz"
        shutil.copy(SAMPLE, p)
        paths.append(str(p))
    return paths


def _run(inputs: list[str], folder: Path, workers: int) -> dict:
    out = folder / f"docs-{workers}"
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(inputs), str(out), str(workers)],
                       capture_output=True, text=True, check=True)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-data-") as tmp:
        folder = Path(tmp)
        four = _inputs(folder, 4)
        rates = {}
        for workers in (1, 2):
            runs = [_run(four, folder, workers) for _ in range(REPEATS)]
            each = [r["docs"] / r["wall_s"] for r in runs]
            rates[workers] = statistics.median(each)
            print(f"workers={workers}: {runs[0]['docs']} documents, median {rates[workers]:.1f} docs/s "
                  f"(runs: {', '.join(f'{x:.1f}' for x in each)})")
        print(f"scaling 2 workers / 1 worker: {rates[2] / rates[1]:.2f}x")

        one = four[:2]
        eight = _inputs(folder, 8)
        for label, inputs in (("1x (2 files)", one), ("4x (8 files)", eight)):
            rss = [_run(inputs, folder, 2)["worker_peak_rss_mb"] for _ in range(REPEATS)]
            print(
                f"peak RSS per worker, {label}: median {statistics.median(rss):.0f} MB "
                f"(runs: {', '.join(f'{x:.0f}' for x in rss)})"
            )


if __name__ == "__main__":
    main()
