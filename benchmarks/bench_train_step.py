"""Kiln's full training step against a plain, minimal PyTorch loop of the same model, in the same run.

Model: Kiln's `Llama` from `kiln.train.trainer.build_model` (d=256, 4 layers, 4 heads, SwiGLU 704,
vocabulary 4,096 from a tokenizer trained on the bundled sample crawl, seq 256, batch 8 = 2,048 tokens
a step), 2 threads, fp32 and bf16 autocast. Data: shards packed from examples/data/sample.warc.gz by
Kiln's own stages; both loops read the same samples in the same seeded order.

  kiln   `Trainer.run()` as `kiln train` runs it: prefetching loader, train_step, optimizer_step (clipping
         by layer group, non-finite and spike guards, update-to-weight ratio every 10 steps), metrics.jsonl,
         watchdog, budget. Eval and checkpoints fall outside the timed window.
  plain  forward, fp32 cross-entropy, backward, clip_grad_norm_(1.0), AdamW (torch defaults), zero_grad.

Every run of every contender is a fresh process (so ru_maxrss is its own peak); the contenders alternate
within each round, and their order flips every round, so load from other jobs hits both alike.
Per run: tokens/s of the median step of STEPS timed steps after WARMUP steps (and over the whole window);
reported: the median over RUNS rounds.

    python -m benchmarks train_step
    KILN_BENCH_DATA=DIR python -m benchmarks train_step   # keep the prepared shards in DIR between runs
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_WARC = ROOT / "examples" / "data" / "sample.warc.gz"
SEQ, BATCH, THREADS = 256, 8, 2
MODEL = {"dim": 256, "n_layers": 4, "n_heads": 4}
VOCAB = 4096
WARMUP, STEPS, RUNS = 5, 20, 5


def bench_config(out_dir: Path, dtype: str = "fp32", compile: bool = False, **train):
    """The reference configuration (NOTES: 'Training on this CPU') with `out_dir`."""
    from kiln.config import build_config

    return build_config({
        "out_dir": str(out_dir), "seed": 7,
        "data": {"inputs": [str(SAMPLE_WARC)], "min_chars": 200, "workers": 2},
        "tokenizer": {"vocab_size": VOCAB},
        "pack": {"seq_len": SEQ, "val_fraction": 0.05},
        "model": MODEL,
        "train": {"batch_size": BATCH, "lr": 3e-4, "warmup_steps": 2, "dtype": dtype, "threads": THREADS,
                  "eval_every": 0, "eval_batches": 1, "max_steps": 10_000, **train},
        "checkpoint": {"every": 10_000},
        "parallel": {"compile": compile},
    })


def prepare(root: Path) -> Path:
    """docs/, tokenizer/ and shards/ under root/data (each stage skips when already complete)."""
    from kiln.flow import run_data_stage, run_pack_stage, run_tokenizer_stage

    cfg = bench_config(root / "data")
    quiet = lambda *_: None
    run_data_stage(cfg, quiet)
    run_tokenizer_stage(cfg, quiet)
    run_pack_stage(cfg, quiet)
    return cfg.out


def fresh_out(data: Path, parent: Path) -> Path:
    """An out_dir that shares the prepared tokenizer and shards but has no run/ (so nothing resumes)."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=parent))
    for name in ("tokenizer", "shards"):
        (out / name).symlink_to(data / name)
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _WindowDone(Exception):
    pass


def step_result(ends: list[float], skipped: int = 0) -> dict:
    """Tokens/s from the end times of consecutive steps: over the whole window, and from the median step
    (robust to a burst of load from other jobs in the middle of a run)."""
    times = [b - a for a, b in itertools.pairwise(ends)]
    tokens = BATCH * SEQ
    return {"tokens_per_s": tokens / statistics.median(times), "window_tokens_per_s": tokens * len(times) / (ends[-1] - ends[0]),
            "peak_rss_mb": peak_rss_mb(), "skipped": skipped}


