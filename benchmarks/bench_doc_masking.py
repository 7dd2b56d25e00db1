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

Then the attention kernel alone (`kiln.model.attention.attend`, forward and backward, fp32, 8 heads of 64, one
row of documents of 300 tokens) at sequence lengths 256, 1,024 and 4,096: causal against masked, alternating one
call each, REPS calls, medians; and the mask's construction (once per forward, shared by the layers). Causal
SDPA skips the blocks above the diagonal; the exact mask makes the kernel do the whole seq x seq product.

    python -m benchmarks doc_masking
    KILN_BENCH_RUNS=3 KILN_BENCH_DTYPES=fp32 python -m benchmarks doc_masking
    KILN_BENCH_PART=kernel python -m benchmarks doc_masking      # only the kernel (train: only the step)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_train_step import (DTYPES, RUNS, STEPS, WARMUP, data_root, fresh_out, kiln_worker, lockstep,
                                         paired_ratio, prepare, worker_command, worker_main)

MODULE = "benchmarks.bench_doc_masking"
THREADS = int(os.environ.get("KILN_BENCH_THREADS", "1"))
PART = os.environ.get("KILN_BENCH_PART", "all")
REPS = 11


def masking_worker(masking: bool):
    def configure(cfg) -> None:
        cfg.model.document_masking = masking
        cfg.train.threads = THREADS

    return lambda out, dtype, compile, warmup, steps: kiln_worker(out, dtype, compile, warmup, steps, configure)


WORKERS = {"off": masking_worker(False), "on": masking_worker(True)}


def documents_per_sample(data: Path) -> float:
    """Documents that start inside a training sample, on average (EOS tokens before its last position)."""
    import numpy as np

    from kiln.shards.reader import ShardSet

    s = ShardSet(data / "shards", "train")
    eos = int(s.manifest["eos_id"])
    n = min(len(s), 2000)
    return 1 + float(np.mean([(s.sample(i)[:-1] == eos).sum() for i in range(n)]))


def kernel_main() -> None:
    import torch

    from kiln.model.attention import DocumentMask, attend

    torch.set_num_threads(THREADS)
    print(f"\n{'seq':>6} {'causal ms':>10} {'masked ms':>10} {'masked/causal':>14} {'mask build ms':>14}")
    for seq in (256, 1024, 4096):
        tokens = torch.randint(3, 1000, (1, seq))
        tokens[0, 300::300] = 1  # EOS: documents of 300 tokens
        q, k, v = (torch.randn(1, 8, seq, 64, requires_grad=True) for _ in range(3))
        times: dict[str, list[float]] = {"causal": [], "masked": [], "build": []}
        for rep in range(REPS + 1):
            for name in (("causal", "masked") if rep % 2 else ("masked", "causal")):
                t0 = time.perf_counter()
                mask = DocumentMask.of(tokens, 1, "sdpa") if name == "masked" else None
                built = time.perf_counter()
                attend(q, k, v, mask).sum().backward()
                if rep:  # the first call of each warms up
                    times[name].append(time.perf_counter() - t0)
                    if mask is not None:
                        times["build"].append(built - t0)
        med = {name: statistics.median(t) * 1000 for name, t in times.items()}
        print(f"{seq:6} {med['causal']:10.1f} {med['masked']:10.1f} {med['masked'] / med['causal']:14.2f} "
              f"{med['build']:14.2f}", flush=True)


def main() -> None:
    if PART in ("all", "train"):
        train_main()
    if PART in ("all", "kernel"):
        kernel_main()


def train_main() -> None:
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
