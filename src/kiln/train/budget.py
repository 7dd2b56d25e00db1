"""Budget guard: device-hours spent (wall time × ranks, across resumes), cost, warnings, a clean stop at 100%."""

from __future__ import annotations

from kiln.config import BudgetConfig


class Budget:
    def __init__(self, cfg: BudgetConfig, world: int) -> None:
        self.cfg, self.world = cfg, world
        self.device_hours = 0.0
        self.warned: list[float] = []

    def spend(self, seconds: float) -> None:
        self.device_hours += seconds * self.world / 3600

    @property
    def cost(self) -> float:
        return self.device_hours * self.cfg.price_per_device_hour

    @property
    def fraction(self) -> float | None:
        return self.device_hours / self.cfg.device_hours if self.cfg.device_hours else None

    def new_warnings(self) -> list[float]:
        """Fractions crossed since the last call (each warned once, also across resumes)."""
        f = self.fraction
        if f is None:
            return []
        crossed = [w for w in self.cfg.warn_fractions if f >= w and w not in self.warned]
        self.warned += crossed
        return crossed

    def exhausted(self) -> bool:
        return self.fraction is not None and self.fraction >= 1.0

    def state_dict(self) -> dict:
        return {"device_hours": self.device_hours, "warned": self.warned}

    def load_state_dict(self, state: dict) -> None:
        self.device_hours, self.warned = state["device_hours"], list(state["warned"])
