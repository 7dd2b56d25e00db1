"""Causal self-attention, and attention that stays inside its document (`model.document_masking`).

Kiln packs documents back to back, each followed by EOS, into fixed-length samples. With document masking a
token attends only to the tokens of its own document (block-causal attention, as Llama 3 trained). The
documents are read from the tokens themselves, so nothing else has to travel with a batch: the EOS *opens*
the next document, as it does at generation time (a prompt starts after EOS). The document of position t is
the number of EOS tokens at positions <= t, and a document's tokens are [EOS, text...]: every prediction of
a document's text, its first token included, sees that document alone, which is exactly what the model sees
when the document is run by itself after an EOS. (torchtitan and OLMo-core count the EOS with the document
it ends instead; then a document's first token is still predicted from the previous one.) A sample's first
document (the tail of one cut by the sample boundary) starts at position 0 without an EOS.

With `model.document_positions` the RoPE positions restart at 0 at each document's EOS. Attention scores
depend only on position differences, so this changes the numbers by rounding only inside a document; what
it changes is which rotary angles a long sample's later documents use (those of short positions, which the
model has seen most).

Two kernels, the same mask:
- "flex": torch.nn.attention.flex_attention with a BlockMask (blocks outside every document are skipped; the
  work shrinks with the documents). Compiled (`torch.compile(flex_attention)`), which is how it runs fast; its
  eager form is a slow reference. The BlockMask is built once per forward and shared by the layers.
- "sdpa": scaled_dot_product_attention with a (batch, 1, seq, seq) boolean mask: exact, runs everywhere,
  costs the full seq x seq work and batch·seq² bytes of mask.
`model.document_attention: auto` takes flex on CUDA and masked SDPA elsewhere: torch 2.13 runs flex_attention
on a CPU only compiled and only forward (no backward: NotImplementedError), so a CPU trains with the masked
SDPA (the trainer refuses flex there in one line).

Pure math: nothing but torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) -> each position's document number in its row: the count of EOS tokens up to it."""
    return (tokens == eos_id).cumsum(1)


def document_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) -> each position's distance from its document's start (its EOS, or the row's start)."""
    t = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.where(tokens == eos_id, t, torch.zeros_like(t)).cummax(1).values
    return t - starts


def kernel_for(choice: str, device: torch.device) -> str:
    """The document-masking kernel `model.document_attention` stands for on `device` (rules: module docstring)."""
    if choice != "auto":
        return choice
    return "flex" if device.type == "cuda" else "sdpa"


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@dataclass
class DocumentMask:
    """What each layer's attention needs to stay inside documents, built once per forward from the tokens."""

    kernel: str  # "flex" or "sdpa"
    dense: torch.Tensor | None = None  # sdpa: (batch, 1, seq, seq) bool, True where a query may attend a key
    block: object = None  # flex: a BlockMask

    @classmethod
    def of(cls, tokens: torch.Tensor, eos_id: int, kernel: str) -> "DocumentMask":
        docs = document_ids(tokens, eos_id)
        if kernel == "sdpa":
            t = tokens.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
            return cls(kernel, dense=(causal & (docs[:, :, None] == docs[:, None, :]))[:, None])
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(b, h, q, k):
            return (k <= q) & (docs[b, q] == docs[b, k])

        b, t = tokens.shape
        # Compiled itself outside a compiled model: its eager form evaluates the mask for every (q, k) pair.
        make = create_block_mask if torch.compiler.is_compiling() else _compiled_block_mask()
        return cls(kernel, block=make(same_document, b, None, t, t, device=tokens.device))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None) -> torch.Tensor:
    """Causal attention of q (batch, heads, seq, head_dim) over k, v (batch, kv_heads, seq, head_dim), inside
    documents when `mask` is given."""
    gqa = k.shape[1] != q.shape[1]
    if mask is not None and mask.kernel == "flex":
        return _compiled_flex()(q, k, v, block_mask=mask.block, enable_gqa=gqa)
    if gqa and q.dtype not in (torch.bfloat16, torch.float16):
        # Flash attention serves enable_gqa only in half precision; in fp32 SDPA would fall back to the
        # math kernel (O(seq^2) memory). Repeating the k/v heads keeps the efficient kernels; a GPU run
        # confirms which kernel SDPA picks.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=gqa)
