"""Guards composed into the loop: skip a bad step, and escalate repeated skips to a rollback.

Every rank sees the same all-reduced loss and gradient norm, so every rank
reaches the same verdict without another collective.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from kiln.config import GuardConfig


class NonFiniteGuard:
    """A NaN/inf loss or gradient norm: the update would poison the weights."""

    def check(self, loss: float, grad_norm: float) -> str | None:
        return None if math.isfinite(loss) and math.isfinite(grad_norm) else "non_finite"


class SpikeGuard:
    """A loss or gradient norm far above the rolling window of accepted steps (z-score)."""

    state_key = "spikes"

    def __init__(self, cfg: GuardConfig) -> None:
        self.zscore, self.grad_zscore, self.min_history = cfg.spike_zscore, cfg.grad_spike_zscore, cfg.spike_min_history
        self.losses: deque[float] = deque(maxlen=cfg.spike_window)
        self.norms: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, loss: float, grad_norm: float) -> str | None:
        checks = (
            ("loss_spike", loss, self.losses, self.zscore),
            ("grad_norm_spike", grad_norm, self.norms, self.grad_zscore),
        )
        for name, value, history, zscore in checks:
            if zscore and len(history) >= self.min_history:
                mean = sum(history) / len(history)
                std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
                if value > mean + zscore * max(std, 1e-3 * abs(mean), 1e-12):
                    return name
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.norms.append(grad_norm)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict) -> None:
        self.losses.extend(state["losses"])
        self.norms.extend(state["norms"])


@dataclass
class Escalation:
    """N skipped steps within a window call for a rollback; M rollbacks stop the run."""

    state_key: ClassVar[str] = "escalation"

    cfg: GuardConfig
    skipped_steps: int = 0
    recent: list[int] = field(default_factory=list)  # steps of recent skips
    rollbacks: int = 0
    lr_factor_until: int = 0  # the lowered learning rate lasts until this step

    def record_skip(self, step: int, escalate: bool = True) -> bool:
        """Count a skip; True when it is time to roll back. fp16 overflows are counted, never escalated."""
        self.skipped_steps += 1
        if not escalate:
            return False
        self.recent = [s for s in self.recent if s > step - self.cfg.rollback_window] + [step]
        return len(self.recent) >= self.cfg.rollback_after

    def first_recent_skip(self) -> int:
        """Where the trouble started: a good checkpoint is one written before this step."""
        return min(self.recent)

    def record_rollback(self, to_step: int) -> bool:
        """Count a rollback to `to_step`; True when the run must stop instead."""
        self.rollbacks += 1
        self.recent = []
        self.lr_factor_until = to_step + self.cfg.rollback_lr_steps
        return self.rollbacks > self.cfg.max_rollbacks

    def lr_factor(self, step: int) -> float:
        return self.cfg.rollback_lr_factor if step <= self.lr_factor_until else 1.0

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "recent": self.recent, "rollbacks": self.rollbacks,
                "lr_factor_until": self.lr_factor_until}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
