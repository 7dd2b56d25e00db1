"""Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU or MoE. Pure math: no I/O, no distributed code.

RoPE uses the rotate-half layout (as Hugging Face's Llama does), so weights
export without permutation. Initialisation (drawn by model/init.py's rule, which gives the same values
whatever the layout the model is split over): every weight ~ N(0, init_std²);
the two projections that write into the residual stream (attention `wo`,
feed-forward `w2`) are scaled by 1/sqrt(2·n_layers) so the residual's variance
does not grow with depth (GPT-2). Norm weights start at 1. MoE blocks (see kiln.model.moe) init the
same way: router and experts ~ N(0, init_std²), experts.w2 with the residual scaling.

RoPE position scaling, to run a model at a longer context than it was trained at (`RopeScalingConfig`):
- "linear" (position interpolation, Chen et al. 2023): every frequency is divided by `factor`, so position
  factor·p gets the angles position p had before.
- "llama3" (Llama 3.1): frequency-dependent. Wavelengths (2π/freq) shorter than
  original_max_seq_len / high_freq_factor are kept (they resolve local order and never saw a longer context
  matter); wavelengths longer than original_max_seq_len / low_freq_factor are divided by `factor` as in
  "linear"; in between, the frequency is interpolated smoothly between the two, with
  smooth = (original_max_seq_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
Both leave the tables unchanged when factor is 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.model.attention import DocumentMask, attend, document_positions, kernel_for
from kiln.model.config import ModelConfig, RopeScalingConfig
from kiln.model.init import init_whole
from kiln.model.moe import MoEFeedForward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the autocast dtype: bf16 loses the small differences that matter here.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def scale_frequencies(inv_freq: torch.Tensor, s: RopeScalingConfig) -> torch.Tensor:
    """The scaled rotary frequencies (rules in the module docstring)."""
    if s.type == "linear":
        return inv_freq / s.factor
    wavelength = 2 * math.pi / inv_freq
    smooth = ((s.original_max_seq_len / wavelength - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    # Written as f/factor + smooth·f·(1 - 1/factor), not (1-smooth)·f/factor + smooth·f: the same number,
    # and exactly f when factor is 1.
    return inv_freq / s.factor + smooth * inv_freq * (1 - 1 / s.factor)


def rope_tables(head_dim: int, seq_len: int, theta: float,
                scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        inv_freq = scale_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout
    return angles.cos().float(), angles.sin().float()


@torch.no_grad()
def reset_rope(model: nn.Module) -> None:
    """Recompute the RoPE tables of every module holding them (a Llama, a pipeline stage) where they lie:
    `to_empty` leaves buffers uninitialised."""
    for m in model.modules():
        if m._buffers.get("rope_cos") is not None:
            c = m.config
            cos, sin = rope_tables(c.head_dim, m.rope_cos.shape[0], c.rope_theta, c.rope_scaling)
            m.rope_cos.copy_(cos)
            m.rope_sin.copy_(sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotates each (i, i + head_dim/2) pair by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = a.n_heads, a.kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: DocumentMask | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.hidden, bias=False)  # gate
        self.w3 = nn.Linear(a.dim, a.hidden, bias=False)  # up
        self.w2 = nn.Linear(a.hidden, a.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        if a.moe is not None and a.moe.is_moe_layer(layer_id):
            self.feed_forward: nn.Module = MoEFeedForward(a.dim, a.moe.ffn_hidden or a.hidden, a.moe)
        else:
            self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: DocumentMask | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The model takes its one config (the `model:` section) and the sizes that are not model keys; `eos_id`,
    the tokenizer's EOS, separates the documents of a sample (needed with model.document_masking)."""

    def __init__(self, config: ModelConfig, vocab_size: int, max_seq_len: int, eos_id: int | None = None) -> None:
        super().__init__()
        a = self.config = config
        self.vocab_size, self.max_seq_len, self.eos_id = vocab_size, max_seq_len, eos_id
        self.tok_embeddings = nn.Embedding(vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, vocab_size, bias=False)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(a.head_dim, max_seq_len, a.rope_theta, a.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Initial weights by model/init.py's rule (the same values whatever the layout), from `seed` (None:
        torch's seed, `torch.manual_seed`'s). A model on the meta device is left for `to_empty` and its owner."""
        if self.tok_embeddings.weight.is_meta:
            return
        init_whole(self, torch.initial_seed() if seed is None else seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab)."""
        t = tokens.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.max_seq_len}")
        documents = self.document_mask(tokens)
        if documents is not None and self.config.document_positions:
            positions = document_positions(tokens, self.eos_id)
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        else:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, documents)
        return self.output(self.norm(h))

    def document_mask(self, tokens: torch.Tensor) -> DocumentMask | None:
        """The documents of `tokens` for every layer's attention (None: plain causal attention)."""
        if not self.config.document_masking:
            return None
        if self.eos_id is None:
            raise ValueError("model.document_masking needs the EOS id that separates documents: build the model "
                             "with eos_id")
        return DocumentMask.of(tokens, self.eos_id, self.attention_kernel(tokens.device))

    def attention_kernel(self, device: torch.device) -> str:
        """What attention runs on `device`: "causal" (no document masking), or document masking's kernel."""
        if not self.config.document_masking:
            return "causal"
        return kernel_for(self.config.document_attention, device)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if non_embedding else n

    def active_params(self) -> int:
        """Weights one token multiplies through: non-embedding parameters plus the output projection, and in an
        MoE block the router and only top_k of the experts."""
        n = sum(p.numel() for p in self.parameters()) - self.tok_embeddings.weight.numel()
        if self.config.tie_embeddings:
            n += self.output.weight.numel()
        for moe in self.moe_layers():
            per_expert = sum(p[0].numel() for p in moe.experts.parameters())
            n -= (moe.n_experts - moe.top_k) * per_expert
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6·N for the (active) weights plus 12·layers·seq·dim for attention (PaLM,
        appendix B)."""
        return 6 * self.active_params() + 12 * self.config.n_layers * seq_len * self.config.dim

    def moe_layers(self) -> list[MoEFeedForward]:
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def moe_losses(self) -> dict[str, torch.Tensor | int]:
        """Router losses and counters of the last forward, summed over MoE layers (zeros for a dense model).

        aux_loss and z_loss are differentiable scalars to add to the LM loss with their coefficients;
        dropped_tokens / routed_tokens count (token, expert) assignments lost to capacity / routed; dropped_tokens
        is a tensor on the model's device (reading it is a host sync: the trainer reads it once a step).
        """
        zero = torch.zeros((), device=self.output.weight.device)
        total: dict[str, torch.Tensor | int] = {"aux_loss": zero, "z_loss": zero, "dropped_tokens": 0,
                                                "routed_tokens": 0}
        for moe in self.moe_layers():
            if moe.stats is None:
                continue
            for key in ("aux_loss", "z_loss"):
                total[key] = total[key] + moe.stats[key]
            total["dropped_tokens"] = total["dropped_tokens"] + moe.stats["dropped_tokens"]  # on the device: no sync
            total["routed_tokens"] += moe.stats["routed_tokens"]
        return total
