"""Kiln's training step side by side with OLMo-core and litgpt on the same model, batch, data and dtype.

The model of bench_train_step (Llama, d=256, 4 layers, 4 heads, SwiGLU 704, untied, RMSNorm 1e-5, RoPE
theta 10,000, vocabulary 4,096, seq 256, batch 8 = 2,048 tokens a step), 2 threads, fp32 and bf16
autocast, eager and torch.compile. Contenders:

  kiln         `Trainer.run()` (bench_train_step.kiln_worker); compiled: `parallel.compile: true`
  plain        the textbook loop (bench_train_step.plain_worker); compiled: torch.compile(model)
  plain+loss   the loop with the loss done the way NOTES found faster: eager, cross-entropy over the
               vocabulary in chunks of 128 rows (as litgpt's `chunked_cross_entropy`); compiled, one
               torch.compile over model and loss together. What Kiln would gain by doing the same.
  olmo-core    OLMo-core's `Trainer.fit()` with its `TransformerTrainModule` (AdamW, clipping 1.0, its
               fused-in-model loss) over its numpy data loader; compiled: OLMo-core's own recipe
               (`Transformer.apply_compile()`, per block and LM head), applied by hand because its train
               module skips compilation when CUDA is absent.
  litgpt       litgpt's `GPT` in its pretraining step (`chunked_cross_entropy`, clipping 1.0, AdamW);
               compiled: torch.compile(model).

Each peer runs in its own environment, never Kiln's: the benchmark takes their interpreters from
OLMO_PYTHON and LITGPT_PYTHON (a venv with `pip install torch==2.13.0` and then `ai2-olmo-core` or
`litgpt`) and skips a peer whose variable is unset. The peers read the same training tokens, written
once from Kiln's shards as a raw uint16 file.

A run starts every contender in its own fresh process at once; they then take turns, one step each, the
turn order shuffled every step (`lockstep` in bench_train_step), so the bursts of load from other jobs that
dominate this shared 2-core machine's noise (±10% between back-to-back processes) fall on every contender's
same steps. Per run: tokens/s of each contender's median step after the warm-up (compiled runs warm up
longer: the first steps compile), and Kiln against the fastest peer paired step by step (the median over
the timed steps of the fastest peer's step time over Kiln's). Reported: medians over RUNS runs.

    OLMO_PYTHON=... LITGPT_PYTHON=... python -m benchmarks train_peers
    KILN_BENCH_MODES=eager/bf16,compiled/fp32 ...   # only these modes
    KILN_BENCH_CONTENDERS=kiln,litgpt ...            # only these contenders (kiln always runs)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_train_step import (
    BATCH,
    MODEL,
    SEQ,
    STEPS,
    THREADS,
    WARMUP,
    StepClock,
)

RUNS = int(os.environ.get("KILN_BENCH_RUNS", "3"))
COMPILE_WARMUP = 8
LR, BETAS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0
PEERS = {"olmo-core": "OLMO_PYTHON", "litgpt": "LITGPT_PYTHON"}


def read_tokens(folder: Path):
    """The prepared training tokens as (samples, SEQ + 1) int64 rows."""
    import numpy as np

    tokens = np.fromfile(folder / "tokens.bin", dtype=np.uint16)
    return tokens[: len(tokens) // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1).astype(np.int64)


def vocab_of(folder: Path) -> int:
    return json.loads((folder / "meta.json").read_text())["vocab_size"]


def plain_loss_worker(out: Path, dtype: str, compile: bool, warmup: int, steps: int) -> dict:
    """The plain loop with chunked cross-entropy (eager) or model and loss compiled as one function."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from benchmarks.bench_train_step import bench_config
    from kiln.shards.reader import ShardSet
    from kiln.train.data import Mixture
    from kiln.model.build import build_model

    cfg = bench_config(out, dtype, compile)
    torch.set_num_threads(THREADS)
    torch.manual_seed(cfg.seed)
    shards = ShardSet(out / "shards", "train")
    train = Mixture([shards])
    order = train.epoch_order(cfg.seed, 0)
    model = build_model(cfg.model, int(shards.manifest["vocab_size"]), cfg.pack.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    amp = torch.bfloat16 if dtype == "bf16" else None

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = model(x)
        if compile:  # inductor fuses the fp32 upcast, log-softmax and gather itself
            return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        rows, targets = logits.flatten(0, 1), y.flatten()
        losses = [F.cross_entropy(r.float(), t, reduction="sum") for r, t in zip(rows.split(128), targets.split(128))]
        return torch.stack(losses).sum() / targets.numel()

    step_loss = torch.compile(loss_fn) if compile else loss_fn
    clock = StepClock(warmup + steps)
    for step in range(warmup + steps):
        rows = np.empty((BATCH, SEQ + 1), np.int64)
        train.gather(order[step * BATCH:(step + 1) * BATCH], rows)
        batch = torch.from_numpy(rows)
        loss = step_loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        clock.tick()
    return clock.result(warmup)


def olmo_worker(folder: Path, dtype: str, compile: bool, warmup: int, steps: int) -> dict:
    import torch
    from olmo_core.data import (
        NumpyDataLoaderConfig,
        NumpyDatasetDType,
        NumpyFSLDatasetConfig,
        TokenizerConfig,
    )
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.train_module import TransformerTrainModule

    torch.set_num_threads(THREADS)
    torch.manual_seed(7)
    vocab = vocab_of(folder)
    model = TransformerConfig.llama_like(d_model=MODEL["dim"], vocab_size=vocab, n_layers=MODEL["n_layers"],
                                         n_heads=MODEL["n_heads"], rope_theta=10_000,
                                         hidden_size_multiple_of=64).build(init_device="cpu")
    if compile:
        model.apply_compile()
    module = TransformerTrainModule(
        model, optim=AdamWConfig(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY), rank_microbatch_size=BATCH * SEQ,
        max_sequence_length=SEQ, autocast_precision=torch.bfloat16 if dtype == "bf16" else None,
        max_grad_norm=CLIP, device=torch.device("cpu"))
    work = Path(tempfile.mkdtemp(prefix="olmo-", dir=folder))
    dataset = NumpyFSLDatasetConfig(paths=[str(folder / "tokens.bin")], sequence_length=SEQ,
                                    tokenizer=TokenizerConfig(vocab_size=vocab, eos_token_id=1, pad_token_id=2),
                                    dtype=NumpyDatasetDType.uint16, work_dir=str(work)).build()
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=7, work_dir=str(work),
                                   num_workers=0).build(dataset)

    class Tick(Callback):
        def post_step(self) -> None:
            clock.tick()

    trainer = TrainerConfig(save_folder=str(work / "save"), max_duration=Duration.steps(warmup + steps),
                            no_checkpoints=True, no_evals=True, metrics_collect_interval=10,
                            callbacks={"clock": Tick()}).build(module, loader)
    clock = StepClock(warmup + steps)
    trainer.fit()
    return clock.result(warmup)


