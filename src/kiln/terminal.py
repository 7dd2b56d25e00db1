"""The rich consoles Kiln prints through: what a user typed is shown as typed, never read as markup, and one
stderr Console for every stage's lines.

Paths, overrides, URLs and document ids reach the console inside messages, tables and progress lines; rich
would read `[bold]`, `[/data/x.jsonl]` or `:smile:` in them as markup or emoji codes (a MarkupError after a
whole run, or silently changed text). Every console Kiln makes comes from `console()`, with markup, emoji
codes and highlighting off: Kiln styles its own output with `Text`/`style=` arguments only, never with
markup in strings.

rich writes around its own proxy of stderr: a line printed by one Console while another Console draws a live
display (the training line, a progress bar) lands glued to the end of that display. Printed by the Console
that draws the display, rich puts the line above it. So every stage logs, draws its progress and its live line
on `stderr_console()`. soft_wrap: a long line (a path, a command) is never broken by an inserted newline, so it
copies whole out of a terminal or a log file. Where the output is not a terminal (a pipe, `| tee log`, a file)
a table is printed as wide as its cells need, never cut to 80 columns with `…`: logs carry the whole table.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


class _Console(Console):
    """A Console that prints a table whole where the output is not a terminal."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        wide = 0 if self.is_terminal else max((Measurement.get(self, self.options.update_width(1 << 16), o).maximum
                                                for o in objects if isinstance(o, Table)), default=0)
        if wide <= self.width:
            return super().print(*objects, **kwargs)
        width, self._width = self._width, wide  # for this print only: rich fits everything to the console's width
        try:
            super().print(*objects, **kwargs)
        finally:
            self._width = width


def console(stderr: bool = True, **kwargs: Any) -> Console:
    """A rich Console (on stderr unless told) that prints strings as they are."""
    return _Console(stderr=stderr, markup=False, emoji=False, highlight=False, **kwargs)


@functools.cache
def stderr_console() -> Console:
    """The one stderr Console every stage's logs, progress bars and live lines share."""
    return console(stderr=True, soft_wrap=True)


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


@contextmanager
def stage_progress(label: str, show: bool | None = None) -> Iterator[None]:
    """A spinner with elapsed time for a stage that reports no counts of its own (tokenizer training);
    it ends as a check mark, not a frozen glyph. Nothing when stderr is not a terminal."""
    if not (stderr_is_terminal() if show is None else show):
        with nullcontext():
            yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(finished_text="✓"), TextColumn(label, markup=False), TimeElapsedColumn(),
                   console=stderr_console(), transient=False)
    task = bar.add_task(label, total=1)
    with bar:
        yield
        bar.update(task, completed=1)
