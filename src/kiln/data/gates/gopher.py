"""Gopher quality and repetition rules (Rae et al. 2021, "Scaling Language Models", appendix A).

Thresholds are the published ones (config: data.quality.gopher_quality / gopher_repetition).
Choices where the paper is English-only:
- stop words: Gopher asks for 2 of {the, be, to, of, and, that, have, with}; Kiln has the same
  handful of function words for de, fr, es, it, pt, nl, ru and pl, and asks for them in the
  document's language (all of them when the language is not known); a language without a list
  (Korean, whose particles are glued to the words) skips the rule rather than fail every page;
- text without spaces (ja, zh): a "word" is one Han/kana character. Mean word length is taken
  over the other words only, and with the stop-word rule skipped when such characters dominate;
  the repetition rules use character n-grams with n times `cjk_ngram_scale` (a Chinese word is
  ~1.5 characters, a Japanese one ~2: with n unscaled, 13 of the 15 Japanese Debian Reference
  pages fail the 5-gram rule, with n doubled none does).
- code: on a page with code (documentation, `TextView.has_code`) the duplicated n-gram limits are
  `code_page_ngram_scale` (1.5) times Gopher's: an API reference repeats its phrasing per entry ("Return
  value: New reference.", "Raises an auditing event"); pages without code keep the published limits.
- code: the repetition rules read the prose (`TextView.prose_lines`, `prose_words`), not the code lines of
  a documentation page, which repeat by nature (see kiln.data.gates.text).
"""

from __future__ import annotations

import bisect
import re
from itertools import repeat

import numpy as np

from kiln.data.gates.text import _CJK, CJK, LETTER, TextView, as_view, code_paragraph, duplicates, ratio
from kiln.data.gates.types import Gate, Verdict, drop

STOP_WORDS_BY_LANG = {lang: frozenset(ws.split()) for lang, ws in {
    "en": "the be to of and that have with",  # Gopher's list
    "de": "der die das und ist zu nicht mit",
    "fr": "le la les et est des une pour",
    "es": "el los las y que del por con",
    "it": "il di che è per una con non",
    "pt": "o os as e que do da para",
    "nl": "de het een en van is dat op",
    "ru": "и в не на что с по как",
    "pl": "i w nie na się z jest to",
}.items()}
STOP_WORDS = frozenset().union(*STOP_WORDS_BY_LANG.values())
_SPACED_WORD = re.compile(f"[^\\s{_CJK}]+")


BULLETS = ("-", "*", "\u2022", "\u2023", "\u25e6", "\u2043", "\u2219", "\u25aa", "\u25cf")
ELLIPSES = ("...", "\u2026")


def gopher_quality(cfg) -> Gate:
    def gate(text: "str | TextView") -> Verdict:
        view = as_view(text)
        text = view.text
        n = view.word_count
        ls = view.lines
        s: dict = {"words": n}
        if n < cfg.min_words:
            return drop("gopher_short_doc", s, min_words=cfg.min_words)
        if n > cfg.max_words:
            return drop("gopher_long_doc", s, max_words=cfg.max_words)
        cjk = view.spaceless
        s["alpha_words_frac"] = ratio(view.words_with(LETTER), n)  # numpy counts the words with a letter
        s["bullet_lines_frac"] = ratio(sum(map(str.startswith, ls, repeat(BULLETS))), len(ls))
        s["ellipsis_lines_frac"] = ratio(sum(map(str.endswith, ls, repeat(ELLIPSES))), len(ls))
        s["symbol_word_ratio"] = ratio(text.count("#") + text.count("...") + text.count("\u2026"), n)
        stop_words = STOP_WORDS_BY_LANG.get(view.lang) if view.lang else STOP_WORDS
        if not cjk:
            has_cjk = view.has_cjk  # without Han/kana the words are the spaced words
            if has_cjk:  # the spaced words: those that are not a Han/kana character
                starts, ends = view.word_bounds
                spaced = (view.char_flags[starts] & CJK) == 0
                s["mean_word_len"] = ratio(int((ends - starts)[spaced].sum()), int(spaced.sum()))
            else:  # the tokens' characters are the visible ones
                s["mean_word_len"] = ratio(view.visible_chars, view.token_count)
            if stop_words:
                s["stop_words"] = 0  # its place among the signals; counted below, in full only if it is shown
        failed = _quality_failure(s, cfg)
        if "stop_words" in s:
            if failed is None and _stop_words_at_least(text, stop_words, cfg.min_stop_words, view.has_cjk):
                return None
            s["stop_words"] = _stop_words_in(text.lower(), stop_words, view.has_cjk)
            if failed is None and s["stop_words"] < cfg.min_stop_words:
                failed = "gopher_stop_words", {"min": cfg.min_stop_words}
        return drop(failed[0], s, **failed[1]) if failed else None
    return gate


