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

Not wired into `kiln train` yet (parallel.ep>1 is refused there with a one-line error): the trainer must still
keep DDP/FSDP2 from averaging expert gradients over ranks that hold different experts (average them over the
ranks holding the same ones, scaled to the data-parallel mean), add expert gradient norms over the ep group,
and gather / slice expert weights and optimizer state for full checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        mine = slice(ep_rank * self.local, (ep_rank + 1) * self.local)
        for name in ("w1", "w3", "w2"):
            setattr(self, name, nn.Parameter(getattr(experts, name).detach()[mine].clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n_experts, C, dim): this rank's slots for every expert -> their outputs, same shape."""
        n_experts, capacity, dim = x.shape
        ep, local = self.ep, self.local
        received = _all_to_all(x.reshape(n_experts * capacity, dim), self.group)  # (ep·local·C, dim), by source
        tokens = received.view(ep, local, capacity, dim).transpose(0, 1).reshape(local, ep * capacity, dim)
        gate = torch.bmm(tokens, self.w1.transpose(1, 2))
        up = torch.bmm(tokens, self.w3.transpose(1, 2))
        out = torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2))
        out = out.view(local, ep, capacity, dim).transpose(0, 1).reshape(ep * local * capacity, dim)
        return _all_to_all(out, self.group).view(n_experts, capacity, dim)


def apply_expert_parallel(model: nn.Module, ep_rank: int, ep: int, group) -> int:
    """Replace every MoE block's experts with this rank's shard; returns how many blocks were sharded."""
    from kiln.model.moe import MoEFeedForward

    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    for moe in blocks:
        moe.experts = ExpertShard(moe.experts, ep_rank, ep, group)
    return len(blocks)
