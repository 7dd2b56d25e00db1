"""`kiln plan --trace`: the configured training step run for real, on fake tensors, by rank 0 of a fake process
group of the planned world size, with torch's memory tracker counting what it allocates.

The model is built and split exactly as `kiln train` does (meta device, `parallelize` with the configured layout,
precision, activation checkpointing; materialised as fake tensors: no memory), then two steps run under
`FakeTensorMode` (forward and backward of one micro-batch, the AdamW step; the second has optimizer state), with
`FSDPMemTracker` (FSDP2) or `MemTracker` (other kinds). The categories at the traced peak:
parameters (sharded and, under FSDP2, the gathered ones), gradients, optimizer state, activations and
temporaries (backward's gradients of activations, FSDP2's all-gather and reduce-scatter buffers).

What a trace on this machine cannot see: the CUDA allocator's fragmentation and caching, NCCL's buffers, the
CUDA context, and kernels that differ by device (the trace runs on fake CPU tensors: SDPA's CPU kernel, not
flash attention). Pipeline parallel is not traced (its schedule's sends need real peers).
"""

from __future__ import annotations

import time

import torch

from kiln.config import Config

CATEGORIES = {  # tracker's reference type -> the plan's category
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters",
    "Buffer": "parameters", "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Optstate": "optimizer", "OptState": "optimizer", "Activation": "activations", "Temp": "temporaries",
    "All Gather": "temporaries", "Reduce Scatter": "temporaries", "Inputs": "activations",
}


def _fake_group(world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def trace_memory(cfg: Config, vocab_size: int, world: int) -> dict:
    """Rank 0's traced peak bytes by category for `cfg`'s layout over `world` fake ranks (see the module)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.errors import ConfigError
    from kiln.model.build import build_model
    from kiln.model.loss import next_token_loss
    from kiln.train.engine import build_optimizer
    from kiln.train.parallel.dist import Dist
    from kiln.train.parallel.materialize import materialize
    from kiln.train.parallel.mesh import Mesh, resolve_degrees
    from kiln.train.parallel.parallelize import Precision, parallelize

    degrees = resolve_degrees(cfg.parallel, world)
    if degrees.pp > 1:
        raise ConfigError("plan --trace: pipeline parallel (parallel.pp > 1) is not traced yet; the formula stands")
    start = time.perf_counter()
    _fake_group(world)
    try:
        d = Dist(rank=0, world=world, device=torch.device("cpu"))
        micro = cfg.train.micro_batch_size or max(cfg.train.batch_size // degrees.dp, 1)
        model = build_model(cfg.model, vocab_size, cfg.pack.seq_len, 0, "meta")  # eos 0: a fake id
        # Split on meta, outside FakeTensorMode (the meshes read their layout from real tensors); no seed: the
        # model stays on meta until it becomes fake tensors below.
        parallel = parallelize(model, d, cfg.parallel, Precision.of(cfg.train), next_token_loss, Mesh(degrees, 0))
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialize(parallel.model, d.device, cfg.seed)
            optimizer = build_optimizer(parallel.model, cfg.train, d.device)
            batch = torch.randint(0, vocab_size, (micro, cfg.pack.seq_len + 1))
            peak = _run_steps(parallel, optimizer, batch)
    finally:
        dist.destroy_process_group()
    out = {k: 0 for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")}
    for ref, n in peak.items():
        key = CATEGORIES.get(getattr(ref, "value", str(ref)))
        if key:
            out[key] += n
    out["total"] = sum(out.values())
    return {**out, "world": world, "micro_batch": micro, "seconds": time.perf_counter() - start,
            "kind": parallel.name, "tracker": {getattr(ref, "value", str(ref)): n for ref, n in peak.items()}}


def _run_steps(parallel, optimizer, batch: torch.Tensor) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(parallel.model, FSDPModule):
        tracker = FSDPMemTracker(parallel.model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(parallel.model, optimizer)
    tracker.track_inputs((batch,)) if hasattr(tracker, "track_inputs") else None
    with tracker:
        for i in range(2):
            with parallel.no_sync(True):
                parallel.loss_fn(parallel.module, batch, parallel.autocast).backward()
            parallel.after_backward()
            optimizer.step()
            optimizer.zero_grad()
            if i == 0:
                tracker.reset_mod_stats()
    snapshot = tracker.get_tracker_snapshot("peak")
    device = max(snapshot, key=lambda dev: snapshot[dev].get("Total", 0))
    return {k: v for k, v in snapshot[device].items() if k != "Total"}