def _quality_failure(s: dict, cfg) -> tuple[str, dict] | None:
    """The first Gopher quality rule (but the stop words') that the signals break, with its limits."""
    if "mean_word_len" in s and not cfg.min_mean_word_len <= s["mean_word_len"] <= cfg.max_mean_word_len:
        return "gopher_mean_word_len", {"min": cfg.min_mean_word_len, "max": cfg.max_mean_word_len}
    if s["symbol_word_ratio"] > cfg.max_symbol_word_ratio:
        return "gopher_symbol_ratio", {"max": cfg.max_symbol_word_ratio}
    if s["bullet_lines_frac"] > cfg.max_bullet_lines_frac:
        return "gopher_bullet_lines", {"max": cfg.max_bullet_lines_frac}
    if s["ellipsis_lines_frac"] > cfg.max_ellipsis_lines_frac:
        return "gopher_ellipsis_lines", {"max": cfg.max_ellipsis_lines_frac}
    if s["alpha_words_frac"] < cfg.min_alpha_words_frac:
        return "gopher_alpha_words", {"min": cfg.min_alpha_words_frac}
    return None


def _stop_words_in(lowered: str, stop_words: frozenset[str], has_cjk: bool) -> int:
    """Stop words among the spaced words of a lower-cased text."""
    return sum(map(stop_words.__contains__, _SPACED_WORD.findall(lowered) if has_cjk else lowered.split()))


STOP_WORD_CHUNK = 2048


def _stop_words_at_least(text: str, stop_words: frozenset[str], k: int, has_cjk: bool) -> bool:
    """Whether the text holds `k` stop words, read from its start in chunks only as far as needed.

    Chunks are cut at a space, so no word is split, and lower-cased alone each is the same slice of
    `text.lower()` (a final sigma looks no further than the space); most pages meet `k` in the first chunk.
    """
    found, start = 0, 0
    while start < len(text):
        cut = text.find(" ", start + STOP_WORD_CHUNK)
        end = len(text) if cut < 0 else cut
        found += _stop_words_in(text[start:end].lower(), stop_words, has_cjk)
        if found >= k:
            return True
        start = end
    return False


