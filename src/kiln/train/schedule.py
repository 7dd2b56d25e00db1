"""Learning-rate schedules: a function from the optimizer step (1-based) to a learning rate."""

from __future__ import annotations

import math


def warmup_cosine(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from peak/warmup to peak over `warmup` steps, then cosine to min_ratio·peak at `total`."""
    if warmup and step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
