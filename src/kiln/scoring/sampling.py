"""Sample text from a model: greedy (temperature 0) or temperature with optional top-k, seeded.

The prompt is preceded by <|eos|>: in the packed training stream every document follows an
EOS, so that is what "the start of a document" looks like to the model. Sampling stops at
the next <|eos|> (not included) or after `max_new_tokens`; the model sees at most its last
`max_seq_len` tokens (no KV cache: each new token re-reads the window, which is fine at the
sizes Kiln trains on a laptop and keeps this code obviously correct).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import KilnError


@dataclass
class Generation:
    prompt: str
    text: str  # the continuation only
    token_ids: list[int]  # the continuation's ids (without the stopping EOS)
    stop: str  # "eos" or "max_new_tokens"


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise KilnError(f"--max-new-tokens must be 0 or more, got {max_new_tokens}")
    if not temperature >= 0:
        raise KilnError(f"--temperature must be 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 1:
        raise KilnError(f"--top-k must be 1 or more (or left out for the whole vocabulary), got {top_k}")


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """One token id from the last position's logits (1-D, over the vocabulary)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def sample_ids(model: torch.nn.Module, context: list[int], max_new_tokens: int, temperature: float = 1.0,
               top_k: int | None = None, seed: int = 0, eos: int | None = None,
               vocab_size: int | None = None) -> tuple[list[int], str]:
    """New token ids after `context` and why sampling stopped ("eos" or "max_new_tokens").

    Ids from `vocab_size` up (rows a padded embedding has beyond the tokenizer) are never chosen.
    """
    check_sampling(max_new_tokens, temperature, top_k)
    if not context:
        raise KilnError("generation needs at least one context token")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    window = model.max_seq_len
    was_training = model.training
    model.eval()
    ids, new = list(context), []
    stop = "max_new_tokens"
    try:
        for _ in range(max_new_tokens):
            tokens = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
            token = next_token(model(tokens)[0, -1, :vocab_size], temperature, top_k, generator)
            if token == eos:
                stop = "eos"
                break
            ids.append(token)
            new.append(token)
    finally:
        model.train(was_training)
    return new, stop


def check_prompt(prompt: str) -> None:
    """A prompt is text: bytes that are not UTF-8 (which Python hands over as lone surrogates) are refused."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(prompt[exc.start])
        what = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"lone surrogate U+{code:04X}"
        raise KilnError(f"--prompt is not valid UTF-8 ({what} at character {exc.start}); pass the prompt as "
                        "UTF-8 text (e.g. convert it with iconv -t UTF-8)") from None


def generate(model: torch.nn.Module, tokenizer, prompt: str, max_new_tokens: int = 100, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, eos_token: str | None = None) -> Generation:
    """Continue `prompt` with `model`; the same seed gives the same text. `eos_token`: default Kiln's <|eos|>."""
    from kiln.tokenizer import EOS, eos_id

    check_prompt(prompt)
    eos = eos_id(tokenizer, eos_token or EOS)
    context = [eos] + tokenizer.encode(prompt, add_special_tokens=False).ids
    new, stop = sample_ids(model, context, max_new_tokens, temperature, top_k, seed, eos, tokenizer.get_vocab_size())
    return Generation(prompt, tokenizer.decode(new, skip_special_tokens=False), new, stop)
