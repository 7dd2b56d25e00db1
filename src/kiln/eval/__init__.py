"""Loss and perplexity of a checkpoint, on the validation shards or a text file (`kiln eval`); the summed loss
itself is model/loss.py's, which validation during training uses too."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.model.build import build_model
from kiln.model.loss import summed_loss


@torch.no_grad()
def row_losses(model: torch.nn.Module, batch: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss (nats, fp32) of each row of `batch`, whose first `lengths[i]` tokens are real:
    the right padding after them is never predicted, and causal attention keeps it out of the real positions."""
    targets = batch[:, 1:].clone()
    targets[torch.arange(targets.shape[1])[None, :] >= (lengths[:, None] - 1)] = -100
    logits = model(batch[:, :-1])
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="none")
    return losses.view(targets.shape).sum(1)


def load_eval_model(folder: Path):
    """(model in eval mode on the CPU, tokenizer, run config) of a verified checkpoint folder."""
    from kiln.tokenizer import eos_id, load_tokenizer
    from kiln.train.checkpoint import checkpoint_config, load_checkpoint

    weights = load_checkpoint(folder)["model"]  # verified first: every file read below is one its manifest lists
    cfg = checkpoint_config(folder)
    tok = load_tokenizer(folder)  # the checkpoint's tokenizer.json, a file its manifest lists (kiln.tokenizer)
    # The embedding's rows, not the tokenizer's size: the model may pad its vocabulary. EOS separates the
    # documents model.document_masking keeps apart.
    eos = eos_id(tok, cfg.tokenizer.eos_token) if cfg.model.document_masking else None
    model = build_model(cfg.model, weights["tok_embeddings.weight"].shape[0], cfg.pack.seq_len, eos)
    model.load_state_dict(weights)
    return model.eval(), tok, cfg


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


def report(total: float, count: int, text_bytes: int | None = None) -> dict:
    loss = total / max(count, 1)
    out = {"loss": round(loss, 6), "perplexity": round(math.exp(min(loss, 50)), 4), "tokens": count}
    if text_bytes:
        out["bits_per_byte"] = round(total / math.log(2) / text_bytes, 6)
    return out


def evaluate_checkpoint(folder: Path, text_file: Path | None = None, max_samples: int | None = None) -> dict:
    """Loss, perplexity and bits per byte of a checkpoint on the run's validation shards, or on a UTF-8 text file
    (read as one document: after an EOS, as in training, and as the exported tokenizer encodes it by default).

    Bits per byte (the summed loss in bits over the UTF-8 bytes of the predicted text) compares runs with
    different tokenizers; on shards the bytes are those of the predicted tokens."""
    from kiln.shards.reader import ShardSet
    from kiln.tokenizer import eos_id, tokenizer_sha256

    model, tok, cfg = load_eval_model(folder)
    device = torch.device("cpu")
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise KilnError(f"{text_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise KilnError(f"{text_file}: cannot read ({exc.strerror})") from None
        # As in training, the text follows an EOS, so every token of it is predicted (and counted in its bytes).
        if not text:
            raise KilnError(f"{text_file} is empty; nothing to evaluate")
        ids = [eos_id(tok, cfg.tokenizer.eos_token)] + tok.encode(text, add_special_tokens=False).ids
        total, count = summed_loss(model, text_windows(ids, cfg.pack.seq_len + 1), device)
        return report(total, count, len(text.encode("utf-8")))
    shards = cfg.out / "shards"
    samples = ShardSet(shards, "val", tokenizer_sha256=tokenizer_sha256(folder))
    if len(samples) == 0:
        raise KilnError(f"{shards}: the validation split has no samples; raise pack.val_fraction")
    n = len(samples) if max_samples is None else min(max_samples, len(samples))
    total, count = summed_loss(model, sample_batches(samples, np.arange(n), 8), device,
                               pad_id=samples.manifest.get("pad_id"))
    widths = token_byte_lengths(tok)
    text_bytes = sum(int(widths[samples.sample(i)[1:].astype(np.int64)].sum()) for i in range(n))
    return report(total, count, text_bytes)


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
