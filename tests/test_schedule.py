"""Learning-rate schedules: each curve's values at its key steps, the breathing state machine driven by
synthetic gradient noise and validation losses, exact resume from state_dict, the warmup calibrator,
the linear scaling rule and the config's checks."""

from __future__ import annotations

import json
import math

import pytest

from kiln.config import BreathingConfig, WarmupCalibrationConfig, build_config
from kiln.errors import ConfigError
from kiln.train.schedule import (Breathing, Constant, Cosine, Warmup, WarmupCalibrator, WarmupStableDecay,
                                 build_schedule, gradient_spread)

CALM, NOISY = 0.001, 0.01  # grad_norm / param_norm with param_norm = 1 (threshold 0.003)


def curve(schedule, total: int) -> list[float]:
    return [schedule.lr(s) for s in range(1, total + 1)]


def non_increasing(xs) -> bool:
    return all(a >= b - 1e-15 for a, b in zip(xs, xs[1:]))


# --- stateless curves --------------------------------------------------------------------------------

def test_cosine_is_linear_warmup_then_half_a_cosine():
    lrs = curve(Cosine(1.0, 10, 100, 0.1), 100)
    closed_form = [s / 10 if s <= 10 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 90))
                   for s in range(1, 101)]
    assert lrs == pytest.approx(closed_form, rel=1e-12)
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0 and lrs[-1] == pytest.approx(0.1)
    assert lrs[54] == pytest.approx(0.55)  # halfway through the cosine: the mean of peak and floor
    assert non_increasing(lrs[9:]) and lrs[:10] == sorted(lrs[:10])


def test_warmup_is_linear_from_peak_over_warmup():
    s = Constant(2.0, 4, 10, 0.0)
    assert curve(s, 6) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0])
    assert curve(Constant(2.0, 0, 10, 0.0), 3) == [2.0, 2.0, 2.0]  # no warmup: the peak from step 1


@pytest.mark.parametrize("shape, at_95", [("linear", 0.55), ("1-sqrt", 1 - (1 - 0.1) * math.sqrt(0.5))])
def test_wsd_holds_the_peak_then_decays_over_the_last_fraction(shape, at_95):
    s = WarmupStableDecay(1.0, 10, 100, 0.1, decay_fraction=0.1, shape=shape)
    lrs = curve(s, 100)
    assert lrs[4] == pytest.approx(0.5)
    assert set(lrs[9:90]) == {1.0}  # steps 10..90: the peak
    assert s.decay_start == 90 and lrs[90] < 1.0
    assert lrs[94] == pytest.approx(at_95)  # step 95: halfway through the decay
    assert lrs[-1] == pytest.approx(0.1) and non_increasing(lrs[9:])


def test_wsd_1_sqrt_drops_faster_early_than_linear():
    lin = WarmupStableDecay(1.0, 0, 100, 0.0, 0.5, "linear")
    sqrt = WarmupStableDecay(1.0, 0, 100, 0.0, 0.5, "1-sqrt")
    assert all(sqrt.lr(s) < lin.lr(s) for s in range(51, 100))
    assert sqrt.lr(100) == lin.lr(100) == 0.0


def test_wsd_decay_never_starts_inside_the_warmup():
    s = WarmupStableDecay(1.0, 30, 40, 0.0, decay_fraction=0.5)
    assert s.decay_start == 30 and s.lr(30) == 1.0 and s.lr(40) == 0.0


def test_build_schedule_picks_each_kind_from_config():
    for name, cls in [("cosine", Cosine), ("wsd", WarmupStableDecay), ("constant", Constant), ("breathing", Breathing)]:
        train = {"schedule": name, "lr": 0.5, "warmup_steps": 5, "max_steps": 50}
        s = build_schedule(build_config({"train": train}).train)
        assert type(s) is cls and s.lr(5) == 0.5 and s.describe()["schedule"] == name
        assert s.measures_noise == (name == "breathing") and not s.wants_layer_norms()
    assert type(build_schedule(build_config({}).train)) is Cosine  # the default
    wsd = build_config({"train": {"schedule": "wsd", "decay_fraction": 0.3, "decay_shape": "linear"}})
    wsd = build_schedule(wsd.train)
    described = wsd.describe()
    assert {k: described[k] for k in ("decay_fraction", "decay_shape", "decay_start")} == \
        {"decay_fraction": 0.3, "decay_shape": "linear", "decay_start": 70}


