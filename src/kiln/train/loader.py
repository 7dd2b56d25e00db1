"""Sample order for training: one seeded global order per epoch, sliced by rank, prefetched in a thread.

The state is (seed, epoch, position): `position` counts draws of the epoch's
order already handed out. Every rank walks the same order and takes its slice
of each global batch, so the global batch is the same set of samples for any
world size, and a restored state (saved under any world size) continues with
no sample repeated or skipped: an elastic job that shrinks or grows resumes the
order where its checkpoint left it. `split_batch` is the arithmetic of a fixed
global batch on a world of any size (the micro-batch kept, accumulation grown),
and `consumed` the sample indices this rank was handed last (the exactly-once
accounting, loader.record_samples).

With `prefetch` > 0 a background thread assembles the next batches into a
bounded queue; each batch travels with the state after it, and `state` is
that of the last batch handed out, never of one merely prefetched. Batches are
built in pinned memory when a GPU is present, so `.to(device, non_blocking=True)`
overlaps the copy.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kiln.shards.reader import ShardSet
from kiln.train.data import Mixture


@dataclass(frozen=True)
class LoaderState:
    seed: int
    epoch: int = 0
    position: int = 0


class BatchPlan:
    """What the next batch is, given a state; used by the caller or by the prefetch thread, never both at once."""

    def __init__(self, samples: Mixture, global_batch: int, micro_batch: int, rank: int, world: int) -> None:
        self.samples, self.global_batch, self.micro_batch = samples, global_batch, micro_batch
        self.per_rank = global_batch // world
        self.rank = rank
        self.pin = torch.cuda.is_available()
        self._order_key: tuple[int, int] | None = None
        self._order = np.empty(0, dtype=np.int64)

    def order(self, seed: int, epoch: int) -> np.ndarray:
        if self._order_key != (seed, epoch):
            self._order, self._order_key = self.samples.epoch_order(seed, epoch), (seed, epoch)
        return self._order

    def advance(self, state: LoaderState) -> tuple[np.ndarray, LoaderState]:
        """The next global batch's flat indices and the state after it; an epoch's remainder smaller than a
        batch is skipped."""
        epoch, position = state.epoch, state.position
        if position + self.global_batch > len(self.samples):
            epoch, position = epoch + 1, 0
        idx = self.order(state.seed, epoch)[position: position + self.global_batch]
        return idx, LoaderState(state.seed, epoch, position + self.global_batch)

    def mine(self, global_indices: np.ndarray) -> np.ndarray:
        """This rank's slice of a global batch's indices."""
        return global_indices[self.rank * self.per_rank: (self.rank + 1) * self.per_rank]

    def assemble(self, mine: np.ndarray) -> list[torch.Tensor]:
        """This rank's samples `mine` as micro-batches, each (micro_batch, sample_len) int64."""
        shape = (len(mine), self.samples.sample_len)
        # numpy's allocator reuses freed memory; torch's returns large blocks to the OS and page-faults them back
        rows = (
            torch.empty(shape, dtype=torch.int64, pin_memory=True)
            if self.pin
            else torch.from_numpy(np.empty(shape, np.int64))
        )
        self.samples.gather(mine, rows.numpy())
        return list(rows.split(self.micro_batch))


class Prefetcher:
    """A daemon thread walking the plan ahead of the caller into a queue of (batch, state after it, its indices)."""

    def __init__(self, plan: BatchPlan, state: LoaderState, depth: int) -> None:
        self.queue: queue.Queue = queue.Queue(depth)
        self.stopped = threading.Event()
        # The thread holds the plan, not the Loader, so an abandoned Loader is collected and its finalizer stops this.
        self.thread = threading.Thread(target=self._run, args=(plan, state, self.queue, self.stopped),
                                       name="kiln-prefetch", daemon=True)
        self.thread.start()

    @staticmethod
    def _run(plan: BatchPlan, state: LoaderState, q: queue.Queue, stopped: threading.Event) -> None:
        def put(item) -> None:
            while not stopped.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return
                except queue.Full:
                    pass

        try:
            while not stopped.is_set():
                idx, state = plan.advance(state)
                mine = plan.mine(idx)
                put((plan.assemble(mine), state, mine))
        except BaseException as exc:  # handed to the caller, raised there
            put((exc, None, None))

    def get(self) -> tuple[list[torch.Tensor], LoaderState, np.ndarray]:
        batch, state, mine = self.queue.get()
        if isinstance(batch, BaseException):
            self.close()
            raise batch
        return batch, state, mine

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()


