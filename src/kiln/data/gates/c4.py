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

from kiln.data.gates.text import TERMINAL_PUNCT, TextView, as_view, ratio, word_count
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
        kept, kept_code, removed = [], [], {"javascript": 0, "policy": 0, "short": 0, "no_punct": 0}
        raw, min_words = view.raw_lines, cfg.min_words_per_line
        javascript = cfg.drop_javascript_lines and "javascript" in low
        policy = cfg.drop_policy_lines and any(p in low for p in POLICY)
        for line, code in zip(raw, view.code):
            stripped = line.strip()
            if not stripped:
                kept.append(line)
                kept_code.append(False)
                continue
            lower = stripped.lower() if javascript or policy else ""
            if javascript and "javascript" in lower:
                removed["javascript"] += 1
            elif policy and any(p in lower for p in POLICY):
                removed["policy"] += 1
            elif code:
                kept.append(line)
                kept_code.append(True)
            elif (len(stripped.split(None, min_words)) < min_words if stripped.isascii()
                  else word_count(stripped) < min_words):  # ASCII: the words are the spaced ones, split in C
                removed["short"] += 1
            elif cfg.require_terminal_punct and not stripped.endswith(TERMINAL_PUNCT):
                removed["no_punct"] += 1
            else:
                kept.append(line)
                kept_code.append(False)
        n_removed = sum(removed.values())
        n_lines = sum(bool(ln.strip()) for ln in raw)
        s = {"lines": n_lines, "lines_removed": n_removed} | {f"removed_{k}": v for k, v in removed.items() if v}
        if n_removed == n_lines or ratio(n_removed, n_lines) > cfg.max_removed_lines_frac:
            return drop("c4_lines_removed", s, max=cfg.max_removed_lines_frac)
        out = "\n".join(kept).strip() if n_removed else text
        if cfg.min_sentences:
            s["sentences"] = len(_SENTENCE_END.findall(out))
            if s["sentences"] < cfg.min_sentences:
                return drop("c4_few_sentences", s, min=cfg.min_sentences)
        if not n_removed:
            return None
        # the lines that stay keep their code marks: the next gates need not split and judge them again
        after = TextView(out, view.lang, raw_lines=kept, code=kept_code) if out == "\n".join(kept) else None
        return Edit(out, {"c4_lines_removed": n_removed}, after)
    return gate
