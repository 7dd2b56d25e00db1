"""Tensor parallel for Kiln's Llama (Megatron-LM's layout, with DTensor's `torch.distributed.tensor.parallel`).

Per block, over the `tp` ranks of one group (the innermost mesh dimension, kiln.train.parallel.mesh):
- attention: wq, wk, wv column-wise (each rank computes n_heads/tp query heads and kv_heads/tp key/value
  heads: whole heads, so attention itself needs no communication), wo row-wise;
- MLP: w1 (gate) and w3 (up) column-wise, w2 (down) row-wise;
- sequence parallel: the residual stream between those regions is split along the sequence (Shard(1)), so
  the RMSNorms run on seq/tp positions and the activations between blocks take 1/tp of the memory. Entering
  attention or the MLP all-gathers the sequence; leaving it, wo/w2's partial sums are reduce-scattered back
  to sequence shards (the all-reduce of plain Megatron TP, split in two halves of the same traffic).
- embeddings row-wise over the vocabulary (each rank looks up its rows, the results are reduce-scattered
  into sequence shards); the output head column-wise over the vocabulary: each rank computes the logits of
  its vocab/tp tokens, and `vocab_parallel_loss` takes the cross-entropy from those shards with three
  all-reduces of one number per position (max, sum of exponentials, target logit): the full
  (batch, seq, vocab) logits are never gathered on any rank during training.

Anything else that calls the model (evaluation, downstream tasks, generation) gets the full logits: a
forward hook all-gathers them unless `vocab_parallel_loss` asked for the shards. That gather costs one
(batch, seq, vocab) tensor per evaluation micro-batch, under no_grad.

The attention modules' `n_heads`/`kv_heads` are set to the local counts (what torchtitan does), so the
model's own `view(b, t, n_heads, head_dim)` reads the local projection; nothing in kiln.model changes.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

_SHARDED_LOGITS = threading.local()


@contextmanager
def sharded_logits():
    """Inside, a tensor-parallel model returns its logits as a DTensor sharded over the vocabulary."""
    before = getattr(_SHARDED_LOGITS, "on", False)
    _SHARDED_LOGITS.on = True
    try:
        yield
    finally:
        _SHARDED_LOGITS.on = before


def _full_logits(module: nn.Module, args, output):
    if getattr(_SHARDED_LOGITS, "on", False):
        return output
    return output.full_tensor()


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Shard `model` (a kiln Llama, before FSDP2, activation checkpointing and compile) over `tp_mesh` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = tp_mesh.size()
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # use_local_output=False: the loss (or the gathering hook) reads the DTensor's vocabulary shards
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin, documents): x is gathered along the sequence; the rotary tables and the document
            # mask (model.document_masking) are plain, whole-sequence values, left alone
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        block.attention.n_heads //= tp
        block.attention.kv_heads //= tp
    model.register_forward_hook(_full_logits)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-position cross-entropy from logits split over the vocabulary (Megatron-LM's vocab-parallel loss).

    logits: (N, V/tp) fp32, this rank's vocabulary columns [start, start + V/tp); targets: (N,) global ids.
    Memory: one (N, V/tp) fp32 softmax kept for backward, as F.cross_entropy keeps its log-softmax.
    """

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        n_local = logits.shape[-1]
        top = logits.max(dim=-1).values
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        local = targets - start
        mine = (local >= 0) & (local < n_local)
        index = local.clamp(0, n_local - 1)
        target = shifted.gather(1, index[:, None]).squeeze(1) * mine
        both = torch.stack([total, target])  # one all-reduce for the two sums
        dist.all_reduce(both, group=group)
        total, target = both[0], both[1]
        exp.div_(total[:, None])  # the softmax, reused by backward
        ctx.save_for_backward(exp, index, mine)
        return total.log() - target

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine = ctx.saved_tensors
        grad_logits = softmax  # d loss / d logits = softmax - onehot(target), the onehot only on its owner
        grad_logits.scatter_add_(1, index[:, None], -mine.to(softmax.dtype)[:, None])
        grad_logits.mul_(grad[:, None])
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Mean cross-entropy in fp32 of a DTensor of logits sharded over the vocabulary (its last dim), without
    gathering them; targets equal to `ignore_index` are not predicted."""
    from torch.distributed.tensor import Shard

    mesh, placement = logits.device_mesh, logits.placements[0]
    if not (isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)):
        raise ValueError(f"vocab_parallel_cross_entropy needs logits sharded on the vocabulary, got {placement}")
    local = logits.to_local().float()
    local, targets = local.flatten(0, -2), targets.flatten()
    start = mesh.get_local_rank() * local.shape[-1]
    keep = targets != ignore_index
    losses = _VocabParallelCrossEntropy.apply(local, targets.where(keep, 0), start, mesh.get_group())
    return (losses * keep).sum() / keep.sum().clamp(min=1)


def vocab_parallel_loss(model: nn.Module, batch: torch.Tensor, autocast_dtype: torch.dtype | None,
                        pad_id: int | None = None) -> torch.Tensor:
    """kiln.eval.next_token_loss for a tensor-parallel model: the same mean loss, from vocabulary shards."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with sharded_logits(), torch.autocast(batch.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(inputs)
    return vocab_parallel_cross_entropy(logits, targets, -100 if pad_id is None else pad_id)
