"""The one rich Console that Kiln writes its stderr lines with.

rich writes around its own proxy of stderr: a line printed by one Console while another Console draws a live
display (the training line, a progress bar) lands glued to the end of that display. Printed by the Console
that draws the display, rich puts the line above it. So every stage logs, draws its progress and its live line
on this one Console. soft_wrap: a long line (a path, a command) is never broken by an inserted newline, so it
copies whole out of a terminal or a log file.
"""

from __future__ import annotations

import functools

from rich.console import Console


@functools.cache
def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)
