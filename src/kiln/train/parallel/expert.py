"""Expert parallel for Kiln's MoE blocks: each of `ep` data-parallel ranks holds n_experts / ep experts, and
tokens travel to their experts and back by all-to-all (GShard's dispatch and combine).

kiln.model.moe routes each rank's tokens into an (n_experts, C, dim) buffer of expert slots (C: the capacity,
computed from the rank's own token count, so equal on ranks with equal micro-batches) and calls
`experts(buffer)`. `ExpertShard` replaces `experts` in place and keeps that contract:
1. dispatch: the buffer's rows are in expert order, so its j-th chunk of n_experts/ep experts belongs to ep
   rank j; one all_to_all_single sends each chunk to its owner, which receives (ep, local, C, dim): every
   rank's slots for its own experts;
2. its `local` experts run as batched matmuls over (local, ep·C, dim);
3. combine: the inverse all_to_all returns each rank's slots, computed, in the original expert order.
The routing, the capacity drops and the router losses stay each rank's own, exactly as without expert
parallel: a rank's output equals the unsharded layer's on the same tokens (tests/test_expert_parallel.py).
Both all-to-alls are differentiable (torch's functional collectives): backward sends the gradients the
same way in reverse, so an owner's expert gradients sum every rank's tokens.

Memory: 1/ep of the experts' weights, gradients and optimizer state per rank; the two buffers in flight are
each one (n_experts, C, dim) activation, the size of the unsharded layer's.

In `kiln train` (`ExpertParallel`) expert parallel composes with DDP replicas or FSDP2/HSDP: DDP skips the
expert weights, FSDP2 leaves them out of its shards (parallelize.ExpertFSDPModel); their gradients are averaged
over the ranks holding the same experts; clipping norms add the experts' squares over the expert group; a
sharded checkpoint holds each rank's experts as a box of the whole tensor along the expert dimension
(`checkpoint_slices`), full checkpoints gather the experts whole and a resume slices them again. Not yet with
tensor or pipeline parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.train.parallel.dist import full_value


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


class ExpertShard(nn.Module):
    """Experts [ep_rank·local, (ep_rank+1)·local) of a kiln.model.moe.Experts, serving all ep ranks' slots.
    Parameters keep the names w1, w3, w2 (their first dimension is `local`, not n_experts)."""

    def __init__(self, experts: nn.Module, ep_rank: int, ep: int, group) -> None:
        super().__init__()
        n_experts = experts.w1.shape[0]
        if n_experts % ep:
            raise ValueError(f"{n_experts} experts do not split over {ep} expert-parallel ranks")
        self.n_experts, self.ep, self.local, self.group = n_experts, ep, n_experts // ep, group
        self.first = ep_rank * self.local  # this rank's first expert in the whole stack (materialize.py)
        mine = slice(self.first, self.first + self.local)
        for name in ("w1", "w3", "w2"):  # on the meta device (training builds there): shapes only, no copy
            setattr(self, name, nn.Parameter(getattr(experts, name).detach()[mine].clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n_experts, C, dim): this rank's slots for every expert -> their outputs, same shape."""
        n_experts, capacity, dim = x.shape
        ep, local = self.ep, self.local
        received = _all_to_all(x.reshape(n_experts * capacity, dim), self.group)  # (ep·local·C, dim), by source
        tokens = received.view(ep, local, capacity, dim).transpose(0, 1).reshape(local, ep * capacity, dim)
        # In the activations' dtype: under FSDP2's bf16 the experts, outside FSDP2, are not cast for them
        w1, w3, w2 = (w.to(x.dtype) for w in (self.w1, self.w3, self.w2))
        gate = torch.bmm(tokens, w1.transpose(1, 2))
        up = torch.bmm(tokens, w3.transpose(1, 2))
        out = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))
        out = out.view(local, ep, capacity, dim).transpose(0, 1).reshape(ep * local * capacity, dim)
        return _all_to_all(out, self.group).view(n_experts, capacity, dim)


def apply_expert_parallel(model: nn.Module, ep_rank: int, ep: int, group) -> int:
    """Replace every MoE block's experts with this rank's shard; returns how many blocks were sharded."""
    from kiln.model.moe import MoEFeedForward

    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    for moe in blocks:
        moe.experts = ExpertShard(moe.experts, ep_rank, ep, group)
    return len(blocks)


# --- the Trainer's seam: groups, gradients, norms and full-format checkpoints of expert-parallel MoE ----------

