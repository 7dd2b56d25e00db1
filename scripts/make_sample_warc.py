#!/usr/bin/env python3
"""Build Kiln's bundled sample crawl, ``examples/data/sample.warc.gz``.

The sample is a real WARC/1.0 file (one gzip member per record) holding the
HTML pages of the Debian Reference manual, version 2.100, in eight languages,
as if they had been crawled from
``https://www.debian.org/doc/manuals/debian-reference/``:

* one ``warcinfo`` record, then
* for every page, sorted by file name, a ``request`` record (an HTTP/1.1 GET)
  followed by a ``response`` record (an HTTP/1.1 200 whose payload is the exact
  bytes of the page as shipped in the Debian package).

The pages come from these Debian packages (all version 2.100, GPL-2+,
Copyright 2007-2013 Osamu Aoki)::

    debian-reference-en debian-reference-de debian-reference-fr
    debian-reference-es debian-reference-it debian-reference-ja
    debian-reference-pt debian-reference-zh-cn

Each package installs 15 pages, ``/usr/share/debian-reference/*.<lang>.html``
(``index``, ``pr01``, ``ch01`` .. ``ch12``, ``apa``). Either install them::

    sudo apt-get install debian-reference-{en,de,fr,es,it,ja,pt,zh-cn}
    python scripts/make_sample_warc.py

or fetch and unpack them without installing (no root needed)::

    mkdir -p debref && cd debref
    apt-get download debian-reference-{en,de,fr,es,it,ja,pt,zh-cn}
    for f in *.deb; do dpkg -x "$f" .; done
    cd .. && python scripts/make_sample_warc.py \\
        --html-dir debref/usr/share/debian-reference

(``apt-get download`` fetches whatever version the configured suite carries;
the bundled file was built from 2.100, which Debian 12 "bookworm" ships. The
.deb files are also at https://snapshot.debian.org/package/debian-reference/2.100/.)

The output is reproducible byte for byte: WARC-Date values are fixed
(2026-11-01T00:00:00Z for the warcinfo record, plus one second per page),
record ids are uuid5 values derived from the URL and record type, HTTP dates
and ETags are fixed, and warcio's gzip members (zlib, level 9) carry no file
name and an mtime of 0. Identical bytes assume the same warcio and zlib
builds; the records themselves are identical regardless.

Requires warcio (a dev dependency: ``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import argparse
import re
import sys
import uuid
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from io import BytesIO
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

VERSION = "2.100"
LANGUAGES = ("en", "de", "fr", "es", "it", "ja", "pt", "zh-cn")
PACKAGES = tuple(f"debian-reference-{lang}" for lang in LANGUAGES)
PAGES_PER_LANGUAGE = 15

BASE_URL = "https://www.debian.org/doc/manuals/debian-reference/"
HOST = "www.debian.org"
# WARC-IP-Address: an address from TEST-NET-2 (RFC 5737); the pages were not
# really fetched over the network, so no real server address is claimed.
IP_ADDRESS = "198.51.100.7"

# WARC-Date of the warcinfo record; page i (0-based) is "fetched" i+1 seconds later.
CRAWL_START = datetime(2026, 11, 1, 0, 0, 0, tzinfo=timezone.utc)
# Last-Modified of every page: the upload of debian-reference 2.100
# (debian/changelog: Sat, 04 Feb 2023 20:59:01 +0900).
LAST_MODIFIED = datetime(2023, 2, 4, 11, 59, 1, tzinfo=timezone.utc)

USER_AGENT = "KilnSampleBot/1.0"
# Fixed namespace for the uuid5 record ids (itself uuid5(NAMESPACE_URL, ...)).
ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://kiln.invalid/sample-warc")

PAGE_RE = re.compile(r"^(?P<page>[a-z0-9]+)\.(?P<lang>[a-z]{2}(?:-[a-z]{2})?)\.html$")
CHARSET_RE = re.compile(rb"""<meta[^>]+charset=["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
HEAD_END_RE = re.compile(rb"</head\s*>", re.IGNORECASE)

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "examples" / "data" / "sample.warc.gz"


def record_id(*parts: str) -> str:
    return f"<urn:uuid:{uuid.uuid5(ID_NAMESPACE, ' '.join(parts))}>"


def warc_date(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def http_date(dt: datetime) -> str:
    return format_datetime(dt, usegmt=True)


def declared_charset(html: bytes) -> str:
    """The charset of the page's <meta> tag (searched in <head> only), else UTF-8."""
    end = HEAD_END_RE.search(html)
    head = html[: end.start()] if end else html[:4096]
    m = CHARSET_RE.search(head)
    return m.group(1).decode("ascii").upper() if m else "UTF-8"


def content_language(lang: str) -> str:
    if "-" in lang:
        a, b = lang.split("-", 1)
        return f"{a}-{b.upper()}"
    return lang


def find_pages(html_dir: Path) -> list[tuple[Path, str]]:
    pages = []
    for path in sorted(html_dir.iterdir(), key=lambda p: p.name):
        m = PAGE_RE.match(path.name)
        if m and m.group("lang") in LANGUAGES and path.is_file():
            pages.append((path, m.group("lang")))
    return pages


def build(html_dir: Path, out: Path) -> dict[str, int]:
    pages = find_pages(html_dir)
    per_lang = {lang: sum(1 for _, l in pages if l == lang) for lang in LANGUAGES}
    missing = [lang for lang, n in per_lang.items() if n == 0]
    if missing:
        raise SystemExit(
            f"no pages for {', '.join(missing)} in {html_dir}; install or unpack "
            + " ".join(f"debian-reference-{lang}" for lang in missing)
        )
    odd = {lang: n for lang, n in per_lang.items() if n != PAGES_PER_LANGUAGE}
    if odd:
        print(f"warning: expected {PAGES_PER_LANGUAGE} pages per language, got {odd}", file=sys.stderr)

    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {"warcinfo": 0, "request": 0, "response": 0}
    with open(out, "wb") as fh:
        writer = WARCWriter(fh, gzip=True, warc_version="1.0")

        info = {
            "software": "Kiln scripts/make_sample_warc.py (warcio)",
            "format": "WARC File Format 1.0",
            "conformsTo": "http://bibnum.bnf.fr/WARC/WARC_ISO_28500_version1_latestdraft.pdf",
            "isPartOf": "kiln-sample",
            "description": (
                f"Kiln sample crawl: the {len(pages)} HTML pages of the Debian Reference "
                f"manual {VERSION} from the Debian packages {' '.join(PACKAGES)} "
                f"(version {VERSION}), recorded as if fetched from {BASE_URL}"
            ),
            "license": "GPL-2+; Debian Reference, Copyright 2007-2013 Osamu Aoki <osamu@debian.org>",
            "robots": "ignore",
            "http-header-user-agent": USER_AGENT,
        }
        payload = "".join(f"{k}: {v}\r\n" for k, v in info.items()).encode("utf-8")
        warcinfo_headers = StatusAndHeaders(
            "",
            [
                ("WARC-Type", "warcinfo"),
                ("WARC-Record-ID", record_id("warcinfo", out.name)),
                ("WARC-Filename", out.name),
                ("WARC-Date", warc_date(CRAWL_START)),
            ],
            protocol="WARC/1.0",
        )
        writer.write_record(
            writer.create_warc_record(
                "", "warcinfo", payload=BytesIO(payload), length=len(payload),
                warc_headers=warcinfo_headers,
            )
        )
        counts["warcinfo"] += 1
        warcinfo_id = warcinfo_headers.get_header("WARC-Record-ID")

        etag_mtime = int(LAST_MODIFIED.timestamp()) * 1_000_000  # Apache: mtime in microseconds
        for i, (path, lang) in enumerate(pages):
            html = path.read_bytes()
            url = BASE_URL + path.name
            when = CRAWL_START + timedelta(seconds=i + 1)
            req_id = record_id(url, "request")
            resp_id = record_id(url, "response")

            req_http = StatusAndHeaders(
                f"GET /doc/manuals/debian-reference/{path.name} HTTP/1.1",
                [
                    ("Host", HOST),
                    ("User-Agent", USER_AGENT),
                    ("Accept", "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"),
                    ("Accept-Language", "en-US,en;q=0.9,*;q=0.5"),
                    # identity, so the stored payload is the page itself, not a gzip stream
                    ("Accept-Encoding", "identity"),
                    ("Connection", "close"),
                ],
                is_http_request=True,
            )
            req = writer.create_warc_record(
                url, "request", http_headers=req_http,
                warc_headers_dict={
                    "WARC-Type": "request",
                    "WARC-Record-ID": req_id,
                    "WARC-Date": warc_date(when),
                    "WARC-Target-URI": url,
                    "WARC-Warcinfo-ID": warcinfo_id,
                    "WARC-IP-Address": IP_ADDRESS,
                    "WARC-Concurrent-To": resp_id,
                },
            )

            resp_http = StatusAndHeaders(
                "200 OK",
                [
                    ("Date", http_date(when)),
                    ("Server", "Apache"),
                    ("Last-Modified", http_date(LAST_MODIFIED)),
                    ("ETag", f'"{len(html):x}-{etag_mtime:x}"'),
                    ("Accept-Ranges", "bytes"),
                    ("Content-Length", str(len(html))),
                    ("Content-Language", content_language(lang)),
                    ("Connection", "close"),
                    ("Content-Type", f"text/html; charset={declared_charset(html)}"),
                ],
                protocol="HTTP/1.1",
            )
            resp = writer.create_warc_record(
                url, "response", payload=BytesIO(html), length=len(html), http_headers=resp_http,
                warc_headers_dict={
                    "WARC-Type": "response",
                    "WARC-Record-ID": resp_id,
                    "WARC-Date": warc_date(when),
                    "WARC-Target-URI": url,
                    "WARC-Warcinfo-ID": warcinfo_id,
                    "WARC-IP-Address": IP_ADDRESS,
                    "WARC-Concurrent-To": req_id,
                },
            )
            writer.write_record(req)
            writer.write_record(resp)
            counts["request"] += 1
            counts["response"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--html-dir", type=Path, default=Path("/usr/share/debian-reference"),
        help="directory holding the *.<lang>.html pages (default: %(default)s, "
        "where apt-get install debian-reference-<lang> puts them)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output WARC (default: examples/data/sample.warc.gz)")
    args = ap.parse_args(argv)
    if not args.html_dir.is_dir():
        ap.error(f"{args.html_dir} is not a directory (see this script's docstring)")
    counts = build(args.html_dir, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size} bytes): " + ", ".join(f"{n} {t}" for t, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
