"""Token-level noise: runs of junk tokens found with a sliding window (SEEDS: 5 tokens, 60%).

SEEDS scores tokens by corpus TF and IDF (noise: TF < 1e-4 and IDF > 12.5). A worker sees one
document at a time, so Kiln recognises the tokens that score that way by their shape instead:
- HTML entities and tags, mojibake (UTF-8 read as Latin-1, U+FFFD);
- long tokens without spaces (base64 blobs, glued-together link text), unless they are URLs or
  paths (also inside quotes or brackets, or as the value of `NAME=`) or written (a tenth or more) in
  a script without spaces: a Chinese, Japanese or Thai sentence is one whitespace token of 40+
  characters, and it is prose, even with `passwd(5)` or a path inside it;
- packed code: in a line of 100+ characters with a 40+ character token, a sixth or more of them code
  punctuation, tokens of 12+ characters a quarter or more code punctuation, as minified JavaScript is
  (`o=t[r]={i:r,l:!1,exports:{}};return`); a line of code in documentation is shorter, and its tokens are
  separated by spaces;
- hex dumps: a line of 8+ hexadecimal groups (`7f 45 4c 46`, `0000010: 0300 3e00`), one with a-f.

Only the lines that hold markup, a long token or a hex run are split into tokens and judged; what a
document can hold is checked first in C (`str.split`, `in`), so that most documents need no regex.

Within each line, the first window of `window` tokens noisier than `max_window_noise` cuts
the line there (the noisy tail goes). The document is dropped when noise tokens are more than
`max_doc_noise` of all tokens, or when cutting would leave less than `min_keep_chars`.
"""

from __future__ import annotations

import re

import numpy as np

from kiln.data.gates.text import HEX, SPACELESS_SCRIPTS, TextView, as_view, ratio
from kiln.data.gates.types import Edit, Gate, Verdict, drop

_ENTITY = r"&(?:[a-zA-Z]{2,8}|#[0-9]{2,6}|#[xX][0-9a-fA-F]{2,5});"
_TAG = r"</?[a-zA-Z][a-zA-Z0-9]{0,10}(?:\s[^<>]{0,80})?/?>"
_MOJIBAKE = "(?:\u00c3[\u0080-\u00bf]|\u00e2\u20ac|\u00c2[\u00a0-\u00bf]|\ufffd|\u00ef\u00bb\u00bf)"


# the mojibake alternatives spelled out, so that every branch starts with a literal and re skips in C to the
# characters that can start one (the same matches as f"{_ENTITY}|{_TAG}|{_MOJIBAKE}", 4x faster)
_MARKUP = re.compile(f"{_ENTITY}|{_TAG}|" + _MOJIBAKE[3:-1])
_MARKUP_STARTS = ("&", "<", "\u00c3", "\u00e2\u20ac", "\u00c2", "\ufffd", "\u00ef\u00bb\u00bf")
_NOT_JUNK = ("/", "~", "$", "http://", "https://", "file://")  # long URLs and paths are text, not noise
_OPENERS = "\"'([{<\u00ab\u201c\u2018\u300c\u300e"  # quotes and brackets a path or URL may sit in
_ASSIGNED = re.compile(r"[\w.-]+=")  # FZF_COMPLETION_PATH=/usr/share/...: a setting whose value is a path
_SPACELESS = re.compile(f"[{SPACELESS_SCRIPTS}]")
_CODE_PUNCT = re.compile(r"[{}()\[\];=,:!&|<>+*?.]")
_HEX_GROUP = re.compile(r"[0-9a-fA-F]{2,8}:?")
_HEX_RUN = re.compile(r"(?<!\S)(?:[0-9a-fA-F]{2,8}:?[ \t]+){7}[0-9a-fA-F]{2,8}:?(?!\S)")  # 8 groups in a row
# the same runs found from the whitespace before them (re skips in C to whitespace, 2x faster); one at the very
# start of the text has none: _HEX_RUN.match finds it
_HEX_RUN_AFTER_SPACE = re.compile(r"\s(?:[0-9a-fA-F]{2,8}:?[ \t]+){7}[0-9a-fA-F]{2,8}:?(?!\S)")
_HEX_LETTER = re.compile(r"[a-fA-F]")
PACKED_LINE_CHARS = 100  # in a line this long, a token this long with this share of code punctuation is packed
PACKED_LINE_PUNCT_FRAC = 0.15  # prose has ~3% of these characters, minified JavaScript ~30%
PACKED_MIN_CHARS = 12
PACKED_PUNCT_FRAC = 0.25


def _spaceless_prose(tok: str) -> bool:
    """A token written (a tenth or more) in Han, kana, Hangul, Thai or another script without spaces."""
    return len(_SPACELESS.findall(tok)) * 10 >= len(tok)


def _url_or_path(tok: str) -> bool:
    tok = tok.lstrip(_OPENERS)
    setting = _ASSIGNED.match(tok)
    return tok.startswith(_NOT_JUNK) or (setting is not None and tok[setting.end():].startswith(_NOT_JUNK))


