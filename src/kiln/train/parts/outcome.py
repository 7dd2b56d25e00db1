"""What one optimizer step did, as the parts' post_step hooks see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    """One optimizer step's numbers, as the post_step hooks see them."""

    step: int  # the step just taken (1-based)
    lr: float
    dt: float  # wall seconds of the whole step
    tokens: int  # tokens in the global batch
    tokens_seen: int  # tokens trained on so far, this step's included
    measured: dict[str, Any]  # Engine.train_step's (loss, flags, timings, MoE numbers), and time_data_s
    result: dict[str, Any]  # Engine.optimizer_step's (grad norms, skip_reason, update_to_weight, time_optim_s)
