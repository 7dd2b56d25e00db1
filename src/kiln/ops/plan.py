"""`kiln plan CONFIG`: how much compute the run needs, how long it takes on G devices and what it costs.

C ≈ 6·N·D (N non-embedding parameters, D training tokens; Kaplan et al. 2020), and the model's own count
(6·N_active plus attention, `Llama.flops_per_token`). Time comes from the step time `kiln preflight` measured
on this machine when it applies (same model, batch and dtype, planning for this device), else from the
device's datasheet peak and an assumed MFU. Every assumption is printed with the numbers.
"""

from __future__ import annotations

import json

import torch

from kiln.config import Config
from kiln.errors import KilnError
from kiln.manifest import read_manifest


def _vocab(cfg: Config) -> int:
    shards = cfg.layout.shards
    return (
        int(read_manifest(shards)["vocab_size"]) if (shards / "manifest.json").is_file() else cfg.tokenizer.vocab_size
    )


def _measured(cfg: Config) -> dict | None:
    path = cfg.out / "preflight.json"
    if cfg.plan.device is not None or not path.is_file():
        return None
    m = json.loads(path.read_text())
    same = (m.get("model_hash"), m.get("batch_size"), m.get("dtype")) == (
        cfg.section_hash("model", "pack"),
        cfg.train.batch_size,
        cfg.train.dtype,
    )
    return m if same else None


def _peak(cfg: Config) -> tuple[str, float | None]:
    from kiln.ops.probes import device_peak
    from kiln.train.metrics import PEAK_TFLOPS

    if cfg.plan.device is None:
        name, peak, _ = device_peak(cfg.train.dtype)
        return name, peak
    for key, peaks in PEAK_TFLOPS.items():
        if key.lower() == cfg.plan.device.lower():
            return key, peaks.get(cfg.train.dtype)
    raise KilnError(f"plan.device={cfg.plan.device!r} is not in the peak table; use one of {', '.join(PEAK_TFLOPS)}")


