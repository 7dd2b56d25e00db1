"""Run a command and measure its process tree: wall time, each process's CPU seconds and peak RSS, the largest.

The tree is polled from /proc every `POLL_S` (a process is found by its parent chain, so Ray's workers under
its raylet count, and so do a pool's); a process's CPU is its last utime + stime seen, its peak its VmHWM.
`/usr/bin/time -v` wraps the command too when it is installed: its "Maximum resident set size" is the largest
single process among the command and the children it waited for (NOTES.md), the figure the issues quote.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

POLL_S = 0.25
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    name: str
    cpu_s: float = 0.0
    peak_mb: float = 0.0


@dataclass
class Measured:
    rc: int
    wall_s: float
    stdout: str
    stderr: str
    procs: dict[int, Proc] = field(default_factory=dict)
    time_max_rss_mb: float | None = None  # /usr/bin/time -v
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start and the end

    @property
    def largest_mb(self) -> float:
        return max([p.peak_mb for p in self.procs.values()] + [self.time_max_rss_mb or 0.0])

    def cpu_of(self, pattern: str) -> list[float]:
        """CPU seconds of the processes whose command line matches `pattern`, busiest first."""
        return sorted((p.cpu_s for p in self.procs.values() if re.search(pattern, p.name)), reverse=True)


def _children() -> dict[int, int]:
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _sample(pid: int, procs: dict[int, Proc]) -> None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return
    hwm = re.search(r"VmHWM:\s+(\d+)", status)
    p = procs.setdefault(pid, Proc(cmd[:200]))
    p.cpu_s = max(p.cpu_s, (int(stat[11]) + int(stat[12])) / TICK)
    p.peak_mb = max(p.peak_mb, int(hwm.group(1)) / 1024 if hwm else 0.0)


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float | None = None) -> Measured:
    """`cmd` in a session of its own, measured (see the module docstring)."""
    use_time = Path("/usr/bin/time").exists()
    full = (["/usr/bin/time", "-v"] if use_time else []) + cmd
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    procs: dict[int, Proc] = {}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            parents = _children()
            tree, frontier = set(), {proc.pid}
            while frontier:
                tree |= frontier
                frontier = {c for c, p in parents.items() if p in frontier} - tree
            for pid in tree:
                _sample(pid, procs)
            done.wait(POLL_S)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        watcher.join()
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err) if use_time else None
    procs.pop(proc.pid, None)  # /usr/bin/time itself
    return Measured(proc.returncode, wall, out, err, procs, int(m.group(1)) / 1024 if m else None,
                    (load0, os.getloadavg()[0]))