class ExpertParallel:
    """Expert parallel over DDP replicas or FSDP2 (parallel.ep of the data-parallel ranks; tensor and pipeline
    parallel off). Ranks [k·ep, (k+1)·ep) form an expert group that shares the experts, rank i of a group holding the
    i-th n_experts/ep of every MoE block's experts; the ranks at the same place in every group hold the same
    experts (replicas). DDP averages the dense weights' gradients over all ranks and must skip the experts':
    `sync_gradients` averages those over the replicas instead, scaled to the same data-parallel mean.

    Memory for a full checkpoint: every rank gathers each expert tensor whole (one block's experts at a time
    through all_gather), as the full format needs on rank 0 anyway.
    """

    def __init__(self, model: nn.Module, dp_rank: int, dp: int, ep: int) -> None:
        import torch.distributed as dist

        self.ep, self.dp, self.ep_rank = ep, dp, dp_rank % ep
        groups = [dist.new_group(list(range(k * ep, (k + 1) * ep))) for k in range(dp // ep)]  # every rank: all
        replicas = [dist.new_group(list(range(i, dp, ep))) for i in range(ep)] if dp > ep else None
        self.group = groups[dp_rank // ep]
        self.replicas = replicas[self.ep_rank] if replicas else None
        apply_expert_parallel(model, self.ep_rank, ep, self.group)
        self.find(model)

    def find(self, model: nn.Module) -> None:
        """The expert weights of `model`, again after `to_empty` (materialize.py), which may replace them."""
        self.names = [n for n, _ in model.named_parameters() if ".experts." in n]
        self.params = [p for n, p in model.named_parameters() if ".experts." in n]
        self.ids = {id(p) for p in self.params}

    def keep_out_of_ddp(self, model: nn.Module) -> None:
        """Before wrapping `model` in DDP: its expert weights are not replicas, DDP must not average them."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Names as DDP sees them now (activation checkpointing may have wrapped the blocks since).
        DDP._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, p in model.named_parameters() if id(p) in self.ids])

    def sync_gradients(self) -> None:
        """After the step's backward: an owner's expert gradients hold its expert group's tokens (the
        all-to-all's backward); adding the replicas' gives every rank's, and / dp makes it DDP's mean."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        if self.replicas is not None:
            dist.all_reduce(flat, group=self.replicas)
        flat.div_(self.dp)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def group_norms(self, groups: dict[str, list[nn.Parameter]]) -> dict[str, torch.Tensor]:
        """dist.group_norms of the whole model: dense gradients are the same on every rank, each
        rank's expert gradients are a slice, so their squares add over the expert group (one all-reduce)."""
        import torch.distributed as dist

        names = list(groups)
        squares = torch.zeros(2, len(names), dtype=torch.float64, device=self.params[0].device)
        for i, g in enumerate(names):
            for row, ps in enumerate(([p for p in groups[g] if id(p) not in self.ids],
                                      [p for p in groups[g] if id(p) in self.ids])):
                grads = [p.grad for p in ps if p.grad is not None]
                if grads:  # full_value: FSDP2's dense gradients are shards (the same groups on every rank)
                    squares[row, i] = full_value(torch.nn.utils.get_total_norm(grads)).double() ** 2
        dist.all_reduce(squares[1], group=self.group)
        return {g: squares[:, i].sum().sqrt().float() for i, g in enumerate(names)}

    def checkpoint_slices(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """{expert weight's name: (offsets, local shape, global shape)}: this rank's experts are rows
        [ep_rank·local, (ep_rank+1)·local) of the whole model's (n_experts, ...) tensor (a sharded checkpoint's
        box; the replicas holding the same experts write it once)."""
        out = {}
        for name, p in zip(self.names, self.params):
            name = name.replace("_checkpoint_wrapped_module.", "")  # as torch.distributed.checkpoint names it
            local = tuple(p.shape)
            out[name] = ((self.ep_rank * local[0],) + (0,) * (p.ndim - 1), local, (local[0] * self.ep, *local[1:]))
        return out

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        pieces = [torch.empty_like(t) for _ in range(self.ep)]
        dist.all_gather(pieces, t.contiguous(), group=self.group)
        return torch.cat(pieces)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        local = t.shape[0] // self.ep
        return t[self.ep_rank * local:(self.ep_rank + 1) * local].clone()

    def full_states(self, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """This rank's state dicts (DDP's: whole dense weights, expert slices; the optimizer's keyed by name) with
        every expert tensor and its AdamW moments gathered whole over the expert group. Every rank of the group
        takes part."""
        return self._map_experts(self._gather, model_sd, optim_sd)

    def local_states(self, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """Full state dicts (the optimizer's keyed by name) -> this rank's: each expert tensor and its moments
        sliced to its experts."""
        return self._map_experts(self._slice, model_sd, optim_sd)

    def _map_experts(self, fn, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """`fn` applied to every expert weight and to its moments (not the step counters), the rest as it is."""
        names = set(self.names)
        model_sd = {k: fn(v) if k in names else v for k, v in model_sd.items()}
        state = {k: {n: fn(t) if n != "step" and t.ndim > 0 else t for n, t in v.items()} if k in names else v
                 for k, v in optim_sd["state"].items()}
        return model_sd, {**optim_sd, "state": state}
