"""What a change costs the data stage: `kiln data` from this checkout against another one's, paired, per CPU second.

    KILN_BENCH_OLD_SRC=/tmp/old/src python -m benchmarks data_change     (RUNS=7 rounds, COPIES=4)

KILN_BENCH_OLD_SRC names the src/ of another Kiln checkout (`git worktree add /tmp/old COMMIT`). Each round runs
`kiln data` (one worker, the default settings: read, extract, language, the gates, dedup signatures and stages,
profiles, merge, commit) on the bundled sample copied COPIES times, once from each checkout in a fresh process,
the first one alternating; a side's cost is the CPU seconds (user + sys) of its process and every process under
it, Python's start and imports included. Printed: each round's ratio old / new (> 1 when this checkout is
cheaper), their median ("paired"), and the ratio of the two sides' median CPU seconds. Both sides must keep the
same documents: the kept counts are compared. Target for a change that only moves code: within 2% (0.98-1.02).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sample.warc.gz"
OLD_SRC = os.environ.get("KILN_BENCH_OLD_SRC")
RUNS = int(os.environ.get("RUNS", "7"))
COPIES = int(os.environ.get("COPIES", "4"))

RUN = r"""
import json, sys
from pathlib import Path
from kiln.config import DataConfig
from kiln.data.pipeline import run_data
stats = run_data(sys.argv[2:], Path(sys.argv[1]), DataConfig(workers=1))
print(json.dumps({"read": stats["documents"]["read"], "kept": stats["documents"]["kept"]}))
"""


def cpu_of(src: str, out: Path, inputs: list[Path]) -> tuple[float, dict]:
    """CPU seconds of one `kiln data` from `src` (its process and every child), and its document counts."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", RUN, str(out), *map(str, inputs)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": src}, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"kiln data from {src} failed: {done.stderr[-2000:]}")
    shutil.rmtree(out)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if not OLD_SRC or not (Path(OLD_SRC) / "kiln").is_dir():
        raise SystemExit("set KILN_BENCH_OLD_SRC to another checkout's src/ (git worktree add /tmp/old COMMIT)")
    new_src = str(ROOT / "src")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-data-change-") as tmp:
        inputs = []
        for k in range(COPIES):
            inputs.append(Path(tmp) / f"copy-{k}.warc.gz")
            shutil.copyfile(SAMPLE, inputs[-1])
        print(f"kiln data, one worker, the sample x{COPIES}: {RUNS} rounds, new = {new_src}, old = {OLD_SRC}")
        new_cpu, old_cpu, ratios = [], [], []
        for r in range(RUNS):
            order = [("new", new_src), ("old", OLD_SRC)][:: 1 if r % 2 == 0 else -1]
            got = {name: cpu_of(src, Path(tmp) / f"docs-{name}", inputs) for name, src in order}
            if got["new"][1] != got["old"][1]:
                raise SystemExit(f"the two checkouts keep other documents: new {got['new'][1]}, old {got['old'][1]}")
            new_cpu.append(got["new"][0])
            old_cpu.append(got["old"][0])
            ratios.append(got["old"][0] / got["new"][0])
            print(f"  round {r + 1} ({order[0][0]} first): new {got['new'][0]:.2f} CPU s, old {got['old'][0]:.2f}, "
                  f"old / new {ratios[-1]:.3f}  ({got['new'][1]['kept']} of {got['new'][1]['read']} kept)",
                  flush=True)
        print(f"paired (median of old / new): {statistics.median(ratios):.3f}; median CPU s new "
              f"{statistics.median(new_cpu):.2f}, old {statistics.median(old_cpu):.2f}: ratio "
              f"{statistics.median(old_cpu) / statistics.median(new_cpu):.3f}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
