"""Per-device training memory for a set of parallel degrees: parameters, gradients, optimizer state and
activations, for `kiln plan`. Sizes come from the model built on the meta device (no memory allocated).

What is counted, per device (the heaviest pipeline stage when parallel.pp > 1):
- parameters: fp32 master weights, 4 bytes each (Kiln keeps fp32 weights under autocast and FSDP2 alike).
  Tensor parallel divides the sharded weights by tp: attention wq/wk/wv/wo, the MLP's w1/w2/w3, the
  embeddings and the output head; the RMSNorm weights are replicated. Pipeline parallel keeps a stage's
  blocks (n_layers / stages), the embeddings on the first stage, the final norm and head on the last.
  Expert parallel (parallel.ep) divides MoE experts by ep (FSDP2 leaves them out of its shards). FSDP2
  (dp_shard) divides the other weights by dp_shard; DDP and HSDP's replicas keep a whole copy each.
- gradients: fp32, the same count as the parameters (FSDP2 reduce-scatters them: sharded the same way).
- optimizer: AdamW's exp_avg and exp_avg_sq, 8 bytes per parameter, sharded like the parameters.
- fsdp_buffers: under FSDP2 the gathered (unsharded) weights of the block being computed and of the next one
  (prefetch), in the compute dtype.
- activations: what backward keeps, per block and micro-batch of b sequences of s tokens (dim h, feed-forward
  width f, kv_heads·head_dim = k), in the compute dtype: the two norm inputs 2·s·b·h and the attention output
  s·b·h (sequence-parallel under tensor parallel: /tp), the inputs the column-wise projections gather
  (2·s·b·h, whole), q, k, v before and after the rotary embedding 2·s·b·(h + 2k) / tp, and the MLP's
  w1 and w3 outputs and their product 3·s·b·f / tp (SDPA keeps no s x s score matrix). With activation
  checkpointing each block keeps only its input (s·b·h / tp) and one block's full set lives during its
  recomputation. Plus the logits (s·b·V / tp) in the compute dtype, their fp32 copy and softmax (8 bytes).
  Under pipeline parallel the micro-batch is cut into M = pp_microbatches; gpipe keeps all M in flight
  (the whole micro-batch), 1f1b at most pp of them on the first stage.
Host memory (`host_plan`): what each rank needs at start-up, kiln.train.cpu_memory's rule (the process, the
largest tensor in fp32, and on a CPU device this rank's weights, gradients and AdamW state).
This is an estimate: the CUDA allocator's fragmentation, NCCL buffers, the CUDA context (~0.5-1 GB) and
torch.compile's workspaces come on top; `fits` keeps HEADROOM of the device free for them.
"""

from __future__ import annotations

import re

from kiln.config import Config
from kiln.train.parallel.mesh import Degrees
from kiln.train.parallel.pipeline import stages_per_rank

HEADROOM = 0.10  # of the device's memory, for what the estimate leaves out (see the module docstring)
DEVICE_MEMORY_GB = {"H100 PCIe": 80, "H100 NVL": 94, "H200 NVL": 141, "H200": 141, "H100": 80, "A100": 80,
                    "L40S": 48, "L4": 24, "RTX 4090": 24}
_TP_SHARDED = re.compile(r"(attention\.w[qkvo]|feed_forward\.w[123]|tok_embeddings|output)\.weight$")
_BLOCK = re.compile(r"^layers\.(\d+)\.")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _stage_of(name: str, n_layers: int, n_stages: int) -> int:
    m = _BLOCK.match(name)
    if m:
        return int(m.group(1)) // (n_layers // n_stages)
    return 0 if name.startswith("tok_embeddings") else n_stages - 1


def stage_params(model, degrees: Degrees, schedule: str, ep: int = 1) -> list[float]:
    """Parameters per device on each pipeline rank (after tp, ep and dp_shard), in elements."""
    n_layers = model.config.n_layers
    n_stages = degrees.pp * stages_per_rank(schedule)
    per_rank = [0.0] * degrees.pp
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # a tied head is the embedding
            continue
        seen.add(id(p))
        n = p.numel() / (degrees.tp if _TP_SHARDED.search(name) else 1)
        experts = ".experts." in name and ep > 1  # each rank holds n_experts / ep of them, outside FSDP2's shards
        per_rank[_stage_of(name, n_layers, n_stages) % degrees.pp] += n / ep if experts else n / degrees.dp_shard
    return per_rank


def block_params(model) -> int:
    return sum(p.numel() for p in model.layers[0].parameters())


