"""A verified checkpoint as a model: what eval, generate, the perplexity gate and export's checks load."""

from __future__ import annotations

from pathlib import Path

from kiln.checkpoint.folder import checkpoint_config
from kiln.checkpoint.read import load_checkpoint
from kiln.model.build import build_model
from kiln.tokenizer import eos_id, load_tokenizer


def load_model(folder: Path):
    """(model in eval mode on the CPU, tokenizer, run config) of a verified checkpoint folder."""
    weights = load_checkpoint(folder)["model"]  # verified first: every file read below is one its manifest lists
    cfg = checkpoint_config(folder)
    tok = load_tokenizer(folder)  # the checkpoint's tokenizer.json, a file its manifest lists (kiln.tokenizer)
    # The embedding's rows, not the tokenizer's size: the model may pad its vocabulary. EOS separates the
    # documents model.document_masking keeps apart.
    eos = eos_id(tok, cfg.tokenizer.eos_token) if cfg.model.document_masking else None
    model = build_model(cfg.model, weights["tok_embeddings.weight"].shape[0], cfg.pack.seq_len, eos)
    model.load_state_dict(weights)
    return model.eval(), tok, cfg
