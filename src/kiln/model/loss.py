"""The training loss: next-token cross-entropy in fp32, in chunks of rows (the trainer's loss and eval's), and its
sum over batches (validation and `kiln eval`)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F


def chunk_rows_for(device: torch.device) -> int:
    """Rows per piece of the fp32 cross-entropy: 128 keep a CPU's chunk in cache; on a GPU small chunks only
    add kernels (hundreds per micro-batch), so chunks of 4,096 rows bound the fp32 upcast (4,096 x vocab x 4
    bytes) with a handful of kernels. A GPU run confirms the choice against one piece."""
    return 4096 if device.type == "cuda" else 128


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor, autocast_dtype: torch.dtype | None,
                    pad_id: int | None = None, chunk_rows: int | None | str = "auto") -> torch.Tensor:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1], computed in fp32.

    Targets equal to `pad_id` (best-fit packing's filler) are not predicted. The pad token is a
    special token that text cannot produce, so masking it never hides real data.
    `chunk_rows="auto"` takes chunk_rows_for(the batch's device); `chunk_rows=None` computes it in one
    piece, for torch.compile: inductor fuses the upcast and
    log-softmax itself, and chunks only cut its graph smaller (within ±1% here, BENCHMARKS.md).
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast(batch.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(inputs)
    rows = chunk_rows_for(batch.device) if chunk_rows == "auto" else chunk_rows
    return chunked_cross_entropy(logits.flatten(0, 1), targets.flatten(), -100 if pad_id is None else pad_id,
                                 rows or len(targets.flatten()))


def chunked_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, rows: int = 128
) -> torch.Tensor:
    """Mean cross-entropy in fp32, `rows` positions at a time.

    The fp32 copy of a whole batch's logits is the largest tensor of a small model's step; in
    chunks it stays in cache (measured: +8% tokens/s in fp32 on a 2-core CPU, BENCHMARKS.md).
    """
    # split, not slicing: split's backward concatenates the chunks' gradients once, where each
    # slice's backward would scatter into a zeroed tensor of the full size.
    losses = [F.cross_entropy(chunk.float(), t, ignore_index=ignore_index, reduction="sum")
              for chunk, t in zip(logits.split(rows), targets.split(rows))]
    return torch.stack(losses).sum() / (targets != ignore_index).sum().clamp(min=1)


@torch.no_grad()
def summed_loss(model: torch.nn.Module, batches: Iterable[torch.Tensor], device: torch.device,
                autocast_dtype: torch.dtype | None = None, pad_id: int | None = None) -> tuple[float, int]:
    """(sum of token losses, number of predicted tokens) over `batches`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        batch = batch.to(device)
        n = int((batch[:, 1:] != pad_id).sum()) if pad_id is not None else batch[:, 1:].numel()
        if n:
            total += float(next_token_loss(model, batch, autocast_dtype, pad_id)) * n
        count += n
    model.train(was_training)
    return total, count
