"""A learned quality gate: a small Kiln model scores each document's bits per byte (CCNet, Wenzek et al. 2020).

CCNet trains a language model on a reference corpus (Wikipedia) and keeps the web pages that model finds
likely; Kiln does the same with a checkpoint the user trained with `kiln train` on their reference text:

    data.quality.perplexity: {checkpoint: ref/run/checkpoints/step-00002000, max_bits_per_byte: 1.6}

A document's bits per byte is the summed next-token loss of its text (the first `max_chars` characters,
tokenized with the checkpoint's own tokenizer.json, after an EOS as in packed training samples), in nats,
divided by ln 2 and by the text's UTF-8 bytes: independent of the tokenizer, so thresholds carry across
models. Kept records carry it as `perplexity_bpb`; documents above `max_bits_per_byte` are rejected with
reason `quality/perplexity_above_max` and `signals.bits_per_byte`. Without `max_bits_per_byte` every
document is kept and scored.

Batched on the data workers: `score_perplexity` holds a task's documents until their windows of the model's
context (`pack.seq_len` tokens) fill `batch_size` rows, then scores them in one forward pass on the CPU.
Memory: the model (loaded once per worker process, at the first batch) plus one batch: `batch_size` rows
of logits (`batch_size x seq_len x vocab` fp32) and the held documents (`max_chars` each at most).

torch is imported only inside this module's functions, when the gate is configured: `kiln data` without it
never loads torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.data.document import Document
from kiln.errors import ConfigError, IntegrityError, KilnError
from kiln.run_layout import checkpoints_of

FIELD = "perplexity_bpb"
REASON = "perplexity_above_max"
_SCORERS: dict[str, Scorer] = {}  # one model per worker process, not per task


def checkpoint_folder(path: str) -> Path:
    """A checkpoint folder (`step-NNNNNNNN`), or the newest valid one of a run folder or its checkpoints/."""
    from kiln.checkpoint import latest_valid

    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    for root in (checkpoints_of(p), p):
        found = latest_valid(root, log=lambda *_: None)
        if found is not None:
            return found
    raise ConfigError(f"data.quality.perplexity.checkpoint {path}: no Kiln checkpoint there; give a checkpoint "
                      "folder (run/checkpoints/step-NNNNNNNN) or a run folder that holds valid checkpoints")


class Scorer:
    """The checkpoint's model and tokenizer on the CPU, in eval mode."""

    def __init__(self, path: str) -> None:
        from kiln.checkpoint.model import load_model
        from kiln.tokenizer import eos_id

        folder = checkpoint_folder(path)
        try:
            self.model, self.tok, cfg = load_model(folder)
        except (IntegrityError, KilnError) as exc:
            raise ConfigError(f"data.quality.perplexity.checkpoint {path}: {exc}") from None
        self.window = cfg.pack.seq_len + 1  # as in training: seq_len inputs, seq_len predictions
        self.eos = eos_id(self.tok)

    def windows(self, text: str) -> list[list[int]]:
        from kiln.scoring.losses import text_windows

        ids = [self.eos] + self.tok.encode(text, add_special_tokens=False).ids
        return [w[0].tolist() for w in text_windows(ids, self.window)]

    def bits_per_byte(self, texts: list[str], batch_size: int) -> list[float]:
        """Each text's summed loss in bits over its UTF-8 bytes; the texts' windows go `batch_size` rows a pass."""
        import torch

        from kiln.scoring.losses import row_losses

        rows, owner = [], []
        for i, text in enumerate(texts):
            for w in self.windows(text):
                rows.append(w)
                owner.append(i)
        nats = [0.0] * len(texts)
        for start in range(0, len(rows), batch_size):
            chunk = rows[start: start + batch_size]
            width = max(len(r) for r in chunk)
            batch = torch.full((len(chunk), width), self.eos, dtype=torch.int64)
            for j, r in enumerate(chunk):
                batch[j, : len(r)] = torch.tensor(r)
            lengths = torch.tensor([len(r) for r in chunk])
            for j, loss in enumerate(row_losses(self.model, batch, lengths).tolist()):
                nats[owner[start + j]] += loss
        return [n / math.log(2) / max(len(t.encode("utf-8")), 1) for n, t in zip(nats, texts)]


def scorer(path: str) -> Scorer:
    if path not in _SCORERS:
        _SCORERS[path] = Scorer(path)
    return _SCORERS[path]


def check(cfg) -> None:
    """Before any work: the checkpoint resolves, verifies and loads (in the driver; workers load it again)."""
    if cfg.checkpoint is None:
        raise ConfigError("data.quality.perplexity.checkpoint is not set; give the checkpoint folder of a model "
                          "trained on your reference corpus (or drop data.quality.perplexity.max_bits_per_byte)")
    scorer(cfg.checkpoint)


def score_perplexity(docs: Iterator[Document], cfg) -> Iterator[Document]:
    """Score the surviving documents in batches, keeping the order; rejected ones pass through."""
    held: list[Document] = []
    rows = 0
    for doc in docs:
        held.append(doc)
        if doc.rejection is None:
            # an estimate before tokenizing: one window per seq_len tokens, ~4 characters a token
            rows += 1 + len(doc.text or "") // 4 // max(scorer(cfg.checkpoint).window - 1, 1)
        if rows >= cfg.batch_size:
            yield from _judge(held, cfg)
            held, rows = [], 0
    yield from _judge(held, cfg)


def _judge(docs: list[Document], cfg) -> list[Document]:
    alive = [d for d in docs if d.rejection is None and d.text]
    if alive:
        scores = scorer(cfg.checkpoint).bits_per_byte([d.text[: cfg.max_chars] for d in alive], cfg.batch_size)
        for doc, bpb in zip(alive, scores):
            bpb = round(bpb, 4)
            doc.scores[FIELD] = bpb
            if cfg.max_bits_per_byte is not None and bpb > cfg.max_bits_per_byte:
                signals: dict[str, Any] = {**doc.scores, "bits_per_byte": bpb, "max": cfg.max_bits_per_byte}
                del signals[FIELD]
                doc.reject("quality", REASON, **signals, **({"edits": dict(doc.edits)} if doc.edits else {}))
    return docs
