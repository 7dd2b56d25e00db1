"""The first, cheapest gates: length, letters, repeated lines (Gopher's duplicate-line fraction).

Characters rather than words are counted so that languages written without
spaces are measured the same way.
"""

from __future__ import annotations

from kiln.data.gates.text import ALPHA, TextView, as_view
from kiln.data.gates.types import Gate, Verdict


def too_short(min_chars: int) -> Gate:
    def gate(text: "str | TextView") -> Verdict:
        n = len(as_view(text).text)
        return ("too_short", {"chars": n, "min_chars": min_chars}) if n < min_chars else None
    return gate


def repetitive_lines(max_frac: float) -> Gate:
    def gate(text: "str | TextView") -> Verdict:
        lines = as_view(text).lines
        if not lines:
            return None
        dup = 1 - len(set(lines)) / len(lines)
        return ("repetitive_lines", {"dup_line_frac": round(dup, 4), "max": max_frac}) if dup > max_frac else None
    return gate


def low_letters(min_frac: float) -> Gate:
    def gate(text: "str | TextView") -> Verdict:
        view = as_view(text)
        visible = view.visible_chars
        if not visible:
            return ("low_letters", {"letter_frac": 0.0, "min": min_frac})
        frac = count_letters(view) / visible
        return ("low_letters", {"letter_frac": round(frac, 4), "min": min_frac}) if frac < min_frac else None
    return gate


def count_letters(text: "str | TextView") -> int:
    """Characters that str.isalpha calls letters (a table lookup per code point, in numpy)."""
    return as_view(text).count(ALPHA)
