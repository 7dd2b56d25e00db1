"""The unit that flows through the data stage, and the verdict a step can give it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rejection:
    stage: str  # the step that dropped it: read, extract, language, quality, dedup
    reason: str  # a stable reason code, e.g. too_short, binary_payload, exact_duplicate
    signals: dict[str, Any] = field(default_factory=dict)  # the numbers behind the decision


@dataclass
class Document:
    id: str
    source: str  # the input file
    offset: int  # gzip member offset of the WARC record (a byte range request gets it back)
    length: int  # compressed length of that member (0 when unknown)
    url: str | None = None
    date: str | None = None
    content_type: str | None = None
    payload: bytes | None = None  # raw HTTP body; dropped after extraction
    text: str | None = None
    lang: str | None = None
    lang_score: float | None = None
    rejection: Rejection | None = None

    def reject(self, stage: str, reason: str, **signals: Any) -> "Document":
        self.rejection = Rejection(stage, reason, signals)
        self.payload = None
        return self

    def kept_record(self) -> dict[str, Any]:
        return {
            "id": self.id, "text": self.text, "url": self.url, "source": self.source,
            "offset": self.offset, "length": self.length, "lang": self.lang,
            "lang_score": None if self.lang_score is None else round(self.lang_score, 4),
            "date": self.date,
        }

    def reject_record(self) -> dict[str, Any]:
        assert self.rejection is not None
        return {
            "id": self.id, "url": self.url, "source": self.source, "offset": self.offset,
            "length": self.length, "stage": self.rejection.stage, "reason": self.rejection.reason,
            "signals": self.rejection.signals,
        }