def litgpt_worker(folder: Path, dtype: str, compile: bool, warmup: int, steps: int) -> dict:
    import numpy as np
    import torch
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    torch.set_num_threads(THREADS)
    torch.manual_seed(7)
    config = Config(block_size=SEQ, vocab_size=vocab_of(folder), padded_vocab_size=vocab_of(folder),
                    n_layer=MODEL["n_layers"], n_head=MODEL["n_heads"], n_embd=MODEL["dim"], rotary_percentage=1.0,
                    parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=1e-5,
                    mlp_class_name="LLaMAMLP", intermediate_size=704, rope_base=10_000)
    model = GPT(config)
    model.apply(model._init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    forward = torch.compile(model) if compile else model
    rows = torch.from_numpy(read_tokens(folder))
    order = np.random.default_rng(7).permutation(len(rows))
    amp = torch.bfloat16 if dtype == "bf16" else None
    clock = StepClock(warmup + steps)
    for step in range(warmup + steps):
        batch = rows[order[step * BATCH:(step + 1) * BATCH]]
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = forward(batch[:, :-1])
            loss = chunked_cross_entropy(logits, batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        clock.tick()
    return clock.result(warmup)


def _kiln(name: str):
    def run(*args):
        from benchmarks import bench_train_step

        return bench_train_step.WORKERS[name](*args)
    return run


WORKERS = {"kiln": _kiln("kiln"), "plain": _kiln("plain"), "plain+loss": plain_loss_worker,
           "olmo-core": olmo_worker, "litgpt": litgpt_worker}


def write_tokens(data: Path, folder: Path) -> None:
    """The training split's tokens as one raw uint16 file (OLMo-core's format) plus the vocabulary size."""
    import numpy as np

    from kiln.shards.reader import ShardSet

    shards = ShardSet(data / "shards", "train")
    rows = np.stack([shards.sample(i) for i in range(len(shards))]).astype(np.uint16)
    rows.tofile(folder / "tokens.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": int(shards.manifest["vocab_size"])}))


