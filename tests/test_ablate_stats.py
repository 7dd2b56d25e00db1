"""kiln.ablate.stats on simulated ablations: the intervals cover the true difference about 95% of the time and
identical arms are called different at most 5% of the time, each measured over 1,000 simulated ablations.

A simulated ablation has what a real one has: per-document byte counts (lognormal, like real pages), a
per-document difficulty shared by both arms (it cancels in the pairing), a per-document arm effect around the
true difference, a per-run seed effect (model init and data order), and per-run-and-document noise; accuracies
are 0/1 hits with per-question difficulty. Regimes: seeds dominate, documents dominate, both matter.

Coverage is never below 95% by more than the binomial noise of 1,000 trials, and errs wide (up to ~99%) where
seed x document noise outweighs the seeds' main effect: with 3 seeds the two cannot be told apart, and the
seed share keeps its 2 degrees of freedom (kiln.ablate.stats). Measured: seeds dominate 95.4%, documents
dominate 98.5%, both 98.8%, accuracies 98.9-99.4%.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ablate import stats


def test_student_t_matches_published_quantiles():
    for df, q, want in [(1, 0.975, 12.7062), (2, 0.975, 4.3027), (5, 0.975, 2.5706), (30, 0.975, 2.0423),
                        (1000, 0.975, 1.9623), (2, 0.8, 1.0607), (10, 0.995, 3.1693), (3, 0.9995, 12.9240)]:
        assert float(stats.t_upper(1 - q, df)) == pytest.approx(want, rel=2e-4), (df, q)
    assert stats.t_sf(0.0, 7) == pytest.approx(0.5) and stats.t_sf(2.0, math.inf) == pytest.approx(0.02275, rel=1e-3)


def test_student_t_is_scipys_and_equals_the_old_incomplete_beta_values():
    """t_sf gives what the hand-written incomplete beta function gave (its values, within 1e-9); the quantiles
    are scipy.stats.t.isf's (the old inverted table's were within 1e-4); a p-value with one variance share is
    exactly the t-test's 2 P(T > |diff| / sd) (the old grid search's was within 1e-3)."""
    import scipy.stats
    for df, t, old in [(1, 1.0, 0.2500000000000002), (1, 4.3, 0.07273273924637133), (2, 1.0, 0.2113248654051873),
                       (2, 4.3, 0.025028577058545765), (9, 1.0, 0.1717181980689575),
                       (9, 4.3, 0.0009953261372306263), (999, 1.0, 0.1587763300881473),
                       (999, 4.3, 9.377007239219678e-06)]:
        assert abs(stats.t_sf(t, df) - old) <= 1e-9 * old, (df, t)
    tails = np.array([0.4, 0.1, 0.025, 1e-3, 1e-6, 1e-12])
    for df in (1, 2, 3, 9, 99, 999):
        np.testing.assert_allclose(stats.t_upper(tails, df), scipy.stats.t.isf(tails, df), rtol=1e-12)
    for diff, v, seeds in [(0.01, 2e-5, 3), (0.3, 0.01, 5), (-0.002, 1e-6, 2)]:
        want = 2 * scipy.stats.t.sf(abs(diff) / math.sqrt(v), seeds - 1)
        assert stats.p_value(diff, v, 0.0, seeds, 1) == pytest.approx(want, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=1, max_size=12))
def test_holm_is_the_step_down_correction(ps):
    adjusted = stats.holm(ps)
    tested = [(p, a) for p, a in zip(ps, adjusted) if p is not None]
    assert [a is None for a in adjusted] == [p is None for p in ps]
    m = len(tested)
    for p, a in tested:  # the definition: max over the smaller-or-equal p's of min(1, (m - rank) p)
        ranked = sorted(q for q, _ in tested)
        want = max(min(1.0, (m - r) * q) for r, q in enumerate(ranked) if q <= p)
        assert a == pytest.approx(want) and p <= a + 1e-12 and a <= 1.0


def test_identical_runs_are_no_difference_and_a_shift_is_seen():
    rng = np.random.default_rng(0)
    runs = rng.normal(3.0, 0.3, (3, 50))
    same = stats.compare(runs, runs.copy(), np.full(50, 100.0))
    assert (same["diff"], same["p"], same["ci_low"], same["ci_high"]) == (0.0, 1.0, 0.0, 0.0)
    shifted = stats.compare(runs + 0.5 + rng.normal(0, 0.01, (3, 50)), runs, np.full(50, 1.0), rng=rng)
    assert shifted["diff"] == pytest.approx(0.5, abs=0.01) and 0 < shifted["ci_low"] and shifted["p"] < 1e-3
    judged = stats.judge([{**shifted, "higher_is_better": False}, {**same, "higher_is_better": False}], 0.95)
    assert [j["verdict"] for j in judged] == [stats.WORSE, stats.SAME]
    assert stats.judge([{**shifted, "higher_is_better": True}], 0.95)[0]["verdict"] == stats.BETTER


def test_the_seed_share_is_the_unbiased_variance_of_the_mean():
    """With many replicates the bootstrap's seed share is var(diffs, ddof=1) / S, the t-test's own."""
    diffs = np.array([0.52, 0.58, 0.43])
    share = stats.seed_share(diffs, 200_000, np.random.default_rng(1))
    assert share == pytest.approx(diffs.var(ddof=1) / 3, rel=0.02)


# --- simulated ablations ----------------------------------------------------------------------------------------

REGIMES = {  # (seed sd, document-effect sd, noise sd) in bits per byte
    "seeds dominate": (0.05, 0.02, 0.05),
    "documents dominate": (0.003, 0.15, 0.1),
    "both matter": (0.012, 0.1, 0.1),
}
SEEDS, DOCS, SIMULATIONS = 3, 100, 1000
# 500 bootstrap replicates, not the default 2,000: four times faster, and a harder test (a noisier variance).
FAST = stats.Settings(resamples=500)


def simulated_bpb(rng, theta: float, seed_sd: float, doc_sd: float, noise_sd: float):
    """(arm bits, baseline bits, bytes): (seeds, documents) arrays whose true bits-per-byte difference is theta."""
    size = rng.lognormal(7, 1, DOCS)
    difficulty = rng.normal(3.0, 0.5, DOCS)
    effect = rng.normal(theta, doc_sd, DOCS)  # the arm is better on some documents, worse on others

    def runs(shift):
        return (difficulty + shift + rng.normal(0, seed_sd, (SEEDS, 1)) + rng.normal(0, noise_sd, (SEEDS, DOCS))) \
            * size
    return runs(effect), runs(0.0), size


def simulated_hits(rng, theta: float, questions: int = 200):
    """(arm, baseline) 0/1 hits per (seed, question); the arm's true accuracy is theta higher."""
    p = rng.uniform(0.25, 0.65, questions)

    def runs(shift):
        return (rng.random((SEEDS, questions)) < p + shift + rng.normal(0, 0.02, (SEEDS, 1))).astype(float)
    return runs(theta), runs(0.0)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_intervals_cover_the_true_difference_about_95_percent(regime):
    rng = np.random.default_rng(24)
    theta = 0.2
    runs = (simulated_bpb(rng, theta, *REGIMES[regime]) for _ in range(SIMULATIONS))
    covered = sum(c["ci_low"] <= theta <= c["ci_high"]
                  for c in (stats.compare(*r, settings=FAST, rng=rng) for r in runs))
    assert 0.94 <= covered / SIMULATIONS <= 0.995, covered / SIMULATIONS