def _hex_dump(line: str) -> bool:
    """8+ hexadecimal groups in a row, one with a letter a-f (a row of decimal numbers is a table, not a dump)."""
    return any(_HEX_LETTER.search(m.group()) for m in _HEX_RUN.finditer(line))


def token_noise(cfg) -> Gate:
    long = cfg.long_token_chars

    def is_noise(tok: str, packed_line: bool) -> bool:
        if _MARKUP.search(tok) is not None:
            return True
        if len(tok) >= long:
            return not _url_or_path(tok) and not _spaceless_prose(tok)
        return packed_line and len(tok) >= PACKED_MIN_CHARS \
            and len(_CODE_PUNCT.findall(tok)) >= PACKED_PUNCT_FRAC * len(tok)

    def gate(text: "str | TextView") -> "Verdict | Edit":
        view = as_view(text)
        text = view.text
        out, noisy, cut_lines, cut_chars = [], 0, 0, 0
        done = 0  # text[:done] is judged (and in `out`)
        for start, end in _suspect_lines(view, long):  # only the lines that hold a suspect are split
            out.append(text[done:start])
            line, done = text[start:end], end
            line_toks = line.split()
            hex_dump = _hex_dump(line)
            packed = len(line) >= PACKED_LINE_CHARS and \
                len(_CODE_PUNCT.findall(line)) >= PACKED_LINE_PUNCT_FRAC * len(line)
            flags = [is_noise(t, packed) or (hex_dump and _HEX_GROUP.fullmatch(t) is not None) for t in line_toks]
            noisy += sum(flags)
            cut = _first_noisy_window(flags, cfg.window, cfg.max_window_noise)
            if cut is None:
                out.append(line)
            else:
                at = _token_start(line, cut)
                cut_lines += 1
                cut_chars += len(line) - at
                out.append(line[:at].rstrip())
        if not noisy:
            return None
        out.append(text[done:])
        total = view.token_count
        s = {"noise_tokens": noisy, "tokens": total, "noise_frac": ratio(noisy, total)}
        if s["noise_frac"] > cfg.max_doc_noise:
            return drop("token_noise", s, max=cfg.max_doc_noise)
        if not cut_lines:
            return None
        new = "".join(out).strip()
        if len(new) < cfg.min_keep_chars:
            return drop("token_noise_truncated_away", s | {"chars_left": len(new)}, min_keep_chars=cfg.min_keep_chars)
        return Edit(new, {"noise_truncated_lines": cut_lines, "noise_truncated_chars": cut_chars})
    return gate


def _suspect_lines(view: TextView, long: int) -> list[tuple[int, int]]:
    """(start, end) of each line holding a long token, markup or a hex run, in order: found by C scans (the
    long tokens from the view's token bounds, `in` before the markup regex), so a clean document costs no
    Python loop."""
    text = view.text
    starts, ends = view.token_bounds
    at: list[int] = starts[ends - starts >= long].tolist()
    if any(c in text for c in _MARKUP_STARTS):
        at += [m.start() for m in _MARKUP.finditer(text)]
    if _may_hold_hex_run(view):  # a run's first character (lines are all that matter here: a run is within one)
        at += [0] if _HEX_RUN.match(text) else []
        at += [m.start() + 1 for m in _HEX_RUN_AFTER_SPACE.finditer(text)]
    spans: dict[int, int] = {}
    for pos in sorted(at):
        start = text.rfind("\n", 0, pos) + 1
        if start not in spans:
            end = text.find("\n", pos)
            spans[start] = len(text) if end < 0 else end
    return list(spans.items())


def _may_hold_hex_run(view: TextView) -> bool:
    """Whether 8 tokens in a row are made of hex digits and colons only, as every hex run's groups are (they
    are whitespace tokens, one after the other): in numpy, so that most documents need no regex scan."""
    starts, _ = view.token_bounds
    if len(starts) < 8 or not _eight_in_row((view.char_flags[starts] & HEX) != 0):  # each starts with one: cheap
        return False
    return _eight_in_row(view.tokens_all(HEX))


def _eight_in_row(flags: np.ndarray) -> bool:
    in_row = np.concatenate([[0], np.cumsum(flags)])
    return bool((in_row[8:] - in_row[:-8] == 8).any())


def _token_start(line: str, index: int) -> int:
    """Character offset of the index-th whitespace-separated token of `line`."""
    return [m.start() for m in re.finditer(r"\S+", line)][index]


def _first_noisy_window(flags: list[bool], window: int, max_noise: float) -> int | None:
    """Index of the first noise token of the first window whose noise share exceeds `max_noise`."""
    width = min(window, len(flags))
    if not width:
        return None
    inside = sum(flags[:width])
    for i in range(len(flags) - width + 1):
        if i:
            inside += flags[i + width - 1] - flags[i - 1]
        if inside / width > max_noise:
            return next(j for j in range(i, i + width) if flags[j])
    return None
