"""The proposal: the mixture that minimises the predicted target on the simplex under the repetition limit.

scipy.optimize.minimize (SLSQP: bounds 0 <= w_s <= the source's cap, one equality sum w = 1) from several
starts (the natural mixture, every swarm run's, each source's largest share), the best feasible end kept; its
weights rounded (kiln.mix.swarm.DIGITS) and made feasible again. The predicted target comes with its
uncertainty: the bootstrap spread of the fit at those weights and the fit's cross-validated error, together
sqrt(spread^2 + rmse^2), the typical miss of one prediction.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.optimize

from kiln.mix.fit import bootstrap_spread, predict_target
from kiln.mix.swarm import DIGITS, Budget, feasible


def starts(budget: Budget, swarm: np.ndarray) -> list[np.ndarray]:
    caps = budget.caps
    out = [budget.natural, *swarm]
    for s in range(len(caps)):  # each source as large as its cap allows, the rest natural
        w = budget.natural.copy()
        w[s] = 10.0
        out.append(feasible(w, caps))
    return [feasible(w, caps) for w in out]


def propose(fits: dict, target: dict[str, float], higher_is_better: bool, budget: Budget,
            swarm: np.ndarray) -> np.ndarray:
    """The weights minimising the predicted target (maximising it for an accuracy), inside the caps."""
    sign = -1.0 if higher_is_better else 1.0
    caps = budget.caps

    def objective(w: np.ndarray) -> float:
        return sign * float(predict_target(fits, target, w[None, :])[0])

    bounds = [(0.0, float(c)) for c in caps]
    constraint = {"type": "eq", "fun": lambda w: float(np.sum(w) - 1.0)}
    best, best_value = None, math.inf
    for start in starts(budget, swarm):
        result = scipy.optimize.minimize(objective, start, method="SLSQP", bounds=bounds, constraints=[constraint],
                                         options={"maxiter": 500, "ftol": 1e-12})
        w = feasible(np.round(feasible(result.x, caps), DIGITS), caps)
        value = objective(w)
        if value < best_value - 1e-12:
            best, best_value = w, value
    return np.round(best, DIGITS)


def proposal(fits: dict, metrics: dict[str, np.ndarray], target: dict[str, float], higher_is_better: bool,
             budget: Budget, swarm: np.ndarray, cv_rmse: float, seed: int) -> dict:
    """mix.json's `proposal`: weights, predicted target, its uncertainty, epochs per source."""
    w = propose(fits, target, higher_is_better, budget, swarm)
    predicted = float(predict_target(fits, target, w[None, :])[0])
    spread = bootstrap_spread(swarm, metrics, fits, target, w, seed)
    return {"weights": budget.as_dict(w), "predicted_target": predicted,
            "uncertainty": math.sqrt(spread ** 2 + cv_rmse ** 2), "bootstrap_sd": spread, "cv_rmse": cv_rmse,
            "epochs": budget.as_dict(budget.epochs(w))}
