"""A model from its config: the one place that turns the `model:` section into modules.

Everything that builds a Llama (trainer, eval, generate, doctor, plan, export, import) calls
build_model, so a new model feature is a key in model/config.py read by the module that uses it.
"""

from __future__ import annotations

import torch

from kiln.model.config import ModelConfig
from kiln.model.llama import Llama


def build_model(config: ModelConfig, vocab_size: int, max_seq_len: int, eos_id: int | None = None,
                device: str | torch.device | None = None) -> Llama:
    """A freshly initialised Llama on the CPU (the caller seeds torch and moves it); its weights by
    model/init.py's rule from torch's seed.

    device="meta": shapes only, no storage and no initial values (training builds this way: the trainer splits
    the model, gives each rank storage for its part with `to_empty` and draws that part by the same rule,
    train/parallel/materialize.py).

    vocab_size: the embedding's rows (the shards manifest's vocab_size, or a checkpoint's embedding rows, which
    may be padded); max_seq_len: the longest sequence it will see (pack.seq_len): the RoPE tables' length;
    eos_id: the token between documents (the shards manifest's eos_id), which model.document_masking reads."""
    if device is None:
        return Llama(config, vocab_size=vocab_size, max_seq_len=max_seq_len, eos_id=eos_id)
    with torch.device(device):
        return Llama(config, vocab_size=vocab_size, max_seq_len=max_seq_len, eos_id=eos_id)