class _Grams:
    """A document's words as ids, with 64-bit hashes of their n-grams: the n-gram rules in numpy.

    An n-gram can occur twice only where its first n-1 words do, so once the rules have grouped the
    shorter n-grams, the longer ones are hashed and sorted only at the positions whose shorter n-gram
    repeats (a few percent of a real page); every other n-gram occurs once, which is all the rules need
    to know of it. Memory: a few arrays of the document's word count.
    """

    def __init__(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        # only the ids' equality matters, and the rules' answers depend on positions, not on the ids' values,
        # so they are the same in every process (the ids are keyed per process, as str hashes are)
        self.ids = ids
        self.cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self._cum_list: list[int] | None = None
        self._repeated: dict[int, np.ndarray] = {}  # n -> positions whose n-gram occurs more than once
        self._every: dict[int, np.ndarray] = {}  # n -> the hashes of every n-gram, once asked for

    @classmethod
    def of_words(cls, ws: list[str]) -> "_Grams":
        """Words as strings: a word's id is its str hash (computed in C)."""
        return cls(np.fromiter(map(hash, ws), dtype=np.int64, count=len(ws)).view(np.uint64),
                   np.fromiter(map(len, ws), dtype=np.int64, count=len(ws)))

    @classmethod
    def of_view(cls, view: TextView) -> "_Grams":
        """The words the repetition rules read, `view.prose_words or view.words`: the words of the prose lines,
        when there are code lines and prose, whose ids and lengths numpy finds in the view's characters
        (`TextView.word_ids`: the whitespace tokens, each Han/kana character a word of its own) with no str per
        word."""
        starts, ends = view.word_bounds
        ids, lengths = view.word_ids, ends - starts
        if any(view.code):
            prose = ~np.array(view.code, dtype=bool)[view.word_lines]
            if prose.any():
                ids, lengths = ids[prose], lengths[prose]
        return cls(ids, lengths)

    @property
    def cum_list(self) -> list[int]:
        """`cum` as a list, for the one rule that must walk the words in Python (on few documents)."""
        if self._cum_list is None:
            self._cum_list = self.cum.tolist()
        return self._cum_list

    def hashes(self, n: int, at: np.ndarray | None = None) -> np.ndarray:
        """Hashes of the n-grams starting at `at` (default: every position, kept: the (n+1)-grams' are made
        from them in one pass)."""
        m = len(self.ids) - n + 1
        if m <= 0:
            return np.empty(0, dtype=np.uint64)
        if at is None or n in self._every:
            if n not in self._every:
                shorter = self.hashes(n - 1) if n > 1 else None
                with np.errstate(over="ignore"):
                    self._every[n] = (self.ids if shorter is None else shorter[:m] ^ self.ids[n - 1:]) * _MIX
            return self._every[n] if at is None else self._every[n][at]
        acc = self.ids[at] * _MIX
        with np.errstate(over="ignore"):
            for j in range(1, n):
                acc = (acc ^ self.ids[at + j]) * _MIX
        return acc

    def groups(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(positions, first, inverse, counts) as np.unique gives them for the n-grams at `positions`: every
        n-gram that can repeat (all of them, or those whose shorter n-gram, grouped before, repeats), less most
        of those that occur once. These are found without sorting: an n-gram alone in its bucket of a table of
        `_BUCKETS_PER_NGRAM` buckets per n-gram (one bincount) occurs once. Every occurrence of a repeated n-gram
        stays, so each rule's answer is the one over all positions."""
        m = len(self.ids) - n + 1
        shorter = [k for k in self._repeated if k < n]
        if m <= 0:
            pos = np.empty(0, dtype=np.int64)
        elif shorter:
            pos = self._repeated[max(shorter)]
            pos = pos[pos < m]
        else:
            pos = np.arange(m)
        hashes = self.hashes(n, None if len(pos) == m else pos)
        if len(pos) > _SORT_ALL:  # leave out n-grams alone in their bucket: they occur once, so no rule needs them
            bits = (_BUCKETS_PER_NGRAM * len(pos)).bit_length()
            bucket = (hashes >> np.uint64(64 - bits)).astype(np.intp)
            shared = np.bincount(bucket, minlength=1 << bits)[bucket] > 1
            pos, hashes = pos[shared], hashes[shared]
        _, first, inverse, counts = np.unique(hashes, return_index=True, return_inverse=True, return_counts=True)
        self._repeated[n] = pos[counts[inverse] > 1]
        return pos, first, inverse, counts

    def chars(self, start: np.ndarray | int, n: int):
        """Characters of the n words starting at `start`."""
        return self.cum[start + n] - self.cum[start]


_MIX = np.uint64(0x9E3779B97F4A7C15)
_SORT_ALL = 64  # n-grams sorted as they are; above this many, those alone in their bucket are left out first
_BUCKETS_PER_NGRAM = 8  # so ~12% of the n-grams that occur once share a bucket and are sorted anyway


def _top_ngram_chars(g: _Grams, n: int) -> int:
    """Characters covered by the most frequent n-gram (its length times its count; 0 if none repeats)."""
    pos, first, _, counts = g.groups(n)
    if not len(pos):
        return 0
    top = counts.max()
    if top < 2:
        return 0
    return int(g.chars(pos[first[counts == top]], n).max()) * int(top)


def _top_ngram_bound(g: _Grams, n: int) -> int:
    """At least `_top_ngram_chars(g, n)`, in one bincount and no sort: all occurrences of an n-gram share a
    bucket (of at least 2 per n-gram), so the characters a bucket sums hold any n-gram's count times its
    characters (and a few others'; a page passes the top n-gram rules by far or not at all)."""
    hashes = g.hashes(n)
    if not len(hashes):
        return 0
    bits = (2 * len(hashes)).bit_length()
    bucket = (hashes >> np.uint64(64 - bits)).astype(np.intp)
    chars = g.cum[n:n + len(hashes)] - g.cum[:len(hashes)]  # g.chars of every n-gram, from slices
    return int(np.bincount(bucket, weights=chars, minlength=1 << bits).max())


def _duplicated_ngram_chars(g: _Grams, n: int, at_most: float | None = None) -> int | None:
    """Characters of words inside n-grams seen before (Gopher, as datatrove counts it: walking the n-grams in
    order, a repeat is counted and the n-1 n-grams overlapping it are skipped, unseen).

    The walk visits only the n-grams whose value occurred earlier in the text (numpy finds them); the others
    cannot be repeats, only make their value seen unless a skip covers them. So a candidate is a repeat
    when its value was seen at an earlier candidate that was walked, or at its first occurrence, unless a
    skipped span covers that.

    With `at_most`, None when the answer is at most that: the counted spans start at later occurrences and do
    not overlap, so the characters their union covers (numpy) bound it, and most pages need no walk.
    """
    pos, first, inverse, _ = g.groups(n)
    if not len(pos):
        return 0
    first_of = pos[first[inverse]]
    later = first_of != pos
    if at_most is not None and _covered_chars(g, pos[later], n) <= at_most:
        return None
    cum = g.cum_list
    skipped: list[int] = []  # starts of the skipped spans (i, i + n), in order
    seen_at_candidate: set[int] = set()
    chars, walk_from = 0, 0
    for i, value, f in zip(pos[later].tolist(), inverse[later].tolist(), first_of[later].tolist()):
        if i < walk_from:
            continue  # inside the span of the last repeat
        k = bisect.bisect_left(skipped, f) - 1  # the last span starting before f
        if value in seen_at_candidate or not (k >= 0 and f < skipped[k] + n):
            chars += cum[i + n] - cum[i]
            skipped.append(i)
            walk_from = i + n
        else:
            seen_at_candidate.add(value)
    return chars


def _covered_chars(g: _Grams, starts: np.ndarray, n: int) -> int:
    """Characters of the words that the n-grams starting at `starts` cover (their union)."""
    size = len(g.ids)
    depth = np.cumsum(np.bincount(starts, minlength=size + n) - np.bincount(starts + n, minlength=size + n))
    return int(np.diff(g.cum)[depth[:size] > 0].sum())


def _repeats_cover(g: _Grams, n: int) -> int:
    """Characters covered by the n-grams that repeat an earlier one: a bound on `_duplicated_ngram_chars` for
    this n and every larger one. An m-gram (m >= n) at i that repeats one at j is covered by the n-grams at
    i .. i+m-n, each a repeat of the one at j + the same offset; so the union of the repeated m-grams lies
    within the union of the repeated n-grams, and `_duplicated_ngram_chars`' own bound is at most this."""
    pos, first, inverse, _ = g.groups(n)
    return _covered_chars(g, pos[pos[first[inverse]] != pos], n) if len(pos) else 0


def gopher_repetition(cfg) -> Gate:
    def gate(text: "str | TextView") -> Verdict:
        view = as_view(text)
        total = len(view.text)
        paras = view.paragraphs
        n_dup_para, para_chars = duplicates(paras, skip=code_paragraph)
        s: dict = {"dup_para_frac": ratio(n_dup_para, len(paras)), "dup_para_char_frac": ratio(para_chars, total)}
        if s["dup_para_frac"] > cfg.max_dup_para_frac:
            return drop("gopher_dup_paragraphs", s, max=cfg.max_dup_para_frac)
        if s["dup_para_char_frac"] > cfg.max_dup_para_char_frac:
            return drop("gopher_dup_paragraph_chars", s, max=cfg.max_dup_para_char_frac)
        _, line_chars = duplicates(view.prose_lines or view.lines)
        s["dup_line_char_frac"] = ratio(line_chars, total)
        if s["dup_line_char_frac"] > cfg.max_dup_line_char_frac:
            return drop("gopher_dup_line_chars", s, max=cfg.max_dup_line_char_frac)
        grams = _Grams.of_view(view)
        word_chars = int(grams.cum[-1])
        scale = cfg.cjk_ngram_scale if view.spaceless else 1
        relax = cfg.code_page_ngram_scale if view.has_code else 1
        limits = {n: min(1.0, limit * relax) for n, limit in cfg.dup_ngram_max_char_frac.items()}
        # the duplicated n-gram rules' bound (below) and the top n-grams' (no sort): most pages end here
        if all(_top_ngram_bound(grams, n * scale) <= limit * word_chars
               for n, limit in cfg.top_ngram_max_char_frac.items()) and \
                (not limits or _repeats_cover(grams, min(limits) * scale) <= min(limits.values()) * word_chars):
            return None
        for n, limit in sorted(cfg.top_ngram_max_char_frac.items()):
            frac = s[f"top_{n}_gram_char_frac"] = ratio(_top_ngram_chars(grams, n * scale), word_chars)
            if frac > limit:
                return drop("gopher_top_ngram", s, n=n * scale, max=limit)
        if limits and _repeats_cover(grams, min(limits) * scale) <= min(limits.values()) * word_chars:
            return None  # every duplicated n-gram rule's bound (below) holds
        bounded = []  # n-grams found within their limit by the bound: walked only if the document is dropped
        for n, limit in sorted(cfg.dup_ngram_max_char_frac.items()):
            limit = min(1.0, limit * relax)
            chars = _duplicated_ngram_chars(grams, n * scale, at_most=limit * word_chars)
            if chars is None:
                s[f"dup_{n}_gram_char_frac"] = None
                bounded.append(n)
                continue
            frac = s[f"dup_{n}_gram_char_frac"] = ratio(chars, word_chars)
            if frac > limit:
                for m in bounded:  # the drop's signals hold every value
                    s[f"dup_{m}_gram_char_frac"] = ratio(_duplicated_ngram_chars(grams, m * scale), word_chars)
                return drop("gopher_dup_ngrams", s, n=n * scale, max=limit)
        return None
    return gate
