"""The rich consoles Kiln prints through: what a user typed is shown as typed, never read as markup.

Paths, overrides, URLs and document ids reach the console inside messages, tables and progress lines; rich
would read `[bold]`, `[/data/x.jsonl]` or `:smile:` in them as markup or emoji codes (a MarkupError after a
whole run, or silently changed text). Every console Kiln makes comes from `console()`, with markup, emoji
codes and highlighting off: Kiln styles its own output with `Text`/`style=` arguments only, never with
markup in strings.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console


def console(stderr: bool = True, **kwargs: Any) -> Console:
    """A rich Console (on stderr unless told) that prints strings as they are."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, **kwargs)
