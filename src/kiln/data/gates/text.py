"""How gates see text: lines, paragraphs and words, for scripts with and without spaces.

Japanese and Chinese are written without spaces, so splitting on whitespace
gives one "word" per sentence. `words` counts each Han/kana character as a word
instead (the usual character-level equivalent), and `spaceless` tells a gate
that rules about word length or words per line do not apply.
"""

from __future__ import annotations

import re

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_WORD = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_CJK_CHAR = re.compile(f"[{_CJK}]")
TERMINAL_PUNCT = (".", "!", "?", '"', "'", "\u201d", "\u3002", "\uff01", "\uff1f", "\u300d", "\u300f")


def words(text: str) -> list[str]:
    """Whitespace-separated words, with each CJK character a word of its own."""
    return _WORD.findall(text)


CJK_CHARS_PER_WORD = 2  # a Chinese word averages ~1.5 characters, a Japanese one ~2


def word_count(text: str) -> float:
    """Words as a reader of the language would count them: spaced words, plus Han/kana characters / 2."""
    cjk = len(_CJK_CHAR.findall(text))
    if not cjk:
        return len(text.split())
    # what is left between the characters: Latin words count, stray brackets and punctuation do not
    spaced = sum(any(c.isalnum() for c in w) for w in _CJK_CHAR.sub(" ", text).split())
    return spaced + cjk / CJK_CHARS_PER_WORD


def is_cjk(word: str) -> bool:
    return len(word) == 1 and _CJK_CHAR.match(word) is not None


def spaceless(text: str) -> bool:
    """True when over 30% of the visible characters are Han or kana (Japanese pages are full of ASCII commands)."""
    visible = len("".join(text.split()))
    return visible > 0 and len(_CJK_CHAR.findall(text)) / visible > 0.3


def lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.split("\n") if ln.strip()]


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def ratio(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0
