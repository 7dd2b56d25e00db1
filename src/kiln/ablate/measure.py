"""One run of an ablation measured, per eval unit, on its final checkpoint (what the statistics resample).

- Text sets: each document's summed loss in bits. Its tokens follow an <|eos|> as in training and are cut into
  windows of pack.seq_len + 1 tokens sharing one token with the next (`kiln.eval.text_windows`), so every token
  is predicted once; bits per byte of a set is the sum over its documents of bits over the sum of their UTF-8
  bytes (tokenizer-independent; every arm shares the tokenizer anyway).
- Tasks: for every question, whether lm-eval's `acc`, `acc_norm` and `acc_bytes` pick the right choice
  (kiln.scoring.mc).
- The final validation loss, as the training loop measured it at its last step (the checkpoint's history).

Everything runs on the CPU in fp32 (or the first GPU when there is one). A window's bits depend on the width
it is padded to (so windows are not sorted by length), and that width is fixed: the widest window of its group
of 16 consecutive windows (GROUP); each group's forwards take ROWS of its windows at a time (4 on a CPU: the
logits stay in cache, half the CPU time of 16, BENCHMARKS.md; bitwise the same bits, as
tests/test_ablate_measure.py checks). The eval texts' token windows are the same for every run that shares
the tokenizer (every run of an ablation or a mix): they are made once per process (`_WINDOWS`, keyed by the
tokenizer's sha256 and the set's kept documents). Memory: the model, and the token windows of the few most
recent (tokenizer, eval set) pairs (an eval set is a benchmark's size, held whole by kiln.ablate.evalsets).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.checkpoint.model import load_model
from kiln.scoring.losses import row_losses, text_windows
from kiln.tokenizer import EOS, eos_id, tokenizer_sha256

GROUP = 16  # windows padded to one width: each window's bits depend on it, so it never changes
ROWS = {"cpu": 4, "cuda": GROUP}  # windows per forward (a divisor of GROUP)
_WINDOWS: dict[tuple, list[tuple[int, list[int]]]] = {}  # (tokenizer sha256, eos, seq_len, set digest) -> windows
KEEP_WINDOWS = 8  # (tokenizer, set) pairs held


def document_windows(tok, eos: int, texts: list[str], seq_len: int) -> list[tuple[int, list[int]]]:
    """(document index, token ids) of every window: a document's tokens after an <|eos|>, cut by text_windows."""
    windows: list[tuple[int, list[int]]] = []
    for k, text in enumerate(texts):
        ids = [eos] + tok.encode(text, add_special_tokens=False).ids
        windows += [(k, w[0].tolist()) for w in text_windows(ids, seq_len + 1)]
    return windows


def cached_windows(key: tuple, make) -> list[tuple[int, list[int]]]:
    if key not in _WINDOWS:
        while len(_WINDOWS) >= KEEP_WINDOWS:
            _WINDOWS.pop(next(iter(_WINDOWS)))
        _WINDOWS[key] = make()
    return _WINDOWS[key]


@torch.no_grad()
def document_bits(model, windows: list[tuple[int, list[int]]], documents: int, device: torch.device) -> np.ndarray:
    """Each document's summed next-token loss in bits (its first token predicted from <|eos|>), summed over its
    windows in order."""
    bits = np.zeros(documents)
    rows = ROWS.get(device.type, GROUP)
    for start in range(0, len(windows), GROUP):
        group = windows[start:start + GROUP]
        width = max(len(w) for _, w in group)
        for first in range(0, len(group), rows):
            chunk = group[first:first + rows]
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, (_, w) in enumerate(chunk):
                batch[i, :len(w)] = torch.tensor(w)
            lengths = torch.tensor([len(w) for _, w in chunk])
            nats = row_losses(model, batch.to(device), lengths.to(device)).double().cpu().numpy()
            np.add.at(bits, [k for k, _ in chunk], nats / math.log(2))
    return bits


def task_hits(model, tok, questions: list, seq_len: int, device: torch.device, eos_token: str) -> dict[str, list]:
    """Per question, 1.0 when the metric picks the right choice: {"acc": [...], "acc_norm": [...], ...}
    (kiln.scoring.mc.question_results, lm-eval's definitions)."""
    from kiln.scoring.mc import METRICS, question_results

    results = question_results(model, tok, questions, seq_len, device, eos_token=eos_token)
    return {metric: [float(r.correct(metric)) for r in results] for metric in METRICS}


def measure_checkpoint(checkpoint: Path, sets: list, keep: dict[str, list[int]]) -> dict[str, Any]:
    """{"text": {set: {"bits": [...]}}, "tasks": {task: {metric: [...]}}} over the kept units of each set."""
    model, tok, cfg = load_model(checkpoint)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    eos = eos_id(tok, cfg.tokenizer.eos_token or EOS)
    sha = tokenizer_sha256(checkpoint)
    out: dict[str, Any] = {"text": {}, "tasks": {}}
    for s in sets:
        if s.kind == "text":
            texts = [s.texts[i] for i in keep[s.name]]
            windows = cached_windows((sha, eos, cfg.pack.seq_len, s.digest(keep[s.name])),
                                     lambda: document_windows(tok, eos, texts, cfg.pack.seq_len))
            out["text"][s.name] = {"bits": document_bits(model, windows, len(texts), device).tolist()}
        else:
            out["tasks"][s.name] = task_hits(model, tok, [s.questions[i] for i in keep[s.name]], cfg.pack.seq_len,
                                             device, cfg.tokenizer.eos_token)
    return out
