"""torchft replica groups in the loop (parallel.fault_tolerance: torchft; the Manager is parallel/ft.py's).

Before the first step and after every step (unless train.outer, whose LocalSGD / DiLoCo ask at each sync) the
group asks the lighthouse for a quorum. A group behind the quorum's step heals there from a live peer: the
weights, the optimizer, and every part's state (the step, the loader's position, the schedule, ...), so the
loop goes on from the peer's next step (under train.outer torchft's step is set to Kiln's before each quorum,
so a group that resumed an older checkpoint heals from the one ahead; a group joining mid-run waits for the
others' next sync, heals from the state they send there and takes part in that sync). The loader then
splits the same global batch over the participating groups (Loader.regroup). A step that a lost group kept
from committing (ft.LOST) is taken again on the groups left, from the same data position (`retry`): nothing is
skipped or counted twice, and the step counter never goes back.

Each change of the participating groups is a `membership` record in metrics.jsonl:

  change                        "start", "shrink", "grow" or "groups" (as many, others)
  step, wall_time               the step the next one follows, and when the quorum formed
  groups_before, groups_after   the replica groups' numbers; `left`, `joined`
  world_before, world_after     data-parallel ranks over all groups (group dp_world x groups)
  healed                        this group took a live peer's state in this quorum
  micro_batch, accumulation     how this world makes the same global batch (loader.split_batch)
  retried_step                  a step taken again because a group was lost during it (else absent)

Under train.outer each synchronisation is an `outer_sync` record: step, algorithm, committed (torchft's
should_commit: false when a group was lost during it, the sync's H steps discarded), groups, bytes (what this
rank handed to the cross-group all-reduces since the last sync: the communication volume), outer_step
(the count of committed syncs). A step the guards skipped still counts toward the next sync.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable

from kiln.errors import KilnError


class Replicas:
    state_key = "replicas"  # torchft's step count and the outer algorithm's position (train.outer)

    def __init__(self, parallel, engine, state, loader, mesh, outer, max_steps: int, event: Callable[[dict], None],
                 log: Callable[[str], None]) -> None:
        from kiln.train.parallel.ft import Outer

        self.parallel, self.groups, self.engine, self.train_state = parallel, parallel.replicas, engine, state
        self.loader, self.mesh, self.max_steps, self.event, self.log = loader, mesh, max_steps, event, log
        self.members: list[int] | None = None
        self.before = loader.state
        self.healed = False
        self.groups.register("kiln", self._heal, self._share)
        if outer is not None:
            self.groups.outer = Outer(outer, self.groups, engine.model, engine.optimizer)

    # --- healing: what a live peer sends, what a joining group loads --------------------------------------

    def _share(self) -> dict[str, Any]:
        e, train, outer = self.engine, self.state().state_dict(), self.groups.outer
        in_sync = outer is not None and outer.in_sync
        if in_sync:  # inside step N's optimizer step (a sync): the state as of step N's end, the sync's to finish
            train["step"] += 1
            train["tokens_seen"] += self.loader.global_batch * (self.loader.samples.sample_len - 1)
        return {"model": e.model.state_dict(), "optimizer": e.optimizer.state_dict(),
                "scaler": e.scaling.state_dict(), "train": train, "in_sync": in_sync}

    def _heal(self, shared: dict[str, Any]) -> None:
        e = self.engine
        e.model.load_state_dict(shared["model"])
        e.optimizer.load_state_dict(shared["optimizer"])
        e.scaling.load_state_dict(shared["scaler"])
        self.pending = shared["train"], shared.get("in_sync", False)

    def _apply_heal(self) -> bool:
        """The peer's loop state, if this quorum healed this group; True when the peer sent it from a sync."""
        pending, self.pending = getattr(self, "pending", None), None
        if pending is None:
            return False
        self.state().load_state_dict(pending[0])  # after the loop's own bookkeeping of the step: the peer's wins
        self.healed = True
        return pending[1]

    # --- the quorum ---------------------------------------------------------------------------------

    def quorum(self, retried: int | None = None) -> None:
        outer = self.groups.outer  # its quorums are at syncs: torchft's step is Kiln's (ReplicaGroups.at_step)
        self.groups.quorum(self.state().step if outer is not None else None)
        joined = self._apply_heal() and outer is not None  # a group joining mid-run: the others' sync
        if joined:
            outer.join_sync()
        self._regroup(self.groups.members(), retried)
        if joined:
            self._synced(self.state().step)

    def _regroup(self, members: list[int], retried: int | None) -> None:
        world_before = self.loader.world
        rank, world = self.groups.data_parallel(self.mesh.dp_rank, self.mesh.dp_world)
        try:
            self.loader.regroup(rank, world)
        except ValueError as exc:
            raise KilnError(f"replica groups {members}: {exc}") from None
        self.before = self.loader.state
        self.parallel.position = self.before.position
        if members != self.members or self.healed:
            before, self.members = self.members, members
            kind = ("start" if before is None else "shrink" if len(members) < len(before) else
                    "grow" if len(members) > len(before) else "groups")
            record = {"event": "membership", "step": self.state().step, "wall_time": time.time(), "change": kind,
                      "groups_before": before, "groups_after": members,
                      "left": sorted(set(before or []) - set(members)),
                      "joined": sorted(set(members) - set(before or [])) if before is not None else [],
                      "world_before": world_before, "world_after": world, "healed": self.healed,
                      "micro_batch": self.loader.micro_batch, "accumulation": self.loader.accumulation}
            self.event({**record, "retried_step": retried} if retried is not None else record)
            if self.d_main:
                self.log(f"replica groups: {kind} at step {self.state().step}, groups {before} -> {members}"
                         f"{' (healed from a live peer)' if self.healed else ''}; the global batch kept: "
                         f"{self.loader.accumulation} micro-batch(es) of {self.loader.micro_batch} per rank")
            self.healed = False

    def state(self):
        return self.train_state()  # the loop's TrainState (made after its parts)

    @property
    def d_main(self) -> bool:
        return self.parallel.d.is_main

    # --- the loop's hooks -----------------------------------------------------------------------------

    def pre_train(self) -> None:
        self.quorum()

    def pre_step(self, step: int) -> None:
        if self.groups.outer is not None:  # a sync in this step asks for its quorum at this step
            self.groups.at_step(step)

    def retry(self, step: int) -> None:
        """Step `step` did not commit (a group was lost during it): again, from the same data, on a new quorum."""
        self.loader.load_state_dict(asdict(self.before))
        self.quorum(retried=step)

    def post_step(self, outcome) -> None:
        outer = self.groups.outer
        if outer is not None:  # LocalSGD / DiLoCo asked for a quorum at their sync, if any
            if outcome.result.get("skip_reason"):
                outer.skipped(self.engine.optimizer)
            self._apply_heal()  # a sync's quorum healed this group inside the optimizer step
            self._regroup(self.groups.members(), None)
            self._synced(outcome.step)
            return
        if outcome.step < self.max_steps:
            self.quorum()

    def _synced(self, step: int) -> None:
        outer = self.groups.outer
        if outer.synced is not None:
            self.event({"event": "outer_sync", "step": step, "wall_time": time.time(), "groups": self.members,
                        **outer.synced})
            outer.synced = None

    def state_dict(self) -> dict[str, Any]:
        return self.groups.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups.load_state_dict(state)

    def close(self) -> None:
        self.groups.close()
