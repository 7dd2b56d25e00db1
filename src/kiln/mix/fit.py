"""The fit: a regression from a run's mixture weights to each eval metric, and its cross-validated quality.

Models (on the metric's log when every value is positive, bits per byte; else on the value, an accuracy):
- `log-linear`: log y = sum_s b_s w_s (RegMix's and olmix's form; the weights sum to 1, so the b_s hold the
  intercept); one parameter per source;
- `log-quadratic`: the same plus b_st w_s w_t for every pair of sources (sources that help or hurt together);
  fitted only where the swarm holds enough runs for it, and chosen only where it measurably predicts better:
  a lower cross-validated error than the log-linear fit's.
Least squares (numpy's lstsq, a ridge of RIDGE on the coefficients for a well-posed system).

Cross-validation: every swarm run predicted by a fit that did not see it (leave one out up to LOO_MAX runs, else
FOLDS folds: run i in fold i mod FOLDS), compared with what it measured: Spearman's rank correlation
(scipy.stats.spearmanr), the root mean square error, and the error of the mean of the other runs (the fit is no
better than the mean when its error is not lower). The target (a weighted mean of metrics) is predicted from each
metric's held-out predictions and judged the same way: only a target fit better than the mean is trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.stats

MODELS = ("log-linear", "log-quadratic")
RIDGE = 1e-6
LOO_MAX = 40
FOLDS = 10


def features(weights: np.ndarray, model: str) -> np.ndarray:
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    if model == "log-linear":
        return w
    k = w.shape[1]
    pairs = [w[:, i] * w[:, j] for i in range(k) for j in range(i + 1, k)]
    return np.column_stack([w, *pairs]) if pairs else w


def n_params(sources: int, model: str) -> int:
    return sources if model == "log-linear" else sources + sources * (sources - 1) // 2


@dataclass(frozen=True)
class Model:
    name: str
    log: bool  # fitted on log(y)
    coef: np.ndarray

    def predict(self, weights: np.ndarray) -> np.ndarray:
        z = features(weights, self.name) @ self.coef
        return np.exp(z) if self.log else z


def fit(weights: np.ndarray, y: np.ndarray, model: str, log: bool | None = None) -> Model:
    x = features(weights, model)
    y = np.asarray(y, dtype=np.float64)
    log = bool(np.all(y > 0)) if log is None else log
    z = np.log(y) if log else y
    a = np.vstack([x, math.sqrt(RIDGE) * np.eye(x.shape[1])])
    b = np.concatenate([z, np.zeros(x.shape[1])])
    return Model(model, log, np.linalg.lstsq(a, b, rcond=None)[0])


def folds(n: int) -> list[np.ndarray]:
    """The held-out runs of each fold: one each (leave one out) up to LOO_MAX runs, else FOLDS folds."""
    k = n if n <= LOO_MAX else FOLDS
    return [np.arange(i, n, k) for i in range(k)]


def held_out(weights: np.ndarray, y: np.ndarray, model: str) -> tuple[np.ndarray, np.ndarray]:
    """(each run's prediction by a fit without it, the mean of the runs without it)."""
    y = np.asarray(y, dtype=np.float64)
    log = bool(np.all(y > 0))
    pred, mean = np.empty(len(y)), np.empty(len(y))
    for out in folds(len(y)):
        inside = np.setdiff1d(np.arange(len(y)), out)
        pred[out] = fit(weights[inside], y[inside], model, log).predict(weights[out])
        mean[out] = y[inside].mean()
    return pred, mean


def quality(actual: np.ndarray, predicted: np.ndarray, mean: np.ndarray) -> dict:
    """Spearman's rho (None where either side is constant), RMSE, and the held-out mean's RMSE."""
    actual, predicted = np.asarray(actual, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    rho = None
    if np.ptp(actual) > 0 and np.ptp(predicted) > 0:
        rho = float(scipy.stats.spearmanr(predicted, actual).statistic)
    return {"spearman": rho, "rmse": float(np.sqrt(np.mean((predicted - actual) ** 2))),
            "mean_rmse": float(np.sqrt(np.mean((mean - actual) ** 2)))}


def fit_metric(weights: np.ndarray, y: np.ndarray) -> dict:
    """The metric's chosen model (the lowest held-out error among those the runs suffice for), its fit on every
    run, its held-out predictions and their quality; None where the runs do not suffice for the log-linear."""
    n, k = weights.shape
    tried = {}
    for model in MODELS:
        if n - 1 < n_params(k, model) + 1:  # every training fold holds more runs than parameters
            continue
        pred, mean = held_out(weights, y, model)
        tried[model] = (pred, mean, quality(y, pred, mean))
    if not tried:
        return {}
    best = min(tried, key=lambda m: (tried[m][2]["rmse"], MODELS.index(m)))
    pred, mean, q = tried[best]
    return {"model": fit(weights, y, best), "held_out": pred, "held_out_mean": mean,
            "cv": {"model": best, **q, "tried": {m: round(t[2]["rmse"], 6) for m, t in tried.items()}}}


def target_of(metrics: dict[str, np.ndarray], target: dict[str, float]) -> np.ndarray:
    """The target per run: the weighted mean of its target metrics."""
    total = sum(target.values())
    return sum(weight / total * np.asarray(metrics[name], dtype=np.float64) for name, weight in target.items())


def fit_all(weights: np.ndarray, metrics: dict[str, np.ndarray], target: dict[str, float], need: int) -> dict:
    """Every metric fitted and the target judged: {"metrics": {name: fit_metric}, "target": quality,
    "trusted": bool, "why": the reason it is not}."""
    weights = np.asarray(weights, dtype=np.float64)
    n = len(weights)
    fits = {name: fit_metric(weights, y) for name, y in metrics.items()}
    if n < need or not all(fits[name] for name in target):
        return {"metrics": fits, "target": None, "trusted": False,
                "why": f"{n} finished swarm run(s): the fit needs at least {need}"}
    actual = target_of(metrics, target)
    predicted = target_of({name: fits[name]["held_out"] for name in target}, target)
    mean = target_of({name: fits[name]["held_out_mean"] for name in target}, target)
    q = quality(actual, predicted, mean)
    trusted = q["rmse"] < q["mean_rmse"]
    why = None if trusted else (f"the fit predicts held-out runs no better than their mean (error {q['rmse']:.4g} "
                                f"against {q['mean_rmse']:.4g}): the mixture does not measurably change the target "
                                "at this swarm's size and noise")
    return {"metrics": fits, "target": q, "trusted": trusted, "why": why, "held_out": predicted}


def predict_target(fits: dict, target: dict[str, float], weights: np.ndarray) -> np.ndarray:
    return target_of({name: fits[name]["model"].predict(weights) for name in target}, target)


def bootstrap_spread(weights: np.ndarray, metrics: dict[str, np.ndarray], fits: dict, target: dict[str, float],
                     at: np.ndarray, seed: int, resamples: int = 200) -> float:
    """The standard deviation of the predicted target at `at` over fits to resampled swarms (runs drawn with
    replacement; each metric's chosen model)."""
    rng = np.random.default_rng(seed)
    n, out = len(weights), []
    for _ in range(resamples):
        pick = rng.integers(0, n, n)
        if len(np.unique(pick)) <= weights.shape[1]:  # fewer distinct runs than weights: no fit to speak of
            continue
        models = {name: {"model": fit(weights[pick], np.asarray(metrics[name])[pick], fits[name]["model"].name,
                                      fits[name]["model"].log)} for name in target}
        out.append(float(predict_target(models, target, at[None, :])[0]))
    return float(np.std(out)) if out else 0.0
