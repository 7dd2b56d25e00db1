"""The gates' parts as they were before they were made faster (Kiln 172dc2d), for test_gate_speedups.py to
check the fast versions against: plain Python loops and whole-text regex scans, slow and obviously right."""

from __future__ import annotations

import re

from kiln.data.gates.noise import _ENTITY, _MARKUP_STARTS, _MOJIBAKE, _TAG
from kiln.data.gates.pii import EMAIL
from kiln.data.gates.gopher import _SPACED_WORD, BULLETS, STOP_WORDS, STOP_WORDS_BY_LANG
from kiln.data.gates.text import _CJK_CHAR, TERMINAL_PUNCT, TextView, code_shaped, ratio, word_count
from kiln.data.gates.types import Edit, drop

MARKUP = re.compile(f"{_ENTITY}|{_TAG}|{_MOJIBAKE}")
HEX_RUN = re.compile(r"(?<!\S)(?:[0-9a-fA-F]{2,8}:?[ \t]+){7}[0-9a-fA-F]{2,8}:?(?!\S)")
LETTER = re.compile(r"[^\W\d_]")
POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f]+(?:\s|$)")


def words(text: str) -> list[str]:
    from kiln.data.gates.text import _WORD

    if _CJK_CHAR.search(text) is None:
        return text.split()
    out: list[str] = []
    for tok in text.split():
        out.extend([tok] if tok.isascii() else _WORD.findall(tok))
    return out


def visible_chars(text: str) -> int:
    return len("".join(text.split()))


def words_with_letters(ws: list[str]) -> int:
    return sum(1 for w in ws if LETTER.search(w))


def duplicates(items: list[str], skip=None) -> tuple[int, int]:
    seen: set[str] = set()
    count = chars = 0
    for it in items:
        if it in seen:
            if skip is None or not skip(it):
                count += 1
                chars += len(it)
        else:
            seen.add(it)
    return count, chars


def code_lines(stripped: list[str]) -> list[bool]:
    out = [bool(s) and code_shaped(s) for s in stripped]
    blank = [i for i, s in enumerate(stripped) if not s]
    blocks = [(a + 1, b) for a, b in zip([-1] + blank, blank + [len(stripped)]) if b > a + 1]
    for a, b in blocks:
        if b - a >= 2 and 2 * sum(out[a:b]) >= b - a:
            out[a:b] = [True] * (b - a)
    for (a, b), (c, _) in zip(reversed(blocks[:-1]), reversed(blocks[1:])):
        if b - a == 1 and out[c] and not out[a] and not stripped[a].endswith(TERMINAL_PUNCT):
            out[a] = True
    return out


def suspect_lines(text: str, long: int) -> list[tuple[int, int]]:
    toks = text.split()
    at: list[int] = []
    cursor = 0
    for tok in toks:
        if len(tok) >= long:
            cursor = text.find(tok, cursor)
            at.append(cursor)
            cursor += len(tok)
    if any(c in text for c in _MARKUP_STARTS):
        at += [m.start() for m in MARKUP.finditer(text)]
    if len(toks) >= 8:
        at += [m.start() for m in HEX_RUN.finditer(text)]
    spans: dict[int, int] = {}
    for pos in sorted(at):
        start = text.rfind("\n", 0, pos) + 1
        if start not in spans:
            end = text.find("\n", pos)
            spans[start] = len(text) if end < 0 else end
    return list(spans.items())


def broken_json(text: str) -> int:
    import json

    broken = 0
    for line in text.split("\n"):
        line = line.strip().rstrip(",")
        if line.startswith(("{", "[")) and '":' in line:
            try:
                json.loads(line)
            except ValueError:
                broken += 1
    return broken


def ragged_table_rows(text: str) -> int:
    ragged, prev = 0, None
    for line in text.split("\n"):
        line = line.strip()
        if line.startswith("|") and line.count("|") >= 2:
            cells = line.strip("|").count("|") + 1
            ragged += prev is not None and cells != prev
            prev = cells
        else:
            prev = None
    return ragged


def redact_emails(text: str, replacement: str) -> tuple[str, int]:
    return EMAIL.subn(replacement, text)


def redact_pii(text: str, email: str, ip: str) -> tuple[str, int, int]:
    """The PII gate as one regex pass each over the whole text: (text, emails, public IPv4 addresses)."""
    import ipaddress

    from kiln.data.gates.pii import IPV4

    text, emails = EMAIL.subn(email, text)
    ips = 0

    def public(m):
        nonlocal ips
        try:
            hit = ipaddress.ip_address(m.group()).is_global
        except ValueError:
            return m.group()
        ips += hit
        return ip if hit else m.group()

    return IPV4.sub(public, text), emails, ips


