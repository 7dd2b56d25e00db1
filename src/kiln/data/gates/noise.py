"""Token-level noise: runs of junk tokens found with a sliding window (SEEDS: 5 tokens, 60%).

SEEDS scores tokens by corpus TF and IDF (noise: TF < 1e-4 and IDF > 12.5). A worker sees one
document at a time, so Kiln recognises the tokens that score that way by their shape instead:
HTML entities and tags, mojibake (UTF-8 read as Latin-1, U+FFFD), and long tokens without
spaces that are not URLs or paths (base64 blobs, hex dumps, glued-together link text).

Within each line, the first window of `window` tokens noisier than `max_window_noise` cuts
the line there (the noisy tail goes). The document is dropped when noise tokens are more than
`max_doc_noise` of all tokens, or when cutting would leave less than `min_keep_chars`.
"""

from __future__ import annotations

import re

from kiln.data.gates.text import ratio
from kiln.data.gates.types import Edit, Gate, Verdict, drop

_ENTITY = r"&(?:[a-zA-Z]{2,8}|#[0-9]{2,6}|#[xX][0-9a-fA-F]{2,5});"
_TAG = r"</?[a-zA-Z][a-zA-Z0-9]{0,10}(?:\s[^<>]{0,80})?/?>"
_MOJIBAKE = "(?:\u00c3[\u0080-\u00bf]|\u00e2\u20ac|\u00c2[\u00a0-\u00bf]|\ufffd|\u00ef\u00bb\u00bf)"


_MARKUP = re.compile(f"{_ENTITY}|{_TAG}|{_MOJIBAKE}")
_NOT_JUNK = ("/", "~", "http://", "https://")  # long URLs and paths are text, not noise


def token_noise(cfg) -> Gate:
    long = cfg.long_token_chars

    def is_noise(tok: str) -> bool:
        return _MARKUP.search(tok) is not None or (len(tok) >= long and not tok.startswith(_NOT_JUNK))

    def gate(text: str) -> "Verdict | Edit":
        out, noisy, total, cut_lines, cut_chars = [], 0, 0, 0, 0
        for line in text.split("\n"):
            toks = line.split()
            total += len(toks)
            if not _MARKUP.search(line) and all(len(t) < long for t in toks):
                out.append(line)
                continue
            flags = [is_noise(t) for t in toks]
            noisy += sum(flags)
            cut = _first_noisy_window(flags, cfg.window, cfg.max_window_noise)
            if cut is None:
                out.append(line)
            else:
                start = _token_start(line, cut)
                cut_lines += 1
                cut_chars += len(line) - start
                out.append(line[:start].rstrip())
        if not noisy:
            return None
        s = {"noise_tokens": noisy, "tokens": total, "noise_frac": ratio(noisy, total)}
        if s["noise_frac"] > cfg.max_doc_noise:
            return drop("token_noise", s, max=cfg.max_doc_noise)
        if not cut_lines:
            return None
        new = "\n".join(out).strip()
        if len(new) < cfg.min_keep_chars:
            return drop("token_noise_truncated_away", s | {"chars_left": len(new)}, min_keep_chars=cfg.min_keep_chars)
        return Edit(new, {"noise_truncated_lines": cut_lines, "noise_truncated_chars": cut_chars})
    return gate


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