# --- breathing -------------------------------------------------------------------------------------

def breathing(**kw) -> Breathing:
    figures = dict(inhale_steps=5, decay=0.5, noise_threshold=0.003, calm_steps=3, pause_steps=4,
                   pause_eval_every=0, restart_factor=1.2)
    return Breathing(1.0, 2, 1000, 0.0, BreathingConfig(**(figures | kw)))


class Feed:
    """Drives a schedule like the trainer: lr, then observe_step, then an eval if one is wanted."""

    def __init__(self, schedule, val_losses=()):
        self.s, self.step, self.lrs, self.evals = schedule, 0, [], []
        self.val_losses = list(val_losses)

    def run(self, noises):
        for noise in noises:
            self.step += 1
            self.lrs.append(self.s.lr(self.step))
            self.s.observe_step(self.step, grad_norm=noise, param_norm=1.0)
            if self.s.wants_eval(self.step):
                self.evals.append(self.step)
                self.s.observe_eval(self.step, self.val_losses.pop(0))
        return self


def test_breathing_inhale_exhale_pause_restart():
    f = Feed(breathing(), val_losses=[3.0, 2.5])
    f.run([NOISY] * 2)  # warmup 0.5, 1.0
    f.run([NOISY] * 5)  # inhale: steps 3..7 at the peak
    assert f.s.phase == "exhale" and f.lrs == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    f.run([NOISY, NOISY, CALM, NOISY])  # steps 8..11: one calm step then noise again: the count restarts
    assert f.lrs[7:] == [0.5, 0.25, 0.125, 0.0625] and f.s.phase == "exhale"
    f.run([CALM] * 3)  # steps 12..14 calm: the pause starts after 14 with an eval
    assert f.s.phase == "pause" and f.evals == [14] and f.lrs[-1] == 0.5 ** 7
    f.run([NOISY] * 4)  # steps 15..18: frozen; noise does not matter; eval at the last one
    assert f.lrs[-4:] == [0.5 ** 7] * 4 and f.evals == [14, 18]
    assert f.s.phase == "inhale" and f.s.restarts == 1  # val loss 3.0 -> 2.5 fell: restart
    f.run([NOISY] * 6)  # inhale at 1.2x the frozen LR for 5 steps, then exhale again
    assert f.lrs[-6:-1] == pytest.approx([1.2 * 0.5 ** 7] * 5)
    assert f.lrs[-1] == pytest.approx(1.2 * 0.5 ** 8) and f.s.phase == "exhale"


def test_breathing_no_restart_when_validation_loss_did_not_fall():
    f = Feed(breathing(), val_losses=[3.0, 3.0])
    f.run([NOISY] * 7 + [CALM] * 3)  # pause after step 10, frozen at 0.5**3
    assert f.s.phase == "pause" and f.evals == [10]
    f.run([NOISY] * 4 + [CALM] * 2)  # pause 11..14; then exhale resumes from the frozen LR, calm count from 0
    assert f.s.restarts == 0 and f.s.phase == "exhale" and f.evals == [10, 14]
    assert f.lrs[10:14] == [0.125] * 4 and f.lrs[14:] == [0.0625, 0.03125]


def test_breathing_restart_never_exceeds_the_peak_and_exhale_stops_at_the_floor():
    s = Breathing(1.0, 0, 1000, 0.2, BreathingConfig(inhale_steps=1, decay=0.5, calm_steps=3, pause_steps=2,
                                                     pause_eval_every=0, restart_factor=100.0))
    f = Feed(s, val_losses=[2.0, 1.0]).run([NOISY] + [CALM] * 3)  # exhale 0.5, 0.25, 0.2 (floor): pause
    assert f.lrs == [1.0, 0.5, 0.25, 0.2] and s.phase == "pause"
    f.run([NOISY] * 3)
    assert f.lrs[-3:] == [0.2, 0.2, 1.0] and s.restarts == 1  # 100 x 0.2 capped at the peak


