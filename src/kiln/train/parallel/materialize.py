"""Materialise a model built on the meta device after it was split: storage for this rank's part only
(`to_empty` on the device), then that part's initial values by kiln.model.init's rule, so the whole model's
weights, gathered, are the same whatever the layout (tests/test_meta_init.py), and no rank ever holds more
than its part plus one chunk being drawn.

Where each parameter's box lies in the whole tensor:
- a DTensor (FSDP2, HSDP, tensor parallel): its local shape and global offset from its placements; a layout
  whose local part is not one box (FSDP2's strided shards over tensor-parallel ones) draws the whole tensor and
  keeps its part (`distribute_tensor` without communication): one tensor at a time;
- an expert-parallel shard (expert.ExpertShard): experts [first, first + local) of the whole stack;
- anything else (one process, DDP, a pipeline stage's layers): the whole tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.model.init import fill_box
from kiln.model.llama import reset_rope
from kiln.train.parallel.optimizer_state import plain_name


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, views: list[nn.Module] = ()) -> None:
    """`model` (split, on meta) -> this rank's part on `device`, initialised from `seed`; RoPE tables recomputed.
    `views`: other modules over the same parameters (a pipeline's stages), whose own buffers are made too."""
    from torch._subclasses.fake_tensor import is_fake

    model.to_empty(device=device)
    for view in views:  # their parameters are the model's, materialised above; their buffers are their own
        for m in view.modules():
            for k, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[k] = torch.empty_like(b, device=device)
        reset_rope(view)
    if any(is_fake(p) for p in model.parameters()):  # `kiln plan --trace`: fake tensors hold no values
        return
    config = _config(model)
    experts = {id(p): m for m in model.modules() if hasattr(m, "local") and hasattr(m, "first")
               for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        name = plain_name(name)
        if hasattr(p, "device_mesh"):
            _fill_dtensor(p, name, config, seed)
        elif id(p) in experts:
            m = experts[id(p)]
            shape = (m.n_experts, *p.shape[1:])
            fill_box(p.data, name, shape, (m.first,) + (0,) * (p.ndim - 1), config, seed)
        else:
            fill_box(p.data, name, tuple(p.shape), (0,) * p.ndim, config, seed)
    reset_rope(model)


def _config(model: nn.Module):
    for m in model.modules():
        if hasattr(m, "config"):
            return m.config
    raise ValueError("materialize: no module of this model holds the model config")


def _fill_dtensor(p, name: str, config, seed: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = p.to_local()
    shape = tuple(p.shape)
    if all(type(pl) in (Shard, Replicate) for pl in p.placements):
        local_shape, offsets = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
        if tuple(local_shape) == tuple(local.shape):
            fill_box(local, name, shape, tuple(offsets), config, seed)
            return
    whole = torch.empty(shape)  # a part that is not one box: the whole tensor, once
    fill_box(whole, name, shape, (0,) * len(shape), config, seed)
    local.copy_(distribute_tensor(whole.to(local.device), p.device_mesh, p.placements, src_data_rank=None).to_local())
