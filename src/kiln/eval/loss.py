"""A checkpoint's loss, perplexity and bits per byte on the run's validation shards, or on a UTF-8 text file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kiln.checkpoint.model import load_model
from kiln.errors import KilnError
from kiln.model.loss import summed_loss
from kiln.scoring.losses import loss_report, sample_batches, text_windows, token_byte_lengths
from kiln.shards.reader import ShardSet
from kiln.tokenizer import eos_id, tokenizer_sha256


def evaluate_checkpoint(folder: Path, text_file: Path | None = None, max_samples: int | None = None) -> dict:
    """Loss, perplexity and bits per byte of a checkpoint on the run's validation shards, or on a UTF-8 text file
    (read as one document: after an EOS, as in training, and as the exported tokenizer encodes it by default).

    Bits per byte (the summed loss in bits over the UTF-8 bytes of the predicted text) compares runs with
    different tokenizers; on shards the bytes are those of the predicted tokens."""
    model, tok, cfg = load_model(folder)
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
        return loss_report(total, count, len(text.encode("utf-8")))
    shards = cfg.layout.shards
    samples = ShardSet(shards, "val", tokenizer_sha256=tokenizer_sha256(folder))
    if len(samples) == 0:
        raise KilnError(f"{shards}: the validation split has no samples; raise pack.val_fraction")
    n = len(samples) if max_samples is None else min(max_samples, len(samples))
    total, count = summed_loss(model, sample_batches(samples, np.arange(n), 8), device,
                               pad_id=samples.manifest.get("pad_id"))
    widths = token_byte_lengths(tok)
    text_bytes = sum(int(widths[samples.sample(i)[1:].astype(np.int64)].sum()) for i in range(n))
    return loss_report(total, count, text_bytes)
