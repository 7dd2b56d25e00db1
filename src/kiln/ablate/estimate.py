"""`kiln ablate FILE --plan`: what the ablation's training costs at each proxy scale, before anything runs.

For each scale (the base config's own model when the file names no proxy, then cpu-tiny, 20m, 150m, 400m, 1b)
the same arms and seeds are planned (kiln.ablate.plan: the distinct runs, each with its token budget), then:
- here: for cpu-tiny and 20m, measured: real training steps (forward, backward, AdamW) of the proxy's model on
  its batch (at most MEASURE_TOKENS tokens of it), on this machine's CPU or GPU with the base config's thread
  count, after one warm-up step; larger scales are extrapolated from the 20m measurement's FLOP rate (FLOPs
  per token from the model, as `kiln plan` counts them), and say so;
- on GPUs: `kiln plan` (kiln.ops.plan.make_plan) for one run at plan.devices = --gpus on plan.device = --gpu
  (its datasheet peak at plan.mfu), times the number of runs.
Training only: the data stage, packing and measuring come on top (seconds to minutes on the bundled sample).
"""

from __future__ import annotations

import time
from pathlib import Path

from kiln.ablate.plan import make_plan
from kiln.ablate.spec import PROXIES, read_spec
from kiln.config import Config, build_config, merge

MEASURED = ("cpu-tiny", "20m")  # larger scales take minutes a step on a CPU: extrapolated from the last of these


MEASURE_TOKENS = 8192  # a measured step holds the run's batch, or as many sequences as fit in this many tokens


def step_seconds(cfg: Config, steps: int = 2) -> tuple[float, int]:
    """(seconds per token of a training step, FLOPs per token) on this machine: the run's batch, or fewer
    sequences (at least one) when it holds more than MEASURE_TOKENS tokens. Under `train.threads: auto` on a CPU,
    the faster of 1 and all available threads, as training's ThreadTuner would choose."""
    import torch

    from kiln.model.build import build_model
    from kiln.model.loss import next_token_loss
    from kiln.train.parts.threads import available_threads

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg.model, cfg.tokenizer.vocab_size, cfg.pack.seq_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = max(1, min(cfg.train.batch_size, MEASURE_TOKENS // cfg.pack.seq_len))
    batch = torch.randint(0, cfg.tokenizer.vocab_size, (rows, cfg.pack.seq_len + 1), device=device)

    def step():
        next_token_loss(model, batch, None).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    threads = cfg.train.threads  # a number, "auto" or None (torch's default)
    if threads == "auto":  # as the ThreadTuner: on a CPU the faster of 1 and all threads; on a GPU nothing is set
        counts = [1, available_threads()] if device.type == "cpu" else [None]
    else:
        counts = [threads]
    best = float("inf")
    for count in dict.fromkeys(counts):  # 1 and N once each, even where N is 1
        if count:
            torch.set_num_threads(count)
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best / (rows * cfg.pack.seq_len), model.flops_per_token(cfg.pack.seq_len)


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token of the config's model, as `kiln plan` counts them (on the meta device)."""
    import torch

    from kiln.model.build import build_model

    with torch.device("meta"):
        return build_model(cfg.model, cfg.tokenizer.vocab_size, cfg.pack.seq_len).flops_per_token(cfg.pack.seq_len)


def gpu_hours(cfg: Config, gpus: int, gpu: str) -> float:
    from kiln.ops.plan import make_plan as kiln_plan

    return kiln_plan(build_config(merge(cfg.model_dump(mode="json"), {"plan": {"devices": gpus, "device": gpu}})))[
        "hours"]


def estimates(path: str | Path, gpus: int, gpu: str) -> list[dict]:
    spec, base = read_spec(path)
    return scale_rows(spec, base, Path(path).resolve(), gpus, gpu)


def scale_rows(spec, base: dict, file: Path, gpus: int, gpu: str, runs: int | None = None) -> list[dict]:
    """One row per scale: `spec`'s runs (or `runs` of them: `kiln mix` counts its swarm and verification)
    at that scale, here and on `gpus` x `gpu`."""
    rows, flop_rate = [], None
    for scale in ([] if spec.proxy else ["base config"]) + list(PROXIES):  # measured scales before extrapolated
        scaled = spec if scale == "base config" else spec.model_copy(update={  # the file's proxy_tokens is its own
            "proxy": scale, "proxy_tokens": spec.proxy_tokens if scale == spec.proxy else None})
        plan = make_plan(scaled, base, file)
        cfg = plan.runs()[0].cfg
        count = len(plan.runs()) if runs is None else runs
        tokens = cfg.train.max_steps * cfg.train.batch_size * cfg.pack.seq_len
        if scale in MEASURED or scale == "base config":
            per_token, flops = step_seconds(cfg)
            how = "measured"
            flop_rate = flops / per_token if scale == MEASURED[-1] else flop_rate
        else:
            per_token, how = flops_per_token(cfg) / flop_rate, f"from {MEASURED[-1]}'s FLOP/s"
        mine = " (this file)" if scale == (spec.proxy or "base config") else ""
        rows.append({"scale": scale + mine, "params": (plan.proxy or {}).get("params"), "tokens_per_run": tokens,
                     "runs": count, "here_hours": per_token * tokens * count / 3600, "here": how,
                     "gpu_hours": gpu_hours(cfg, gpus, gpu) * count, "gpus": f"{gpus} x {gpu}"})
    return rows


def print_estimates(path: str | Path, gpus: int, gpu: str, rows: list[dict] | None = None,
                    command: str = "kiln ablate") -> None:
    """The table of `estimates` (or of `rows`, `command`'s) on stdout."""
    from rich.table import Table
    from rich.text import Text

    from kiln.terminal import console as plain_console

    table = Table(title=f"{command} --plan: training time of every run of {Path(path).name}")
    for column in ("scale", "N (non-embedding)", "tokens per run", "runs", "here", "", f"on {gpus} x {gpu} "
                   "(kiln plan)"):
        table.add_column(column)
    for r in rows if rows is not None else estimates(path, gpus, gpu):
        table.add_row(*(Text(str(v)) for v in (
            r["scale"], f"{r['params']:,}" if r["params"] else "", f"{r['tokens_per_run']:,}", r["runs"],
            _duration(r["here_hours"]), r["here"], _duration(r["gpu_hours"]))))
    console = plain_console(stderr=False)  # a log file gets the whole table (kiln.terminal)
    console.print(table)
    console.print(Text("training only: the data stage, packing and measuring come on top; a GPU figure is "
                       "kiln plan's (datasheet peak x plan.mfu), one run after another"))


def _duration(hours: float) -> str:
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 2:
        return f"{hours * 60:.1f} min"
    return f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} days"
