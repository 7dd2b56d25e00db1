"""Membership: which hosts train, what changed since the group before, and which hosts are excluded from the job.

An elastic job (`torchrun --nnodes=MIN:MAX --rdzv-backend=c10d`) restarts its workers whenever a node is lost or
comes back, and each start of the loop is a new group. `Membership` compares the group that starts with the one
that trained before it in this run folder and, when the world size or its hosts changed, says so: one console
line at once, and at the first step of the new group a `membership` record in metrics.jsonl:

  change                       "shrink", "grow" or "hosts" (the same size on other hosts)
  world_before, world_after    ranks of the group before and of this one
  hosts_before, hosts_after    their hosts by rank; `left`, `joined`: the hosts that went and came
  checkpoint, step             the checkpoint resumed (folder name; null: a fresh start) and its step
  last_step_before             the last step the group before completed (from metrics.jsonl)
  lost_steps, lost_s           its work past that checkpoint, trained again (steps, wall seconds)
  recovery_s                   seconds from that last step to the end of this group's first step
  micro_batch, accumulation    how this world makes the same global batch (loader.split_batch)

Where the group before is known from: `run/membership.json`, which rank 0 writes at every start (world and hosts
by rank); in a run folder without it, the record of the group that wrote the checkpoint resumed (this part's
state, key `membership`). Its last step and that step's time come from metrics.jsonl's step records, read before
the resume truncates them. Both need the run folder on a filesystem every node sees (as sharded checkpoints do);
on a node-local one a new rank 0 finds neither and reports no change.

Excluded hosts (`watchdog.on_stall: exclude_host`): `run/excluded_hosts/HOST`, one file per host holding the
watchdog's report. At every start the ranks take rank 0's list (`admit`): a rank on an excluded host stops its
torchrun agent with SIGTERM (an agent that ends by a signal leaves the rendezvous open, where one that returns
closes it for every node: torch's elastic launcher) and exits; the other ranks exit too, and their agents
re-rendezvous without that host. An operator lets the host back in by deleting its file and starting its agent
again: the group grows at its next restart.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from kiln.errors import KilnError
from kiln.manifest import write_atomic
from kiln.train.parallel import Dist, all_gather_objects
from kiln.train.parallel.dist import shares_agent_store

GROUP_FILE = "membership.json"
EXCLUDED = "excluded_hosts"
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")  # a host name that is a plain file name


# --- excluded hosts ---------------------------------------------------------------------------

def exclude_host(run_dir: Path, host: str, report: dict[str, Any]) -> Path | None:
    """Record `host` as excluded from the run (its file holds `report`); None when the name cannot be a file name."""
    if not HOST_NAME.match(host):
        return None
    folder = Path(run_dir) / EXCLUDED
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / host, json.dumps(report) + "\n")
    return folder / host


def excluded_hosts(run_dir: Path) -> list[str]:
    """The hosts excluded from the run (temporary files of a write in progress start with a dot: not hosts)."""
    folder = Path(run_dir) / EXCLUDED
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_file() and HOST_NAME.match(p.name))


def stop_agent() -> bool:
    """SIGTERM to this worker's torchrun agent (its parent), so the agent leaves the job without closing the
    rendezvous; False when the parent is not a torchrun agent (then nothing is signalled). This process ignores
    the SIGTERM the agent then sends its workers: it is on its way out and says why first."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    try:
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    if b"torchrun" not in cmdline and b"torch.distributed.run" not in cmdline:
        return False
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent passes it on to us: we are leaving, with our message
    os.kill(parent, signal.SIGTERM)
    return True


# --- the previous group's last steps -------------------------------------------------------------

def last_steps(metrics: Path, resume_step: int) -> dict[str, Any]:
    """From metrics.jsonl (streamed; a torn last line of a killed writer is skipped): the last step record's step
    and wall time, and the wall time of the step resumed from (from step 0: when step 1 began)."""
    found: dict[str, Any] = {"last_step": None, "last_time": None, "resume_time": None}
    try:
        with open(metrics) as f:
            for line in f:
                if '"event": "step"' not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                found.update(last_step=record["step"], last_time=record.get("wall_time"))
                if record["step"] == resume_step:
                    found["resume_time"] = record.get("wall_time")
                elif record["step"] == 1 and resume_step == 0 and record.get("wall_time") is not None:
                    found["resume_time"] = record["wall_time"] - record["step_time_s"]
    except OSError:
        pass
    return found


# --- the part ---------------------------------------------------------------------------------

