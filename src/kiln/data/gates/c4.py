"""C4's line rules (Raffel et al. 2020, section 2.2): clean line by line, then judge the document.

Lines are removed when they mention javascript, read like cookie/terms boilerplate, are too
short (C4: 3 words; two Han/kana characters count as a word) or, optionally, lack terminal punctuation.
FineWeb turned that last rule off (it has its own punctuation-ratio rule), and so does Kiln by
default. A document is dropped for "lorem ipsum", for a curly brace (optional: it drops every
page with code), for too few sentences, or when (nearly) all its lines were removed.
Code lines (`TextView.code`) are not removed for being short or unpunctuated: `try:` and `}` are
code, not boilerplate, and removing them would leave broken examples behind.
"""

from __future__ import annotations

import re
from itertools import compress

import numpy as np

from kiln.data.gates.text import TERMINAL_PUNCT, TextView, as_view, ratio
from kiln.data.gates.types import Edit, Gate, Verdict, drop

POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f]+(?:\s|$)")


def c4_lines(cfg) -> Gate:
    def gate(view: "str | TextView") -> "Verdict | Edit":
        view = as_view(view)
        text = view.text
        low = text.lower()
        if cfg.drop_lorem_ipsum and "lorem ipsum" in low:
            return drop("c4_lorem_ipsum", {})
        if cfg.drop_curly_brace and "{" in text:
            return drop("c4_curly_brace", {})
        stripped, min_words = view.stripped_lines, cfg.min_words_per_line
        code = np.array(view.code, dtype=bool)
        # removed first, code or not
        javascript = _lines_with(view, low, ("javascript",) if cfg.drop_javascript_lines else ())
        policy = _lines_with(view, low, POLICY if cfg.drop_policy_lines else ()) & ~javascript
        # word_count of each line, in numpy; blank (no token) and code lines are never short
        short = (view.line_token_counts > 0) & (view.line_word_counts < min_words) & ~code
        if cfg.require_terminal_punct:
            punct = np.array([not line or line.endswith(TERMINAL_PUNCT) for line in stripped], dtype=bool) | code
        else:
            punct = np.ones(len(stripped), dtype=bool)
        left = ~(javascript | policy)
        keep = left & ~short & punct
        removed = {"javascript": int(javascript.sum()), "policy": int(policy.sum()), "short": int((left & short).sum()),
                   "no_punct": int((left & ~short & ~punct).sum())}
        keep_list = keep.tolist()
        kept, kept_code = list(compress(view.raw_lines, keep_list)), list(compress(view.code, keep_list))
        n_removed = sum(removed.values())
        n_lines = len(view.lines)
        s = {"lines": n_lines, "lines_removed": n_removed} | {f"removed_{k}": v for k, v in removed.items() if v}
        if n_removed == n_lines or ratio(n_removed, n_lines) > cfg.max_removed_lines_frac:
            return drop("c4_lines_removed", s, max=cfg.max_removed_lines_frac)
        joined = "\n".join(kept) if n_removed else text
        out = joined.strip() if n_removed else text
        if cfg.min_sentences:
            s["sentences"] = len(_SENTENCE_END.findall(out))
            if s["sentences"] < cfg.min_sentences:
                return drop("c4_few_sentences", s, min=cfg.min_sentences)
        if not n_removed:
            return None
        # the lines that stay keep their code marks: the next gates need not split and judge them again
        after = TextView(out, view.lang, raw_lines=kept, code=kept_code, stripped=list(compress(stripped, keep_list))) \
            if out == joined else None
        return Edit(out, {"c4_lines_removed": n_removed}, after)
    return gate


def _lines_with(view: TextView, low: str, phrases: tuple[str, ...]) -> np.ndarray:
    """For each raw line: does its lower-cased text hold one of `phrases`? Found with str.find in `low` (the
    text lower-cased) and mapped to lines, so a page pays per occurrence, not per line. A phrase holds no
    whitespace at its ends, so a stripped line holds it when its raw line does; lower-casing a line alone is
    lower-casing its slice of the text (a newline is not a cased letter, so final sigma reads the same) as long
    as no character grows when lower-cased (U+0130), and then each line is lower-cased alone instead."""
    lines = view.raw_lines
    found = np.zeros(len(lines), dtype=bool)
    if not any(p in low for p in phrases):
        return found
    if len(low) != len(view.text):  # a character grew: line by line
        found[:] = [any(p in line.lower() for p in phrases) for line in lines]
        return found
    line_starts = np.zeros(len(lines), dtype=np.int64)
    np.cumsum(np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))[:-1] + 1, out=line_starts[1:])
    for phrase in phrases:
        at = low.find(phrase)
        while at >= 0:
            found[np.searchsorted(line_starts, at, side="right") - 1] = True
            at = low.find(phrase, at + 1)
    return found
