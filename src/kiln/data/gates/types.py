"""The contract every quality step follows.

A gate reads a document's text (or, when it sets `reads_url`, its URL) and
returns a Verdict: None to keep, or (reason, signals) to drop. A step that
rewrites text (line removal, truncation, redaction) returns an Edit with the
new text and what it counted; the counts travel with the document. A step that
scores (the classifier) returns a Score: the document is kept and carries the
value in its record under that field name (`quality_score`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

Verdict = tuple[str, dict[str, Any]] | None


class Edit(NamedTuple):
    text: str
    counts: dict[str, int]
    view: Any = None  # a TextView of `text` the step built anyway (a cache: not part of the value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, tuple) and tuple(self[:2]) == tuple(other[:2])

    def __hash__(self) -> int:
        return hash(self.text)


class Score(NamedTuple):
    field: str
    value: float


Gate = Callable[[str], "Verdict | Edit | Score"]


def drop(reason: str, signals: dict[str, Any], **limit: Any) -> Verdict:
    """A drop verdict whose signals hold every number the gate computed plus the limit it broke."""
    return (reason, {**signals, **limit})
