"""`kiln ablate`'s overhead against running the same arms by hand, and what each proxy scale costs here.

The ablation: examples/ablation.yaml (the default gates against every gate off, on the bundled sample crawl,
the cpu-tiny proxy, the handbook eval sets) with seeds [1, 2] and proxy_tokens KILN_BENCH_TOKENS (default
100,000) so that a run of the benchmark takes minutes.

  ablate   `kiln ablate FILE` (kiln.ablate.ablate) in a fresh process: every step, ablation.json and .html.
  by hand  the same work as a careful user does it with Kiln's own commands, in a fresh process, calling
           what each command calls: `kiln run ARM --until data` per arm, `kiln tokenizer train` once on the
           baseline's documents, `kiln run ARM --until pack` per arm (tokenizer.path: that tokenizer), and
           per arm and seed `kiln train` (seed=N, loader.sources: the arm's shards), `kiln eval RUN --text`
           on the reference set (its documents joined) and `kiln eval RUN --mc` on the task. One process for
           all of it: the ablation is not charged with the 20-odd interpreter and torch starts a shell would
           pay. Same model, token budget and seeds; each run starts from nothing (a fresh folder).

The two take turns (ablate, by hand, ablate, ...), KILN_BENCH_RUNS times each (default 3), so load from
other jobs on this shared machine falls on both; reported: wall seconds of each, their medians, and the
overhead = median(ablate) / median(by hand) - 1 (the ablation's own work: the overlap check, the tokenizer's
sample from every arm, measuring per document, the bootstrap, the page).

Then `kiln ablate --plan`'s table for the same file (kiln.ablate.estimate): cpu-tiny and 20m measured here,
150m, 400m and 1b extrapolated from 20m's FLOP rate; on 8 x H100 from `kiln plan`.

    python -m benchmarks ablate
    KILN_BENCH_RUNS=5 KILN_BENCH_TOKENS=400000 python -m benchmarks ablate
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ablation.yaml"
RUNS = int(os.environ.get("KILN_BENCH_RUNS", "3"))
TOKENS = int(os.environ.get("KILN_BENCH_TOKENS", "100000"))


def bench_file(folder: Path) -> Path:
    """examples/ablation.yaml with two seeds, the benchmark's token budget and its paths made absolute."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec.update(base=str(ROOT / "examples" / "tiny.yaml"), out_dir=str(folder / "ablation"), seeds=[1, 2],
                proxy_tokens=TOKENS)
    spec["eval"] = {"text": {k: str(ROOT / "examples" / v) for k, v in spec["eval"]["text"].items()},
                    "tasks": [{**t, "path": str(ROOT / "examples" / t["path"])} for t in spec["eval"]["tasks"]]}
    path = folder / "ablation.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def by_hand(path: Path, folder: Path) -> None:
    """The ablation's work through what Kiln's commands call, in the order a user runs them."""
    from kiln.ablate import load
    from kiln.config import build_config, merge
    from kiln.eval import evaluate_checkpoint
    from kiln.eval.mc import evaluate_mc_checkpoint
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage, run_train_stage

    def quiet(*_):
        return None

    plan, sets, _ = load(path)  # the arms' configs, as the user would write them
    hand = folder / "by-hand"

    def config(arm, **changes):
        return build_config(merge(arm.cfg.model_dump(mode="json"), {"out_dir": str(hand / arm.name), **changes}))

    arms = {arm.name: config(arm, tokenizer={"path": None}) for arm in plan.arms}
    for cfg in arms.values():  # kiln run ARM --until data
        run_data_stage(cfg, quiet)
    baseline = arms[plan.baseline.name]
    run_tokenizer_stage(baseline, quiet)  # kiln tokenizer train on the baseline's documents
    tokenizer = str(baseline.out / "tokenizer" / "tokenizer.json")
    reference = hand / "reference.txt"
    text = next(s for s in sets if s.kind == "text")
    reference.write_text("\n\n".join(text.texts))
    task = next(t.path for t in plan.spec.eval.tasks)
    for arm in plan.arms:  # kiln run ARM --until pack, then kiln train and kiln eval per seed
        cfg = config(arm, tokenizer={"path": tokenizer})
        run_tokenizer_stage(cfg, quiet)
        run_pack_stage(cfg, quiet)
        for seed in arm.seeds:
            run = config(arm, tokenizer={"path": tokenizer}, seed=seed, out_dir=str(hand / arm.name / f"seed-{seed}"),
                         loader={"sources": [{"path": str(cfg.out / "shards")}]})
            run_tokenizer_stage(run, quiet)
            run_train_stage(run, quiet)
            last = max((run.out / "run" / "checkpoints").glob("step-*"))
            evaluate_checkpoint(last, reference)
            evaluate_mc_checkpoint(last, Path(task))


def worker(kind: str, folder: str) -> None:
    """One contender, in this (fresh) process; prints its wall seconds."""
    from kiln.ablate import ablate

    folder = Path(folder)
    path = bench_file(folder)
    start = time.perf_counter()
    if kind == "ablate":
        ablate(path, lambda *_: None)
    else:
        by_hand(path, folder)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def run_worker(kind: str, parent: Path) -> float:
    folder = tempfile.mkdtemp(prefix=f"{kind}-", dir=parent)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_ablate", kind, folder], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if proc.returncode:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    subprocess.run(["rm", "-rf", folder], check=True)  # a fresh start for every run
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    from kiln.ablate.estimate import print_estimates

    times: dict[str, list[float]] = {"ablate": [], "by hand": []}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ablate-") as tmp:
        for i in range(RUNS):
            for kind in ("ablate", "by hand") if i % 2 == 0 else ("by hand", "ablate"):
                times[kind].append(run_worker(kind.replace(" ", "-"), Path(tmp)))
                print(f"run {i + 1}/{RUNS} {kind}: {times[kind][-1]:.1f} s (load {os.getloadavg()[0]:.1f})")
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"runs": times, "median_s": medians, "proxy_tokens": TOKENS,
                          "overhead": round(medians["ablate"] / medians["by hand"] - 1, 4)}, indent=1))
        print_estimates(bench_file(Path(tmp)), 8, "H100")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        worker(sys.argv[1], sys.argv[2])
    else:
        main()
