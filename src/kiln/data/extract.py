"""HTTP payload -> main-content text, with the rejections that come before it.

resiliparse's main-content extraction by default (~20x faster than trafilatura
here, see NOTES); `data.extractor: trafilatura` for its more conservative
boilerplate removal. Documents that arrive with text (JSONL, Parquet) skip
extraction.

Navigation is skipped before resiliparse extracts (`NAVIGATION`): its main-content heuristics keep
a page's table of contents and its header/footer navigation bars (DocBook's `div.toc`, `div.navheader`,
Sphinx's `role="navigation"` bars), which repeat the page's headings and titles, so that every chapter
of a manual looked like boilerplate to the duplicated-line rules (FineWeb, Gopher).
"""

from __future__ import annotations

import re
from typing import Iterator

from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.encoding import bytes_to_str, detect_encoding
from resiliparse.parse.html import HTMLTree

from kiln.data.document import Document
from kiln.errors import KilnError

# Magic numbers of formats that servers commonly mislabel as text/html.
_BINARY_MAGIC = (
    b"\x89PNG",
    b"\xff\xd8\xff",
    b"GIF8",
    b"%PDF",
    b"PK\x03\x04",
    b"\x1f\x8b",
    b"BZh",
    b"\x00\x00\x01\x00",
    b"RIFF",
    b"\x7fELF",
)
_CONTROL = bytes(range(0, 9)) + bytes(range(14, 32))
_CHARSET = re.compile(r"charset=[\"']?([\w.:-]+)", re.I)


def binary_fraction(payload: bytes, sample: int = 4096) -> float:
    """Share of control bytes (not tab/newline/CR/FF) in the first `sample` bytes."""
    head = payload[:sample]
    if not head:
        return 0.0
    return (len(head) - len(head.translate(None, _CONTROL))) / len(head)


def looks_binary(payload: bytes) -> bool:
    return (
        payload.lstrip()[:4].startswith(_BINARY_MAGIC) or b"\x00" in payload[:4096] or binary_fraction(payload) > 0.05
    )


def decode_html(payload: bytes, content_type: str | None) -> str:
    """The HTTP header's charset, else the page's <meta> charset, else uchardet's guess.

    Never raises: undecodable bytes are replaced, an unknown charset name falls back to detection.
    """
    declared = _CHARSET.search(content_type or "")
    encoding = declared.group(1) if declared else detect_encoding(payload, from_html_meta=True)
    try:
        return bytes_to_str(payload, encoding, errors="replace")
    except LookupError:
        return bytes_to_str(payload, detect_encoding(payload, from_html_meta=True), errors="replace")


# <nav>, ARIA navigation, class names starting with "nav" (navbar, navheader, navigation), and in-page
# tables of contents as DocBook, MediaWiki and Sphinx/docutils write them
NAVIGATION = ["nav", "[role=navigation]", "[class^=nav]", ".toc", "#toc", ".toctree-wrapper", "div.topic.contents"]


def resiliparse_text(html: str) -> str:
    return extract_plain_text(HTMLTree.parse(html), main_content=True, alt_texts=False, skip_elements=NAVIGATION)


def trafilatura_text(html: str) -> str:
    try:
        import trafilatura
    except ImportError as exc:
        from kiln.install import install_hint

        raise KilnError(f"data.extractor=trafilatura needs trafilatura and lxml_html_clean ({exc}): "
                        f"{install_hint('trafilatura')}, or use data.extractor=resiliparse") from None
    return trafilatura.extract(html, include_comments=False, include_tables=True, deduplicate=False) or ""


EXTRACTORS = {"resiliparse": resiliparse_text, "trafilatura": trafilatura_text}


def extract(docs: Iterator[Document], max_page_bytes: int, extractor: str = "resiliparse") -> Iterator[Document]:
    to_text = EXTRACTORS[extractor]
    for doc in docs:
        if doc.rejection is None:
            _extract_one(doc, max_page_bytes, to_text)
        yield doc


def _extract_one(doc: Document, max_page_bytes: int, to_text) -> None:
    if doc.payload is None and doc.text is not None:  # JSONL/Parquet: the text is given
        if not doc.text.strip():
            doc.reject("extract", "empty_text", html_chars=0)
        return
    payload = doc.payload or b""
    mime = (doc.content_type or "").split(";")[0].strip().lower()
    if len(payload) > max_page_bytes:
        doc.reject("extract", "too_large", bytes=len(payload), max_page_bytes=max_page_bytes)
    elif mime and not (mime.startswith("text/") or "html" in mime or "xml" in mime):
        doc.reject("extract", "not_html", content_type=mime)
    elif looks_binary(payload):
        doc.reject("extract", "binary_payload", content_type=mime, control_fraction=round(binary_fraction(payload), 4))
    else:
        html = decode_html(payload, doc.content_type)
        doc.text = to_text(html).strip()
        doc.payload = None
        if not doc.text:
            doc.reject("extract", "empty_text", html_chars=len(html))