def activation_bytes(cfg: Config, model, degrees: Degrees, micro_batch: int, pp_rank: int) -> float:
    """Activations backward keeps on pipeline rank `pp_rank` (formula in the module docstring)."""
    a, s, tp = model.config, cfg.pack.seq_len, degrees.tp
    width = DTYPE_BYTES[cfg.train.dtype]
    h, k, f = a.dim, a.kv_heads * a.head_dim, a.hidden
    n_stages = degrees.pp * stages_per_rank(cfg.parallel.pp_schedule)
    if degrees.pp > 1:
        n_micro = cfg.parallel.pp_microbatches or degrees.pp
        in_flight = n_micro if cfg.parallel.pp_schedule == "gpipe" else min(degrees.pp, n_micro)
        b = micro_batch / n_micro * in_flight
    else:
        b = micro_batch
    per_block = s * b * ((3 * h) / tp + 2 * h + 2 * (h + 2 * k) / tp + 3 * f / tp) * width
    blocks = a.n_layers // n_stages * stages_per_rank(cfg.parallel.pp_schedule)
    if cfg.parallel.activation_checkpointing:
        total = blocks * s * b * h / tp * width + per_block
    else:
        total = blocks * per_block
    if pp_rank == degrees.pp - 1:  # the head: logits in the compute dtype, an fp32 copy and its softmax
        total += s * b * model.vocab_size / tp * (width + 8)
    return total


def memory_plan(cfg: Config, model, degrees: Degrees, device_bytes: float | None) -> dict:
    """Bytes per device for `degrees`, on the heaviest pipeline rank; `fits` is None when the device's memory
    is unknown."""
    micro = cfg.train.micro_batch_size or max(cfg.train.batch_size // degrees.dp, 1)
    params = stage_params(model, degrees, cfg.parallel.pp_schedule, cfg.parallel.ep)
    gathered = block_params(model) / degrees.tp * DTYPE_BYTES[cfg.train.dtype] * 2  # this block and the next
    rows = []
    for rank, n in enumerate(params):
        row = {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n,
               "fsdp_buffers": gathered if degrees.mode == "fsdp" and degrees.dp_shard > 1 else 0.0,
               "activations": activation_bytes(cfg, model, degrees, micro, rank)}
        row["total"] = sum(row.values())
        rows.append(row)
    worst = max(range(len(rows)), key=lambda r: rows[r]["total"])
    fits = None if device_bytes is None else rows[worst]["total"] <= device_bytes * (1 - HEADROOM)
    return {"degrees": {"pp": degrees.pp, "dp_replicate": degrees.dp_replicate, "dp_shard": degrees.dp_shard,
                        "tp": degrees.tp, "mode": degrees.mode},
            "micro_batch": micro, "pp_rank": worst, **rows[worst], "device_bytes": device_bytes, "fits": fits}


def host_plan(model, degrees: Degrees, device_type: str, devices: int) -> dict:
    """Host memory at start-up (train/cpu_memory.py's rule): per rank, and per node of min(devices, 8) ranks."""
    from kiln.train.cpu_memory import startup_host_bytes

    per_rank = startup_host_bytes(model, device_type, degrees.dp_shard * degrees.tp * degrees.pp)
    ranks = min(devices, 8)
    return {"per_rank_bytes": per_rank, "ranks_per_node": ranks, "per_node_bytes": per_rank * ranks,
            "device_type": device_type}


def alternatives(cfg: Config, model, devices: int, device_bytes: float | None) -> list[dict]:
    """Every FSDP2 layout of `devices` ranks (tp and pp powers of two the model splits into, the rest
    dp_shard), with its per-device total and whether it fits."""
    from kiln.errors import ConfigError
    from kiln.train.parallel.mesh import check_model, resolve_degrees

    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            if devices % (tp * pp):
                continue
            p = cfg.parallel.model_copy(update={"tp": tp, "pp": pp, "mode": "fsdp", "mesh": None,
                                                "dp_replicate": None, "dp_shard": None})
            trial = cfg.model_copy(update={"parallel": p})
            try:
                degrees = resolve_degrees(p, devices)
                check_model(degrees, trial, model.vocab_size, trial.train.micro_batch_size
                            or max(trial.train.batch_size // degrees.dp, 1))
            except ConfigError:
                continue
            m = memory_plan(trial, model, degrees, device_bytes)
            out.append({**m["degrees"], "total": m["total"], "fits": m["fits"]})
    return out