def make_plan(cfg: Config) -> dict:
    from kiln.model.build import build_model

    with torch.device("meta"):  # sizes only: a 70B config must not allocate 280 GB here
        model = build_model(cfg.model, _vocab(cfg), cfg.pack.seq_len)
    n = model.num_params(non_embedding=True)
    tokens_per_step = cfg.train.batch_size * cfg.pack.seq_len
    d = cfg.plan.tokens or cfg.train.max_steps * tokens_per_step
    flops_per_token = model.flops_per_token(cfg.pack.seq_len)
    g = cfg.plan.devices
    device, peak = _peak(cfg)
    assumptions = [f"N = {n:,} non-embedding parameters ({model.num_params(non_embedding=False):,} in all)",
                   f"D = {d:,} tokens" + ("" if cfg.plan.tokens else f" = train.max_steps {cfg.train.max_steps} × "
                                          f"batch_size {cfg.train.batch_size} × seq_len {cfg.pack.seq_len}"),
                   f"{flops_per_token:,} training FLOPs per token (6·N_active + attention, PaLM appendix B)"]
    measured = _measured(cfg)
    if measured:
        tokens_per_s = measured["tokens_per_s"] * g / measured["world"]
        assumptions.append(
            f"{measured['tokens_per_s']:,.0f} tokens/s per device measured by `kiln preflight` on "
            f"{measured['device']}, scaled linearly to {g} device(s) (communication is not free: an upper bound)"
        )
        source = "preflight"
    elif peak:
        tokens_per_s = g * peak * 1e12 * cfg.plan.mfu / flops_per_token
        assumptions.append(
            f"{device} peak {peak:g} TFLOP/s in {cfg.train.dtype} (datasheet) at plan.mfu = {cfg.plan.mfu:.0%}"
        )
        source = "peak × MFU"
    else:
        raise KilnError(f"no step time to plan with: the peak of {device!r} is unknown; run `kiln preflight` first "
                        "or set plan.device (e.g. plan.device=H100)")
    seconds = d / tokens_per_s
    price = getattr(getattr(cfg, "budget", None), "price_per_device_hour", 0.0) or 0.0
    hours = seconds / 3600
    assumptions.append(f"price {price:g} per device-hour (budget.price_per_device_hour)")
    mfu = tokens_per_s * flops_per_token / (g * peak * 1e12) if peak else None
    return {"params_non_embedding": n, "tokens": d, "compute_6ND": 6 * n * d, "compute_flops": flops_per_token * d,
            "devices": g, "device": device, "peak_tflops": peak, "mfu": mfu, "time_source": source,
            "tokens_per_s": tokens_per_s, "hours": hours, "device_hours": hours * g, "cost": hours * g * price,
            "steps": -(-d // tokens_per_step), "assumptions": assumptions, "memory": plan_memory(cfg, model, device)}


def _device_bytes(cfg: Config, device: str) -> float | None:
    from kiln.ops.memory import DEVICE_MEMORY_GB

    if cfg.plan.device_memory_gb:
        return cfg.plan.device_memory_gb * 1e9
    if cfg.plan.device is None and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return DEVICE_MEMORY_GB[device] * 1e9 if device in DEVICE_MEMORY_GB else None


def plan_memory(cfg: Config, model, device: str) -> dict:
    """Per-device memory of the configured degrees over plan.devices ranks, and of the other layouts."""
    from kiln.ops.memory import alternatives, host_plan, memory_plan
    from kiln.train.parallel.mesh import check_model, resolve_degrees

    degrees = resolve_degrees(cfg.parallel, cfg.plan.devices)  # an invalid combination: a ConfigError here too
    check_model(degrees, cfg, model.vocab_size, cfg.train.micro_batch_size
                or max(cfg.train.batch_size // degrees.dp, 1))
    device_bytes = _device_bytes(cfg, device)
    device_type = "cpu" if cfg.plan.device is None and not torch.cuda.is_available() else "cuda"
    return {**memory_plan(cfg, model, degrees, device_bytes),
            "host": host_plan(model, degrees, device_type, cfg.plan.devices),
            "alternatives": alternatives(cfg, model, cfg.plan.devices, device_bytes)}


def add_trace(plan: dict, cfg: Config) -> dict:
    """`kiln plan --trace`: the traced step (ops/trace.py) under plan["trace"]; the traced total, with the
    formula's HEADROOM kept free, then decides `fits` (memory.fits_by says which; fits_formula keeps the other)."""
    from kiln.ops.memory import HEADROOM
    from kiln.ops.trace import trace_memory

    m = plan["memory"]
    plan["trace"] = trace_memory(cfg, _vocab(cfg), cfg.plan.devices, m["host"]["device_type"])
    m["fits_formula"] = m["fits"]
    if m["device_bytes"] is not None:
        m["fits"] = plan["trace"]["total"] <= m["device_bytes"] * (1 - HEADROOM)
    m["fits_by"] = "trace"
    return plan


def print_plan(plan: dict) -> None:
    from rich.table import Table

    from kiln.terminal import console as plain_console

    t = Table("estimate", "value", title="kiln plan")
    t.add_row("compute C = 6·N·D", f"{plan['compute_6ND']:.3e} FLOPs")
    t.add_row("compute (model count)", f"{plan['compute_flops']:.3e} FLOPs")
    t.add_row(
        "throughput",
        f"{plan['tokens_per_s']:,.0f} tokens/s on {plan['devices']} × {plan['device']} ({plan['time_source']})",
    )
    if plan["mfu"] is not None:
        t.add_row("MFU", f"{plan['mfu']:.1%}")
    t.add_row("wall time", f"{plan['hours']:.3f} h ({plan['hours'] * 60:.1f} min)")
    t.add_row("device-hours", f"{plan['device_hours']:.3f}")
    t.add_row("cost", f"{plan['cost']:.2f}")
    console = plain_console(stderr=False)
    console.print(t)
    _print_memory(console, plan["memory"])
    if "trace" in plan:
        _print_trace(console, plan["trace"], plan["memory"])
    console.print("assumptions:\n" + "\n".join(f"  - {a}" for a in plan["assumptions"]))


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _layout(d: dict) -> str:
    return f"pp {d['pp']} x dp_replicate {d['dp_replicate']} x dp_shard {d['dp_shard']} x tp {d['tp']}"


def _print_memory(console, m: dict) -> None:
    from rich.table import Table

    from kiln.ops.memory import HEADROOM

    console.print(f"memory per device: {_layout(m['degrees'])} ({m['degrees']['mode']}), micro-batch "
                  f"{m['micro_batch']}" + (f", pipeline rank {m['pp_rank']} (the heaviest)" if m['degrees']['pp'] > 1
                                           else ""))
    t = Table("per device", "bytes")
    for key in ("parameters", "gradients", "optimizer", "fsdp_buffers", "activations", "total"):
        t.add_row(key, _gb(m[key]))
    device = "unknown (set plan.device or plan.device_memory_gb)" if m["device_bytes"] is None \
        else _gb(m["device_bytes"])
    t.add_row("device memory", device)
    by = m.get("fits_by", "formula")
    t.add_row(f"fits (by the {by}, {HEADROOM:.0%} kept free)", {None: "unknown", True: "yes", False: "NO"}[m["fits"]])
    h = m["host"]
    t.add_row("host per rank at start-up", f"{_gb(h['per_rank_bytes'])} ({h['device_type']} ranks)")
    t.add_row(f"host per node ({h['ranks_per_node']} ranks)", _gb(h["per_node_bytes"]))
    console.print(t)
    if m["alternatives"]:
        alt = Table("layout", "per device", "fits", title="other FSDP2 layouts of the same devices")
        for a in m["alternatives"]:
            alt.add_row(_layout(a), _gb(a["total"]), {None: "?", True: "yes", False: "no"}[a["fits"]])
        console.print(alt)


def _print_trace(console, tr: dict, formula: dict) -> None:
    """The traced peak beside the formula's figures (with --trace, `fits` is the trace's: add_trace)."""
    from rich.table import Table

    t = Table("per device", "traced at the peak", "formula",
              title=f"kiln plan --trace: rank 0 of {tr['world']} fake ranks ({tr['kind']}, {tr['seconds']:.0f} s)")
    pairs = [("parameters", formula["parameters"] + formula["fsdp_buffers"]), ("gradients", formula["gradients"]),
             ("optimizer", formula["optimizer"]), ("activations", formula["activations"]), ("temporaries", None),
             ("total", formula["total"])]
    for key, f in pairs:
        t.add_row(key, _gb(tr[key]), "-" if f is None else _gb(f))
    said = {None: "unknown", True: "yes", False: "NO"}
    t.add_row("fits (the plan's: the trace's)", said[formula["fits"]], said[formula.get("fits_formula")])
    console.print(t)