def test_breathing_asks_for_evals_through_the_pause():
    s = breathing(pause_steps=7, pause_eval_every=3)
    f = Feed(s, val_losses=[5.0, 4.0, 4.5, 4.9]).run([NOISY] * 7 + [CALM] * 3 + [NOISY] * 7)
    assert f.evals == [10, 13, 16, 17]  # entry, every 3 steps, last step
    assert s.restarts == 1  # 4.9 < 5.0: the pause's last loss against its first


def test_breathing_pause_ends_without_its_final_eval():
    s = breathing()
    Feed(s, val_losses=[3.0]).run([NOISY] * 7 + [CALM] * 3)
    for step in range(11, 16):  # a trainer that ignores wants_eval after the first
        s.observe_step(step, NOISY, 1.0)
    assert s.phase == "exhale" and s.restarts == 0 and s.lr(16) == pytest.approx(0.5 ** 4)


def test_breathing_non_finite_noise_is_not_calm():
    f = Feed(breathing()).run([NOISY] * 7 + [CALM, CALM, math.nan, CALM, CALM])
    assert f.s.phase == "exhale" and f.s.calm == 2
    f.s.observe_step(13, 1.0, 0.0)  # a zero parameter norm gives no measurement
    assert f.s.calm == 0


def test_state_dict_round_trip_mid_pause_gives_identical_future():
    def drive(s, first, last, losses):
        f = Feed(s, val_losses=losses)
        f.step = first - 1
        return f.run([NOISY] * (last - first + 1)), f

    noises = [NOISY] * 7 + [CALM] * 3 + [NOISY] * 2  # into the pause, two steps in
    a = Feed(breathing(pause_eval_every=2), val_losses=[3.0, 2.9]).run(noises)
    assert a.s.phase == "pause"
    saved = json.loads(json.dumps(a.s.state_dict()))  # the trainer keeps it in state.json
    b_schedule = breathing(pause_eval_every=2)
    b_schedule.load_state_dict(saved)
    a_rest, _ = drive(a.s, 13, 40, [2.8, 2.7])
    b_rest, _ = drive(b_schedule, 13, 40, [2.8, 2.7])
    assert a_rest.lrs == b_rest.lrs and a_rest.evals == b_rest.evals
    assert a.s.state_dict() == b_schedule.state_dict() and a.s.restarts == 1


def test_a_changed_schedule_on_resume_starts_its_own_phases_fresh():
    cosine_state = json.loads(json.dumps(Cosine(1.0, 2, 100, 0.1).state_dict()))
    wsd = WarmupStableDecay(1.0, 2, 100, 0.1, decay_fraction=0.2)
    wsd.load_state_dict(cosine_state)  # the usual cool-down: resume a constant/cosine run as wsd
    assert curve(wsd, 100) == curve(WarmupStableDecay(1.0, 2, 100, 0.1, decay_fraction=0.2), 100)
    b = breathing()
    b.load_state_dict(cosine_state)
    assert (b.phase, b.start, b.level, b.restarts) == ("inhale", 1, 1.0, 0)
    c = Cosine(1.0, 10, 100, 0.1)  # a stateless schedule's warmup follows the config, not the checkpoint
    c.load_state_dict(Cosine(1.0, 2, 100, 0.1).state_dict())
    assert c.warmup == Warmup(10)


# --- warmup calibrator -----------------------------------------------------------------------------

