"""Worker processes never outlive the driver that started them.

`ending_workers(pool)`: while the driver iterates a process pool, SIGTERM and SIGINT are noted by a handler
(raising from inside the executor's own locks could deadlock it) and `check()` raises `Terminated` at the
driver's next safe point, within `POLL_S` (`result(future)` waits that way); whatever ends the iteration
(a signal, an error, a consumer that stops early) terminates the pool's processes before returning.
`worker_init` runs in each worker: it asks Linux to send SIGTERM to the worker if the driver dies without
cleaning up (SIGKILL), and leaves
SIGINT (a terminal's Ctrl-C goes to the whole process group) to the driver.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from concurrent.futures import wait
from contextlib import contextmanager
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """The driver got SIGTERM: handled like Ctrl-C (the finished tasks are kept; the same command resumes)."""


POLL_S = 0.2


class _Requests:
    signum: int | None = None

    def note(self, signum, _frame) -> None:
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Terminated(signal.Signals(self.signum).name)

    def result(self, future):
        """`future.result()`, checking for a signal every POLL_S while it waits."""
        while not future.done():
            wait([future], timeout=POLL_S)
            self.check()
        return future.result()


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
def ending_workers(pool) -> Iterator[_Requests]:
    """Yields the signal requests; call `.check()` between waits of at most POLL_S."""
    requests = _Requests()
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, requests.note) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        yield requests
    except BaseException:  # any way out (an error, a signal, Ctrl-C) ends the workers; re-raised
        processes = list((getattr(pool, "_processes", None) or {}).values())  # the executor has no public kill
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(5)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
