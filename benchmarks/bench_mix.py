"""`kiln mix`'s overhead against running the same runs by hand, and what each proxy scale costs here.

The mix: examples/mix.yaml (the bundled crawl's European and CJK pages as two sources, the cpu-tiny proxy,
the handbook eval sets) with seeds [1, 2] and proxy_tokens KILN_BENCH_TOKENS (default 50,000) so that a run
of the benchmark takes minutes.

  mix      `kiln mix FILE` (kiln.mix.mix) in a fresh process: every step, mix.json and mix.html.
  by hand  the same work as a careful user does it with Kiln's own commands, in a fresh process, calling what
           each command calls: `kiln run SOURCE --until data` per source, `kiln tokenizer train` once on the
           first source's documents, `kiln run SOURCE --until pack` per source (tokenizer.path: that
           tokenizer), then per swarm mixture (the same weights: kiln.mix.swarm.draw on the same sizes)
           `kiln train` (loader.sources: the weighted shards), `kiln eval RUN --text SET` on each text set
           (its documents as one text file) and `kiln eval RUN --mc TASK` on each task: the fit regresses every
           eval metric, so every swarm run is measured on every eval set, as the mix measures it; the fit and
           proposal (kiln.mix.fit / propose on those numbers, every metric, the mix's target: what a user's
           notebook would do); then per verification arm (natural, proposed, best swarm run) and seed
           `kiln train` and the same evals. One process for all of it. Same model, token budget, weights and
           seeds; each run starts from nothing (a fresh folder).

The two take turns (mix, by hand, by hand, mix, ...), KILN_BENCH_RUNS times each (default 3), so load from
other jobs on this shared machine falls on both; reported: wall seconds of each, their medians, and the
overhead = median(mix) / median(by hand) - 1 (the mix's own work: the overlap check, the tokenizer's sample
from every source, measuring per document, the fit's cross-validation, the bootstrap, the page).

Then `kiln mix --plan`'s table for the same file (kiln.ablate.estimate, the swarm's and the verification's
runs): cpu-tiny and 20m measured here, 150m, 400m and 1b extrapolated from 20m's FLOP rate; on 8 x H100 from
`kiln plan`.

    python -m benchmarks mix
    KILN_BENCH_RUNS=1 KILN_BENCH_TOKENS=20000 python -m benchmarks mix
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
EXAMPLE = ROOT / "examples" / "mix.yaml"
RUNS = int(os.environ.get("KILN_BENCH_RUNS", "3"))
TOKENS = int(os.environ.get("KILN_BENCH_TOKENS", "50000"))


def bench_file(folder: Path) -> Path:
    """examples/mix.yaml with two seeds, the benchmark's token budget and its paths made absolute."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec.update(base=str(ROOT / "examples" / "tiny.yaml"), out_dir=str(folder / "mix"), seeds=[1, 2],
                proxy_tokens=TOKENS)
    for source in spec["sources"].values():
        source["inputs"] = [str(ROOT / "examples" / i) for i in source["inputs"]]
    spec["eval"] = {"text": {k: str(ROOT / "examples" / v) for k, v in spec["eval"]["text"].items()},
                    "tasks": [{**t, "path": str(ROOT / "examples" / t["path"])} for t in spec["eval"]["tasks"]]}
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def by_hand(path: Path, folder: Path) -> None:
    """The mix's work through what Kiln's commands call, in the order a user runs them."""
    import numpy as np

    from kiln.config import build_config, merge
    from kiln.eval import evaluate_checkpoint
    from kiln.eval.mc import evaluate_mc_checkpoint
    from kiln.manifest import read_manifest
    from kiln.mix import load
    from kiln.mix.driver import target_metric
    from kiln.mix.fit import fit_all
    from kiln.mix.propose import propose
    from kiln.mix.spec import min_swarm
    from kiln.mix.swarm import Budget, draw
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage, run_train_stage

    def quiet(*_):
        return None

    plan, sets = load(path)  # the sources' configs, as the user would write them
    spec, hand = plan.spec, folder / "by-hand"

    def config(arm, **changes):
        return build_config(merge(arm.cfg.model_dump(mode="json"), {"out_dir": str(hand / arm.name), **changes}))

    arms = plan.sources.arms
    for arm in arms:  # kiln run SOURCE --until data
        run_data_stage(config(arm, tokenizer={"path": None}), quiet)
    first = config(arms[0], tokenizer={"path": None})
    run_tokenizer_stage(first, quiet)  # kiln tokenizer train on the first source's documents
    tokenizer = str(first.layout.tokenizer / "tokenizer.json")
    shards = {}
    for arm in arms:  # kiln run SOURCE --until pack
        cfg = config(arm, tokenizer={"path": tokenizer})
        run_tokenizer_stage(cfg, quiet)
        run_pack_stage(cfg, quiet)
        shards[arm.name] = cfg.layout.shards
    texts = {}  # each text set as the one text file `kiln eval --text` reads
    for s in sets:
        if s.kind == "text":
            texts[s.name] = hand / f"{s.name}.txt"
            texts[s.name].write_text("\n\n".join(s.texts))
    t = first.train
    budget = Budget([a.name for a in arms], np.asarray([read_manifest(shards[a.name])["splits"]["train"]["samples"]
                                                       for a in arms], dtype=float), t.max_steps * t.batch_size,
                    spec.max_epochs)

    def train(weights, seed, name) -> dict[str, float]:
        """kiln train, then kiln eval RUN --text SET per text set and --mc TASK per task: every metric."""
        sources = [{"path": str(shards[n]), "weight": float(w)} for n, w in zip(budget.names, weights) if w > 0]
        run = config(arms[0], tokenizer={"path": tokenizer}, seed=seed, out_dir=str(hand / name),
                     loader={"sources": sources})
        run_tokenizer_stage(run, quiet)
        run_train_stage(run, quiet)
        last = max(run.layout.checkpoints.glob("step-*"))
        metrics = {f"{n}/bits_per_byte": evaluate_checkpoint(last, f)["bits_per_byte"] for n, f in texts.items()}
        for task in spec.eval.tasks:
            mc = evaluate_mc_checkpoint(last, Path(task.path))
            metrics.update({f"{task.name}/{m}": mc[m] for m in ("acc", "acc_norm", "acc_bytes")})
        return metrics

    swarm = np.array(draw(budget, spec.concentration, spec.swarm_seed, spec.runs_in_swarm))
    rows = [train(w, spec.swarm_seed, f"swarm-{i}") for i, w in enumerate(swarm)]
    metrics = {m: np.array([r[m] for r in rows]) for m in rows[0]}  # the fit regresses every metric, as the mix's
    target = {target_metric(n): w for n, w in spec.target.items()}
    fits = fit_all(swarm, metrics, target, min_swarm(len(arms)))
    chosen = {"natural": budget.natural,
              "best-swarm": swarm[int(np.argmin(sum(w * metrics[m] for m, w in target.items())))]}
    if fits["trusted"]:
        chosen["proposed"] = propose(fits["metrics"], target, False, budget, swarm)
    for name, weights in chosen.items():
        for seed in spec.seeds:
            train(weights, seed, f"{name}-{seed}")


