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
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kiln.errors import KilnError


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


def init_distributed(startup_timeout_s: float = 1800, trace_dir: Path | None = None) -> Dist:
    """Join the torchrun group when launched by torchrun, else run as a single process."""
    if torch.cuda.is_available():
        cuda_defaults(trace_dir)
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        cuda = torch.cuda.is_available()
        return Dist(device=torch.device("cuda", local_device_index(0)) if cuda else torch.device("cpu"))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_device_index(local)), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # Long at start-up: loading data and compiling on some ranks can take minutes.
        timeout = timedelta(seconds=startup_timeout_s)
        # device_id binds the NCCL communicator to this GPU at once (no guessing from the rank, no lazy
        # set-up inside the first collective). A GPU run confirms the eager NCCL init on each layout.
        dist.init_process_group(backend, store=attempt_store(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout, device_id=device if device.type == "cuda" else None)
    return Dist(rank, world, local, device)


def local_device_index(local_rank: int, visible: int | None = None) -> int:
    """The CUDA device index this process uses: its LOCAL_RANK when it sees every GPU of the node, 0 when the
    launcher (srun --gpus-per-task, Kubernetes) shows each process only its own GPU."""
    visible = torch.cuda.device_count() if visible is None else visible
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise KilnError(f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start one process per visible GPU, "
                        "or show each process all of the node's GPUs or exactly one")
    return local_rank


# The NCCL flight recorder: the last collectives of each rank, dumped on a timeout next to the watchdog's
# stacks, so a hang says which collective each rank was in. Set before the first communicator is made.
FLIGHT_RECORDER_ENTRIES = "2000"


def cuda_defaults(trace_dir: Path | None) -> None:
    """Environment the CUDA caching allocator and NCCL read once, at first use; a user's own setting wins.

    expandable_segments: the allocator grows segments instead of leaving fragments between fixed-size ones
    (torchtitan's default); a GPU run confirms the reserved - allocated gap it saves.
    """
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(Path(trace_dir) / "nccl-trace-rank"))


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
    """After the first step a collective that takes this long means a hung rank, not a slow start.

    Every group gets it (the device mesh's HSDP/FSDP subgroups too, not only WORLD), after a barrier so no
    rank shortens the timeout while another is still in a long first collective. A GPU run confirms NCCL
    takes the new timeout on each subgroup.
    """
    if d.world == 1:
        return
    dist.barrier()
    timeout = timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


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
    # An MoE block records its router numbers on the module in forward. Under checkpointing dynamo refuses
    # that side effect (it would be replayed when the forward is recomputed in backward) and breaks the
    # graph: the MoE blocks then ran eagerly. Recomputing gives the same numbers, so the replay may be skipped
    # (torchtitan sets the same).
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def apply_fsdp(model: nn.Module, d: Dist, mesh_shape: list[int] | None, param_dtype: torch.dtype | None,
               fp32_kinds: list[str] = (), dp_mesh=None) -> None:
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
    if not dist.is_initialized():  # FSDP2 on one device (no torchrun): a process group of one, in memory
        dist.init_process_group("nccl" if d.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    shape = tuple(mesh_shape) if mesh_shape else (d.world,)
    if dp_mesh is None and int(torch.tensor(shape).prod()) != d.world:
        raise ValueError(
            f"parallel.mesh={list(shape)} multiplies to {int(torch.tensor(shape).prod())}, not the {d.world} ranks"
        )
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    # dp_mesh: the data-parallel dimensions of kiln.train.mesh's DeviceMesh, when tensor/pipeline parallel share it
    mesh = dp_mesh if dp_mesh is not None else init_device_mesh(d.device.type, shape, mesh_dim_names=names)
    # Parameters are gathered in the compute dtype; gradients are reduced in fp32 so small updates survive.
    # Inputs are not cast: a block's activations are already in the compute dtype, and casting would turn the
    # fp32 RoPE tables to bf16 in every block, which DDP under autocast does not do (torchtitan: the same).
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if param_dtype is not None and param_dtype != torch.float32:
        for kind in fp32_kinds:
            keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=None if kind == "output" else param_dtype)
            for module in modules_of_kind(model, kind):
                fully_shard(module, mesh=mesh, mp_policy=keep)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # The root group (embeddings, final norm, head) is used again at once by backward: resharding it after
    # forward would only gather it again. A GPU run confirms the memory/communication trade on the 1B model.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


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
        # FSDP2: gradients are reduce-scattered after every micro-batch, so each rank accumulates only its
        # shard (skipping that sync would hold unsharded fp32 gradients, 4 bytes per parameter, on every
        # rank). Under HSDP only the all-reduce across replicas waits for the last micro-batch.
        model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            model.set_requires_all_reduce(True)


def full_state_dict(model: nn.Module, mode: str) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (gathered on every rank under FSDP2; rank 0 writes them)."""
    if mode == "fsdp" or has_dtensors(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
        )
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str) -> dict:
    if mode == "fsdp" or has_dtensors(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return optimizer.state_dict()


def load_states(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str, model_sd: dict, optim_sd: dict,
                world: int = 1) -> None:
    """Load full (unsharded) weights and optimizer state. With several ranks only rank 0 has read them (the
    others pass empty dicts): rank 0 broadcasts, and each rank keeps its shard (FSDP2) or the whole (DDP),
    so host memory holds one copy per node's rank 0, not one per rank."""
    if world == 1 and mode != "fsdp" and not has_dtensors(model):
        unwrap(model).load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1)
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)


def has_dtensors(model: nn.Module) -> bool:
    """Sharded by tensor parallel (or FSDP2): the parameters are DTensors."""
    return any(hasattr(p, "device_mesh") for p in model.parameters())


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


def all_reduce_(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum `t` over the ranks in place (no host sync); returns it."""
    if d.world > 1:
        dist.all_reduce(t)
    return t


def all_reduce_mean(value: float, d: Dist) -> float:
    return all_reduce_sum([value], d)[0] / d.world


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

