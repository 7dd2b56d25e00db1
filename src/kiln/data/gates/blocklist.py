"""URL blocklist from a user's file (data.blocklist.file).

One entry a line; `#` starts a comment. A plain entry is a domain and blocks it and every
subdomain (`example.com` blocks `ads.example.com`, not `myexample.com`); `contains:TEXT`
blocks every URL containing TEXT (case-insensitive).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from kiln.data.gates.types import Gate, Verdict, drop
from kiln.errors import KilnError


def load_blocklist(path: str | Path) -> tuple[frozenset[str], tuple[str, ...]]:
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KilnError(f"data.blocklist.file {path}: cannot read it ({exc.__class__.__name__}); "
                        "give a UTF-8 text file with one domain or 'contains:TEXT' a line") from None
    domains, substrings = set(), []
    for line in raw.splitlines():
        entry = line.split("#", 1)[0].strip().lower()
        if entry.startswith("contains:"):
            if entry[9:]:
                substrings.append(entry[9:])
        elif entry:
            domains.add(entry.lstrip("*.").rstrip("."))
    return frozenset(domains), tuple(substrings)


def url_blocklist(path: str | Path) -> Gate:
    domains, substrings = load_blocklist(path)

    def gate(url: str | None) -> Verdict:
        if not url:
            return None
        low = url.lower()
        host = (urlsplit(low).hostname or "").rstrip(".")
        labels = host.split(".")
        for i in range(len(labels)):  # example.com matches a.b.example.com through its suffixes
            if ".".join(labels[i:]) in domains:
                return drop("url_blocklist", {"domain": ".".join(labels[i:])})
        for sub in substrings:
            if sub in low:
                return drop("url_blocklist", {"substring": sub})
        return None
    gate.reads_url = True  # type: ignore[attr-defined]
    return gate