def worker(kind: str, folder: str) -> None:
    """One contender, in this (fresh) process; prints its wall seconds."""
    from kiln.mix import mix

    folder = Path(folder)
    path = bench_file(folder)
    start = time.perf_counter()
    if kind == "mix":
        mix(path, lambda *_: None)
    else:
        by_hand(path, folder)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def run_worker(kind: str, parent: Path) -> float:
    folder = tempfile.mkdtemp(prefix=f"{kind}-", dir=parent)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_mix", kind, folder], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if proc.returncode:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    subprocess.run(["rm", "-rf", folder], check=True)  # a fresh start for every run
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    from kiln.mix.driver import print_plan

    times: dict[str, list[float]] = {"mix": [], "by hand": []}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-mix-") as tmp:
        for i in range(RUNS):
            for kind in ("mix", "by hand") if i % 2 == 0 else ("by hand", "mix"):
                times[kind].append(run_worker(kind.replace(" ", "-"), Path(tmp)))
                print(f"run {i + 1}/{RUNS} {kind}: {times[kind][-1]:.1f} s (load {os.getloadavg()[0]:.1f})")
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"runs": times, "median_s": medians, "proxy_tokens": TOKENS,
                          "overhead": round(medians["mix"] / medians["by hand"] - 1, 4)}, indent=1))
        print_plan(bench_file(Path(tmp)), 8, "H100")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        worker(sys.argv[1], sys.argv[2])
    else:
        main()
