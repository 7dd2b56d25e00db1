"""Budget guard: device-hours spent (wall time × ranks, across resumes), cost, warnings, a clean stop at 100%."""

from __future__ import annotations

from typing import Callable

from kiln.config import BudgetConfig
from kiln.train.parts.outcome import Outcome


class Budget:
    """A part: spends each step's wall time, warns at budget.warn_fractions and flags `budget_exhausted` (agreed
    by every rank, so all stop at the same step). Its spend is saved in checkpoints and resumed."""

    state_key = "budget"

    def __init__(self, cfg: BudgetConfig, world: int, event: Callable[[dict], None] = lambda r: None,
                 log: Callable[[str], None] = lambda *_: None) -> None:
        self.cfg, self.world, self.event, self.log = cfg, world, event, log
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

    # --- hooks --------------------------------------------------------------------------------------

    def flags(self) -> dict[str, bool]:
        # Every rank's verdict on the steps so far: one rank alone must never stop (it would enter the save's
        # collectives while the others start the next step's).
        return {"budget_exhausted": self.exhausted()}

    def post_step(self, outcome: Outcome) -> None:
        self.spend(outcome.dt)
        for fraction in self.new_warnings():
            self.event({"event": "budget", "step": outcome.step, "fraction": fraction, "cost": self.cost})
            self.log(f"budget: {fraction:.0%} of budget.device_hours spent "
                     f"({self.device_hours:.3f} h, cost {self.cost:.2f})")

    def state_dict(self) -> dict:
        return {"device_hours": self.device_hours, "warned": self.warned}

    def load_state_dict(self, state: dict) -> None:
        self.device_hours, self.warned = state["device_hours"], list(state["warned"])
