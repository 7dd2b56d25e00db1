"""The first, cheapest gates: length, letters, repeated lines (Gopher's duplicate-line fraction).

Characters rather than words are counted so that languages written without
spaces are measured the same way.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kiln.data.gates.text import TextView, as_view
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
        frac = count_letters(view.text) / visible
        return ("low_letters", {"letter_frac": round(frac, 4), "min": min_frac}) if frac < min_frac else None
    return gate


@lru_cache(maxsize=1)
def _bmp_letters() -> np.ndarray:
    """str.isalpha of every code point of the Basic Multilingual Plane (64 KiB, built once per process)."""
    return np.fromiter((chr(c).isalpha() for c in range(0x10000)), dtype=bool, count=0x10000)


def count_letters(text: str) -> int:
    """Characters that str.isalpha calls letters: a table lookup over the UTF-32 code points, in numpy."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    bmp = codes < 0x10000
    n = int(_bmp_letters()[codes[bmp]].sum())
    if not bmp.all():  # beyond the BMP (emoji, rare scripts): asked one by one
        n += sum(chr(c).isalpha() for c in codes[~bmp].tolist())
    return n
