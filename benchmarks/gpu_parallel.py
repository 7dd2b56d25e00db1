"""Parallel layouts side by side on one node: `kiln train` under torchrun with FSDP2, tensor parallel and
pipeline parallel degrees (examples/gpu-1b.yaml by default), the same global batch for each.

For every layout (--layout, repeatable: comma-separated parallel.* degrees, e.g. "dp_shard=8",
"tp=2,dp_shard=4", "pp=2,dp_shard=4,pp_schedule=1f1b"), one torchrun over --nproc ranks; from its
metrics.jsonl: the median step time and tokens/s over the steps after --warmup, the peak device memory
rank 0 reports (mem_peak_gb), and the losses of the first steps. The report puts each layout's tokens/s and
memory as a ratio to the first layout's, and checks that every layout's first losses match the first's
within LOSS_RTOL (the same batch through a different split; bf16 adds its own noise on GPUs).

    python benchmarks/gpu_parallel.py                                  # 8 GPUs: the default layouts below
    python benchmarks/gpu_parallel.py --nproc 4 --layout dp_shard=4 --layout tp=2,dp_shard=2
    python benchmarks/gpu_parallel.py --smoke                          # 2 gloo ranks on CPU, a tiny model

torch.compile is turned off for pipeline layouts (kiln does not compile pipeline stages yet). On CPU the
memory figure is rank 0's peak RSS (mem_peak_gb), which the whole process's state dominates, and the speed of
two ranks sharing two cores says nothing about a GPU node: the smoke run checks the script and the layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "gpu-1b.yaml"
SMOKE = ["tokenizer.vocab_size=512", "pack.seq_len=64", "model.dim=64", "model.n_layers=4", "model.n_heads=4",
         "model.multiple_of=64", "train.batch_size=8", "train.micro_batch_size=null", "train.threads=1",
         "train.dtype=fp32", "parallel.compile=false", "data.workers=1"]
LOSS_STEPS, LOSS_RTOL = 5, 2e-2


def default_layouts(n: int) -> list[str]:
    layouts = [f"dp_shard={n}"]
    if n >= 2:
        layouts += [f"tp=2,dp_shard={n // 2}" if n > 2 else "tp=2", f"pp=2,dp_shard={n // 2}" if n > 2 else "pp=2"]
    if n >= 8:
        layouts += [f"tp=4,dp_shard={n // 4}", f"tp=8,dp_shard={n // 8}" if n > 8 else "tp=8"]
    return layouts


def overrides_for(layout: str) -> list[str]:
    pairs = [p.strip() for p in layout.split(",") if p.strip()]
    out = [f"parallel.{p}" for p in pairs]
    if any(p.startswith("pp=") and p != "pp=1" for p in pairs):
        out += ["parallel.compile=false", "train.micro_batch_size=null"]  # the pipeline cuts its own micro-batches
    return out


def run_layout(cfg_path: Path, base: list[str], layout: str, nproc: int, out: Path, shared: Path,
               timeout: float) -> dict:
    from kiln.train.metrics import read_metrics

    for part in ("tokenizer", "shards"):
        shutil.copytree(shared / part, out / part)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "kiln",
           "train", str(cfg_path), *base, *overrides_for(layout), f"out_dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"layout": layout, "error": (proc.stderr or proc.stdout)[-3000:]}
    steps = [r for r in read_metrics(out / "run" / "metrics.jsonl") if r["event"] == "step"]
    return {"layout": layout, "steps": steps, "wall_s": time.perf_counter() - t0}


def summarise(result: dict, warmup: int) -> dict:
    steps = result.pop("steps")
    timed = steps[warmup:] or steps
    step_s = statistics.median(r["step_time_s"] for r in timed)
    mem = [r.get("mem_peak_gb") for r in timed if r.get("mem_peak_gb")]
    return {**result, "median_step_s": step_s, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mem_peak_gb": max(mem) if mem else None, "first_losses": [r["loss"] for r in steps[:LOSS_STEPS]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE for every layout")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--nproc", type=int, default=None, help="ranks per layout (default: the GPUs here; smoke 2)")
    parser.add_argument("--layout", action="append", default=None, help="comma-separated parallel.* degrees")
    parser.add_argument("--steps", type=int, default=None, help="training steps per layout (default 30; smoke 8)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 10; smoke 3)")
    parser.add_argument("--smoke", action="store_true", help="2 gloo ranks on CPU, a tiny model")
    parser.add_argument("--report", default="gpu-parallel-report", help="folder for report.json")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds each layout may take")
    args = parser.parse_args(argv)

    import torch

    from kiln.config import load_config
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage

    nproc = args.nproc or (2 if args.smoke else max(torch.cuda.device_count(), 1))
    layouts = args.layout or default_layouts(nproc)
    steps, warmup = args.steps or (8 if args.smoke else 30), args.warmup or (3 if args.smoke else 10)
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    inputs = [str(p if Path(p).is_absolute() else ROOT / p) for p in load_config(args.config).data.inputs]
    base = (SMOKE if args.smoke else []) + [f"data.inputs={json.dumps(inputs)}", f"train.max_steps={steps}",
                                            "train.log_every=1", "train.eval_every=0",
                                            f"checkpoint.every={steps + 10}"] + args.overrides
    results, failures = [], []
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-parallel-") as tmp:
        shared = Path(tmp) / "prepared"
        cfg = load_config(args.config, base + [f"out_dir={shared}"])
        for stage in (run_data_stage, run_tokenizer_stage, run_pack_stage):
            stage(cfg, print)
        for i, layout in enumerate(layouts):
            print(f"== {layout} on {nproc} ranks", flush=True)
            r = run_layout(Path(args.config), base, layout, nproc, Path(tmp) / f"layout-{i}", shared, args.timeout)
            if "error" in r:
                failures.append(f"{layout}: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
                results.append(r)
                continue
            results.append(summarise(r, warmup))
    ok = [r for r in results if "error" not in r]
    if ok:
        first = ok[0]
        for r in ok:
            r["tokens_per_s_ratio"] = r["tokens_per_s"] / first["tokens_per_s"]
            r["mem_ratio"] = r["mem_peak_gb"] / first["mem_peak_gb"] if r["mem_peak_gb"] and first["mem_peak_gb"] \
                else None
            agree = all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(r["first_losses"], first["first_losses"]))
            r["losses_match_first"] = agree
            if not agree:
                failures.append(f"{r['layout']}: first losses {r['first_losses']} differ from {first['layout']}'s "
                                f"{first['first_losses']} by more than {LOSS_RTOL:.0%}")
    out = {"nproc": nproc, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "config": args.config, "overrides": base, "layouts": results, "failures": failures}
    (report / "report.json").write_text(json.dumps(out, indent=1))
    for r in ok:
        mem = f"{r['mem_peak_gb']:.1f} GB (x{r['mem_ratio']:.2f})" if r["mem_ratio"] else "n/a"
        print(f"{r['layout']:>32}: {r['tokens_per_s']:,.0f} tokens/s (x{r['tokens_per_s_ratio']:.2f}), "
              f"peak memory {mem}, losses match: {r['losses_match_first']}")
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