def test_gradient_spread_is_the_std_of_log10_norms():
    assert gradient_spread([0.1, 1.0, 10.0]) == pytest.approx(math.sqrt(2 / 3))
    assert gradient_spread([3.0, 3.0, 3.0]) == 0.0
    assert gradient_spread([1e-3, 1e-3 * 10 ** 0.3]) == pytest.approx(0.15)  # scale-free: only ratios count
    assert gradient_spread([2.0, 0.0, math.inf, math.nan, 20.0]) == pytest.approx(0.5)  # unusable norms left out
    assert gradient_spread([1.0]) is None and gradient_spread([]) is None


@pytest.mark.parametrize("sigma, total, expected", [
    (0.10, 100_000, None),  # within the threshold: keep the configured warmup
    (0.15, 100_000, None),  # "above" is strict
    (0.16, 100_000, 5_000),  # 200 x 0.16 x 1000 = 32,000: capped at 5,000
    (0.16, 20_000, 3_000),  # ... and at 15% of the run
])
def test_calibrated_warmup_with_seeds_figures(sigma, total, expected):
    assert WarmupCalibrator(total=total).calibrated_steps(sigma) == expected


def test_calibrated_warmup_follows_sigma_below_the_caps():
    c = WarmupCalibrator(WarmupCalibrationConfig(steps_per_sigma=1_000), total=1_000_000)
    assert c.calibrated_steps(0.5) == 500 and c.calibrated_steps(2.0) == 2_000


def spread_norms(sigma: float) -> list[float]:
    """Four layers whose log10 norms are ±sigma around 0: population std exactly sigma."""
    return [10 ** sigma, 10 ** -sigma, 10 ** sigma, 10 ** -sigma]


def test_calibrator_stretches_the_warmup_without_a_jump():
    cal = WarmupCalibrator(WarmupCalibrationConfig(steps=10), total=10_000)  # caps: 5,000 steps and 1,500 (15%)
    s = Constant(1.0, 20, 10_000, 0.0, calibrator=cal)
    for step in range(1, 11):
        assert s.lr(step) == pytest.approx(step / 20) and s.wants_layer_norms()
        s.observe_step(step, 1.0, 1.0, layer_grad_norms=spread_norms(0.4 if step != 3 else 0.0))
    assert (
        cal.sigma == pytest.approx(0.4) and cal.decided and not s.wants_layer_norms()
    )  # the median ignores the odd step
    assert s.warmup == Warmup(1_500, knee_step=10, knee_factor=0.5)
    assert s.lr(10) == pytest.approx(0.5) and s.lr(1_500) == 1.0
    assert s.lr(755) == pytest.approx(0.75)  # a straight line from (10, 0.5) to (1500, 1.0)
    lrs = curve(s, 2_000)
    assert lrs == sorted(lrs) and max(b - a for a, b in zip(lrs, lrs[1:])) < 0.051
    assert s.describe()["warmup_steps"] == 1_500


def test_calibrator_keeps_the_warmup_when_layers_agree():
    cal = WarmupCalibrator(WarmupCalibrationConfig(steps=10), total=10_000)
    s = Cosine(1.0, 20, 10_000, 0.1, calibrator=cal)
    reference = curve(Cosine(1.0, 20, 10_000, 0.1), 100)
    for step in range(1, 11):
        s.observe_step(step, 1.0, 1.0, layer_grad_norms=spread_norms(0.05))
    assert cal.sigma == pytest.approx(0.05) and s.warmup == Warmup(20)
    assert curve(s, 100) == reference


def test_calibrator_state_resumes_mid_window():
    def fresh():
        cal = WarmupCalibrator(WarmupCalibrationConfig(steps=10), total=10_000)
        return Constant(1.0, 20, 10_000, 0.0, calibrator=cal)

    a, b = fresh(), fresh()
    for step in range(1, 6):
        a.observe_step(step, 1.0, 1.0, layer_grad_norms=spread_norms(0.3))
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for s in (a, b):
        for step in range(6, 11):
            s.observe_step(step, 1.0, 1.0, layer_grad_norms=spread_norms(0.3))
    assert a.warmup == b.warmup == Warmup(1_500, 10, 0.5) and curve(a, 50) == curve(b, 50)