class Membership:
    """The group's hosts by rank (agreed once, at construction: a collective), `admit` against the excluded hosts,
    and the change since the group before (`begin` after the resume, recorded at the first step)."""

    state_key = "membership"  # the group that saved a checkpoint: where the group before is known from, failing
    # the run folder's membership.json

    def __init__(self, d: Dist, run_dir: Path, event: Callable[[dict], None], log: Callable[[str], None]) -> None:
        self.d, self.run_dir, self.event, self.log = d, Path(run_dir), event, log
        seen = all_gather_objects(d, (d.host, excluded_hosts(self.run_dir) if d.is_main else None))
        self.hosts = [host for host, _ in seen]
        self.excluded = seen[0][1]  # rank 0's view of the run folder decides, as for checkpoints (consensus.py)
        self.saved: dict[str, Any] | None = None
        self.change: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"world": self.d.world, "hosts": self.hosts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state

    def admit(self) -> None:
        """Stop every rank when some rank of the group is on an excluded host: those ranks stop their agent and
        exit; the others exit, and torchrun restarts them without that host."""
        bad = [(rank, host) for rank, host in enumerate(self.hosts) if host in self.excluded]
        if not bad:
            return
        folder = self.run_dir / EXCLUDED
        if self.d.host in self.excluded:
            agent = ("its torchrun agent stops" if stop_agent() else
                     "stop its torchrun agent (this process's parent is not one)")
            raise KilnError(f"host {self.d.host} is excluded from this run ({folder / self.d.host}): its workers "
                            f"leave the job and {agent}; to let it back in, delete that file and start the agent "
                            "again")
        rank, host = bad[0]
        raise KilnError(f"rank {rank} on host {host} is excluded from this run ({folder / host}); exiting so "
                        "torchrun restarts the group without it")

    def begin(self, checkpoint: Path | None, step: int, micro_batch: int, accumulation: int) -> None:
        """After the resume, before metrics.jsonl is truncated to it: find what changed since the group before
        (rank 0), say it, and record this group as the one before the next."""
        if not self.d.is_main:
            return
        group_file = self.run_dir / GROUP_FILE
        try:
            before = json.loads(group_file.read_text())
        except (OSError, ValueError):
            before = self.saved
        now = {"world": self.d.world, "hosts": self.hosts}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(group_file, json.dumps(now) + "\n")
        if not before or (before["world"], sorted(before["hosts"])) == (now["world"], sorted(now["hosts"])):
            return
        self.change = self._change(before, checkpoint, step, micro_batch, accumulation)
        self.log(self._line(self.change))
        if self.change["change"] == "shrink" and "TORCHELASTIC_RUN_ID" in os.environ and shares_agent_store():
            self.log("warning: this job cannot grow back: torch 2.13's c10d rendezvous hangs when a node rejoins "
                     "unless every agent runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch issue 147064)")

    def _change(self, before: dict, checkpoint: Path | None, step: int, micro_batch: int,
                accumulation: int) -> dict[str, Any]:
        old, new = Counter(before["hosts"]), Counter(self.hosts)
        last = last_steps(self.run_dir / "metrics.jsonl", step)
        lost = last["last_step"] - step if last["last_step"] is not None else None
        lost_s = (last["last_time"] - last["resume_time"] if None not in (last["last_time"], last["resume_time"])
                  else None)
        kind = ("shrink" if self.d.world < before["world"] else "grow" if self.d.world > before["world"]
                else "hosts")
        return {"event": "membership", "step": step, "change": kind, "world_before": before["world"],
                "world_after": self.d.world, "hosts_before": before["hosts"], "hosts_after": self.hosts,
                "left": sorted((old - new).elements()), "joined": sorted((new - old).elements()),
                "checkpoint": checkpoint.name if checkpoint else None, "last_step_before": last["last_step"],
                "lost_steps": lost, "lost_s": lost_s, "failed_after": last["last_time"],
                "micro_batch": micro_batch, "accumulation": accumulation}

    @staticmethod
    def _line(c: dict[str, Any]) -> str:
        moved = "; ".join(f"{what}: {', '.join(c[what])}" for what in ("left", "joined") if c[what])
        where = f"resumed from {c['checkpoint']}" if c["checkpoint"] else "no checkpoint: starting over"
        lost = f", {c['lost_steps']} steps of work lost" if c["lost_steps"] else ""
        batches = f"{c['accumulation']} micro-batch{'es' if c['accumulation'] > 1 else ''} of {c['micro_batch']}"
        return (f"membership: {c['change']}, world {c['world_before']} -> {c['world_after']} ({moved or 'other hosts'}"
                f"); {where}{lost}; the global batch kept: {batches} per rank")

    def post_step(self, outcome) -> None:
        if self.change is None:
            return
        change, self.change = self.change, None
        failed = change.pop("failed_after")
        change["recovery_s"] = round(time.time() - failed, 3) if failed is not None else None
        self.event(change)
        if change["recovery_s"] is not None:
            self.log(f"membership: step {outcome.step} done {change['recovery_s']:.1f} s after the last step of the "
                     "group before")
