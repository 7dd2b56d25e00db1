"""Tokens/s and MFU of Kiln's Trainer on a ~1B-parameter Llama (examples/gpu-1b.yaml): bf16, torch.compile.

Prepares the data with Kiln's own stages (the bundled sample crawl, packed into 2,048-token samples),
then runs `Trainer.run()` and times it by the log line it prints after every step; the first WARMUP steps
(compilation) are left out. MFU is `kiln.train.metrics.mfu` of the median step against
`kiln.train.metrics.peak_tflops` for the device and dtype (an unknown device reports none; set
train.peak_tflops to give its peak). Target on one H100/H200-class GPU: MFU >= 45%.

    python benchmarks/gpu_1b.py                          # on the GPU machine
    python benchmarks/gpu_1b.py train.micro_batch_size=16  # any config override
    python benchmarks/gpu_1b.py --smoke                  # a tiny model on CPU: checks the script end to end
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "gpu-1b.yaml"
SMOKE = ["tokenizer.vocab_size=512", "pack.seq_len=64", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
         "model.multiple_of=64", "train.batch_size=4", "train.micro_batch_size=2", "train.threads=2",
         "data.workers=1"]


class _WindowDone(Exception):
    pass


def measure(cfg, warmup: int, steps: int) -> dict:
    import torch

    from kiln.train.metrics import mfu
    from kiln.train.trainer import Trainer

    ends: list[float] = []

    def log(msg: str) -> None:
        if msg.startswith("step ") and "/" in msg.split()[1]:
            ends.append(time.perf_counter())
            if len(ends) == warmup + steps:
                raise _WindowDone
        elif not msg.startswith("step "):
            print(msg, flush=True)

    trainer = Trainer(cfg, log=log)
    try:
        trainer.run()
    except _WindowDone:
        pass
    times = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    tokens = cfg.train.batch_size * cfg.pack.seq_len
    tps = tokens / statistics.median(times)
    d = trainer.d
    return {
        "device": torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu",
        "world": d.world, "params": sum(p.numel() for p in trainer.model.parameters()),
        "flops_per_token": trainer.flops_per_token, "tokens_per_step": tokens, "timed_steps": len(times),
        "tokens_per_s": tps, "window_tokens_per_s": tokens * len(times) / (ends[-1] - ends[warmup - 1]),
        "mfu": mfu(trainer.flops_per_token, tps, trainer.peak, d.world), "peak_tflops": trainer.peak,
        "peak_source": trainer.peak_source,
        "peak_memory_gb": (torch.cuda.max_memory_allocated(d.device) / 2**30 if d.device.type == "cuda" else None),
        "compile": cfg.parallel.compile, "dtype": cfg.train.dtype,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU, a few steps")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 10; smoke 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; smoke 4)")
    parser.add_argument("--out", default=None, help="out_dir (default: a temporary folder)")
    args = parser.parse_args(argv)

    from kiln.config import load_config
    from kiln.flow import run_data_stage, run_pack_stage, run_tokenizer_stage

    warmup = args.warmup or (3 if args.smoke else 10)
    steps = args.steps or (4 if args.smoke else 20)
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-1b-") as tmp:
        out = args.out or tmp
        overrides = (SMOKE if args.smoke else []) + args.overrides + [
            f"out_dir={out}", f"train.max_steps={warmup + steps + 1}", "train.log_every=1", "train.eval_every=0",
            f"checkpoint.every={warmup + steps + 10}"]
        cfg = load_config(args.config, overrides)
        inputs = [str(p if Path(p).is_absolute() else ROOT / p) for p in cfg.data.inputs]
        cfg = load_config(args.config, overrides + [f"data.inputs={json.dumps(inputs)}"])
        for stage in (run_data_stage, run_tokenizer_stage, run_pack_stage):
            stage(cfg, print)
        result = measure(cfg, warmup, steps)
    print(json.dumps(result, indent=1))
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else f"not reported ({result['peak_source']})"
    print(f"{result['device']}: {result['params'] / 1e9:.2f} B parameters, {result['dtype']}, "
          f"compile={result['compile']}: {result['tokens_per_s']:,.0f} tokens/s (median step), MFU {mfu}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
