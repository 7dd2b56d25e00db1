"""A model from its config: the one place that turns the `model:` section into modules.

Everything that builds a Llama (trainer, eval, generate, doctor, plan, export, import) calls
build_model, so a new model feature is a key in model/config.py read by the module that uses it.
"""

from __future__ import annotations

from kiln.model.config import ModelConfig
from kiln.model.llama import Llama


def build_model(config: ModelConfig, vocab_size: int, max_seq_len: int, eos_id: int | None = None) -> Llama:
    """A freshly initialised Llama on the CPU (the caller seeds torch and moves it).

    vocab_size: the embedding's rows (the shards manifest's vocab_size, or a checkpoint's embedding rows, which
    may be padded); max_seq_len: the longest sequence it will see (pack.seq_len): the RoPE tables' length;
    eos_id: the token between documents (the shards manifest's eos_id), which model.document_masking reads."""
    return Llama(config, vocab_size=vocab_size, max_seq_len=max_seq_len, eos_id=eos_id)
