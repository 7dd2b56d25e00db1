"""`train.threads: auto` (the default): the intra-op thread count that is fastest now, chosen by timing real steps.

On a CPU, torch's intra-op threads meet at a barrier after every op. When other programs keep the cores busy,
the scheduler parks one thread and every op waits for it: on 2 busy cores a step of a small model took
1.5-2.3 s with 2 threads and 0.08 s with 1 (NOTES.md). So on a CPU `auto` starts at 1 thread and, after the
first step, times real training steps taking turns at N threads (the cores this process may run on, shared by
the processes of this node) and at 1, three steps each, and keeps the faster by the median (at once when one
count's fastest step is CLEAR times the other's slowest: a busy machine costs one slow step, not three); it
says what it chose and why. It times again when its steps get SLOWER times slower than when it chose (load
came), and otherwise after an interval of steps that doubles each time the choice stands (load went).

The count does not change the numbers (CPU kernels here split work the same way whatever the thread count;
tests/test_threads.py trains with 1 and 2 threads and compares the losses bit for bit), so a resume may choose
differently without breaking bitwise resumption, and the choice holds no checkpoint state. On a GPU, and for
a number in train.threads, nothing is timed.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from typing import Callable

import torch

from kiln.train.parts.outcome import Outcome

TRIAL_STEPS = 3  # steps at each count in one trial
SLOWER = 1.5  # the chosen count's recent median step this much slower than when chosen: time again
CLEAR = 2.0  # a count whose fastest trial step is this much slower than the other's slowest loses at once
FIRST_INTERVAL = 50  # steps until the next trial when the choice stands; doubles each time, up to LAST_INTERVAL
LAST_INTERVAL = 1600


def available_threads() -> int:
    """The cores this process may run on (its CPU affinity), divided among the processes torchrun started on
    this node (LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class ThreadTuner:
    """A part: under `auto` on a CPU, sets torch's intra-op threads before each step (a number in train.threads
    is set once by the Trainer)."""

    def __init__(self, setting: int | str | None, device: torch.device, log: Callable[[str], None],
                 event: Callable[[dict], None], most: int | None = None) -> None:
        self.setting, self.log, self.event = setting, log, event
        self.most = most or available_threads()
        self.tuning = setting == "auto" and device.type == "cpu" and self.most > 1
        self.plan: list[int] = []  # the counts of the coming trial steps
        self.trial: dict[int, list[float]] = {}
        self.chosen, self.chosen_s = 1, float("inf")
        self.recent: deque[float] = deque(maxlen=TRIAL_STEPS)
        self.interval, self.next_trial = FIRST_INTERVAL, 0

    def pre_train(self) -> None:
        if self.tuning:
            torch.set_num_threads(1)  # safe on a busy machine, never far off on an idle one
            self.next_trial = -1  # after the first step, which pays for allocations and warm-up

    def pre_step(self, step: int) -> None:
        if self.tuning and self.plan:
            torch.set_num_threads(self.plan[0])

    def post_step(self, outcome: Outcome) -> None:
        if not self.tuning:
            return
        seconds = outcome.dt - float(outcome.measured.get("time_data_s") or 0.0)  # compute, not waiting for data
        if self.plan:
            self.trial.setdefault(self.plan.pop(0), []).append(seconds)
            if not self.plan or self.clear_winner():
                self.plan = []
                self.choose(outcome.step)
            return
        self.recent.append(seconds)
        slower = len(self.recent) == self.recent.maxlen and statistics.median(self.recent) > SLOWER * self.chosen_s
        if self.next_trial < 0 or slower or outcome.step >= self.next_trial:
            self.plan = [self.most, 1] * TRIAL_STEPS
            self.trial = {}

    def clear_winner(self) -> bool:
        """One count's fastest step is CLEAR times slower than the other's slowest: more steps would not change
        the choice (on busy cores a step at N threads can take 10x one at 1: no need to take three)."""
        if len(self.trial) < 2:
            return False
        (a, times_a), (b, times_b) = self.trial.items()
        return min(times_a) > CLEAR * max(times_b) or min(times_b) > CLEAR * max(times_a)

    def choose(self, step: int) -> None:
        medians = {n: statistics.median(times) for n, times in self.trial.items()}
        best = min(medians, key=lambda n: (medians[n], n))
        changed = best != self.chosen or self.chosen_s == float("inf")
        self.interval = FIRST_INTERVAL if changed else min(2 * self.interval, LAST_INTERVAL)
        self.chosen, self.chosen_s, self.next_trial = best, medians[best], step + self.interval
        self.recent.clear()
        torch.set_num_threads(best)
        self.event({"event": "threads", "step": step, "threads": best,
                    "step_s": {str(n): round(s, 4) for n, s in sorted(medians.items())}})
        if changed:
            busy = " (the cores are busy with other work)" if best < self.most else ""
            self.log(f"train.threads auto: {best} thread{'s' if best > 1 else ''}{busy}; a step took "
                     + ", ".join(f"{medians[n]:.3f} s on {n}" for n in sorted(medians)))
