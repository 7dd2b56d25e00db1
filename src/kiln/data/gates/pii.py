"""PII redaction: e-mail addresses and public IP addresses are replaced and counted.

Private, loopback and documentation addresses (192.168.x.x, 127.0.0.1, ...) are kept: they
identify nobody, and technical text is full of them.
"""

from __future__ import annotations

import ipaddress
import re

import numpy as np

from kiln.data.gates.text import DIGIT, TextView, as_view
from kiln.data.gates.types import Edit, Gate

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}\b")
# ipaddress then checks the octets; the lookbehind after the first digit lets re skip to digits in C
IPV4 = re.compile(r"\d(?<![\d.]\d)\d{0,2}(?:\.\d{1,3}){3}(?![\d.])")


def redact_pii(cfg) -> Gate:
    def gate(view: "str | TextView") -> Edit | None:
        view = as_view(view)
        text = view.text
        emails = ips = 0
        if "@" in text:
            text, emails = _redact_emails(text, cfg.email_replacement)
            if emails:
                view = TextView(text)

        def public(m: re.Match) -> str:
            nonlocal ips
            try:
                public_ip = ipaddress.ip_address(m.group()).is_global
            except ValueError:  # an octet over 255: a version number, not an address
                return m.group()
            if public_ip:
                ips += 1
                return cfg.ip_replacement
            return m.group()

        text = _sub_in_lines(IPV4, public, text, _ip_lines(view))
        counts = {k: v for k, v in (("pii_emails", emails), ("pii_ips", ips)) if v}
        return Edit(text, counts) if counts else None
    return gate


def _redact_emails(text: str, replacement: str) -> tuple[str, int]:
    """`EMAIL.subn(replacement, text)`, with the regex run only on the lines that hold an "@".

    The same result: an address holds no whitespace, so every match lies inside one line, and `\\b` at a line's
    edge (next to "\\n") behaves as at the text's edges. Scanning the whole text cost ~15x more (the regex starts
    at every word).
    """
    out, count, done = [], 0, 0
    at = text.find("@")
    while at >= 0:
        start, end = text.rfind("\n", 0, at) + 1, text.find("\n", at)
        end = len(text) if end < 0 else end
        line, n = EMAIL.subn(replacement, text[start:end])
        out += [text[done:start], line]
        count, done = count + n, end
        at = text.find("@", end)
    return "".join(out) + text[done:], count


def _ip_lines(view: TextView) -> list[int]:
    """Where the lines that may hold an IPv4 address start: those with three dots between two \\d digits
    (numpy over the view's characters), as an address has; most documents have none, and need no regex."""
    codes, digit = view.codes, (view.char_flags & DIGIT) != 0
    dots = np.flatnonzero((codes[1:-1] == ord(".")) & digit[:-2] & digit[2:]) + 1
    if len(dots) < 3:
        return []
    text = view.text
    return sorted({text.rfind("\n", 0, pos) + 1 for pos in dots.tolist()})


def _sub_in_lines(pattern: re.Pattern, repl, text: str, line_starts: list[int]) -> str:
    """`pattern.sub(repl, text)` for a pattern that matches within a line (no "\\n" in a match, and the same
    match at a line's edge as at the text's), run on the lines starting at `line_starts` only: the caller
    knows the other lines hold no match."""
    out, done = [], 0
    for start in line_starts:
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        out += [text[done:start], pattern.sub(repl, text[start:end])]
        done = end
    return "".join(out) + text[done:]
