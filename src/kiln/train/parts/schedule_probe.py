"""What the LR schedule measures each step (train/schedule.py's contract): the per-block gradient norms before
clipping while a warmup calibrator measures, and the parameter norm the breathing schedule's noise needs."""

from __future__ import annotations

from typing import Any

import torch

from kiln.train.parallel import full_value, group_norms
from kiln.train.schedule import Schedule


class ScheduleProbe:
    """Called by the engine around the update; feeds `schedule.observe_step` once per optimizer step."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.layer_norms: list[float] | None = None

    def before_clip(self, engine) -> None:
        self.layer_norms = None
        if self.schedule.wants_layer_norms():  # the calibrator measures the raw spread
            blocks = {str(i): list(b.parameters()) for i, b in enumerate(engine.model.layers)}
            self.layer_norms = [float(n) for n in group_norms(blocks).values()]

    def after_step(self, engine, step: int, grad_norm: float, out: dict[str, Any]) -> None:
        if self.schedule.measures_noise:  # the breathing schedule's gradient noise is grad_norm / param_norm
            params = [p.detach() for p in engine.model.parameters()]
            out["param_norm"] = float(full_value(torch.nn.utils.get_total_norm(params)))
        self.schedule.observe_step(step, grad_norm, out.get("param_norm", 0.0), self.layer_norms)
