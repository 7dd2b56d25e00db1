"""Process group and model wrapping: single process, or torchrun with DDP (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass
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

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
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
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    return Dist(rank, world, local, device)


def wrap_model(model: nn.Module, d: Dist) -> nn.Module:
    if d.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def all_reduce_mean(value: float, d: Dist) -> float:
    if d.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return float(t.item()) / d.world


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    if d.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
