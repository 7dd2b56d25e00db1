"""Worker processes never outlive the driver that started them.

`ending_workers(pool)`: while the driver iterates a process pool, SIGTERM and SIGINT raise `Terminated`
in the driver (the main thread), and whatever ends the iteration (a signal, an error, a consumer that
stops early) terminates the pool's processes before returning. `worker_init` runs in each worker: it
asks Linux to send SIGTERM to the worker if the driver dies without cleaning up (SIGKILL), and leaves
SIGINT (a terminal's Ctrl-C goes to the whole process group) to the driver.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """The driver got SIGTERM: handled like Ctrl-C (the finished tasks are kept; the same command resumes)."""


def _raise(signum, _frame) -> None:
    raise Terminated(f"{signal.Signals(signum).name}")


def worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform == "linux":
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() == 1:  # the driver died before prctl took effect
            os._exit(1)


@contextmanager
def ending_workers(pool) -> Iterator[None]:
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        yield
    except BaseException:
        for process in list(getattr(pool, "_processes", {}).values()):  # the executor has no public kill
            if process.is_alive():
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
