"""SIGTERM: finish the step, checkpoint, exit 0. SIGUSR2: checkpoint at the next step boundary and go on.

The handlers only set flags; the loop acts on them at a step boundary after
every rank has agreed (the flags travel in the step's one all-reduce).
"""

from __future__ import annotations

import signal
import threading


class StopRequests:
    def __init__(self) -> None:
        self.stop = False
        self.save = False
        self._previous = {}

    def install(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig, fn in ((signal.SIGTERM, self._on_term), (signal.SIGUSR2, self._on_usr2)):
                self._previous[sig] = signal.signal(sig, fn)
        return self

    def uninstall(self) -> None:
        for sig, fn in self._previous.items():
            signal.signal(sig, fn)
        self._previous.clear()

    # --- hooks (train/parts) ----------------------------------------------------------------------

    def pre_train(self) -> None:
        self.install()

    def flags(self) -> dict[str, bool]:
        return {"stop": self.stop, "save": self.save}

    def close(self) -> None:
        self.uninstall()

    def _on_term(self, *_):
        self.stop = True

    def _on_usr2(self, *_):
        self.save = True