def kiln_worker(out: Path, dtype: str, compile: bool, warmup: int, steps: int) -> dict:
    """Time `Trainer.run()` by the log line it prints after every step (log_every=1); stop it after the window."""
    from kiln.train.trainer import Trainer

    cfg = bench_config(out, dtype, compile, log_every=1, max_steps=warmup + steps + 1)
    ends: list[float] = []

    def log(msg: str) -> None:
        if msg.startswith("step ") and "/" in msg.split()[1]:
            ends.append(time.perf_counter())
            if len(ends) == warmup + steps:
                raise _WindowDone

    trainer = Trainer(cfg, log=log)
    try:
        trainer.run()
    except _WindowDone:
        pass
    records = [json.loads(ln) for ln in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return step_result(ends[warmup - 1:], skipped=sum(1 for r in records if r.get("event") == "skip"))


def plain_worker(out: Path, dtype: str, compile: bool, warmup: int, steps: int, chunked: bool = False) -> dict:
    """The textbook loop on the same model, samples and order."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from kiln.shards.format import ShardSet
    from kiln.train.data import Mixture
    from kiln.train.trainer import build_model

    cfg = bench_config(out, dtype, compile)
    torch.set_num_threads(THREADS)
    torch.manual_seed(cfg.seed)
    shards = ShardSet(out / "shards", "train")
    train = Mixture([shards])
    order = train.epoch_order(cfg.seed, 0)  # the order Kiln's loader walks
    model = build_model(cfg, int(shards.manifest["vocab_size"]))
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    forward = torch.compile(model) if compile else model
    amp = torch.bfloat16 if dtype == "bf16" else None
    ends = []
    for step in range(warmup + steps):
        rows = np.empty((BATCH, SEQ + 1), np.int64)
        train.gather(order[step * BATCH:(step + 1) * BATCH], rows)
        batch = torch.from_numpy(rows)
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        ends.append(time.perf_counter())
    return step_result(ends[warmup - 1:])


WORKERS = {"kiln": kiln_worker, "plain": plain_worker}


def spawn(module: str, name: str, out: Path, dtype: str, compile: bool = False, warmup: int = WARMUP,
          steps: int = STEPS, python: str = sys.executable) -> dict:
    """Run one contender in a fresh process; its result is the JSON on its last stdout line."""
    cmd = [python, "-m", module, "--worker", name, str(out), dtype, str(int(compile)), str(warmup), str(steps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} {dtype} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_main(argv: list[str], workers: dict) -> None:
    name, out, dtype, compile, warmup, steps = argv
    result = workers[name](Path(out), dtype, bool(int(compile)), int(warmup), int(steps))
    print(json.dumps(result))


def rounds(contenders: list[str], run_one, runs: int) -> dict[str, list[dict]]:
    """`runs` rounds; each runs every contender once, in an order that flips every round."""
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    for r in range(runs):
        for c in (contenders if r % 2 == 0 else contenders[::-1]):
            results[c].append(run_one(c))
            print(f"  round {r + 1} {c}: {results[c][-1]['tokens_per_s']:,.0f} tok/s, "
                  f"{results[c][-1]['peak_rss_mb']:.0f} MB", flush=True)
    return results


def data_root(tmp: str) -> Path:
    keep = os.environ.get("KILN_BENCH_DATA")
    return Path(keep) if keep else Path(tmp)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-train-") as tmp:
        root = data_root(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        data = prepare(root)
        print(f"prepared shards in {time.perf_counter() - t0:.0f} s ({data})")
        table = []
        for dtype in ("fp32", "bf16"):
            print(f"{dtype}: {RUNS} rounds of kiln/plain, {WARMUP} warm-up + {STEPS} timed steps each")
            res = rounds(["kiln", "plain"], lambda c, dtype=dtype: spawn("benchmarks.bench_train_step", c, fresh_out(data, Path(tmp)), dtype), RUNS)
            med = {c: statistics.median(r["tokens_per_s"] for r in v) for c, v in res.items()}
            mem = {c: statistics.median(r["peak_rss_mb"] for r in v) for c, v in res.items()}
            window = {c: statistics.median(r["window_tokens_per_s"] for r in v) for c, v in res.items()}
            skipped = sum(r["skipped"] for r in res["kiln"])
            table.append((dtype, med, mem, res, skipped, window))
        print(f"\n{'dtype':6} {'kiln tok/s':>11} {'plain tok/s':>12} {'ratio':>6} {'kiln MB':>8} {'plain MB':>9} {'mem ratio':>9}")
        for dtype, med, mem, res, skipped, window in table:
            print(f"{dtype:6} {med['kiln']:11,.0f} {med['plain']:12,.0f} {med['kiln'] / med['plain']:6.3f} "
                  f"{mem['kiln']:8.0f} {mem['plain']:9.0f} {mem['kiln'] / mem['plain']:9.3f}"
                  + f"  (whole-window tok/s: {window['kiln']:,.0f} / {window['plain']:,.0f} = {window['kiln'] / window['plain']:.3f})"
                  + (f"  ({skipped} kiln steps skipped by guards)" if skipped else ""))
            for c in ("kiln", "plain"):
                print(f"       {c} runs: " + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in res[c]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:], WORKERS)
    else:
        main()
