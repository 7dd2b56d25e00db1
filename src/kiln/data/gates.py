"""Quality gates: each computes its signals, then keeps (None) or drops with (reason, signals).

Thresholds come from config (`data.*`); the defaults follow Gopher (Rae et al.,
2021): documents need some length, few repeated lines, and mostly letters.
Characters rather than words are counted so that languages written without
spaces (Japanese, Chinese) are measured the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from kiln.data.document import Document

Verdict = tuple[str, dict[str, Any]] | None
Gate = Callable[[str], Verdict]


def too_short(min_chars: int) -> Gate:
    def gate(text: str) -> Verdict:
        n = len(text)
        return ("too_short", {"chars": n, "min_chars": min_chars}) if n < min_chars else None
    return gate


def repetitive_lines(max_frac: float) -> Gate:
    def gate(text: str) -> Verdict:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not lines:
            return None
        dup = 1 - len(set(lines)) / len(lines)
        return ("repetitive_lines", {"dup_line_frac": round(dup, 4), "max": max_frac}) if dup > max_frac else None
    return gate


def low_letters(min_frac: float) -> Gate:
    def gate(text: str) -> Verdict:
        visible = [c for c in text if not c.isspace()]
        if not visible:
            return ("low_letters", {"letter_frac": 0.0, "min": min_frac})
        frac = sum(c.isalpha() for c in visible) / len(visible)
        return ("low_letters", {"letter_frac": round(frac, 4), "min": min_frac}) if frac < min_frac else None
    return gate


def default_gates(cfg) -> list[Gate]:
    return [too_short(cfg.min_chars), low_letters(cfg.min_letter_frac), repetitive_lines(cfg.max_dup_line_frac)]


def apply_gates(docs: Iterator[Document], gates: list[Gate]) -> Iterator[Document]:
    for doc in docs:
        if doc.rejection is None:
            for gate in gates:
                verdict = gate(doc.text or "")
                if verdict is not None:
                    doc.reject("quality", verdict[0], **verdict[1])
                    break
        yield doc
