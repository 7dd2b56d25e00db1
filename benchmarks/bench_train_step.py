"""Kiln's full training step against a plain, minimal PyTorch loop of the same model, in the same run.

Model: Kiln's `Llama` from `kiln.model.build.build_model` (d=256, 4 layers, 4 heads, SwiGLU 704,
vocabulary 4,096 from a tokenizer trained on the bundled sample crawl, seq 256, batch 8 = 2,048 tokens
a step), 2 threads, fp32 and bf16 autocast. Data: shards packed from examples/data/sample.warc.gz by
Kiln's own stages; both loops read the same samples in the same seeded order.

  kiln   `Trainer.run()` as `kiln train` runs it: prefetching loader, train_step, optimizer_step (clipping
         by layer group, non-finite and spike guards, update-to-weight ratio every 10 steps), metrics.jsonl,
         watchdog, budget. Eval and checkpoints fall outside the timed window.
  plain  forward, fp32 cross-entropy, backward, clip_grad_norm_(1.0), AdamW (torch defaults), zero_grad.

Every run starts both contenders in fresh processes (so ru_maxrss is each one's own peak), which take
turns one step at a time (`lockstep`), so load from other jobs hits both alike. Per run: tokens/s of the
median step of STEPS timed steps after WARMUP steps (and over the whole window); reported: the median over
RUNS runs.

    python -m benchmarks train_step
    KILN_BENCH_DATA=DIR python -m benchmarks train_step   # keep the prepared shards in DIR between runs
    KILN_BENCH_OLD_SRC=/tmp/old/src python -m benchmarks train_step   # kiln against kiln-old instead of plain

KILN_BENCH_OLD_SRC names the src/ of another Kiln checkout (`git worktree add /tmp/old COMMIT`): its
`Trainer.run()` is the baseline contender `kiln-old`, run by the same worker in lockstep with this one, to show
what a change costs. KILN_BENCH_RUNS sets the number of runs (default 5), KILN_BENCH_DTYPES the precisions
(default fp32,bf16).
"""

from __future__ import annotations

import json
import os
import random
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
WARMUP, STEPS = 5, 20
RUNS = int(os.environ.get("KILN_BENCH_RUNS", "5"))
OLD_SRC = os.environ.get("KILN_BENCH_OLD_SRC")  # another checkout's src/: the `kiln-old` contender
DTYPES = os.environ.get("KILN_BENCH_DTYPES", "fp32,bf16").split(",")  # which precisions to run, in order


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
        "watchdog": {"stall_timeout_s": 3600},  # in lockstep a worker waits for the others' (compiling) steps
        "parallel": {"compile": compile},
    })


def prepare(root: Path) -> Path:
    """docs/, tokenizer/ and shards/ under root/data (each stage skips when already complete)."""
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage

    cfg = bench_config(root / "data")

    def quiet(*_):
        return None

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


class StepClock:
    """Each step's duration, measured by a worker as it trains.

    In lockstep (KILN_BENCH_LOCKSTEP=1, set by `lockstep()`), the worker waits for a line on stdin before
    its first step and after every step but the last, and reports each step's duration on stdout: the
    contenders then run side by side, taking turns one step at a time, so a burst of load from elsewhere
    (this shared machine's largest source of noise) falls on every contender's same steps, not on one run.
    """

    def __init__(self, total: int) -> None:
        self.total, self.durations = total, []
        self.lockstep = os.environ.get("KILN_BENCH_LOCKSTEP") == "1"
        if self.lockstep:
            sys.stdin.readline()
        self.t0 = time.perf_counter()

    def tick(self) -> None:
        """Call at the end of every step."""
        now = time.perf_counter()
        self.durations.append(now - self.t0)
        if self.lockstep:
            print(json.dumps({"step_s": now - self.t0}), flush=True)
            if len(self.durations) < self.total:
                sys.stdin.readline()
        self.t0 = time.perf_counter()

    def result(self, warmup: int, skipped: int = 0) -> dict:
        """Tokens/s over the steps after `warmup`: from the median step (robust to a burst of load from
        other jobs in the middle of a run) and over the whole window."""
        times = self.durations[warmup:]
        tokens = BATCH * SEQ
        return {
            "tokens_per_s": tokens / statistics.median(times),
            "window_tokens_per_s": tokens * len(times) / sum(times),
            "peak_rss_mb": peak_rss_mb(),
            "skipped": skipped,
            "step_s": times,
        }


