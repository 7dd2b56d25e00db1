"""The validation loss and the downstream tasks in the loop (the loop asks `should_validate` / `tasks_due`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.config import TrainConfig
from kiln.errors import KilnError
from kiln.scoring.losses import sample_batches
from kiln.train.parallel import Dist, all_reduce_sum
from kiln.train.parallel.parallelize import Parallelized
from kiln.train.schedule import Schedule


class Validator:
    """Mean loss on the first train.eval_batches batches of the validation split (the same samples every time),
    every train.eval_every steps, at the last step and whenever the schedule asks (breathing's pauses); the
    eval.tasks every eval.tasks_every steps. Its history (val_loss by step) is saved as `history`."""

    state_key = "history"

    def __init__(self, train: TrainConfig, val_set, micro_batch: int, parallel: Parallelized, d: Dist,
                 pad_id: int | None, schedule: Schedule, tasks, seq_len: int, shards: Path,
                 event: Callable[[dict], None], log: Callable[[str], None], beat: Callable[[int], None]) -> None:
        self.cfg, self.val_set, self.micro_batch, self.parallel, self.d = train, val_set, micro_batch, parallel, d
        self.pad_id, self.schedule, self.tasks, self.seq_len, self.shards = pad_id, schedule, tasks, seq_len, shards
        self.event, self.log, self.beat = event, log, beat
        self.val_loss: dict[str, float] = {}  # step (as a string: JSON) -> val loss

    def should_validate(self, step: int) -> bool:
        t = self.cfg
        return bool(t.eval_every and step % t.eval_every == 0) or step == t.max_steps or self.schedule.wants_eval(step)

    def evaluate(self, step: int) -> float:
        w = self.parallel.dp_world  # the ranks of one tensor-parallel group or one pipeline take the same rows
        n = min(len(self.val_set), self.cfg.eval_batches * self.micro_batch * w) // w * w
        if n == 0:
            raise KilnError(f"{self.shards}: the validation split has too few samples; raise pack.val_fraction")
        mine = torch.arange(n)[self.parallel.dp_rank::w].numpy()  # equal counts: FSDP2 needs every rank in every
        total, count = self.parallel.summed_loss(sample_batches(self.val_set, mine, self.micro_batch),  # forward
                                                 self.pad_id)
        total, count = all_reduce_sum([total, count], self.d)
        self.beat(step)
        return total / count

    def validate(self, step: int) -> float:
        """Evaluate, record it in the history and the metrics, and tell the schedule."""
        val = self.evaluate(step)
        self.val_loss[str(step)] = val
        self.event({"event": "eval", "step": step, "val_loss": val})
        self.log(f"step {step} val_loss {val:.4f}")
        return val

    def tasks_due(self, step: int) -> bool:
        return self.tasks.due(step, self.cfg.max_steps)

    def run_tasks(self, step: int) -> None:
        """The downstream tasks of eval.tasks (kiln.scoring.mc), one `task` event each."""
        reduce = functools.partial(all_reduce_sum, d=self.d)
        p = self.parallel
        for name, result in self.tasks.run(p.module, self.seq_len, self.d.device, p.autocast, self.d.rank,
                                           self.d.world, reduce):
            self.event({"event": "task", "step": step, "task": name, **result})
            self.log(f"step {step} {name}: acc {result['acc']:.4f} acc_norm {result['acc_norm']:.4f} "
                     f"acc_bytes {result['acc_bytes']:.4f} (n {result['n']})")
        self.beat(step)

    def best_step(self) -> int | None:
        """The step of the lowest validation loss after step 0 (checkpoint.keep_best keeps it)."""
        vals = {int(s): v for s, v in self.val_loss.items() if int(s) > 0}
        return min(vals, key=vals.get) if vals else None

    def state_dict(self) -> dict[str, Any]:
        return {"val_loss": self.val_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.val_loss = dict(state["val_loss"])
