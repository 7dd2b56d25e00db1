"""Heartbeats and a watchdog for hung ranks.

Every rank's watchdog thread publishes (progress, time, host, pid) in the
torch.distributed store every `heartbeat_s`, and watches everyone's progress
with its own clock (so hosts' clocks need not agree). When a rank has not
advanced for `stall_timeout_s`, the first watchdog to notice reports it by rank
and host, asks every rank to dump its Python stacks (faulthandler) and exits
non-zero: `torchrun --max-restarts=N` then restarts the group, which resumes
from the newest valid checkpoint. A stopped or dead rank cannot dump; the
report says so. A watchdog whose own process was frozen (SIGSTOP, a paused VM:
its ticks came late) starts its clocks again. A rank saving a checkpoint is judged against
checkpoint.save_timeout_s, unless its heartbeat stopped too (a save runs beside
the heartbeat thread, so a silent rank is stopped or gone, not saving).

With `on_stall: exclude_host` the reporting rank also records the stalled
rank's host in the run folder (parts/membership.py): at the next rendezvous that
host's workers stop their agent and leave, and an elastic job goes on without
it. A group whose ranks are all on that one host restarts instead.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from kiln.config import WatchdogConfig
from kiln.train.parallel import Dist
from kiln.train.parallel.dist import store_prefix
from kiln.train.parts.membership import EXCLUDED, exclude_host

EXIT_STALLED = 3


class Watchdog:
    def __init__(self, d: Dist, cfg: WatchdogConfig, run_dir: Path, log=print,
                 startup_timeout_s: float | None = None) -> None:
        self.d, self.cfg, self.run_dir, self.log = d, cfg, Path(run_dir), log
        self.progress = 0  # bumped at every step, eval and save: any sign of life
        self.step = 0
        # Until a rank completes its first step in this process it may be compiling (torch.compile of the
        # whole model) or setting up NCCL on many ranks: judged against startup_timeout_s until then, like
        # the collectives (parallel.startup_timeout_s). A GPU run confirms the first compiled step's length.
        self.startup_timeout_s = max(startup_timeout_s or 0.0, cfg.stall_timeout_s)
        self.first_step: int | None = None  # the step this process started from (set by start)
        self.save_timeout_s: float | None = None  # set while this rank saves a checkpoint (saving())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- hooks (train/parts) ----------------------------------------------------------------------

    def pre_train(self) -> None:
        self.start()

    def post_step(self, outcome) -> None:
        self.beat(outcome.step)

    def close(self) -> None:
        self.stop()

    def beat(self, step: int) -> None:
        self.step = step
        self.progress += 1

    @contextmanager
    def saving(self, timeout_s: float):
        """A checkpoint save is in progress on this rank: until it ends the rank is judged against `timeout_s`
        (checkpoint.save_timeout_s), not stall_timeout_s, and every watchdog sees so in its heartbeat."""
        outer = self.save_timeout_s  # nested (a save that waits for the previous one): the outer one's, after
        self.save_timeout_s = max(timeout_s, self.cfg.stall_timeout_s)
        try:
            yield
        finally:
            self.save_timeout_s = outer
            self.progress += 1  # the save's end is progress: the clock starts again from here

    @property
    def warm(self) -> bool:
        """This rank has completed a step since it started."""
        return self.first_step is not None and self.step > self.first_step

    def timeout_for(self, beat: dict, silent: bool = False) -> float:
        """How long a rank may go without progress: its save's timeout while it saves (unless `silent`: its
        heartbeat stopped), startup_timeout_s until its first step, else stall_timeout_s."""
        if beat.get("saving") and not silent:
            return beat["saving"]
        return self.cfg.stall_timeout_s if beat.get("warm") or beat.get("saving") else self.startup_timeout_s

    def silent(self, ticks: dict[int, tuple[int, float]], now: float) -> set[int]:
        """The ranks whose heartbeat has not changed for three heartbeats: stopped or dead."""
        return {r for r, (_, since) in ticks.items() if now - since > 3 * self.cfg.heartbeat_s}

    def start(self) -> "Watchdog":
        self.first_step = self.step
        if self.cfg.enabled:
            self._thread = threading.Thread(target=self._run, name="kiln-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.heartbeat_s * 2)

    def _store(self):
        if self.d.world == 1:
            return None
        # A client of its own (the main thread's connection is not shared across threads), under the
        # same per-restart prefix as the process group.
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=max(30.0, self.cfg.heartbeat_s * 4)))
        return dist.PrefixStore(f"{store_prefix()}/watchdog", client)

    def _run(self) -> None:
        try:
            store = self._store()
        except Exception as exc:  # no store: still watch this rank
            self.log(f"watchdog: no distributed store ({exc}); watching rank {self.d.rank} only")
            store = None
        t0 = time.monotonic()
        progress: dict[int, tuple[int, float]] = {}  # rank -> (progress, when it last changed), on our clock
        ticks: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat count, when it last changed)
        beats: dict[int, dict] = {}
        tick, last = 0, t0
        while tick == 0 or not self._stop.wait(self.cfg.heartbeat_s):  # publish at once, then every heartbeat_s
            tick += 1
            now = time.monotonic()
            if now - last > 3 * self.cfg.heartbeat_s + 1:  # this process was frozen (SIGSTOP, a paused VM): what it
                progress = {r: (v, now) for r, (v, _) in progress.items()}  # saw before says nothing of the others
                ticks = {r: (v, now) for r, (v, _) in ticks.items()}  # now; their clocks start again
                t0 = now
            last = now
            beats[self.d.rank] = {"progress": self.progress, "step": self.step, "host": self.d.host,
                                  "pid": os.getpid(), "tick": tick, "warm": self.warm,
                                  "saving": self.save_timeout_s}
            try:
                if store is not None:
                    store.set(f"hb/{self.d.rank}", json.dumps(beats[self.d.rank]))
                    if store.check(["dump"]):
                        self._dump_and_exit(json.loads(store.get("dump")))
                    for r in range(self.d.world):
                        if r != self.d.rank and store.check([f"hb/{r}"]):
                            beats[r] = json.loads(store.get(f"hb/{r}"))
            except Exception:  # the store going away means the group is being torn down; torchrun handles it
                pass
            for r, beat in beats.items():
                for seen, value in ((progress, beat["progress"]), (ticks, beat["tick"])):
                    if r not in seen or seen[r][0] != value:
                        seen[r] = (value, now)
            silent = self.silent(ticks, now)
            stalled = [r for r in range(self.d.world)
                       if now - progress.get(r, (0, t0))[1] > self.timeout_for(beats.get(r, {}), r in silent)]
            if stalled:
                never_seen = {r for r in stalled if r not in ticks}
                self._report(stalled, beats, sorted(silent | never_seen), store)

    def _report(self, stalled: list[int], beats: dict, silent: list[int], store) -> None:
        """Blame the rank that is behind: one whose heartbeat stopped (stopped or dead), else the lowest
        step; the others are waiting for it in a collective."""
        # Any rank whose heartbeat stopped, stalled by its own clock yet or not: the others wait for it, and a
        # waiting rank's progress stops first (it sees the silent rank's last progress up to a heartbeat late).
        culprit = (silent or sorted(stalled, key=lambda r: beats.get(r, {}).get("step", -1)))[0]
        beat = beats.get(culprit, {"host": "unknown", "step": "unknown", "pid": "unknown"})
        report = {"rank": culprit, "host": beat["host"], "pid": beat["pid"], "step": beat["step"],
                  "heartbeat_stopped": culprit in silent, "reported_by": self.d.rank}
        stopped = " and its heartbeat stopped (stopped or dead: it cannot dump its stacks)" if culprit in silent else ""
        self.log(
            f"watchdog: rank {culprit} on host {beat['host']} (pid {beat['pid']}) has not advanced past step "
            f"{beat['step']} for over {self.timeout_for(beat, culprit in silent):.0f} s{stopped}; "
            f"dumping stacks and exiting so torchrun can restart the group"
        )
        if self.cfg.on_stall == "exclude_host":
            self._exclude(beat["host"], report, beats)
        if store is not None:
            try:
                store.set("dump", json.dumps(report))
            except Exception:  # the store is going away with the group: this rank still dumps and exits below
                pass
        self._dump_and_exit(report)

    def _exclude(self, host: str, report: dict, beats: dict) -> None:
        """on_stall: exclude_host: record the stalled rank's host in the run folder, unless it is every host the
        group has (then the group only restarts)."""
        if {b.get("host") for b in beats.values()} <= {host} or host == "unknown":
            self.log(f"watchdog: not excluding host {host}: no other host would be left; the group restarts")
            return
        path = exclude_host(self.run_dir, host, {**report, "excluded_at": time.time()})
        if path is None:
            self.log(f"watchdog: host name {host!r} cannot be a file name in {self.run_dir / EXCLUDED}; the group "
                     "restarts with it")
            return
        self.log(f"watchdog: host {host} excluded from this run ({path}): its workers leave at the next "
                 "rendezvous; to let it back in, delete that file and start its agent again")

    def _dump_and_exit(self, report: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / f"stacks-rank{self.d.rank:05d}.txt"
        with open(path, "w") as f:
            f.write(json.dumps(report) + "\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        sys.stderr.write(f"watchdog: rank {self.d.rank} stacks written to {path}\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_STALLED)
