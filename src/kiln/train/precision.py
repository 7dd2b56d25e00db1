"""Precision policy: what runs in fp32 while the rest of the model runs in bf16/fp16 under autocast.

Always fp32: RMSNorm (it upcasts inside), the loss (logits are upcast before the cross-entropy),
and attention's softmax (scaled_dot_product_attention accumulates it in fp32). `train.fp32_modules`
pins whole module kinds to fp32 as well, e.g. the output head when its logits overflow in fp16.
Under autocast (one process, DDP) `apply_precision_policy` runs them with autocast off; under FSDP2,
which casts parameters instead, `parallel.fsdp.apply_fsdp` shards them as groups gathered in fp32.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kiln.model.llama import Attention

KINDS = ("attention", "feed_forward", "output", "embeddings")


def modules_of_kind(model: nn.Module, kind: str) -> list[nn.Module]:
    if kind == "output":
        return [model.output]
    if kind == "embeddings":
        return [model.tok_embeddings]
    if kind == "attention":
        return [m for m in model.modules() if isinstance(m, Attention)]
    return [block.feed_forward for block in model.layers]  # dense SwiGLU or MoE alike


def apply_precision_policy(model: nn.Module, fp32_kinds: list[str]) -> None:
    for kind in fp32_kinds:
        for module in modules_of_kind(model, kind):
            module.forward = _in_fp32(module.forward)


def _in_fp32(forward):
    # Wrapping the bound forward keeps parameter names (and so checkpoints) unchanged.
    @functools.wraps(forward)
    def run(*args, **kwargs):
        args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return forward(*args, **kwargs)
    return run
