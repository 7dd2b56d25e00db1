"""Sample order for training: one seeded global permutation per epoch, sliced by rank.

The state is (seed, epoch, position): `position` counts samples of the epoch's
permutation already handed out. Every rank walks the same permutation and takes
its slice of each global batch, so the global batch is the same set of samples
for any world size, and a restored state continues with no sample repeated or
skipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from kiln.shards.format import ShardSet


@dataclass
class LoaderState:
    seed: int
    epoch: int = 0
    position: int = 0


class Loader:
    def __init__(self, samples: ShardSet, global_batch: int, micro_batch: int, rank: int, world: int, seed: int) -> None:
        if global_batch % (micro_batch * world):
            raise ValueError(f"train.batch_size={global_batch} must be a multiple of micro_batch_size×world = {micro_batch}×{world}")
        if global_batch > len(samples):
            raise ValueError(f"train.batch_size={global_batch} exceeds the {len(samples)} training samples; lower it or add data")
        self.samples, self.global_batch, self.micro_batch = samples, global_batch, micro_batch
        self.rank, self.world = rank, world
        self.state = LoaderState(seed)
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.state.seed, epoch]))
            self._perm, self._perm_epoch = rng.permutation(len(self.samples)), epoch
        return self._perm

    def next_global_indices(self) -> np.ndarray:
        """Advance by one global batch; an epoch's remainder smaller than a batch is skipped."""
        if self.state.position + self.global_batch > len(self.samples):
            self.state.epoch, self.state.position = self.state.epoch + 1, 0
        perm = self.permutation(self.state.epoch)
        idx = perm[self.state.position: self.state.position + self.global_batch]
        self.state.position += self.global_batch
        return idx

    def next_batch(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the next global batch, each (micro_batch, sample_len) int64."""
        idx = self.next_global_indices()
        per_rank = self.global_batch // self.world
        mine = idx[self.rank * per_rank: (self.rank + 1) * per_rank]
        rows = np.stack([self.samples.sample(int(i)) for i in mine]).astype(np.int64)
        return list(torch.from_numpy(rows).split(self.micro_batch))

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = LoaderState(**state)