def _close(running: list[Prefetcher]) -> None:
    while running:
        running.pop().close()


def split_batch(global_batch: int, micro_batch: int | None, world: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) that make the global batch on `world` data-parallel ranks.

    train.batch_size is global whatever the world: an elastic job that shrinks accumulates more micro-batches per
    step, so the optimisation (global batch, schedule, tokens per step) stays the same. `micro_batch`
    (train.micro_batch_size) is kept when given, so memory per device does not grow; unset, each rank takes its
    whole share in one micro-batch. A world the batch cannot be split over is a ValueError that names the world
    sizes it can."""
    micro = micro_batch or global_batch // world
    if micro >= 1 and global_batch % (micro * world) == 0:
        return micro, global_batch // (micro * world)
    unit = micro_batch or 1
    fits = [w for w in range(1, global_batch // unit + 1) if global_batch % (unit * w) == 0]
    what = (f"must be a multiple of micro_batch_size×world = {micro}×{world}" if micro >= 1 else
            f"is smaller than the data-parallel world size {world}")
    raise ValueError(f"train.batch_size={global_batch} {what}: it splits over "
                     f"{', '.join(map(str, fits[:12]))}{', ...' if len(fits) > 12 else ''} data-parallel ranks"
                     f"{f' in micro-batches of {micro_batch}' if micro_batch else ''}; choose a batch size every "
                     "world of the job divides (elastic: each node count from torchrun's --nnodes MIN to MAX, "
                     "times --nproc-per-node)")


class Loader:
    state_key = "loader"  # saved in every checkpoint (train/checkpoint/checkpointer.py); a rollback keeps the position

    def __init__(self, samples: Mixture | ShardSet, global_batch: int, micro_batch: int | None, rank: int,
                 world: int, seed: int, prefetch: int = 0) -> None:
        """`micro_batch` None: each rank's share of the global batch in one micro-batch (split_batch)."""
        samples = samples if isinstance(samples, Mixture) else Mixture([samples])
        micro_request = micro_batch
        micro_batch, self.accumulation = split_batch(global_batch, micro_batch, world)
        if global_batch > len(samples):
            raise ValueError(
                f"train.batch_size={global_batch} exceeds the {len(samples)} training samples; lower it or add data"
            )
        self.samples, self.global_batch, self.micro_batch = samples, global_batch, micro_batch
        self.rank, self.world, self.prefetch, self.micro_request = rank, world, prefetch, micro_request
        self.plan = BatchPlan(samples, global_batch, micro_batch, rank, world)
        self.state = LoaderState(seed)
        self.consumed = np.empty(0, dtype=np.int64)  # the sample indices of this rank's last batch
        self._running: list[Prefetcher] = []  # at most one
        weakref.finalize(self, _close, self._running)

    def next_batch(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the next global batch, each (micro_batch, sample_len) int64."""
        if not self.prefetch:
            idx, self.state = self.plan.advance(self.state)
            self.consumed = self.plan.mine(idx)
            return self.plan.assemble(self.consumed)
        if not self._running:
            self._running.append(Prefetcher(self.plan, self.state, self.prefetch))
        batch, self.state, self.consumed = self._running[0].get()
        return batch

    def regroup(self, rank: int, world: int) -> None:
        """Another data-parallel world (torchft replica groups that left or joined): the same global batch split
        over it (split_batch; a world it cannot be split over is its ValueError), the position kept."""
        if (rank, world) == (self.rank, self.world):
            return
        micro, accumulation = split_batch(self.global_batch, self.micro_request, world)
        _close(self._running)
        self.micro_batch, self.accumulation, self.rank, self.world = micro, accumulation, rank, world
        self.plan = BatchPlan(self.samples, self.global_batch, micro, rank, world)

    def last_global_batch(self) -> list[list[int]]:
        """The last batch handed out, every data-parallel rank's slice of it (from the order, not the ranks)."""
        s = self.state
        idx = self.plan.order(s.seed, s.epoch)[s.position - self.global_batch: s.position]
        return [idx[r * self.plan.per_rank: (r + 1) * self.plan.per_rank].tolist() for r in range(self.world)]

    def next_global_indices(self) -> np.ndarray:
        """Advance by one global batch without reading it (all ranks' indices)."""
        _close(self._running)
        idx, self.state = self.plan.advance(self.state)
        return idx

    def close(self) -> None:
        """Stop the prefetch thread (it restarts from `state` on the next batch)."""
        _close(self._running)

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        _close(self._running)
        self.state = LoaderState(**state)