def cjk_chars(text: str) -> int:
    return len(_CJK_CHAR.findall(text))


def c4_lines(cfg):
    """The C4 gate as one loop over the lines (code marks from the reference `code_lines`)."""
    def gate(text: str):
        low = text.lower()
        if cfg.drop_lorem_ipsum and "lorem ipsum" in low:
            return drop("c4_lorem_ipsum", {})
        if cfg.drop_curly_brace and "{" in text:
            return drop("c4_curly_brace", {})
        kept, removed = [], {"javascript": 0, "policy": 0, "short": 0, "no_punct": 0}
        raw, min_words = text.split("\n"), cfg.min_words_per_line
        javascript = cfg.drop_javascript_lines and "javascript" in low
        policy = cfg.drop_policy_lines and any(p in low for p in POLICY)
        for line, code in zip(raw, code_lines([ln.strip() for ln in raw])):
            stripped = line.strip()
            if not stripped:
                kept.append(line)
                continue
            lower = stripped.lower() if javascript or policy else ""
            if javascript and "javascript" in lower:
                removed["javascript"] += 1
            elif policy and any(p in lower for p in POLICY):
                removed["policy"] += 1
            elif code:
                kept.append(line)
            elif word_count(stripped) < min_words:
                removed["short"] += 1
            elif cfg.require_terminal_punct and not stripped.endswith(TERMINAL_PUNCT):
                removed["no_punct"] += 1
            else:
                kept.append(line)
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
        return Edit(out, {"c4_lines_removed": n_removed}) if n_removed else None
    return gate


def gopher_quality(cfg):
    """The Gopher quality gate with every signal counted in full, word by word."""
    def gate(text: str, lang: str | None = None):
        view = TextView(text, lang)
        text = view.text
        n = len(words(text))
        ls = view.lines
        s: dict = {"words": n}
        if n < cfg.min_words:
            return drop("gopher_short_doc", s, min_words=cfg.min_words)
        if n > cfg.max_words:
            return drop("gopher_long_doc", s, max_words=cfg.max_words)
        cjk = _CJK_CHAR.search(text) is not None and cjk_chars(text) / visible_chars(text) > 0.3
        s["alpha_words_frac"] = ratio(words_with_letters(words(text)), n)
        s["bullet_lines_frac"] = ratio(sum(ln.startswith(BULLETS) for ln in ls), len(ls))
        s["ellipsis_lines_frac"] = ratio(sum(ln.endswith(("...", "\u2026")) for ln in ls), len(ls))
        s["symbol_word_ratio"] = ratio(text.count("#") + text.count("...") + text.count("\u2026"), n)
        stop_words = STOP_WORDS_BY_LANG.get(view.lang) if view.lang else STOP_WORDS
        if not cjk:
            has_cjk = view.has_cjk  # without Han/kana the words are the spaced words
            spaced = _SPACED_WORD.findall(text) if has_cjk else text.split()
            s["mean_word_len"] = ratio(sum(map(len, spaced)), len(spaced))
            if stop_words:
                lowered = _SPACED_WORD.findall(text.lower()) if has_cjk else text.lower().split()
                s["stop_words"] = sum(map(stop_words.__contains__, lowered))
            if not cfg.min_mean_word_len <= s["mean_word_len"] <= cfg.max_mean_word_len:
                return drop("gopher_mean_word_len", s, min=cfg.min_mean_word_len, max=cfg.max_mean_word_len)
        if s["symbol_word_ratio"] > cfg.max_symbol_word_ratio:
            return drop("gopher_symbol_ratio", s, max=cfg.max_symbol_word_ratio)
        if s["bullet_lines_frac"] > cfg.max_bullet_lines_frac:
            return drop("gopher_bullet_lines", s, max=cfg.max_bullet_lines_frac)
        if s["ellipsis_lines_frac"] > cfg.max_ellipsis_lines_frac:
            return drop("gopher_ellipsis_lines", s, max=cfg.max_ellipsis_lines_frac)
        if s["alpha_words_frac"] < cfg.min_alpha_words_frac:
            return drop("gopher_alpha_words", s, min=cfg.min_alpha_words_frac)
        if "stop_words" in s and s["stop_words"] < cfg.min_stop_words:
            return drop("gopher_stop_words", s, min=cfg.min_stop_words)
        return None
    return gate
