"""Real documentation pages from Debian's HTML packages, written as reproducible WARC files.

Used by `python -m benchmarks data_quality` (a multilingual crawl with planted copies and junk) and by
`scripts/make_docs_fixture.py` (the small tests/data/docs_pages.warc.gz the tests read). The packages:

    apt-get install python3.11-doc maint-guide maint-guide-ja maint-guide-ru maint-guide-zh-cn \\
        debian-faq debian-faq-{de,fr,it,ja,ko,nl,pt,ru,zh-cn} debian-reference-{en,de,fr,es,it,ja,pt,zh-cn}

Each page becomes a request and a response record with fixed dates and uuid5 record ids, so the same
pages give the same bytes (for the same warcio and zlib).
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from io import BytesIO
from pathlib import Path

DOC = Path("/usr/share/doc")
# (glob under /, URL prefix the page is "crawled" from, how the language is found)
CORPORA = {
    "debian-faq": ("usr/share/doc/debian/FAQ/*/*.*.html", "https://www.debian.org/doc/manuals/debian-faq/"),
    "debian-faq-en": ("usr/share/doc/debian/FAQ/*.en.html", "https://www.debian.org/doc/manuals/debian-faq/"),
    "maint-guide": ("usr/share/doc/maint-guide*/html/*.*.html", "https://www.debian.org/doc/manuals/maint-guide/"),
    "debian-reference": ("usr/share/debian-reference/*.*.html", "https://www.debian.org/doc/manuals/debian-reference/"),
    "python": ("usr/share/doc/python3.11/html/*/*.html", "https://docs.python.org/3.11/"),
}
_LANG = re.compile(r"\.([a-z]{2}(?:-[a-z]{2})?)\.html$")
START = datetime(2026, 11, 1, tzinfo=UTC)
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://kiln.invalid/debian-docs")


def page_lang(path: Path) -> str:
    """The page's language as language ID names it (zh-cn -> zh); python3.11-doc is English."""
    m = _LANG.search(path.name)
    return m.group(1).split("-")[0] if m else "en"


def page_url(path: Path, corpus: str) -> str:
    prefix = CORPORA[corpus][1]
    if corpus == "python":
        return prefix + "/".join(path.parts[-2:])
    return prefix + path.name


def find_pages(corpus: str, root: Path = Path("/")) -> list[Path]:
    return sorted(p for p in root.glob(CORPORA[corpus][0]) if p.is_file())


def write_warc(out: Path, pages: list[tuple[str, bytes]], content_type: str = "text/html; charset=utf-8") -> Path:
    """A gzipped WARC/1.0 with a request and a response record per (url, payload), byte-reproducible."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        w = WARCWriter(f, gzip=True, warc_version="1.0")
        for i, (url, payload) in enumerate(pages):
            when = (START + timedelta(seconds=i)).strftime("%Y-%m-%dT%H:%M:%SZ")
            ids = {kind: f"<urn:uuid:{uuid.uuid5(NAMESPACE, f'{i} {url} {kind}')}>" for kind in ("request", "response")}
            host = url.split("/")[2]
            req = StatusAndHeaders(f"GET /{url.split('/', 3)[-1]} HTTP/1.1", [("Host", host)], is_http_request=True)
            w.write_record(w.create_warc_record(url, "request", http_headers=req, warc_headers_dict={
                "WARC-Record-ID": ids["request"], "WARC-Date": when}))
            http = StatusAndHeaders("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(payload)))],
                                    protocol="HTTP/1.1")
            w.write_record(w.create_warc_record(url, "response", payload=BytesIO(payload), length=len(payload),
                                                http_headers=http, warc_headers_dict={
                                                    "WARC-Record-ID": ids["response"], "WARC-Date": when}))
    return out
