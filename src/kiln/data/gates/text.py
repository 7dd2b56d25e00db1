"""How gates see text: lines, paragraphs and words, for scripts with and without spaces.

Japanese and Chinese are written without spaces, so splitting on whitespace
gives one "word" per sentence. `words` counts each Han/kana character as a word
instead (the usual character-level equivalent), and `spaceless` tells a gate
that rules about word length or words per line do not apply.

`TextView` splits one version of a document's text once (lines, tokens, words, paragraphs) for
every gate that reads it; `apply_gates` makes a new one only when a step rewrites the text.
Counts over characters and whitespace tokens (visible characters, letters, token lengths and
which tokens hold a letter) come from one numpy pass (`TextView.char_flags`, `token_bounds`): a
table lookup per code point instead of a Python call per word.

Code lines. Documentation repeats code by nature (`import asyncio`, `try:`, `>>> parser.print_help()`,
`}`), and code lines end without a full stop, so the rules FineWeb and Gopher wrote for web prose (duplicated
lines, duplicated n-grams, punctuated lines) read a page of examples as boilerplate. `TextView.code` marks
code lines by shape, so that those rules judge the prose around them (junk is prose-shaped: spam, link farms,
tables and navigation stay measured). A line is code-shaped when it starts with a prompt (`>>>`, `...`, `$`,
`#`, `%`), ends with code punctuation (`{ } ( ) [ ] ; , : \\ =`), or, without terminal punctuation,
holds an assignment, a call, brackets or `--`; and every line of a block (lines with no blank line
between them) is code when at least half of the block's lines are code-shaped, which takes in
`import sys` and `pass` beside them.
"""

from __future__ import annotations

import re
import secrets
from collections import Counter
from functools import lru_cache
from itertools import repeat

import numpy as np

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_WORD = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_CJK_CHAR = re.compile(f"[{_CJK}]")
# scripts whose sentences run without spaces, or whose words are written as one run (for the noise gate):
# CJK punctuation, kana, Han, Hangul, Thai, Lao, Tibetan, Myanmar, Khmer, full-width forms
SPACELESS_SCRIPTS = ("\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
                     "\u1100-\u11ff\u0e00-\u0eff\u0f00-\u0fff\u1000-\u109f\u1780-\u17ff\uff00-\uffef")
CODE_PAGE_SHARE = 0.05
_PROMPTS = (">>>", "...", "$ ", "# ", "% ")
_CODE_ENDS = tuple("{}()[];,:\\=")
# `=`, a call (`\w(`: found at its "(", then looked behind, so that every branch starts with a character re
# skips to in C: 2x faster than `\w\(` first), a bracket, `--` or `::`; only whether a line holds one matters
_CODE_SIGN = re.compile(r"=|\((?<=\w\()|[{}\[\]<>]|--|::")
TERMINAL_PUNCT = (".", "!", "?", '"', "'", "\u201d", "\u3002", "\uff01", "\uff1f", "\u300d", "\u300f")


def words(text: str) -> list[str]:
    """Whitespace-separated words, with each CJK character a word of its own."""
    if _CJK_CHAR.search(text) is None:
        return text.split()  # the same words (\\s is str.isspace), split in C several times faster
    return _WORD.findall(text)  # whitespace is in neither branch: each token's findall, in one scan


CJK_CHARS_PER_WORD = 2  # a Chinese word averages ~1.5 characters, a Japanese one ~2


def word_count(text: str) -> float:
    """Words as a reader of the language would count them: spaced words, plus Han/kana characters / 2."""
    cjk = len(_CJK_CHAR.findall(text))
    if not cjk:
        return len(text.split())
    # what is left between the characters: Latin words count, stray brackets and punctuation do not
    spaced = sum(any(c.isalnum() for c in w) for w in _CJK_CHAR.sub(" ", text).split())
    return spaced + cjk / CJK_CHARS_PER_WORD


def spaceless(text: "str | TextView") -> bool:
    """True when over 30% of the visible characters are Han or kana (Japanese pages are full of ASCII commands)."""
    return as_view(text).spaceless


def lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.split("\n") if ln.strip()]


def code_paragraph(paragraph: str) -> bool:
    """A paragraph all of whose lines are code (by `code_lines`, judged within the paragraph alone)."""
    return all(code_lines([ln.strip() for ln in paragraph.split("\n")]))


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


# bits of `char_flags`: str.isspace (what str.split splits on), str.isalpha, re's [^\W\d_] (a letter to
# Gopher's "word with a letter"), Han/kana (_CJK_CHAR), what a hex dump's groups are made of, "\n",
# str.isalnum, and re's \d (str.isdecimal)
SPACE, ALPHA, LETTER, CJK, HEX, NEWLINE, ALNUM, DIGIT = 1, 2, 4, 8, 16, 32, 64, 128
_LETTER_RE = re.compile(r"[^\W\d_]")
_HEX_CHARS = frozenset("0123456789abcdefABCDEF:")


def _flags_of(c: str) -> int:
    return (SPACE * c.isspace() | ALPHA * c.isalpha() | LETTER * (_LETTER_RE.match(c) is not None)
            | CJK * (_CJK_CHAR.match(c) is not None) | HEX * (c in _HEX_CHARS) | NEWLINE * (c == "\n")
            | ALNUM * c.isalnum() | DIGIT * c.isdecimal())


@lru_cache(maxsize=1)
def _bmp_flags() -> np.ndarray:
    """`_flags_of` every code point of the Basic Multilingual Plane (64 KiB, built once per process, ~0.1 s)."""
    return np.fromiter((_flags_of(chr(c)) for c in range(0x10000)), dtype=np.uint8, count=0x10000)


