"""FineWeb's own rules (Penedo et al. 2024): punctuated lines, short lines, duplicated lines, lists.

The line rules read the prose lines (`TextView.prose_lines`): code lines end without a full stop, are
short and repeat (`try:`, `import os`), which is what these rules take for web boilerplate; a page that is
all code is judged on all its lines. The duplicated characters are still a share of all the characters.
On a page with code (`TextView.has_code`: documentation) the duplicated-line limit is
`max_dup_line_char_ratio_code` (0.03): a reference repeats its notes once per entry ("New in version 3.5.",
"Availability: Unix."), which FineWeb's 1%, tuned on web prose, takes for boilerplate; pages without code
(spam, shops, boilerplate) keep the published 1%.
"""

from __future__ import annotations

from kiln.data.gates.text import TERMINAL_PUNCT, TextView, as_view, duplicates, ratio
from kiln.data.gates.types import Gate, Verdict, drop


def fineweb_rules(cfg) -> Gate:
    def gate(text: "str | TextView") -> Verdict:
        view = as_view(text)
        ls = view.prose_lines or view.lines
        if not ls:
            return None
        s: dict = {"line_punct_ratio": ratio(sum(map(str.endswith, ls, [TERMINAL_PUNCT] * len(ls))), len(ls))}
        if s["line_punct_ratio"] < cfg.min_line_punct_ratio:
            return drop("fineweb_line_punct", s, min=cfg.min_line_punct_ratio)
        s["short_line_ratio"] = ratio(sum(map(cfg.short_line_chars.__ge__, map(len, ls))), len(ls))
        if s["short_line_ratio"] > cfg.max_short_line_ratio:
            return drop("fineweb_short_lines", s, max=cfg.max_short_line_ratio)
        _, dup_chars = duplicates(ls)
        s["dup_line_char_ratio"] = ratio(dup_chars, len(view.text) - view.text.count("\n"))
        limit = cfg.max_dup_line_char_ratio_code if view.has_code else cfg.max_dup_line_char_ratio
        if s["dup_line_char_ratio"] > limit:
            return drop("fineweb_dup_line_chars", s, max=limit)
        s["list_ratio"] = ratio(view.text.count("\n"), view.word_count)
        if s["list_ratio"] > cfg.max_list_ratio:
            return drop("fineweb_list_ratio", s, max=cfg.max_list_ratio)
        return None
    return gate
