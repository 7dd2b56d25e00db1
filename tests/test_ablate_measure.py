"""kiln.ablate.measure: a run's per-document bits, measured in pieces of ROWS windows, are bitwise those of one
forward per group of GROUP windows (the measurement every eval.json of MEASURE_VERSION 1 holds), and the eval
texts' windows are made once per tokenizer."""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.ablate import measure
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.scoring.losses import row_losses, text_windows

SEQ = 128


def whole_groups(model, windows, documents: int) -> np.ndarray:
    """The reference: one forward of each group of GROUP consecutive windows, padded to its widest."""
    bits = np.zeros(documents)
    for start in range(0, len(windows), measure.GROUP):
        chunk = windows[start:start + measure.GROUP]
        batch = torch.zeros(len(chunk), max(len(w) for _, w in chunk), dtype=torch.long)
        for i, (_, w) in enumerate(chunk):
            batch[i, :len(w)] = torch.tensor(w)
        with torch.no_grad():
            nats = row_losses(model, batch, torch.tensor([len(w) for _, w in chunk])).double().numpy()
        np.add.at(bits, [k for k, _ in chunk], nats / math.log(2))
    return bits


def test_bits_in_pieces_are_bitwise_those_of_whole_groups():
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2), 512, SEQ).eval()
    rng = np.random.default_rng(0)
    # long documents (several full windows and a partial one), then a run of short ones: a group of 16 with
    # no full window, padded narrower than the others
    lengths = [int(n) for n in rng.integers(150, 500, 12)] + [int(n) for n in rng.integers(3, 100, 20)]
    windows = []
    for k, n in enumerate(lengths):
        ids = [0] + rng.integers(1, 512, n).tolist()
        windows += [(k, w[0].tolist()) for w in text_windows(ids, SEQ + 1)]
    assert measure.ROWS["cpu"] < measure.GROUP and measure.GROUP % measure.ROWS["cpu"] == 0
    got = measure.document_bits(model, windows, len(lengths), torch.device("cpu"))
    want = whole_groups(model, windows, len(lengths))
    assert got.tobytes() == want.tobytes()
    assert (got > 0).all()


def test_eval_windows_are_made_once_per_tokenizer_and_set(monkeypatch):
    monkeypatch.setattr(measure, "_WINDOWS", {})
    made = []

    def make(tag):
        return lambda: made.append(tag) or [(0, [tag])]

    assert measure.cached_windows(("sha-a", 0, SEQ, "set"), make(1)) == [(0, [1])]
    assert measure.cached_windows(("sha-a", 0, SEQ, "set"), make(2)) == [(0, [1])]  # the same run's windows
    assert measure.cached_windows(("sha-b", 0, SEQ, "set"), make(3)) == [(0, [3])]  # another tokenizer: made anew
    for i in range(measure.KEEP_WINDOWS):
        measure.cached_windows(("sha-c", 0, SEQ, str(i)), make(4))
    assert len(measure._WINDOWS) == measure.KEEP_WINDOWS and ("sha-a", 0, SEQ, "set") not in measure._WINDOWS
    assert made == [1, 3] + [4] * measure.KEEP_WINDOWS