def code_points(text: str) -> np.ndarray:
    """Each character's code point (uint32, one per character)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def char_flags(text: str, codes: np.ndarray | None = None) -> np.ndarray:
    """`_flags_of` each character of `text` (uint8, one per character): a table lookup, in numpy; the few
    characters beyond the BMP (emoji, rare scripts; never whitespace) are asked one by one. `codes`: its
    `code_points`, when known."""
    codes = code_points(text) if codes is None else codes
    if not len(codes) or codes.max() <= 0xFFFF:
        return _bmp_flags().take(codes)  # take: ~2x faster than indexing with the array
    beyond = np.flatnonzero(codes > 0xFFFF)
    flags = _bmp_flags().take(np.minimum(codes, 0xFFFF))
    flags[beyond] = [_flags_of(chr(c)) for c in codes[beyond].tolist()]
    return flags


def duplicates(items: list[str], skip=None) -> tuple[int, int]:
    """How many items repeat an earlier one, and their characters (not counting repeats `skip` says to)."""
    distinct = set(items)
    if len(distinct) == len(items):
        return 0, 0  # the usual case, decided in C
    if skip is None:  # every occurrence after a value's first counts: all of them less one of each value
        return len(items) - len(distinct), sum(map(len, items)) - sum(map(len, distinct))
    count = chars = 0
    for it, k in Counter(items).items():  # counted in C; only the repeated values are asked about
        if k > 1 and not skip(it):
            count, chars = count + k - 1, chars + (k - 1) * len(it)
    return count, chars


def ratio(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


_TOKEN_KEY = np.uint64(secrets.randbits(64))


class TextView:
    """One version of a document's text, split on demand and at most once per way of splitting it.

    Memory: the splits of one document (a few times its size), dropped with the view.
    """

    __slots__ = ("text", "lang", "_raw_lines", "_stripped", "_lines", "_words", "_paragraphs", "_spaceless",
                 "_visible", "_code", "_prose_lines", "_prose_words", "_has_cjk", "_flags", "_tokens", "_codes",
                 "_line_of", "_word_bounds")

    def __init__(self, text: str, lang: str | None = None, raw_lines: list[str] | None = None,
                 code: list[bool] | None = None, stripped: list[str] | None = None) -> None:
        """`raw_lines`, `code` and `stripped`, when given, must be `text.split("\\n")`, its code marks and those
        lines stripped (an edit that kept some lines knows them)."""
        self.text, self.lang = text, lang  # lang: what language ID said (None: not known)
        self._raw_lines, self._code, self._stripped = raw_lines, code, stripped
        self._lines = self._words = self._paragraphs = None
        self._spaceless = self._visible = self._prose_lines = self._prose_words = self._has_cjk = None
        self._flags = self._tokens = self._codes = self._line_of = self._word_bounds = None

    @property
    def raw_lines(self) -> list[str]:
        """`text.split("\\n")`: every line as written, blank ones too."""
        if self._raw_lines is None:
            self._raw_lines = self.text.split("\n")
        return self._raw_lines

    @property
    def stripped_lines(self) -> list[str]:
        """Every raw line, stripped (blank ones become "")."""
        if self._stripped is None:
            self._stripped = list(map(str.strip, self.raw_lines))
        return self._stripped

    @property
    def lines(self) -> list[str]:
        """Non-blank lines, stripped (`lines(text)`)."""
        if self._lines is None:
            self._lines = [s for s in self.stripped_lines if s]
        return self._lines

    @property
    def words(self) -> list[str]:
        if self._words is None:
            self._words = words(self.text) if self.has_cjk else self.text.split()
        return self._words

    @property
    def paragraphs(self) -> list[str]:
        """Blocks of lines between blank lines, stripped (`paragraphs(text)`)."""
        if self._paragraphs is None:
            self._paragraphs = paragraphs(self.text)
        return self._paragraphs

    @property
    def code(self) -> list[bool]:
        """For each raw line: is it code (see the module docstring)? Blank lines are not."""
        if self._code is None:
            self._code = code_lines(self.stripped_lines)
        return self._code

    @property
    def has_code(self) -> bool:
        """A page with code: at least CODE_PAGE_SHARE of its non-blank lines are code (documentation)."""
        return sum(self.code) >= CODE_PAGE_SHARE * max(len(self.lines), 1)

    @property
    def prose_lines(self) -> list[str]:
        """The non-blank lines that are not code, stripped."""
        if self._prose_lines is None:
            self._prose_lines = [s for s, c in zip(self.stripped_lines, self.code) if s and not c]
        return self._prose_lines

    @property
    def prose_words(self) -> list[str]:
        """`words` of the prose lines (all the words when there is no code)."""
        if self._prose_words is None:
            if not any(self.code):
                self._prose_words = self.words
            else:  # the prose lines hold Han/kana only if the text does
                prose = "\n".join(self.prose_lines)
                self._prose_words = words(prose) if self.has_cjk else prose.split()
        return self._prose_words

    @property
    def codes(self) -> np.ndarray:
        """`code_points(text)`."""
        if self._codes is None:
            self._codes = code_points(self.text)
        return self._codes

    @property
    def char_flags(self) -> np.ndarray:
        """`char_flags(text)`: the SPACE, ALPHA, LETTER, CJK, HEX, NEWLINE, ALNUM and DIGIT bits of each
        character."""
        if self._flags is None:
            self._flags = char_flags(self.text, self.codes)
        return self._flags

    @property
    def token_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends): character offsets of the whitespace-separated tokens (`text.split()`), in order."""
        if self._tokens is None:
            solid = (self.char_flags & SPACE) == 0
            edges = np.flatnonzero(solid[1:] != solid[:-1]) + 1  # where a token starts or ends inside the text
            if len(solid) and solid[0]:
                edges = np.concatenate([[0], edges])
            if len(solid) and solid[-1]:
                edges = np.concatenate([edges, [len(solid)]])
            self._tokens = edges[0::2], edges[1::2]
        return self._tokens

    @property
    def line_of(self) -> np.ndarray:
        """For each character but a newline: the raw line it is on (the newlines up to it)."""
        if self._line_of is None:
            self._line_of = np.cumsum((self.char_flags & NEWLINE) != 0)
        return self._line_of

    @property
    def token_lines(self) -> np.ndarray:
        """For each whitespace token: the raw line it is on."""
        return self.line_of[self.token_bounds[0]]

    @property
    def word_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends): character offsets of `words` (the whitespace tokens, each Han/kana character cut out of
        them as a word of its own), in order, found in numpy: no str per word."""
        if not self.has_cjk:
            return self.token_bounds
        if self._word_bounds is None:
            flags = self.char_flags
            solid = np.concatenate([[0], (flags & (SPACE | CJK)) == 0, [0]]).astype(np.int8)
            edges = np.flatnonzero(np.diff(solid))  # the runs of characters that are neither space nor Han/kana
            cjk = np.flatnonzero(flags & CJK)
            starts = np.concatenate([edges[0::2], cjk])
            order = np.argsort(starts, kind="stable")
            self._word_bounds = starts[order], np.concatenate([edges[1::2], cjk + 1])[order]
        return self._word_bounds

    @property
    def word_lines(self) -> np.ndarray:
        """For each word (`word_bounds`): the raw line it is on."""
        return self.line_of[self.word_bounds[0]]

    @property
    def line_token_counts(self) -> np.ndarray:
        """For each raw line: how many whitespace tokens it holds (`len(line.split())`; 0 for a blank line)."""
        return np.bincount(self.token_lines, minlength=len(self.raw_lines))

    @property
    def token_ids(self) -> np.ndarray:
        """For each whitespace token: a 64-bit id, the same for equal tokens and, for two different ones, the same
        with probability ~2^-64, as their str hashes: the sum over its characters of a mix (splitmix64's, keyed
        per process as Python keys str hashes) of (code point, place in the token), in numpy instead of a str
        per token. Ids are compared within the document, never kept."""
        return self._ids(*self.token_bounds)

    @property
    def word_ids(self) -> np.ndarray:
        """For each word (`word_bounds`): its id, as `token_ids` makes them."""
        return self._ids(*self.word_bounds)

    def _ids(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Ids of the spans (starts, ends) that cover the visible characters, each once, in order (the tokens, or
        the words)."""
        if not len(starts):
            return np.empty(0, dtype=np.uint64)
        lengths = ends - starts
        inside = np.flatnonzero((self.char_flags & SPACE) == 0)  # the tokens' characters, token after token
        x = (inside - np.repeat(starts, lengths)).astype(np.uint64) << np.uint64(21)  # code points are < 2^21
        x |= self.codes[inside]
        x ^= _TOKEN_KEY
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        offsets = np.zeros(len(starts), dtype=np.intp)
        np.cumsum(lengths[:-1], out=offsets[1:])
        return np.add.reduceat(x, offsets)

    @property
    def line_word_counts(self) -> np.ndarray:
        """For each raw line: `word_count(line)` (tokens, or with Han/kana in it: the spaced words that hold a
        letter or digit plus its Han/kana characters / 2), counted in numpy."""
        tokens = self.line_token_counts
        if not self.has_cjk:
            return tokens
        flags, lines, line_of = self.char_flags, len(self.raw_lines), self.line_of
        cjk = np.bincount(line_of[(flags & CJK) != 0], minlength=lines)
        solid = np.concatenate([[0], (flags & (SPACE | CJK)) == 0, [0]]).astype(np.int8)  # words between them
        edges = np.flatnonzero(np.diff(solid))
        starts, ends = edges[0::2], edges[1::2]
        alnum = np.concatenate([[0], np.cumsum((flags & ALNUM) != 0)])
        spaced = np.bincount(line_of[starts][alnum[ends] > alnum[starts]], minlength=lines)
        return np.where(cjk > 0, spaced + cjk / CJK_CHARS_PER_WORD, tokens)

    @property
    def token_count(self) -> int:
        """len(text.split())."""
        return len(self._words) if self._words is not None and not self.has_cjk else len(self.token_bounds[0])

    @property
    def word_count(self) -> int:
        """len(words): the tokens, unless Han/kana make each such character a word."""
        return len(self.word_bounds[0]) if self.has_cjk else self.token_count

    def count(self, bit: int) -> int:
        """Characters with that bit of `char_flags` (ALPHA: str.isalpha letters)."""
        return int(np.count_nonzero(self.char_flags & bit))

    def tokens_with(self, bit: int) -> int:
        """Whitespace tokens holding at least one character with that bit (LETTER: Gopher's words with a letter)."""
        return self._spans_with(bit, self.token_bounds[0])

    def words_with(self, bit: int) -> int:
        """Words (`word_bounds`) holding at least one character with that bit."""
        return self._spans_with(bit, self.word_bounds[0])

    def _spans_with(self, bit: int, starts: np.ndarray) -> int:
        """How many of the spans starting at `starts` hold a character with `bit`, a bit no whitespace has (not
        SPACE, NEWLINE): each span is read to the next one's start, past its end over whitespace only."""
        if not len(starts):
            return 0
        return int(np.count_nonzero(np.logical_or.reduceat((self.char_flags & bit) != 0, starts)))

    def tokens_all(self, bit: int) -> np.ndarray:
        """For each whitespace token: are all its characters ones with that bit?"""
        starts, ends = self.token_bounds
        return self._chars_in_tokens(bit) == ends - starts

    def _chars_in_tokens(self, bit: int) -> np.ndarray:
        return self._chars_in(bit, *self.token_bounds)

    def _chars_in(self, bit: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        within = np.concatenate([[0], np.cumsum((self.char_flags & bit) != 0)])
        return within[ends] - within[starts]

    @property
    def visible_chars(self) -> int:
        """Characters that are not whitespace (as str.isspace has it)."""
        if self._visible is None:
            self._visible = len(self.text) - self.count(SPACE)
        return self._visible

    @property
    def has_cjk(self) -> bool:
        """Any Han or kana at all (the CJK bit of `char_flags`, which the gates need anyway; most documents have
        none, and then words split in C)."""
        if self._has_cjk is None:
            self._has_cjk = bool((self.char_flags & CJK).any())
        return self._has_cjk

    @property
    def spaceless(self) -> bool:
        if self._spaceless is None:
            self._spaceless = self.has_cjk and self.count(CJK) / self.visible_chars > 0.3
        return self._spaceless


def code_shaped(line: str) -> bool:
    """One stripped, non-blank line looks like code (the module docstring says how)."""
    if line.startswith(_PROMPTS) or line.endswith(_CODE_ENDS):
        return True
    return not line.endswith(TERMINAL_PUNCT) and _CODE_SIGN.search(line) is not None


def code_lines(stripped: list[str]) -> list[bool]:
    """Which lines (each stripped, blank ones "") are code: code-shaped ones, every line of a block that is
    at least half code-shaped, and a lone unpunctuated line right before code (`import asyncio`, cut from its
    example by a blank line)."""
    # code_shaped, line by line, with the str tests run by map in C and the regex only where they leave it open
    prompt = map(str.startswith, stripped, repeat(_PROMPTS))
    code_end = map(str.endswith, stripped, repeat(_CODE_ENDS))
    final = map(str.endswith, stripped, repeat(TERMINAL_PUNCT))
    out = [bool(s) and (p or e or (not f and _CODE_SIGN.search(s) is not None))
           for s, p, e, f in zip(stripped, prompt, code_end, final)]
    blank = [i for i, s in enumerate(stripped) if not s]
    blocks = [(a + 1, b) for a, b in zip([-1] + blank, blank + [len(stripped)]) if b > a + 1]
    for a, b in blocks:
        if b - a >= 2 and 2 * sum(out[a:b]) >= b - a:
            out[a:b] = [True] * (b - a)
    for (a, b), (c, _) in zip(reversed(blocks[:-1]), reversed(blocks[1:])):  # backwards: chains of such lines
        if b - a == 1 and out[c] and not out[a] and not stripped[a].endswith(TERMINAL_PUNCT):
            out[a] = True
    return out


def as_view(text: "str | TextView") -> TextView:
    """The view a gate reads: the one apply_gates shares, or a new one for a gate called on a string."""
    return text if isinstance(text, TextView) else TextView(text)
