"""Learning-rate schedules: objects the trainer drives once per optimizer step.

The trainer's contract, for optimizer step `step` (1-based):

    lr = schedule.lr(step)                      # before the step; pure: asking twice gives the same value
    ... forward, backward, optimizer step ...
    schedule.observe_step(step, grad_norm, param_norm, layer_grad_norms)
        # param_norm: needed when schedule.measures_noise; layer_grad_norms (one per transformer
        # block, before clipping): needed while schedule.wants_layer_norms(); else 0.0 / None
    if <its own eval is due> or schedule.wants_eval(step):
        schedule.observe_eval(step, evaluate())
    checkpoint: state["schedule"] = schedule.state_dict()   (plain JSON)
    resume:     schedule.load_state_dict(state["schedule"])

Every schedule starts with a linear warmup from peak/warmup to the peak (`train.lr`, or
`train.base_lr × train.batch_size / train.reference_batch_size`), and decays no lower than
`train.min_lr_ratio × peak`. What follows the warmup is `train.schedule`:

cosine     half a cosine from the peak at the end of warmup to the floor at `train.max_steps`.
wsd        warmup-stable-decay: the peak until the last `train.decay_fraction` of the steps, then
           down to the floor at `train.max_steps`, linearly (`decay_shape: linear`) or as 1 - sqrt
           of the decay's progress (`1-sqrt`, the default: Hägele et al. 2024, "Scaling Laws and
           Compute-Optimal Training Beyond Fixed Training Durations", found it beats linear).
constant   the peak until the end.
breathing  SEEDS' schedule that follows the gradient noise and the validation loss; see `Breathing`.

`train.warmup_calibration` makes the warmup length a measurement; see `WarmupCalibrator`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from kiln.config import BreathingConfig, TrainConfig, WarmupCalibrationConfig


@dataclass
class Warmup:
    """A linear ramp to the peak, reached at step `end` (0: no warmup).

    A calibrated warmup bends once: the first `knee_step` steps rise in a straight line to
    `knee_factor` of the peak (the configured ramp), then a second straight line leads from there
    to the peak at `end`, so the learning rate never jumps or falls when the calibrator stretches
    the warmup mid-ramp.
    """

    end: int
    knee_step: int = 0
    knee_factor: float = 0.0

    def factor(self, step: int) -> float:
        """Fraction of the peak at `step` (1 from `end` on)."""
        if step >= self.end:
            return 1.0
        if step <= self.knee_step:
            return self.knee_factor * step / self.knee_step
        return self.knee_factor + (1 - self.knee_factor) * (step - self.knee_step) / (self.end - self.knee_step)


class Schedule:
    """Warmup, then `after_warmup`. Stateless schedules only implement `after_warmup`."""

    name = "schedule"
    state_key = "schedule"  # saved in every checkpoint (train/checkpoint/checkpointer.py)
    restore_on_rollback = True  # the breathing phases and a calibrated warmup rewind with the step
    measures_noise = False  # whether observe_step needs a real param_norm (the trainer may skip computing it)

    def __init__(self, peak: float, warmup: int, total: int, min_ratio: float,
                 calibrator: "WarmupCalibrator | None" = None) -> None:
        self.peak, self.total, self.min_ratio = peak, total, min_ratio
        self.floor = peak * min_ratio
        self.calibrator = calibrator
        self.warmup = Warmup(warmup)

    def lr(self, step: int) -> float:
        if step < self.warmup.end:
            return self.peak * self.warmup.factor(step)
        return self.after_warmup(step)

    def after_warmup(self, step: int) -> float:
        raise NotImplementedError

    def wants_layer_norms(self) -> bool:
        """Whether the next observe_step needs per-block gradient norms (only while a calibrator measures)."""
        return self.calibrator is not None and not self.calibrator.decided

    def observe_step(self, step: int, grad_norm: float, param_norm: float,
                     layer_grad_norms: Sequence[float] | None = None) -> None:
        if self.calibrator and (stretched := self.calibrator.observe(step, layer_grad_norms, self.warmup)):
            self.warmup = stretched

    def observe_eval(self, step: int, val_loss: float) -> None:
        pass

    def wants_eval(self, step: int) -> bool:
        """Whether the schedule needs a validation loss after `step` (beyond the trainer's own evals)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"name": self.name, "warmup": asdict(self.warmup)}
        if self.calibrator:
            state["calibrator"] = self.calibrator.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what was measured. The warmup comes from the config unless a calibrator set it; a
        state written under another `train.schedule` (say cosine, resumed as wsd for a cool-down) gives
        the new schedule a fresh start of its own phases."""
        if self.calibrator and "calibrator" in state:
            self.calibrator.load_state_dict(state["calibrator"])
            self.warmup = Warmup(**state["warmup"])

    def describe(self) -> dict[str, Any]:
        out = {"schedule": self.name, "peak_lr": self.peak, "min_lr": self.floor, "warmup_steps": self.warmup.end,
               "total_steps": self.total}
        if self.calibrator:
            out["warmup_calibration"] = self.calibrator.describe()
        return out


class Cosine(Schedule):
    """Warmup, then half a cosine from the peak to min_lr_ratio·peak at `total`."""

    name = "cosine"

    def after_warmup(self, step: int) -> float:
        progress = min(1.0, (step - self.warmup.end) / max(1, self.total - self.warmup.end))
        return self.peak * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Constant(Schedule):
    """Warmup, then the peak until the end."""

    name = "constant"

    def after_warmup(self, step: int) -> float:
        return self.peak


class WarmupStableDecay(Schedule):
    """Warmup, the peak, then a decay over the last `decay_fraction` of `total` steps to the floor.

    The decay starts after step total - round(decay_fraction·total) (never before the warmup
    ends) and reaches the floor exactly at `total`. shape "linear": 1 - p of the way down;
    "1-sqrt": 1 - sqrt(p), which drops faster early and flattens near the floor.
    """

    name = "wsd"

    def __init__(self, peak: float, warmup: int, total: int, min_ratio: float, decay_fraction: float,
                 shape: str = "1-sqrt", calibrator: "WarmupCalibrator | None" = None) -> None:
        super().__init__(peak, warmup, total, min_ratio, calibrator)
        self.decay_fraction, self.shape = decay_fraction, shape

    @property
    def decay_start(self) -> int:
        """The last step at the peak."""
        return max(self.warmup.end, self.total - round(self.decay_fraction * self.total))

    def after_warmup(self, step: int) -> float:
        if step <= self.decay_start:
            return self.peak
        p = min(1.0, (step - self.decay_start) / max(1, self.total - self.decay_start))
        remaining = 1 - p if self.shape == "linear" else 1 - math.sqrt(p)
        return self.floor + (self.peak - self.floor) * remaining

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"decay_fraction": self.decay_fraction, "decay_shape": self.shape,
                                     "decay_start": self.decay_start}


class Breathing(Schedule):
    """SEEDS' "breathing" schedule: a cycle of four phases after the warmup.

    inhale   hold the level (first the peak) for `inhale_steps` steps.
    exhale   multiply the LR by `decay` every step (never below the floor) while watching the
             gradient noise grad_norm / param_norm of each step. When it stays below
             `noise_threshold` for `calm_steps` consecutive steps, pause.
    pause    freeze the LR for `pause_steps` steps; the schedule asks for a validation loss when
             the pause begins (after the step that triggered it), every `pause_eval_every` steps
             and at its last step (`wants_eval`).
    restart  at the pause's end: if the last validation loss of the pause is below the one taken
             when it began, raise the LR to `restart_factor` × the frozen LR (never above the
             peak) and inhale again; otherwise exhale on from the frozen LR with the calm count
             reset. A pause whose final loss never arrives ends at the next step as "no restart".

    The figures are `cfg` (train.breathing, config.BreathingConfig, whose defaults are SEEDS': inhale 10,000,
    decay 0.9995, noise 0.003 for 500 steps, pause 2,000, restart 1.2×); its peak of 0.0015 is `train.lr`.
    `train.max_steps` only matters to the warmup calibrator's cap: breathing has no end of its own.
    """

    name = "breathing"
    measures_noise = True

    def __init__(self, peak: float, warmup: int, total: int, min_ratio: float,
                 cfg: BreathingConfig = BreathingConfig(), calibrator: "WarmupCalibrator | None" = None) -> None:
        super().__init__(peak, warmup, total, min_ratio, calibrator)
        self.inhale_steps, self.decay, self.noise_threshold = cfg.inhale_steps, cfg.decay, cfg.noise_threshold
        self.calm_steps, self.pause_steps, self.pause_eval_every = cfg.calm_steps, cfg.pause_steps, cfg.pause_eval_every
        self.restart_factor = cfg.restart_factor
        # The first inhale starts when the warmup ends, which a calibrator may still move: start=1
        # means "right after the warmup", whatever its length turns out to be.
        self.phase, self.start, self.level = "inhale", 1, peak
        self.calm = 0
        self.pause_val_first: float | None = None
        self.pause_val_last: float | None = None
        self.restarts = 0

    def _phase_start(self) -> int:
        return max(self.start, self.warmup.end + 1)

    def _pause_end(self) -> int:
        return self.start + self.pause_steps - 1

    def after_warmup(self, step: int) -> float:
        if self.phase == "exhale":
            return max(self.floor, self.level * self.decay ** (step - self.start + 1))
        return self.level

    def observe_step(self, step: int, grad_norm: float, param_norm: float,
                     layer_grad_norms: Sequence[float] | None = None) -> None:
        super().observe_step(step, grad_norm, param_norm, layer_grad_norms)
        if step <= self.warmup.end:
            return
        if self.phase == "inhale" and step >= self._phase_start() + self.inhale_steps - 1:
            self._enter("exhale", step + 1, self.level)
        elif self.phase == "exhale":
            noise = grad_norm / param_norm if param_norm > 0 else math.inf
            self.calm = self.calm + 1 if noise < self.noise_threshold else 0  # NaN is not calm
            if self.calm >= self.calm_steps:
                self._enter("pause", step + 1, self.after_warmup(step))
        elif self.phase == "pause" and step > self._pause_end():
            self._end_pause(step)

    def wants_eval(self, step: int) -> bool:
        if self.phase != "pause":
            return False
        into = step - (self.start - 1)  # 0 at the step that triggered the pause
        return (
            into == 0 or step == self._pause_end() or (self.pause_eval_every > 0 and into % self.pause_eval_every == 0)
        )

    def observe_eval(self, step: int, val_loss: float) -> None:
        if self.phase != "pause" or step < self.start - 1:
            return
        if self.pause_val_first is None:
            self.pause_val_first = val_loss
        self.pause_val_last = val_loss
        if step >= self._pause_end():
            self._end_pause(step)

    def _end_pause(self, step: int) -> None:
        first, last = self.pause_val_first, self.pause_val_last
        if first is not None and last is not None and last < first:
            self.restarts += 1
            self._enter("inhale", step + 1, min(self.peak, self.level * self.restart_factor))
        else:
            self._enter("exhale", step + 1, self.level)

    def _enter(self, phase: str, start: int, level: float) -> None:
        self.phase, self.start, self.level = phase, start, level
        self.calm = 0
        self.pause_val_first = self.pause_val_last = None

    _STATE = ("phase", "start", "level", "calm", "pause_val_first", "pause_val_last", "restarts")

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("name") == self.name:
            for k in self._STATE:
                setattr(self, k, state[k])

    def describe(self) -> dict[str, Any]:
        return super().describe() | {
            "inhale_steps": self.inhale_steps, "decay": self.decay, "noise_threshold": self.noise_threshold,
            "calm_steps": self.calm_steps, "pause_steps": self.pause_steps, "pause_eval_every": self.pause_eval_every,
            "restart_factor": self.restart_factor, "phase": self.phase, "restarts": self.restarts}


def gradient_spread(layer_grad_norms: Sequence[float]) -> float | None:
    """Spread σ of per-layer gradient norms: the standard deviation (population) of their log10.

    On a log scale σ is blind to the overall gradient scale and counts orders of magnitude:
    σ = 0.15 means the layers' norms typically differ from their geometric mean by a factor
    of 10^0.15 ≈ 1.41. Zero and non-finite norms carry no ratio and are left out; fewer than
    two usable norms give None (no measurement).
    """
    logs = [math.log10(g) for g in layer_grad_norms if math.isfinite(g) and g > 0]
    return statistics.pstdev(logs) if len(logs) >= 2 else None


class WarmupCalibrator:
    """SEEDS' dynamic warmup: measure the per-layer gradient-norm spread, then set the warmup.

    The figures are `cfg` (train.warmup_calibration, config.WarmupCalibrationConfig, where their defaults
    live). Over steps 1..`steps`, each step's spread (`gradient_spread` of the per-layer norms the
    trainer passes, one per transformer block) is recorded; σ is their median, so one odd step
    cannot decide. At step `steps`, if σ > `sigma_threshold` the warmup becomes
    min(`max_steps`, `steps_per_sigma` × σ, `max_fraction` × total steps); otherwise it stays
    the configured one. With SEEDS' figures (200 × σ × 1,000) any σ above 0.15 asks for at
    least 30,000 steps, so the caps decide: 5,000 steps or 15% of the run.

    The measurement happens during the configured warmup (the config requires train.warmup_steps
    > `steps`), and the calibrator only ever lengthens the ramp from the point it has reached.
    """

    def __init__(self, cfg: WarmupCalibrationConfig = WarmupCalibrationConfig(), total: int = 0) -> None:
        self.steps, self.sigma_threshold, self.max_steps = cfg.steps, cfg.sigma_threshold, cfg.max_steps
        self.max_fraction, self.steps_per_sigma, self.total = cfg.max_fraction, cfg.steps_per_sigma, total
        self.spreads: list[float] = []
        self.sigma: float | None = None
        self.decided = False

    def calibrated_steps(self, sigma: float) -> int | None:
        """The warmup length σ asks for, or None when σ is within the threshold."""
        if sigma <= self.sigma_threshold:
            return None
        return int(min(self.max_steps, self.steps_per_sigma * sigma, self.max_fraction * self.total))

    def observe(self, step: int, layer_grad_norms: Sequence[float] | None, warmup: Warmup) -> Warmup | None:
        """Record one step; at the end of the window return the stretched warmup, if any."""
        if self.decided:
            return None
        if layer_grad_norms is not None and (spread := gradient_spread(layer_grad_norms)) is not None:
            self.spreads.append(spread)
        if step < self.steps:
            return None
        self.decided = True
        self.sigma = statistics.median(self.spreads) if self.spreads else 0.0
        wanted = self.calibrated_steps(self.sigma)
        if wanted is None or wanted <= warmup.end:
            return None
        return Warmup(wanted, knee_step=step, knee_factor=warmup.factor(step))

    def state_dict(self) -> dict[str, Any]:
        return {"spreads": list(self.spreads), "sigma": self.sigma, "decided": self.decided}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spreads, self.sigma, self.decided = list(state["spreads"]), state["sigma"], state["decided"]

    def describe(self) -> dict[str, Any]:
        return {"steps": self.steps, "sigma_threshold": self.sigma_threshold, "max_steps": self.max_steps,
                "max_fraction": self.max_fraction, "steps_per_sigma": self.steps_per_sigma, "sigma": self.sigma,
                "decided": self.decided}


def build_schedule(t: TrainConfig) -> Schedule:
    """The schedule that the train section describes."""
    calibrator = WarmupCalibrator(t.warmup_calibration, total=t.max_steps) if t.warmup_calibration else None
    common = dict(peak=t.lr, warmup=t.warmup_steps, total=t.max_steps, min_ratio=t.min_lr_ratio, calibrator=calibrator)
    if t.schedule == "wsd":
        return WarmupStableDecay(decay_fraction=t.decay_fraction, shape=t.decay_shape, **common)
    if t.schedule == "constant":
        return Constant(**common)
    if t.schedule == "breathing":
        return Breathing(cfg=t.breathing, **common)
    return Cosine(**common)
