"""`kiln generate`: a verified checkpoint folder (weights, config.yaml, tokenizer.json) loaded on the CPU, continuing a
prompt (the sampling is kiln.scoring.sampling)."""

from __future__ import annotations

from pathlib import Path

from kiln.checkpoint.model import load_model
from kiln.scoring.sampling import Generation, check_prompt, check_sampling, generate


def generate_from_checkpoint(folder: str | Path, prompt: str, max_new_tokens: int = 100, temperature: float = 1.0,
                             top_k: int | None = None, seed: int = 0) -> Generation:
    """Load a verified checkpoint folder (weights, config.yaml, tokenizer.json) on the CPU and continue `prompt`."""
    check_sampling(max_new_tokens, temperature, top_k)  # before the (slow) load
    check_prompt(prompt)
    model, tok, cfg = load_model(Path(folder))
    return generate(model, tok, prompt, max_new_tokens, temperature, top_k, seed, cfg.tokenizer.eos_token)
