"""The watchdog of a local Ray that Kiln started: it ends that Ray session's processes once Kiln is gone.

Run as a script (`python raywatch.py MARKER`, by `executor`), it imports nothing of Kiln. Kiln holds the other
end of its stdin: EOF comes when Kiln ends the engine or dies, SIGKILL included. Then every process of this
user whose environment holds `KILN_RAY_SESSION=MARKER` (the driver sets it before `ray.init`, so GCS, raylet,
dashboard, agents and workers all inherit it, whatever title they give themselves) gets SIGKILL, round after
round until none is left. Ray's own fate-sharing misses its dashboard and runtime-env agents, which also ignore
SIGTERM. The marker is unique to the session, so nothing else is touched. Linux (/proc) only."""

from __future__ import annotations

import os
import signal
import sys
import time

VAR = "KILN_RAY_SESSION"


def holders(marker: str) -> list[int]:
    """The pids whose environment holds VAR=marker (zombies and other users' processes cannot be read: skipped)."""
    entry = f"{VAR}={marker}".encode()
    found: list[int] = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def end_session(marker: str, within_s: float = 10.0) -> list[int]:
    """SIGKILL every holder of the marker until none is left (a dying raylet may still start one); the pids."""
    killed: list[int] = []
    deadline = time.monotonic() + within_s
    while (pids := holders(marker)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        time.sleep(0.1)
    return killed


def main(marker: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is Kiln's to handle; EOF ends this
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdin.buffer.read()
    end_session(marker)


if __name__ == "__main__":
    main(sys.argv[1])
