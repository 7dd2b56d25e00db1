"""Heartbeats and a watchdog for hung ranks.

Every rank's watchdog thread publishes (progress, time, host, pid) in the
torch.distributed store every `heartbeat_s`, and watches everyone's progress
with its own clock (so hosts' clocks need not agree). When a rank has not
advanced for `stall_timeout_s`, the first watchdog to notice reports it by rank
and host, asks every rank to dump its Python stacks (faulthandler) and exits
non-zero: `torchrun --max-restarts=N` then restarts the group, which resumes
from the newest valid checkpoint. A stopped or dead rank cannot dump; the
report says so.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from kiln.config import WatchdogConfig
from kiln.train.parallel import Dist

EXIT_STALLED = 3


class Watchdog:
    def __init__(self, d: Dist, cfg: WatchdogConfig, run_dir: Path, log=print) -> None:
        self.d, self.cfg, self.run_dir, self.log = d, cfg, Path(run_dir), log
        self.progress = 0  # bumped at every step, eval and save: any sign of life
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.prefix = f"kiln/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def beat(self, step: int) -> None:
        self.step = step
        self.progress += 1

    def start(self) -> "Watchdog":
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
        # A client of its own: the main thread's store connection is not shared across threads.
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=max(30.0, self.cfg.heartbeat_s * 4)))

    def _run(self) -> None:
        try:
            store = self._store()
        except Exception as exc:  # no store: still watch this rank
            self.log(f"watchdog: no distributed store ({exc}); watching rank {self.d.rank} only")
            store = None
        seen: dict[int, tuple[int, float, dict]] = {}  # rank -> (progress, when it last changed, beat)
        while not self._stop.wait(self.cfg.heartbeat_s):
            now = time.monotonic()
            beats = {self.d.rank: {"progress": self.progress, "step": self.step, "host": self.d.host, "pid": os.getpid()}}
            try:
                if store is not None:
                    store.set(f"{self.prefix}/hb/{self.d.rank}", json.dumps(beats[self.d.rank]))
                    if store.check([f"{self.prefix}/dump"]):
                        self._dump_and_exit(json.loads(store.get(f"{self.prefix}/dump")))
                    for r in range(self.d.world):
                        key = f"{self.prefix}/hb/{r}"
                        if r != self.d.rank and store.check([key]):
                            beats[r] = json.loads(store.get(key))
            except Exception:
                pass  # the store going away means the group is being torn down; torchrun handles it
            for r, beat in beats.items():
                prev = seen.get(r)
                if prev is None or prev[0] != beat["progress"]:
                    seen[r] = (beat["progress"], now, beat)
            for r in range(self.d.world):
                prev = seen.get(r)
                since = now - (prev[1] if prev else self._started(now))
                if since > self.cfg.stall_timeout_s:
                    beat = prev[2] if prev else {"host": "unknown", "step": "unknown", "pid": "unknown"}
                    report = {"rank": r, "host": beat["host"], "pid": beat["pid"], "step": beat["step"],
                              "stalled_s": round(since, 1), "reported_by": self.d.rank}
                    self.log(f"watchdog: rank {r} on host {beat['host']} (pid {beat['pid']}) has not advanced "
                             f"past step {beat['step']} for {since:.0f} s; dumping stacks and exiting so torchrun "
                             f"can restart the group (a stopped or dead rank cannot dump its own stacks)")
                    if store is not None:
                        try:
                            store.set(f"{self.prefix}/dump", json.dumps(report))
                        except Exception:
                            pass
                    self._dump_and_exit(report)

    _t0: float | None = None

    def _started(self, now: float) -> float:
        if self._t0 is None:
            self._t0 = now
        return self._t0

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
