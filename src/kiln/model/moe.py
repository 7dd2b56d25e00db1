"""Mixture-of-experts feed-forward: a top-k router over SwiGLU experts, with capacity, load balancing and z-loss.

Parameter layout (Mixtral-like, so an exporter slices experts out without reshaping):

    feed_forward.router.weight   (n_experts, dim)          nn.Linear(dim, n_experts, bias=False)
    feed_forward.experts.w1      (n_experts, hidden, dim)  gate: w1[e] is expert e's Linear(dim, hidden).weight
    feed_forward.experts.w3      (n_experts, hidden, dim)  up
    feed_forward.experts.w2      (n_experts, dim, hidden)  down: writes into the residual stream

Expert e computes w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x)), the dense block's SwiGLU. Hugging Face Mixtral's
`block_sparse_moe.gate.weight` is the router and `block_sparse_moe.experts.{e}.{w1,w2,w3}.weight` are the slices.

Routing, per forward pass, over all batch·seq tokens together:

1. Router logits in fp32 even under autocast: bf16 logits tie and flip the top-k choice (ST-MoE, "selective
   precision").
2. probs = softmax(logits) over experts; each token takes its top_k experts. The combine weights are the chosen
   probabilities renormalised to sum to 1 (Mixtral). With top_k = 1 the weight is the probability itself (Switch):
   renormalised it would always be 1 and the LM loss would send the router no gradient.
3. Capacity: an expert takes at most C = ceil(capacity_factor · tokens · top_k / n_experts) assignments (and never
   more than `tokens`, one per token). First choices are served before second choices (GShard), then in token
   order. An assignment over capacity is dropped: that expert adds nothing for that token, the residual stream
   carries the token on unchanged, and its other choices still apply. capacity_factor None means no drops.
4. Load-balancing loss (Switch eq. 4; Mixtral): n_experts · Σ_e f_e · P_e, where f_e is the share of the
   tokens·top_k assignments (counted before drops) that chose e and P_e is e's mean router probability. It is 1
   for balanced routing and up to n_experts when one expert takes everything. (HF Mixtral's
   load_balancing_loss_func does not divide f by top_k, so its value is top_k times this one.)
5. Router z-loss (ST-MoE eq. 5): mean over tokens of logsumexp(logits)². It keeps the logits small, where the
   fp32 softmax stays accurate.

Counters: `dropped` counts (token, expert) assignments lost to capacity; `routed` is tokens · top_k.

The computation is vectorised: tokens are scattered into an (n_experts, C, dim) buffer, the experts run as
batched matmuls, and the results are gathered back and weighted. No Python loop over tokens or experts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kiln.model.config import MoEConfig


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int:
    if capacity_factor is None:
        return n_tokens
    # Rounded before ceil so that 1.1 · 10 tokens gives 11 slots, not 12 from the float 11.000000000000002.
    return min(n_tokens, math.ceil(round(capacity_factor * n_tokens * top_k / n_experts, 6)))


class Routing(NamedTuple):
    probs: torch.Tensor  # (tokens, n_experts) softmax of the router logits, fp32
    experts: torch.Tensor  # (tokens, top_k) chosen expert ids, most probable first
    weights: torch.Tensor  # (tokens, top_k) combine weights
    position: torch.Tensor  # (tokens, top_k) slot of each assignment in its expert's buffer
    kept: torch.Tensor  # (tokens, top_k) bool: the assignment is within capacity
    counts: torch.Tensor  # (n_experts,) assignments per expert before drops


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """logits (tokens, n_experts) -> which experts each token goes to, with what weight, in which slot."""
    n_experts = logits.shape[-1]
    probs = logits.float().softmax(-1)
    top_p, experts = probs.topk(top_k, dim=-1)
    weights = top_p / top_p.sum(-1, keepdim=True) if top_k > 1 else top_p
    # Assignments in priority order (choice rank, then token): a running count per expert gives each its slot.
    onehot = F.one_hot(experts.t().reshape(-1), n_experts)  # (top_k·tokens, n_experts)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1).view(top_k, -1).t()
    return Routing(probs, experts, weights, position, position < capacity, onehot.sum(0))


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """n_experts · Σ_e f_e · P_e; f from the (non-differentiable) counts, so the gradient flows through P."""
    n_experts = probs.shape[-1]
    f = counts.to(probs.dtype) / counts.sum()
    return n_experts * (f * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


class Experts(nn.Module):
    """n_experts SwiGLU feed-forwards as stacked weights (layout in the module docstring)."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n_experts, slots, dim): expert e's slots -> (n_experts, slots, dim)."""
        gate = torch.bmm(x, self.w1.transpose(1, 2))
        up = torch.bmm(x, self.w3.transpose(1, 2))
        return torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2))


class MoEFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, m: MoEConfig) -> None:
        super().__init__()
        if not 1 <= m.top_k <= m.n_experts:
            raise ValueError(f"top_k={m.top_k} must be between 1 and n_experts={m.n_experts}")
        self.n_experts, self.top_k, self.capacity_factor = m.n_experts, m.top_k, m.capacity_factor
        self.router = nn.Linear(dim, m.n_experts, bias=False)
        self.experts = Experts(m.n_experts, dim, hidden)
        self.stats: dict[str, torch.Tensor | int] | None = None  # from the last forward; read by Llama.moe_losses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dim = x.shape, x.shape[-1]
        x = x.reshape(-1, dim)
        n, k, n_exp = x.shape[0], self.top_k, self.n_experts
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        capacity = expert_capacity(n, k, n_exp, self.capacity_factor)
        r = route(logits, k, capacity)

        # One buffer row per (expert, slot); dropped assignments all land in a spare last row that is discarded.
        spare = n_exp * capacity
        slot = torch.where(r.kept, r.experts * capacity + r.position, spare).reshape(-1)  # (tokens·top_k,)
        sources = x.unsqueeze(1).expand(n, k, dim).reshape(-1, dim)
        buffer = x.new_zeros(spare + 1, dim).index_add(0, slot, sources)
        out = self.experts(buffer[:spare].view(n_exp, capacity, dim)).reshape(spare, dim)
        out = torch.cat([out, out.new_zeros(1, dim)])  # the spare row's output: zero, so drops add nothing
        y = (out[slot].view(n, k, dim) * r.weights.unsqueeze(-1)).sum(1)

        self.stats = {"aux_loss": load_balancing_loss(r.probs, r.counts), "z_loss": router_z_loss(logits),
                      "dropped_tokens": (~r.kept).sum(), "routed_tokens": n * k}
        return y.to(x.dtype).view(shape)
