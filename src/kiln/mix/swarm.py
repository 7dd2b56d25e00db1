"""The swarm: mixtures drawn around the sources' natural shares, every one inside the repetition limit.

A run's weights are loader.sources weights: the loader (kiln.train.data.Mixture) gives source s the share w_s of
the run's T training samples (every sample is pack.seq_len + 1 tokens, so samples and tokens are the same
shares), so s is repeated w_s * T / n_s times, n_s being its training samples. The repetition limit
`max_epochs` E is then a cap per source: w_s <= E * n_s / T (and <= 1). Some mixture meets every cap exactly
when the natural one does (w_s = n_s / N, repeated T / N times), i.e. when T <= E * N; else no mixture can.

Draw i of the swarm is Dirichlet(concentration * k * natural) for k sources (concentration 1 and equal shares:
uniform on the simplex), from its own seeded stream (swarm_seed, i), so a larger swarm keeps the earlier
draws; a draw over a cap is drawn again (at most MAX_TRIES times, then one line says to loosen the limit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import ConfigError

MAX_TRIES = 10_000  # Dirichlet draws per swarm run before the limit is called too tight for the swarm
DIGITS = 6  # weights are rounded to this many decimals (in loader.sources and mix.json)


@dataclass(frozen=True)
class Budget:
    names: list[str]  # the sources, in the mix file's order
    samples: np.ndarray  # each source's training samples
    run_samples: int  # samples a run trains on (train.max_steps x train.batch_size)
    max_epochs: float

    @property
    def natural(self) -> np.ndarray:
        return self.samples / self.samples.sum()

    @property
    def caps(self) -> np.ndarray:
        """Each source's largest weight under the repetition limit."""
        return np.minimum(1.0, self.max_epochs * self.samples / self.run_samples)

    def epochs(self, weights: np.ndarray) -> np.ndarray:
        """How often each source is repeated in a run of these weights."""
        return np.asarray(weights, dtype=np.float64) * self.run_samples / self.samples

    def fits(self, weights: np.ndarray, slack: float = 1e-9) -> bool:
        return bool(np.all(np.asarray(weights) <= self.caps + slack))

    def as_dict(self, weights: np.ndarray) -> dict[str, float]:
        return {name: round(float(w), DIGITS) for name, w in zip(self.names, weights)}


def check_feasible(budget: Budget, file) -> None:
    """One line when no mixture can meet the repetition limit (the natural one is the last to)."""
    empty = [n for n, s in zip(budget.names, budget.samples) if s <= 0]
    if empty:
        raise ConfigError(f"{file}: source {empty[0]!r} has no training samples after packing (its documents are "
                          "fewer or shorter than one sequence); give it more data or remove it")
    total = int(budget.samples.sum())
    need = budget.run_samples / total
    if need > budget.max_epochs:
        raise ConfigError(f"{file}: max_epochs {budget.max_epochs:g} is a limit no mixture can meet: a run trains on "
                          f"{budget.run_samples:,} samples and the sources hold {total:,} together ({need:.2f} epochs "
                          f"of everything); raise max_epochs to {need:.2f} or more, lower proxy_tokens, or add data")


def feasible(weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """The weights made a mixture under the caps: negatives to 0, then the mass over a cap handed to the sources
    under theirs in proportion to their weights (to all under theirs equally when those weigh 0)."""
    w = np.clip(np.asarray(weights, dtype=np.float64), 0.0, None)
    w = w / w.sum() if w.sum() > 0 else np.full(len(w), 1.0 / len(w))
    for _ in range(len(w) + 1):
        over = w > caps
        if not over.any():
            break
        spare = float((w[over] - caps[over]).sum())
        w[over] = caps[over]
        free = (~over) & (w < caps)
        share = w[free] if w[free].sum() > 0 else np.ones(int(free.sum()))
        w[free] += spare * (share / share.sum())  # the fractions first: spare * a subnormal share is 0
    return w


def draw(budget: Budget, concentration: float, seed: int, count: int) -> list[np.ndarray]:
    """`count` mixtures, each inside the caps, rounded to DIGITS decimals."""
    alpha = np.maximum(concentration * len(budget.names) * budget.natural, 1e-3)
    caps, out = budget.caps, []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        for _ in range(MAX_TRIES):
            w = np.round(rng.dirichlet(alpha), DIGITS)
            if w.sum() > 0 and budget.fits(w):
                out.append(w)
                break
        else:
            raise ConfigError(f"swarm run {i}: {MAX_TRIES:,} Dirichlet draws around the natural shares all repeat "
                              f"some source more than max_epochs {budget.max_epochs:g} times (caps "
                              f"{budget.as_dict(caps)}); raise max_epochs or concentration, or lower proxy_tokens")
    return out
