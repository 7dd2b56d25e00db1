"""The unit that flows through the data stage, and the verdict a step can give it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


SCORE_FIELDS = ("quality_score", "semantic_score", "perplexity_bpb")  # record fields that scoring gates write
# data.distribution.source_key for a document without the URL or field it names: one source for all of them
NO_HOST = "(no host)"


def missing_group(source_key: str) -> str | None:
    """The source group of the documents that lack what `source_key` names (no URL, no such field; the
    distribution gate's); None for `file`, which every document has."""
    if source_key == "host":
        return NO_HOST
    return f"(no {source_key[len('field:'):]})" if source_key.startswith("field:") else None


@dataclass
class Rejection:
    stage: str  # the step that dropped it: read, extract, language, quality, dedup
    reason: str  # a stable reason code, e.g. too_short, binary_payload, exact_duplicate
    signals: dict[str, Any] = field(default_factory=dict)  # the numbers behind the decision


@dataclass
class ReadReport:
    """What a task's input held besides documents: WARC record types, and a cut at the end."""

    records_by_type: dict[str, int] = field(default_factory=dict)
    truncated_at: int | None = None

    def count(self, kind: str) -> None:
        self.records_by_type[kind] = self.records_by_type.get(kind, 0) + 1


@dataclass
class Document:
    id: str
    source: str  # the input file (path or URL)
    offset: int  # WARC: gzip member offset of the record (a byte range request gets it back); JSONL: line offset
    length: int  # compressed length of that member (0 when unknown)
    url: str | None = None  # WARC-Target-URI
    date: str | None = None  # WARC-Date: when it was fetched
    content_type: str | None = None  # the HTTP Content-Type
    record_id: str | None = None  # WARC-Record-ID as written (or the JSONL/Parquet id field)
    payload: bytes | None = None  # raw HTTP body; dropped after extraction
    text: str | None = None
    lang: str | None = None
    lang_score: float | None = None
    rejection: Rejection | None = None
    edits: dict[str, int] = field(default_factory=dict)  # what rewriting gates changed, e.g. {"pii_email": 2}
    text_chars: int | None = None  # a reject record's text length (its text is not kept), for the report
    scores: dict[str, float] = field(default_factory=dict)  # what scoring gates gave, e.g. {"quality_score": 0.93}
    source_group: str | None = None  # the distribution gate's source (data.distribution.source_key)

    def reject(self, stage: str, reason: str, **signals: Any) -> "Document":
        self.rejection = Rejection(stage, reason, signals)
        self.payload = None
        return self

    def kept_record(self) -> dict[str, Any]:
        return {
            "id": self.id, "text": self.text, "url": self.url, "source": self.source,
            "offset": self.offset, "length": self.length, "lang": self.lang,
            "lang_score": None if self.lang_score is None else round(self.lang_score, 4),
            "date": self.date, "record_id": self.record_id, "content_type": self.content_type,
            **({"edits": self.edits} if self.edits else {}), **self.scores,
            **({"source_group": self.source_group} if self.source_group is not None else {}),
        }

    def reject_record(self, with_text: bool = False) -> dict[str, Any]:
        """The rejection; `with_text` adds the text (a task's outcome for a document set aside for review)."""
        assert self.rejection is not None
        return ({"text": self.text} if with_text else {}) | {
            "id": self.id, "url": self.url, "source": self.source, "offset": self.offset,
            "length": self.length, "stage": self.rejection.stage, "reason": self.rejection.reason,
            "signals": self.rejection.signals, "date": self.date, "record_id": self.record_id,
            "content_type": self.content_type, "lang": self.lang,
            "chars": len(self.text) if self.text is not None else self.text_chars,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Document":
        """A kept or reject record (as a task wrote it) back into a Document."""
        names = ("id", "source", "offset", "length", "url", "date", "content_type", "record_id", "text", "lang",
                 "lang_score", "source_group")
        doc = cls(**{k: rec.get(k) for k in names}, edits=rec.get("edits") or {}, text_chars=rec.get("chars"),
                  scores={k: rec[k] for k in SCORE_FIELDS if rec.get(k) is not None})
        if "reason" in rec:
            doc.rejection = Rejection(rec["stage"], rec["reason"], rec["signals"])
        return doc