def kiln_worker(out: Path, dtype: str, compile: bool, warmup: int, steps: int, configure=None) -> dict:
    """Time `Trainer.run()` by the log line it prints after every step (log_every=1); stop it after the window.
    `configure(cfg)` may change the config first (another benchmark's variant)."""
    from kiln.train.trainer import Trainer

    cfg = bench_config(out, dtype, compile, log_every=1, max_steps=warmup + steps + 1)
    if configure is not None:
        configure(cfg)

    def log(msg: str) -> None:
        if msg.startswith("step ") and "/" in msg.split()[1]:
            clock.tick()
            if len(clock.durations) == warmup + steps:
                raise _WindowDone

    trainer = Trainer(cfg, log=log)
    clock = StepClock(warmup + steps)  # the first step includes the step-0 evaluation: a warm-up step
    try:
        trainer.run()
    except _WindowDone:
        pass
    records = [json.loads(ln) for ln in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return clock.result(warmup, skipped=sum(1 for r in records if r.get("event") == "skip"))


def plain_worker(out: Path, dtype: str, compile: bool, warmup: int, steps: int, chunked: bool = False) -> dict:
    """The textbook loop on the same model, samples and order."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from kiln.shards.reader import ShardSet
    from kiln.train.data import Mixture
    from kiln.model.build import build_model

    cfg = bench_config(out, dtype, compile)
    torch.set_num_threads(THREADS)
    torch.manual_seed(cfg.seed)
    shards = ShardSet(out / "shards", "train")
    train = Mixture([shards])
    order = train.epoch_order(cfg.seed, 0)  # the order Kiln's loader walks
    model = build_model(cfg.model, int(shards.manifest["vocab_size"]), cfg.pack.seq_len)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    forward = torch.compile(model) if compile else model
    amp = torch.bfloat16 if dtype == "bf16" else None
    clock = StepClock(warmup + steps)
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
        clock.tick()
    return clock.result(warmup)


WORKERS = {"kiln": kiln_worker, "kiln-old": kiln_worker, "plain": plain_worker}


def worker_command(module: str, name: str, out: Path, dtype: str, compile: bool = False, warmup: int = WARMUP,
                   steps: int = STEPS, python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run one contender's worker."""
    cmd = [python, "-m", module, "--worker", name, str(out), dtype, str(int(compile)), str(warmup), str(steps)]
    # kiln-old imports kiln from OLD_SRC alone (the caller's PYTHONPATH may name this checkout's src).
    if name == "kiln-old":
        path = [str(ROOT), OLD_SRC]
    else:
        path = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return cmd, {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def lockstep(commands: dict[str, tuple[list[str], dict[str, str]]], total: int) -> dict[str, dict]:
    """Run every contender's worker at once, in fresh processes that take turns one step at a time (the
    turn order shuffled every step; see StepClock). Returns each worker's result."""
    procs: dict[str, subprocess.Popen] = {}
    errs = {name: tempfile.TemporaryFile(mode="w+") for name in commands}
    try:
        for name, (cmd, env) in commands.items():
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env={**env, "KILN_BENCH_LOCKSTEP": "1"}, text=True,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[name])

        def failed(name: str, what: str) -> RuntimeError:
            procs[name].wait()
            errs[name].seek(0)
            return RuntimeError(f"{name} {what} (exit {procs[name].returncode}):\n{errs[name].read()[-3000:]}")

        names = list(commands)
        turns = random.Random(0)
        for step in range(total):
            # A fresh order every step: each contender follows every other in turn, so what one leaves in
            # the caches (or its threads still spinning) costs every contender alike.
            for name in turns.sample(names, len(names)):
                p = procs[name]
                try:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                except BrokenPipeError:
                    raise failed(name, f"exited before step {step + 1}") from None
                while not (line := p.stdout.readline()).startswith('{"step_s"'):  # other output is skipped
                    if not line:
                        raise failed(name, f"exited before step {step + 1}")
        results = {}
        for name, p in procs.items():
            p.stdin.close()
            out = p.stdout.read()  # not communicate(): it reads the pipe directly and would miss what readline buffered
            if p.wait():
                raise failed(name, "failed")
            results[name] = json.loads(out.strip().splitlines()[-1])
        return results
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in errs.values():
            f.close()


def worker_main(argv: list[str], workers: dict) -> None:
    name, out, dtype, compile, warmup, steps = argv
    result = workers[name](Path(out), dtype, bool(int(compile)), int(warmup), int(steps))
    print(json.dumps(result))


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
        base = "kiln-old" if OLD_SRC else "plain"
        for dtype in DTYPES:
            print(f"{dtype}: {RUNS} lockstep runs of kiln and {base}, {WARMUP} warm-up + {STEPS} timed steps each")
            res: dict[str, list[dict]] = {"kiln": [], base: []}
            for r in range(RUNS):
                order = ["kiln", base] if r % 2 == 0 else [base, "kiln"]
                run = lockstep({c: worker_command("benchmarks.bench_train_step", c, fresh_out(data, Path(tmp)), dtype)
                                for c in order}, WARMUP + STEPS)
                for c in res:
                    res[c].append(run[c])
                print(f"  run {r + 1}: kiln {run['kiln']['tokens_per_s']:,.0f}, "
                      f"{base} {run[base]['tokens_per_s']:,.0f} tok/s, paired median step ratio "
                      f"{paired_ratio(run['kiln'], run[base]):.3f}", flush=True)
            med = {c: statistics.median(r["tokens_per_s"] for r in v) for c, v in res.items()}
            mem = {c: statistics.median(r["peak_rss_mb"] for r in v) for c, v in res.items()}
            window = {c: statistics.median(r["window_tokens_per_s"] for r in v) for c, v in res.items()}
            skipped = sum(r["skipped"] for r in res["kiln"])
            table.append((dtype, med, mem, res, skipped, window))
        print(f"\n{'dtype':6} {'kiln tok/s':>11} {base + ' tok/s':>14} {'ratio':>6} {'paired':>6} "
              f"{'kiln MB':>8} {base + ' MB':>11} {'mem ratio':>9}")
        for dtype, med, mem, res, skipped, window in table:
            paired = statistics.median(paired_ratio(a, b) for a, b in zip(res["kiln"], res[base]))
            print(
                f"{dtype:6} {med['kiln']:11,.0f} {med[base]:14,.0f} {med['kiln'] / med[base]:6.3f} {paired:6.3f} "
                f"{mem['kiln']:8.0f} {mem[base]:11.0f} {mem['kiln'] / mem[base]:9.3f}"
                + f"  (whole-window tok/s: {window['kiln']:,.0f} / {window[base]:,.0f}"
                f" = {window['kiln'] / window[base]:.3f})"
                + (f"  ({skipped} kiln steps skipped by guards)" if skipped else "")
            )
            for c in ("kiln", base):
                print(f"       {c} runs: " + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in res[c]))


def paired_ratio(kiln: dict, base: dict) -> float:
    """Median over the timed steps of (base's step time / kiln's at the same step): > 1 when kiln is faster. In
    lockstep both took the same step side by side, so a burst of outside load falls on both alike."""
    return statistics.median(b / a for a, b in zip(kiln["step_s"], base["step_s"]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:], WORKERS)
    else:
        main()
