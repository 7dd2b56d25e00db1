"""The training data: one or several shard sources, mixed by weight, in a seeded order per epoch.

A `Mixture` numbers the samples of its sources one after another (flat index).
An epoch has as many draws as the sources hold samples together; source s gets
its weight's share of them (largest remainder). Which draw goes to which source
is a seeded shuffle of the epoch; the k-th draw from source s takes element
k mod n_s of a seeded permutation of that source for pass k // n_s, so a
source drawn more than its size is repeated evenly and one drawn less is
subsampled afresh each epoch. The order is a pure function of (seed, epoch):
any position can be resumed exactly. One source without a weight is a plain
seeded permutation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.config import Config, SourceConfig
from kiln.errors import KilnError
from kiln.shards.reader import ShardSet
from kiln.shards.remote import ShardCache


def seeded(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def draws_per_source(sizes: list[int], weights: list[float]) -> np.ndarray:
    """Each source's share of an epoch of sum(sizes) draws, rounded by largest remainder (ties: earlier source)."""
    total = sum(sizes)
    quota = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(quota).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(quota - counts), kind="stable")[:short]] += 1
    return counts


class Mixture:
    """Samples of several ShardSets (same tokenizer and sample length) under one flat index."""

    def __init__(self, sets: list[ShardSet], weights: list[float] | None = None) -> None:
        first = sets[0]
        for s in sets[1:]:
            for key in ("tokenizer_sha256", "sample_len", "vocab_size"):
                if s.manifest[key] != first.manifest[key]:
                    raise KilnError(
                        f"{s.location}: {key} {s.manifest[key]} differs from {first.location} "
                        f"({first.manifest[key]}); pack every source with the same tokenizer and pack.seq_len"
                    )
        self.sets, self.manifest, self.sample_len = sets, first.manifest, first.sample_len
        self.sizes = [len(s) for s in sets]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.weights = weights
        self.counts = draws_per_source(self.sizes, weights) if weights else np.asarray(self.sizes, dtype=np.int64)
        for s, n, c in zip(sets, self.sizes, self.counts):
            if c and not n:
                raise KilnError(
                    f"{s.location}: has a sampling weight but no samples in this split; drop it from loader.sources"
                )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sample(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return self.sets[s].sample(i - int(self.offsets[s]))

    def gather(self, indices: np.ndarray, out: np.ndarray) -> None:
        """out[k] = sample(indices[k]) for flat indices."""
        if len(self.sets) == 1:
            self.sets[0].gather(indices, out)
            return
        src = np.searchsorted(self.offsets, indices, side="right") - 1
        for s in np.unique(src).tolist():
            rows = np.flatnonzero(src == s)
            self.sets[s].gather(indices[rows] - self.offsets[s], out, rows)

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The flat sample indices of one epoch, in training order."""
        if len(self.sets) == 1 and not self.weights:
            return seeded(seed, epoch, 0, 0).permutation(len(self))
        assign = np.repeat(np.arange(len(self.sets)), self.counts)
        seeded(seed, epoch).shuffle(assign)
        order = np.empty(len(assign), dtype=np.int64)
        for s, (n, c) in enumerate(zip(self.sizes, self.counts.tolist())):
            if not c:
                continue
            passes = [seeded(seed, epoch, s, j).permutation(n) for j in range(-(-c // n))]
            order[assign == s] = self.offsets[s] + np.concatenate(passes)[:c]
        return order


def sources(cfg: Config) -> list[SourceConfig]:
    return cfg.loader.sources or [SourceConfig(path=str(cfg.layout.shards))]


def open_splits(cfg: Config, tokenizer_sha256: str) -> tuple[Mixture, Mixture]:
    """(train, val) over `loader.sources` (default: {out_dir}/shards): train mixed by weight, val one source
    after another."""
    cache = ShardCache(Path(cfg.loader.cache_dir) if cfg.loader.cache_dir else cfg.layout.shard_cache,
                       int(cfg.loader.cache_max_gb * 2**30))
    chosen = sources(cfg)
    train = [ShardSet(s.path, "train", tokenizer_sha256, cache) for s in chosen]
    val = [ShardSet(s.path, "val", tokenizer_sha256, cache) for s in chosen]
    # 'data': the source's size times the weight the data stage's distribution check gave its documents.
    weights = [len(t) * t.manifest.get("data_weight", 1.0) if s.weight == "data" else s.weight
               for s, t in zip(chosen, train)]
    if None in weights and any(w is not None for w in weights):
        raise KilnError(f"loader.sources[{weights.index(None)}].weight is missing; give every source a weight, or none "
                        "(then each source counts by its number of samples)")
    if any(t.manifest["splits"]["train"].get("groups") for t in train):
        train, weights = by_shard_group(chosen, train, weights, tokenizer_sha256, cache)
    return Mixture(train, None if None in weights else weights), Mixture(val)


def by_shard_group(chosen: list[SourceConfig], train: list[ShardSet], weights: list, tokenizer_sha256: str,
                   cache: ShardCache) -> tuple[list[ShardSet], list[float]]:
    """Each source packed in shard groups (pack.py `ShardGroups`) becomes one set per group, drawn in
    proportion to its samples times its group's weight: a drifting source's share of samples drops by
    its weight. A source given a number keeps that weight in total, split between its groups that way;
    with every weight unset, an ungrouped source counts by its samples, as without groups."""
    sets, out = [], []
    for s, t, w in zip(chosen, train, weights):
        groups = t.manifest["splits"]["train"].get("groups")
        if not groups:
            sets.append(t)
            out.append(len(t) if w is None else w)  # every weight unset: counts by its samples
            continue
        parts = [ShardSet(s.path, "train", tokenizer_sha256, cache, group=k) for k in range(len(groups))]
        share = [len(p) * g["weight"] for p, g in zip(parts, groups)]
        scale = s.weight / sum(share) if isinstance(s.weight, float) else 1.0
        sets += parts
        out += [x * scale for x in share]
    return sets, out