def paired_ratio(results: dict[str, dict]) -> tuple[str, float] | None:
    """The fastest peer of the run (by median step) and, over the timed steps, the median of its step time
    over Kiln's at the same step: above 1, Kiln is faster. Steps ran in turns, so each pair saw the same
    load from elsewhere. (Pairing each step with whichever peer was fastest at that step would favour the
    peers: the minimum of several noisy times is biased low.)"""
    peers = [c for c in PEERS if c in results]
    if not peers:
        return None
    best = max(peers, key=lambda c: results[c]["tokens_per_s"])
    kiln, peer = results["kiln"]["step_s"], results[best]["step_s"]
    return best, statistics.median(p / k for p, k in zip(peer, kiln))


def main() -> None:
    from benchmarks.bench_train_step import data_root, fresh_out, lockstep, prepare, worker_command

    pythons = {"kiln": sys.executable, "plain": sys.executable, "plain+loss": sys.executable}
    for peer, var in PEERS.items():
        if os.environ.get(var):
            pythons[peer] = os.environ[var]
        else:
            print(f"skipping {peer}: set {var} to the python of an environment with it installed")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-peers-") as tmp:
        root = data_root(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = prepare(root)
        peers_dir = Path(tmp) / "peers"
        peers_dir.mkdir()
        write_tokens(data, peers_dir)
        contenders = list(pythons)
        if os.environ.get("KILN_BENCH_CONTENDERS"):  # e.g. "kiln,litgpt": a quicker look at one pairing
            contenders = [c for c in contenders if c == "kiln" or c in os.environ["KILN_BENCH_CONTENDERS"].split(",")]
        table = []
        for compile in (False, True):
            warmup = COMPILE_WARMUP if compile else WARMUP
            for dtype in ("fp32", "bf16"):
                mode = "compiled" if compile else "eager"
                if os.environ.get("KILN_BENCH_MODES") and f"{mode}/{dtype}" not in os.environ["KILN_BENCH_MODES"].split(
                    ","
                ):
                    continue
                print(f"{mode} {dtype}: {RUNS} lockstep runs, {warmup} warm-up + {STEPS} timed steps", flush=True)
                runs: list[dict[str, dict]] = []
                for r in range(RUNS):
                    order = contenders if r % 2 == 0 else contenders[::-1]
                    commands = {c: worker_command("benchmarks.bench_train_peers", c,
                                                  peers_dir if c in PEERS else fresh_out(data, Path(tmp)),
                                                  dtype, compile, warmup, STEPS, pythons[c]) for c in order}
                    runs.append(lockstep(commands, warmup + STEPS))
                    paired = paired_ratio(runs[-1])
                    print(f"  run {r + 1}: " + ", ".join(f"{c} {runs[-1][c]['tokens_per_s']:,.0f}" for c in contenders)
                          + (f" tok/s; kiln vs {paired[0]} paired by step: {paired[1]:.3f}" if paired else " tok/s"),
                          flush=True)
                    if os.environ.get("KILN_BENCH_JSON"):  # every step time, for a second look
                        with open(os.environ["KILN_BENCH_JSON"], "a") as f:
                            f.write(
                                json.dumps({"mode": mode, "dtype": dtype, "run": r + 1, "results": runs[-1]}) + "\n"
                            )
                table.append((mode, dtype, runs))
        print(f"\n{'mode':9} {'dtype':5} " + " ".join(f"{c:>11}" for c in contenders)
              + "  kiln/fastest peer: of medians; paired by step (median of runs)")
        for mode, dtype, runs in table:
            med = {c: statistics.median(run[c]["tokens_per_s"] for run in runs) for c in contenders}
            peers = [c for c in PEERS if c in med]
            ratio = "-"
            if peers:
                paired = statistics.median(paired_ratio(run)[1] for run in runs)
                ratio = f"{med['kiln'] / max(med[c] for c in peers):.3f}; {paired:.3f}"
            print(f"{mode:9} {dtype:5} " + " ".join(f"{med[c]:11,.0f}" for c in contenders) + f"  {ratio}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        from benchmarks.bench_train_step import worker_main

        worker_main(sys.argv[2:], WORKERS)
    else:
        main()
