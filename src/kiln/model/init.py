"""Initial weights that do not depend on how the model is split: every value is a pure function of (seed, the
parameter's name, its place in the whole tensor).

The rule (llama.py's docstring gives the distributions): a parameter of the whole model, of shape
(rows, ...), is drawn in chunks of `rows_per_chunk` consecutive rows (at most CHUNK elements each); chunk c
of parameter `name` comes from its own generator, seeded with the first 8 bytes of
sha256(f"{seed}/{name}/{c}"). So a rank that holds any box of the parameter (an FSDP2 shard of rows, a
tensor-parallel slice of columns, a share of the experts, a pipeline stage's whole layers) draws only the
chunks that cross its box and keeps its part: the weights gathered afterwards are bitwise the same for one
process and every layout, and no rank ever draws more than its box plus one chunk (16 MiB of fp32).

Names are the plain model's (`layers.3.attention.wo.weight`); wrappers' parts (`_checkpoint_wrapped_module`,
`_orig_mod`) are not in them. Nothing here knows how the model was split: the caller says where each box lies.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

CHUNK = 1 << 22  # elements drawn at a time

_RESIDUAL = ("wo.weight", "w2.weight", "experts.w2")  # write into the residual stream: scaled by 1/sqrt(2·layers)


def param_std(name: str, config) -> float | None:
    """The standard deviation parameter `name` is drawn with (None: a norm weight, which starts at 1)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(_RESIDUAL):
        return config.init_std / math.sqrt(2 * config.n_layers)
    return config.init_std


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rows_per_chunk(shape: tuple[int, ...]) -> int:
    return max(1, CHUNK // max(1, math.prod(shape[1:])))


@torch.no_grad()
def fill_box(out: torch.Tensor, name: str, shape: tuple[int, ...], offsets: tuple[int, ...], config,
             seed: int) -> None:
    """Write into `out` the initial values of the box of parameter `name` (whole shape `shape`) that starts at
    `offsets`; out.shape is the box's shape."""
    std = param_std(name, config)
    if std is None:
        out.fill_(1.0)
        return
    if out.numel() == 0:
        return
    rows = rows_per_chunk(shape)
    lo, hi = offsets[0], offsets[0] + out.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], out.shape[1:]))
    for c in range(lo // rows, (hi + rows - 1) // rows):
        start, stop = c * rows, min((c + 1) * rows, shape[0])
        g = torch.Generator().manual_seed(chunk_seed(seed, name, c))
        values = torch.empty((stop - start, *shape[1:])).normal_(0.0, std, generator=g)
        a, b = max(lo, start), min(hi, stop)
        out[a - lo:b - lo].copy_(values[(slice(a - start, b - start), *inner)])


def init_whole(model: nn.Module, seed: int) -> None:
    """Every parameter of an unsplit model (llama.Llama), whole, by the rule above."""
    for name, p in model.named_parameters():
        fill_box(p.data, name, tuple(p.shape), (0,) * p.ndim, model.config, seed)