def test_accuracy_intervals_cover_the_true_difference_about_95_percent():
    rng = np.random.default_rng(25)
    runs = (simulated_hits(rng, 0.05) for _ in range(SIMULATIONS))
    covered = sum(c["ci_low"] <= 0.05 <= c["ci_high"]
                  for c in (stats.compare(*r, higher_is_better=True, settings=FAST, rng=rng) for r in runs))
    assert 0.94 <= covered / SIMULATIONS <= 0.995, covered / SIMULATIONS


def test_identical_arms_are_called_different_at_most_5_percent_of_the_time():
    """An A/A ablation (identical settings, other seeds) on six metrics: two text sets (two regimes), the
    validation loss and a task's three accuracies, Holm-corrected as kiln ablate does."""
    rng = np.random.default_rng(26)
    false_alarms, raw = 0, []
    for _ in range(SIMULATIONS):
        comparisons = [stats.compare(*simulated_bpb(rng, 0.0, *REGIMES["seeds dominate"]), settings=FAST, rng=rng),
                       stats.compare(*simulated_bpb(rng, 0.0, *REGIMES["both matter"]), settings=FAST, rng=rng),
                       stats.compare(rng.normal(4.0, 0.05, (SEEDS, 1)), rng.normal(4.0, 0.05, (SEEDS, 1)),
                                     settings=FAST, rng=rng)]
        arm, base = simulated_hits(rng, 0.0)
        flip = rng.random(arm.shape) < 0.1  # acc_norm and acc_bytes: mostly the same picks as acc
        for hits in (arm, np.where(flip, 1 - arm, arm), np.where(flip & (rng.random(arm.shape) < 0.5), 1 - arm, arm)):
            comparisons.append(stats.compare(hits, base, higher_is_better=True, settings=FAST, rng=rng))
        verdicts = stats.judge(comparisons, 0.95)
        false_alarms += any(v["verdict"] != stats.SAME for v in verdicts)
        raw += [c["p"] < 0.05 for c in comparisons]
    assert false_alarms / SIMULATIONS <= 0.05, false_alarms / SIMULATIONS
    assert np.mean(raw) <= 0.06, np.mean(raw)  # each comparison alone too (1,000 x 6: binomial noise ~0.3%)
