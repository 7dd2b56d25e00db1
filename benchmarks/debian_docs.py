"""Real documentation pages from Debian's HTML packages, written as reproducible WARC files.

Used by `python -m benchmarks data_quality` (a multilingual crawl with planted copies and junk), by
`python -m benchmarks filter_stage` and by `scripts/make_docs_fixture.py` (the small
tests/data/docs_pages.warc.gz the tests read). The packages:

    apt-get install python3.11-doc maint-guide maint-guide-ja maint-guide-ru maint-guide-zh-cn \\
        debian-faq debian-faq-{de,fr,it,ja,ko,nl,pt,ru,zh-cn} debian-reference-{en,de,fr,es,it,ja,pt,zh-cn}

`LONG_CORPORA`, a crawl of long pages that no gate was tuned on (filter_stage's third input):

    apt-get install debian-handbook git-doc r-doc-html gnu-standards

the Debian Administrator's Handbook's chapter pages in its 26 languages (one page per chapter, 3-90 KB),
git's manual pages, R's seven manuals and the GNU coding standards (single pages of 0.2-1 MB).

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
# (glob under /, URL prefix, a regex of file names left out): long pages, none of which the gates were tuned on
LONG_CORPORA = {
    "debian-handbook": ("usr/share/doc/debian-handbook/html/*/*.html", "https://debian-handbook.info/browse/",
                        r"sect\."),  # chapter pages; the sect.* pages repeat each chapter's sections
    "git-doc": ("usr/share/doc/git-doc/*.html", "https://git-scm.com/docs/", None),
    "r-manuals": ("usr/share/R/doc/manual/*.html", "https://cran.r-project.org/doc/manuals/r-release/", None),
    "gnu-standards": ("usr/share/doc/gnu-standards/*.html", "https://www.gnu.org/prep/", None),
}
# Handbook translations whose chapters are all translated (language ID of the whole text agreed with the folder
# on 18-21 of the 21 chapter pages); the others' untranslated chapters are English, so their pages get no label.
HANDBOOK_COMPLETE = {"ar", "ca", "de", "en", "es", "fa", "fr", "id", "it", "ja", "nb", "pt", "ru"}
_LANG = re.compile(r"\.([a-z]{2}(?:-[a-z]{2})?)\.html$")
_HANDBOOK_LANG = re.compile(r"/browse/([a-z]{2})-[A-Z]{2}/")
START = datetime(2026, 11, 1, tzinfo=UTC)
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://kiln.invalid/debian-docs")


def page_lang(path: Path) -> str:
    """The page's language as language ID names it (zh-cn -> zh); python3.11-doc is English."""
    m = _LANG.search(path.name)
    return m.group(1).split("-")[0] if m else "en"


def url_lang(url: str) -> str | None:
    """The language of a page of these crawls, from its URL, as language ID names it (nb -> no); None for a
    handbook page of an incomplete translation (`HANDBOOK_COMPLETE`)."""
    m = _HANDBOOK_LANG.search(url)
    if m:
        return {"nb": "no"}.get(m.group(1), m.group(1)) if m.group(1) in HANDBOOK_COMPLETE else None
    m = _LANG.search(url)
    return m.group(1).split("-")[0] if m else "en"


def page_url(path: Path, corpus: str) -> str:
    prefix = {**CORPORA, **LONG_CORPORA}[corpus][1]
    if corpus == "python":
        return prefix + "/".join(path.parts[-2:])
    if corpus == "debian-handbook":
        return f"{prefix}{path.parent.name}/stable/{path.name}"
    return prefix + path.name


def find_pages(corpus: str, root: Path = Path("/")) -> list[Path]:
    pattern, _, *skip = {**CORPORA, **LONG_CORPORA}[corpus]
    leave_out = re.compile(skip[0]) if skip and skip[0] else None
    return sorted(p for p in root.glob(pattern) if p.is_file() and not (leave_out and leave_out.match(p.name)))


def crawl(corpora: dict, out: Path, min_pages: int = 200) -> Path | None:
    """A WARC of every page of `corpora` (None when fewer than `min_pages` are installed)."""
    pages = [(page_url(p, c), p.read_bytes()) for c in corpora for p in find_pages(c)]
    return write_warc(out, pages) if len(pages) >= min_pages else None


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
