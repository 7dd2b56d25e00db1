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
copies whole out of a terminal or a log file.
"""

from __future__ import annotations

import functools
from typing import Any

from rich.console import Console


def console(stderr: bool = True, **kwargs: Any) -> Console:
    """A rich Console (on stderr unless told) that prints strings as they are."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, **kwargs)


@functools.cache
def stderr_console() -> Console:
    """The one stderr Console every stage's logs, progress bars and live lines share."""
    return console(stderr=True, soft_wrap=True)
