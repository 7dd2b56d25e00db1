"""`kiln plan --trace`: the configured training step run for real, on fake tensors, by rank 0 of a fake process
group of the planned world size, with torch's memory tracker counting what it allocates.

The model is built and split exactly as `kiln train` does (meta device, `parallelize` with the configured layout,
precision, activation checkpointing; materialised as fake tensors: no memory), then two steps run under
`FakeTensorMode` (forward and backward of one micro-batch, the AdamW step; the second has optimizer state and,
when the configured step accumulates gradients, two micro-batches: the second runs beside the gradients), with
`FSDPMemTracker` (FSDP2) or `MemTracker` (other kinds); `held` is what the rank holds after the second
step (parameters, gradients before zero_grad, optimizer state). The categories at the traced peak:
parameters (sharded and, under FSDP2, the gathered ones), gradients, optimizer state, activations and
temporaries (backward's gradients of activations, FSDP2's all-gather and reduce-scatter buffers, and the
optimizer step's work tensors: torch's trackers file everything allocated inside `step()` as optimizer state,
so "optimizer" here is the state AdamW holds, exp_avg and exp_avg_sq, and the rest of the step goes to
temporaries). The optimizer is built as on the planned device (fused AdamW on a GPU, engine.build_optimizer).

Not counted (torch's trackers would): DTensor's sharding propagation, which under an outer FakeTensorMode
runs each op once more on global-shape fake tensors to learn its output's shape; that memory is never
allocated by a real run (with the step's work, it was the 70B's 21.4 GB once traced as optimizer state).

What a trace on this machine cannot see: the CUDA allocator's fragmentation and caching, NCCL's buffers, the
CUDA context, and kernels that differ by device (the trace runs on fake CPU tensors: SDPA's CPU kernel, not
flash attention). Pipeline parallel is not traced (its schedule's sends need real peers).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

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


_PROPAGATING = [0]  # > 0 while DTensor's sharding propagation runs (its fake tensors are not this rank's memory)


@contextmanager
def _propagation_untracked():
    """While inside: DTensor's output-shape propagation says so in _PROPAGATING (the trackers skip it)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        _PROPAGATING[0] += 1
        try:
            return original(self, op_schema)
        finally:
            _PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def _skipping_propagation(tracker_class: type) -> type:
    class Tracker(tracker_class):
        def _track(self, reftype, t):
            if not _PROPAGATING[0]:
                super()._track(reftype, t)

    return Tracker


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state `optimizer` holds on this rank: each state tensor's storage (a DTensor's local shard)."""
    return sum((v.to_local() if hasattr(v, "to_local") else v).untyped_storage().nbytes()
               for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def trace_memory(cfg: Config, vocab_size: int, world: int, device_type: str = "cuda") -> dict:
    """Rank 0's traced peak bytes by category for `cfg`'s layout over `world` fake ranks (see the module);
    `device_type`: the planned device's (the optimizer is built as there)."""
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
        with FakeTensorMode(allow_non_fake_inputs=True), _propagation_untracked():
            materialize(parallel.model, d.device, cfg.seed)
            optimizer = build_optimizer(parallel.model, cfg.train, torch.device(device_type))
            batch = torch.randint(0, vocab_size, (micro, cfg.pack.seq_len + 1))
            accumulates = cfg.train.batch_size > micro * degrees.dp  # micro-steps hold the gradients between them
            peak, now = _run_steps(parallel, optimizer, batch, 2 if accumulates else 1)
            state = optimizer_state_bytes(optimizer)
    finally:
        dist.destroy_process_group()
    out = {k: 0 for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")}
    for ref, n in peak.items():
        key = CATEGORIES.get(getattr(ref, "value", str(ref)))
        if key:
            out[key] += n
    held = {k: 0 for k in ("parameters", "gradients", "optimizer")}
    for ref, n in now.items():
        name = getattr(ref, "value", str(ref))
        key = CATEGORIES.get(name)
        if key in held and name != "Buffer":
            held[key] += n
    step_work = max(out["optimizer"] - state, 0)  # allocated inside step(), not held after it
    out["optimizer"] -= step_work
    out["temporaries"] += step_work
    out["total"] = sum(out.values())
    return {**out, "world": world, "micro_batch": micro, "seconds": time.perf_counter() - start,
            "kind": parallel.name, "optimizer_state_bytes": state, "held": held,
            "tracker": {getattr(ref, "value", str(ref)): n for ref, n in peak.items()}}


def _run_steps(parallel, optimizer, batch: torch.Tensor, micro_steps: int) -> tuple[dict, dict]:
    """Two optimizer steps (the second with AdamW's state), the second of `micro_steps` micro-batches: with
    gradient accumulation the later micro-batches run while the rank holds its gradients."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(parallel.model, FSDPModule):
        tracker = _skipping_propagation(FSDPMemTracker)(parallel.model, optimizer)
    else:
        tracker = _skipping_propagation(MemTracker)()
        tracker.track_external(parallel.model, optimizer)
    tracker.track_inputs((batch,)) if hasattr(tracker, "track_inputs") else None
    with tracker:
        for i in range(2):
            n = micro_steps if i == 1 else 1
            for j in range(n):
                if j:
                    tracker.reset_mod_stats()  # FSDPMemTracker takes one forward per module between resets
                with parallel.no_sync(j == n - 1):
                    parallel.loss_fn(parallel.module, batch, parallel.autocast).backward()
            parallel.after_backward()
            optimizer.step()
            if i == 1:  # what the rank holds between steps, gradients not yet zeroed
                now = tracker.get_tracker_snapshot("current")
            optimizer.zero_grad()
            if i == 0:
                tracker.reset_mod_stats()
    snapshot = tracker.get_tracker_snapshot("peak")
    device = max(snapshot, key=lambda dev: snapshot[dev].get("Total", 0))
    return ({k: v for k, v in snapshot[device].items() if k != "Total"},
            {k: v for k, v in now[device].items() if k != "Total"})
