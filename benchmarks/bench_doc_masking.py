"""The cost of document masking on a CPU: Kiln's training step with model.document_masking on against off.

The reference setup of bench_train_step (Kiln's Llama d=256, 4 layers, seq 256, batch 8 = 2,048 tokens a step;
shards packed from examples/data/sample.warc.gz by Kiln's own stages), `Trainer.run()` as `kiln train` runs
it, in fp32 and bf16, on KILN_BENCH_THREADS intra-op threads (default 1: on a shared 2-core machine two
threads wait at barriers for a parked sibling, NOTES). Off: causal scaled_dot_product_attention
(`is_causal=True`). On: the CPU's kernel, scaled_dot_product_attention with the exact (batch, 1, seq, seq)
block-causal mask built once per forward from the EOS tokens (flex_attention has no backward on a CPU in
torch 2.13). The two contenders run in fresh processes that take turns one step at a time (`lockstep`), so
load from other jobs hits both alike; reported: the median over runs of each one's median-step tokens/s,
and the paired median step-time ratio.

    python -m benchmarks doc_masking
    KILN_BENCH_RUNS=3 KILN_BENCH_DTYPES=fp32 python -m benchmarks doc_masking
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_train_step import (DTYPES, RUNS, STEPS, WARMUP, _WindowDone, StepClock, bench_config,
                                         data_root, fresh_out, lockstep, paired_ratio, prepare, worker_command,
                                         worker_main)

MODULE = "benchmarks.bench_doc_masking"
THREADS = int(os.environ.get("KILN_BENCH_THREADS", "1"))


def masking_worker(masking: bool):
    def worker(out: Path, dtype: str, compile: bool, warmup: int, steps: int) -> dict:
        from kiln.train.trainer import Trainer

        cfg = bench_config(out, dtype, compile, log_every=1, max_steps=warmup + steps + 1)
        cfg.model.document_masking = masking
        cfg.train.threads = THREADS

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
        return clock.result(warmup)

    return worker


WORKERS = {"off": masking_worker(False), "on": masking_worker(True)}


def documents_per_sample(data: Path) -> float:
    """Documents that start inside a training sample, on average (EOS tokens before its last position)."""
    import numpy as np

    from kiln.shards.reader import ShardSet

    s = ShardSet(data / "shards", "train")
    eos = int(s.manifest["eos_id"])
    n = min(len(s), 2000)
    return 1 + float(np.mean([(s.sample(i)[:-1] == eos).sum() for i in range(n)]))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-docmask-") as tmp:
        root = data_root(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        data = prepare(root)
        print(f"prepared shards in {time.perf_counter() - t0:.0f} s; {documents_per_sample(data):.2f} documents "
              "per training sample")
        rows = []
        for dtype in DTYPES:
            print(f"{dtype}: {RUNS} lockstep runs of masking off and on, {WARMUP} warm-up + {STEPS} timed steps")
            res: dict[str, list[dict]] = {"off": [], "on": []}
            for r in range(RUNS):
                order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                run = lockstep({c: worker_command(MODULE, c, fresh_out(data, Path(tmp)), dtype) for c in order},
                               WARMUP + STEPS)
                for c in res:
                    res[c].append(run[c])
                print(f"  run {r + 1}: off {run['off']['tokens_per_s']:,.0f}, on {run['on']['tokens_per_s']:,.0f} "
                      f"tok/s, paired step time on/off {paired_ratio(run['off'], run['on']):.3f}", flush=True)
            med = {c: statistics.median(x["tokens_per_s"] for x in v) for c, v in res.items()}
            paired = statistics.median(paired_ratio(off, on) for off, on in zip(res["off"], res["on"]))
            rows.append((dtype, med, paired))
        print(f"\n{'dtype':6} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'paired step time on/off':>24}")
        for dtype, med, paired in rows:
            print(f"{dtype:6} {med['off']:10,.0f} {med['on']:10,.0f} {med['on'] / med['off']:7.3f} {paired:24.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:], WORKERS)
    else:
        main()
