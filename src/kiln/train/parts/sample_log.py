"""loader.record_samples: the exactly-once accounting of the data, as a record per step.

Every step each rank hands in the sample indices its loader gave it (`Loader.consumed`) and rank 0 writes
`{"event": "samples", "step", "epoch", "ranks": [[indices of data-parallel rank 0], [of rank 1], ...]}` to
metrics.jsonl (the ranks of one model replica, under tensor or pipeline parallelism, read the same ones). A
resume truncates metrics.jsonl to the checkpoint's step, so the records left describe the steps the final
weights saw: over a run with shrinks and grows, each sample of an epoch must appear in them once. One
all_gather_object of a few hundred integers per step: a check to run, not a setting for speed.
"""

from __future__ import annotations

from typing import Callable

from kiln.train.parallel import Dist, all_gather_objects


class SampleLog:
    def __init__(self, loader, d: Dist, event: Callable[[dict], None]) -> None:
        self.loader, self.d, self.event = loader, d, event

    def post_step(self, outcome) -> None:
        # By data-parallel rank: the ranks of one replica (tensor or pipeline parallel) read the same samples.
        ranks: list[list[int] | None] = [None] * self.loader.world
        for dp_rank, indices in all_gather_objects(self.d, (self.loader.rank, self.loader.consumed.tolist())):
            ranks[dp_rank] = indices
        if None in ranks:  # torchft: the other replica groups' slices, of the position every group checked it was at
            whole = self.loader.last_global_batch()
            ranks = [mine if mine is not None else theirs for mine, theirs in zip(ranks, whole)]
        self.event({"event": "samples", "step": outcome.step, "epoch": self.loader.state.epoch, "ranks": ranks})
