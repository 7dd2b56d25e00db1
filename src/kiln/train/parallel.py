"""Process group and model wrapping: one process, or torchrun with DDP or FSDP2 (gloo on CPU, nccl on GPU).

The model code knows nothing of this: parallelism, activation checkpointing and
compilation are applied here, to a plain `Llama`.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    host: str = field(default_factory=socket.gethostname)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(startup_timeout_s: float = 1800) -> Dist:
    """Join the torchrun group when launched by torchrun, else run as a single process."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Dist(device=torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # Long at start-up: loading data and compiling on some ranks can take minutes.
        timeout = timedelta(seconds=startup_timeout_s)
        dist.init_process_group(backend, store=attempt_store(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout)
    return Dist(rank, world, local, device)


def attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store, under a prefix per torchrun restart.

    torchrun's workers share its agent's store across restarts; without a fresh prefix a restarted
    rank can read the addresses the previous attempt left there and fail to connect ("Connection
    refused" in connectFullMesh).
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=rank == 0 and not agent, timeout=timeout)
    return dist.PrefixStore(f"kiln/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def set_step_timeout(d: Dist, seconds: float) -> None:
    """After the first step a collective that takes this long means a hung rank, not a slow start."""
    if d.world > 1:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), dist.group.WORLD)


def parallel_mode(requested: str, d: Dist) -> str:
    if requested == "auto":
        return "ddp" if d.world > 1 else "none"
    if d.world == 1 and requested == "ddp":
        return "none"
    return requested


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward: memory for compute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model: nn.Module, d: Dist, mesh_shape: list[int] | None, param_dtype: torch.dtype | None,
               fp32_kinds: list[str] = ()) -> None:
    """FSDP2: shard each block, then the root; a 2-D mesh [replicate, shard] gives hybrid sharding (HSDP).

    `fp32_kinds` (train.fp32_modules) are sharded as groups of their own whose parameters are gathered in
    fp32 and whose inputs are cast to fp32: FSDP2's counterpart of running them outside autocast. Their
    outputs return in the compute dtype, which the rest of the block expects, except the output head's:
    fp32 logits are why one keeps the head in fp32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kiln.train.precision import modules_of_kind

    if model.args.tie_embeddings and {"output", "embeddings"} & set(fp32_kinds):
        raise ValueError("train.fp32_modules with 'output' or 'embeddings' needs untied embeddings under FSDP2 "
                         "(one weight cannot sit in two shard groups of different dtypes); set "
                         "model.tie_embeddings: false, or use parallel.mode=ddp")
    shape = tuple(mesh_shape) if mesh_shape else (d.world,)
    if int(torch.tensor(shape).prod()) != d.world:
        raise ValueError(f"parallel.mesh={list(shape)} multiplies to {int(torch.tensor(shape).prod())}, not the {d.world} ranks")
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh(d.device.type, shape, mesh_dim_names=names)
    # Parameters are gathered in the compute dtype; gradients are reduced in fp32 so small updates survive.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if param_dtype is not None and param_dtype != torch.float32:
        for kind in fp32_kinds:
            keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=None if kind == "output" else param_dtype)
            for module in modules_of_kind(model, kind):
                fully_shard(module, mesh=mesh, mp_policy=keep)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def wrap_model(model: nn.Module, d: Dist, mode: str) -> nn.Module:
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    return model  # FSDP2 shards in place; one process needs nothing


@contextmanager
def gradient_sync(model: nn.Module, mode: str, enabled: bool):
    """Gradient accumulation: reduce gradients only on the last micro-step."""
    if enabled or mode == "none":
        yield
    elif mode == "ddp":
        with model.no_sync():
            yield
    else:  # fsdp
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def full_state_dict(model: nn.Module, mode: str) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (gathered on every rank under FSDP2; rank 0 writes them)."""
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False))
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str) -> dict:
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def load_states(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str, model_sd: dict, optim_sd: dict) -> None:
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_sd, options=opts)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
    else:
        unwrap(model).load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a reduction result is replicated), else the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    if d.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_mean(value: float, d: Dist) -> float:
    return all_reduce_sum([value], d)[0] / d.world


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