def test_breathing_inhale_starts_after_a_calibrated_warmup():
    cal = WarmupCalibrator(WarmupCalibrationConfig(steps=2, max_steps=8), total=1000)
    s = Breathing(1.0, 4, 1000, 0.0, BreathingConfig(inhale_steps=3, decay=0.5, calm_steps=3, pause_steps=4),
                  calibrator=cal)
    f = Feed(s)
    for _ in range(2):
        f.step += 1
        f.lrs.append(s.lr(f.step))
        s.observe_step(f.step, NOISY, 1.0, layer_grad_norms=spread_norms(1.0))
    assert s.warmup.end == 8
    f.run([NOISY] * 12)  # warmup to 8, inhale 9..11, exhale from 12
    assert f.lrs[7:12] == [1.0, 1.0, 1.0, 1.0, 0.5]


# --- config: linear scaling rule and checks ----------------------------------------------------------

def test_linear_scaling_rule_sets_lr():
    cfg = build_config({"train": {"base_lr": 0.0015, "batch_size": 512}})
    assert cfg.train.lr == pytest.approx(0.003) and cfg.train.reference_batch_size == 256
    cfg = build_config({"train": {"base_lr": 0.001, "batch_size": 64, "reference_batch_size": 32}})
    assert cfg.train.lr == pytest.approx(0.002) and build_schedule(cfg.train).peak == pytest.approx(0.002)
    assert build_config({"train": {"lr": 0.01}}).train.lr == 0.01  # no base_lr: lr as given


def test_resolved_config_loads_back_unchanged():
    cfg = build_config({"train": {"base_lr": 0.0015, "batch_size": 8}})
    again = build_config(json.loads(json.dumps(cfg.model_dump(mode="json"))))
    assert again.train.lr == cfg.train.lr == pytest.approx(0.0015 * 8 / 256)


def test_lr_and_base_lr_that_disagree_are_refused():
    with pytest.raises(ConfigError, match="give only one of lr and base_lr"):
        build_config({"train": {"lr": 0.003, "base_lr": 0.0015, "batch_size": 8}})
    with pytest.raises(ConfigError, match="give only one of lr and base_lr"):
        build_config({"train": {"base_lr": 0.0015}}, ["train.lr=0.1"])


@pytest.mark.parametrize("overrides, key", [
    (["train.schedule=linear"], "train.schedule"),
    (["train.decay_fraction=0"], "train.decay_fraction"),
    (["train.decay_shape=sqrt"], "train.decay_shape"),
    (["train.breathing.decay=1.5"], "train.breathing.decay"),
    (["train.breathing.restart_factor=0.5"], "train.breathing.restart_factor"),
    (["train.breathing.inhale=5"], "train.breathing.inhale"),
    (["train.base_lr=-1"], "train.base_lr"),
    (["train.reference_batch_size=0"], "train.reference_batch_size"),
    (["train.warmup_calibration.max_fraction=2", "train.warmup_steps=200"], "train.warmup_calibration.max_fraction"),
])
def test_bad_schedule_keys_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config({}, overrides)


def test_warmup_calibration_defaults_and_its_warmup_check():
    cfg = build_config({"train": {"warmup_calibration": {}, "warmup_steps": 500, "max_steps": 10_000}})
    c = cfg.train.warmup_calibration
    assert (c.steps, c.sigma_threshold, c.max_steps, c.max_fraction) == (100, 0.15, 5_000, 0.15)
    assert build_schedule(cfg.train).describe()["warmup_calibration"]["steps"] == 100
    assert build_config({}).train.warmup_calibration is None
    with pytest.raises(ConfigError, match="warmup_steps=10 must exceed train.warmup_calibration.steps=100"):
        build_config({"train": {"warmup_calibration": {}}})


def test_breathing_defaults_are_seeds_figures():
    b = build_config({}).train.breathing
    assert (b.inhale_steps, b.decay, b.noise_threshold, b.calm_steps, b.pause_steps, b.restart_factor) == \
        (10_000, 0.9995, 0.003, 500, 2_000, 1.2)
