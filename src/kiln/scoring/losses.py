"""Losses of a model in memory, on batches of samples or windows of one text, and bits per byte: what validation
during training, the perplexity gate, `kiln eval` and `kiln ablate` share (the summed loss itself is
model/loss.py's)."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import KilnError


@torch.no_grad()
def row_losses(model: torch.nn.Module, batch: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss (nats, fp32) of each row of `batch`, whose first `lengths[i]` tokens are real:
    the right padding after them is never predicted, and causal attention keeps it out of the real positions."""
    targets = batch[:, 1:].clone()
    targets[torch.arange(targets.shape[1])[None, :] >= (lengths[:, None] - 1)] = -100
    logits = model(batch[:, :-1])
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="none")
    return losses.view(targets.shape).sum(1)


def sample_batches(samples, indices: np.ndarray, batch: int) -> Iterable[torch.Tensor]:
    for i in range(0, len(indices), batch):
        rows = np.stack([samples.sample(int(j)) for j in indices[i: i + batch]]).astype(np.int64)
        yield torch.from_numpy(rows)


def text_windows(token_ids: list[int], sample_len: int) -> Iterable[torch.Tensor]:
    """Windows of `sample_len` tokens sharing one token with the next, so every token but the first is
    predicted once."""
    if len(token_ids) < 2:
        raise KilnError("the text encodes to fewer than 2 tokens; nothing to evaluate")
    for i in range(0, len(token_ids) - 1, sample_len - 1):
        yield torch.tensor([token_ids[i: i + sample_len]], dtype=torch.int64)


def loss_report(total: float, count: int, text_bytes: int | None = None) -> dict:
    loss = total / max(count, 1)
    out = {"loss": round(loss, 6), "perplexity": round(math.exp(min(loss, 50)), 4), "tokens": count}
    if text_bytes:
        out["bits_per_byte"] = round(total / math.log(2) / text_bytes, 6)
    return out


def token_byte_lengths(tok) -> np.ndarray:
    """Bytes of text each token id stands for: byte-level BPE maps one byte to one character of the token's
    string, so it is the string's length; an added domain term is stored as plain text (its UTF-8 length);
    special tokens (EOS between documents) stand for no text."""
    added = tok.get_added_tokens_decoder()

    def width(i: int) -> int:
        if i in added:
            return 0 if added[i].special else len(added[i].content.encode("utf-8"))
        return len(tok.id_to_token(i) or "")

    return np.array([width(i) for i in range(tok.get_vocab_size())], dtype=np.int64)
