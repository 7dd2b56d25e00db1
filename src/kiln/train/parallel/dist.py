"""The process group: joining torchrun's group (gloo on CPU, nccl on GPU), its timeouts, and the few collectives
the loop uses. Wrapping a model for DDP/FSDP2 is parallelize.py's.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a norm or sum taken over FSDP2's sharded DTensors, else `t` itself.

    A norm of DTensor gradients is a DTensor whose shards' partial sums still need adding: `full_tensor()`
    is that all-reduce (a collective every rank must enter), not a local read.
    """
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def group_norms(groups: dict[str, list[torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The gradient norm of each layer group (clip.layer_groups) of the whole model, on every rank."""
    return {g: full_value(torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None]))
            for g, ps in groups.items()}


def init_single_process_group(d: Dist) -> None:
    """A process group of one, in memory, for FSDP2 on one device (no torchrun)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if d.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


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


def all_gather_objects(d: Dist, value: Any, group=None) -> list[Any]:
    """Every rank's `value`, in rank order (all_gather_object over `group`, by default the default group)."""
    if d.world == 1:
        return [value]
    values: list[Any] = [None] * d.world
    dist.all_gather_object(values, value, group=group)
    return values


def broadcast_object(d: Dist, value: Any, group=None) -> Any:
    """Rank 0's `value` on every rank."""
    if d.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

