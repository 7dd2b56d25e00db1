"""A torch.profiler trace of steps [first, last] when train.profile_steps asks for one; Python's collector paused in
the loop."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from kiln.train.parts.outcome import Outcome


class Profiler:
    """Traces steps window[0]..window[-1] into `out`/trace-rank{rank}.json."""

    def __init__(self, window: list[int] | None, out: Path, rank: int) -> None:
        self.window, self.out, self.rank, self.prof = window, out, rank, None

    def pre_step(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self.prof = torch.profiler.profile(record_shapes=True, with_stack=False)
            self.prof.__enter__()

    def post_step(self, outcome: Outcome) -> None:
        if self.prof is not None and outcome.step == self.window[-1]:
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.out.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.out / f"trace-rank{self.rank:05d}.json"))
            self.prof = None


class CollectorPause:
    """Python's collector off in the loop and run every train.gc_every steps, at the same steps on every rank: a
    collection at a random moment on one rank makes every other rank wait for it in the next collective."""

    def __init__(self, every: int) -> None:
        self.every, self.paused = every, False

    def pre_train(self) -> None:
        self.paused = bool(self.every) and gc.isenabled()
        if self.paused:
            gc.disable()

    def post_step(self, outcome: Outcome) -> None:
        if self.paused and outcome.step % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.paused:
            gc.enable()
            self.paused = False
