"""The `kiln data` progress bar on stderr: input bytes done, records/s, MB/s and the kept share."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kiln.terminal import stderr_console


class DataProgress:
    """Advanced once per finished task (tasks are the unit of work; the bar moves in their steps)."""

    def __init__(self, total_bytes: int, tasks: int) -> None:
        self.bar = Progress(
            TextColumn("data"), BarColumn(), TextColumn("{task.completed:,.0f}/{task.total:,.0f} B"),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
            console=stderr_console(), transient=False,
        )
        self.job = self.bar.add_task("data", total=max(total_bytes, 1), rate=f"0/{tasks} tasks")
        self.tasks, self.done, self.records, self.kept, self.bytes = tasks, 0, 0, 0, 0
        self.t0 = time.perf_counter()

    def __enter__(self) -> "DataProgress":
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def __call__(self, summary: dict[str, Any]) -> None:
        self.done += 1
        self.records += summary["documents"]
        self.kept += summary["kept"]
        self.bytes += summary["bytes"]
        dt = max(time.perf_counter() - self.t0, 1e-9)
        kept = 100 * self.kept / self.records if self.records else 0.0
        rate = (f"{self.done}/{self.tasks} tasks  {self.records / dt:,.0f} records/s  "
                f"{self.bytes / dt / 1e6:,.1f} MB/s  kept {kept:.1f}%")
        self.bar.update(self.job, completed=self.bytes, rate=rate)
