"""The corpus's shape for the report: rejections per language and document length histograms.

Counted in the data stage's merge, one document at a time; memory is a counter per (language, reason) and
per length bin (powers of two of characters), so it does not grow with the corpus.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def length_bin(chars: int) -> int:
    """The power of two at or below `chars` (0 for empty text): the histogram's bin."""
    return 1 << (chars.bit_length() - 1) if chars > 0 else 0


class CorpusShape:
    def __init__(self) -> None:
        self.rejected_by_lang: dict[str, Counter[str]] = {}
        self.lengths: dict[str, Counter[int]] = {"kept": Counter(), "rejected": Counter()}

    def add(self, doc) -> None:
        """A merged document (kiln.data.document.Document), kept or rejected."""
        if doc.rejection is not None:
            # Before language ID ran (read, extract) a document has no language: "unknown".
            lang = doc.lang or "unknown"
            self.rejected_by_lang.setdefault(lang, Counter())[f"{doc.rejection.stage}/{doc.rejection.reason}"] += 1
        chars = len(doc.text) if doc.text is not None else doc.text_chars
        if chars is not None:  # a document rejected before extraction has no text to measure
            self.lengths["kept" if doc.rejection is None else "rejected"][length_bin(chars)] += 1

    def report(self) -> dict[str, Any]:
        """stats.json's `rejected_by_lang` {lang: {reason: n}} and `length_histogram` {kept|rejected: {bin: n}}
        (bin: the smallest character count of the bin, a power of two)."""
        langs = sorted(self.rejected_by_lang.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
        return {"rejected_by_lang": {lang: dict(sorted(c.items())) for lang, c in langs},
                "length_histogram": {k: {str(b): n for b, n in sorted(c.items())} for k, c in self.lengths.items()}}
