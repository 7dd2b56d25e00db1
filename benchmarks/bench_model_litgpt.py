"""Kiln's `Llama` against litgpt's `GPT` in one process: the models alone, without either training loop.

`train_peers` compares whole training processes, and at bf16 their gap is within the noise between processes.
Here both models live in one process, in litgpt's environment (Kiln's model needs only torch), and take
turns step by step in a shuffled order. Model, batch, dtype and optimiser are those of `train_peers`: d=256,
4 layers, 4 heads, SwiGLU 704, vocabulary 4,096, seq 256, batch 8, 2 threads. One step is forward, loss over
the vocabulary in chunks of 128 rows (Kiln's `chunked_cross_entropy`, litgpt's `chunked_cross_entropy`),
backward, clipping at 1.0 and AdamW, on random tokens. Per run: each model's median step time and
the per-step ratio (litgpt's time over Kiln's, so above 1 Kiln is faster); reported: medians over RUNS runs.

    LITGPT_PYTHON=... python -m benchmarks model_litgpt
    KILN_BENCH_DTYPES=bf16 ...   # only these dtypes (default fp32,bf16)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

from benchmarks.bench_train_step import BATCH, MODEL, ROOT, SEQ, THREADS, VOCAB

RUNS = int(os.environ.get("KILN_BENCH_RUNS", "5"))
STEPS, WARMUP = 40, 5
PARTS = ("forward_loss", "backward", "optimizer", "step")


def worker(dtype: str) -> dict:
    import torch
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy as litgpt_loss

    from kiln.model.config import ModelConfig
    from kiln.model.llama import Llama
    from kiln.model.loss import chunked_cross_entropy

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    kiln = Llama(ModelConfig(ffn_hidden=704, **MODEL), vocab_size=VOCAB, max_seq_len=SEQ)
    litgpt = GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=MODEL["n_layers"],
                        n_head=MODEL["n_heads"], n_embd=MODEL["dim"], rotary_percentage=1.0, parallel_residual=False,
                        bias=False, norm_class_name="RMSNorm", norm_eps=1e-5, mlp_class_name="LLaMAMLP",
                        intermediate_size=704, rope_base=10_000))
    litgpt.apply(litgpt._init_weights)
    amp = torch.bfloat16 if dtype == "bf16" else None

    def kiln_loss(batch):
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = kiln(batch[:, :-1])
        return chunked_cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), -100)

    def litgpt_step_loss(batch):
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):  # as litgpt's pretraining step does
            return litgpt_loss(litgpt(batch[:, :-1]), batch[:, 1:])

    contenders = {"kiln": (kiln, kiln_loss), "litgpt": (litgpt, litgpt_step_loss)}
    optimisers = {n: torch.optim.AdamW(m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
                  for n, (m, _) in contenders.items()}
    data = torch.randint(0, VOCAB, (8 * BATCH, SEQ + 1))
    times: dict[str, list[tuple[float, ...]]] = {n: [] for n in contenders}
    turns = random.Random(0)
    for i in range(WARMUP + STEPS):
        batch = data[(i % 8) * BATCH:(i % 8 + 1) * BATCH]
        for name in turns.sample(list(contenders), len(contenders)):
            model, loss_fn = contenders[name]
            t0 = time.perf_counter()
            loss = loss_fn(batch)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimisers[name].step()
            optimisers[name].zero_grad(set_to_none=True)
            loss.item()
            t3 = time.perf_counter()
            times[name].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    out = {
        n: {part: statistics.median(t[j] for t in ts[WARMUP:]) for j, part in enumerate(PARTS)}
        for n, ts in times.items()
    }
    out["paired"] = statistics.median(b[3] / a[3] for a, b in zip(times["kiln"][WARMUP:], times["litgpt"][WARMUP:]))
    out["params"] = {n: sum(p.numel() for p in m.parameters()) for n, (m, _) in contenders.items()}
    return out


def main() -> None:
    python = os.environ.get("LITGPT_PYTHON")
    if not python:
        print("skipping: set LITGPT_PYTHON to the python of an environment with litgpt installed")
        return
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    for dtype in os.environ.get("KILN_BENCH_DTYPES", "fp32,bf16").split(","):
        runs = []
        for r in range(RUNS):
            done = subprocess.run([python, "-m", "benchmarks.bench_model_litgpt", "--worker", dtype], cwd=ROOT, env=env,
                                  capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(
                f"  {dtype} run {r + 1}: kiln {runs[-1]['kiln']['step'] * 1e3:.1f} ms, litgpt "
                f"{runs[-1]['litgpt']['step'] * 1e3:.1f} ms; litgpt/kiln paired by step {runs[-1]['paired']:.3f}",
                flush=True,
            )
        print(
            f"{dtype}: litgpt/kiln paired (median of {RUNS} runs) {statistics.median(r['paired'] for r in runs):.3f}; "
            f"per part, ms (kiln / litgpt): "
            + ", ".join(
                f"{part} {statistics.median(r['kiln'][part] for r in runs) * 1e3:.1f} / "
                f"{statistics.median(r['litgpt'][part] for r in runs) * 1e3:.1f}"
                for part in PARTS
            )
            + f"; parameters {runs[0]['params']['kiln']:,} / {runs[0]['params']['litgpt']:,}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
    else:
        main()
