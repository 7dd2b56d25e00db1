"""Documentation and code-bearing pages in many languages are kept, junk still goes: `kiln data` with the
default settings on tests/data/docs_pages.warc.gz (16 real pages from Debian's documentation packages:
the Debian FAQ in eight languages, the New Maintainers' Guide, the Python 3.11 docs; built by
scripts/make_docs_fixture.py). Before the fixes, the default gates kept none of these pages
(fineweb_dup_line_chars, gopher_dup_ngrams, gopher_stop_words)."""

from __future__ import annotations

import base64
import random
from pathlib import Path

import pytest
from conftest import write_warc

from kiln.config import DataConfig
from kiln.data.extract import resiliparse_text
from kiln.data.gates.text import TextView
from kiln.data.docs import read_docs, read_part
from kiln.data.pipeline import run_data

DOCS_WARC = Path(__file__).parent / "data" / "docs_pages.warc.gz"
LANGS = {"de", "fr", "ja", "ko", "nl", "pt", "ru", "zh", "en"}


def junk_pages() -> dict[str, bytes]:
    rng = random.Random(7)

    def page(body: str) -> bytes:
        return f"<html><head><title>t</title></head><body>{body}</body></html>".encode()

    spam = " ".join(rng.choice(["buy", "cheap", "pills", "online", "best", "price", "casino", "bonus"])
                    for _ in range(3000))
    blobs = "".join(f"<p>{base64.b64encode(rng.randbytes(600)).decode()}</p>" for _ in range(40))
    farm = (
        "<ul>"
        + "".join(f'<li><a href="http://farm{i}.example/">cheap loans {i}</a></li>' for i in range(400))
        + "</ul>"
    )
    table = "<table>" + "".join("<tr>" + "".join(f"<td>{rng.randint(0, 99999)}</td>" for _ in range(8)) + "</tr>"
                                for _ in range(300)) + "</table>"
    boiler = "".join("<p>Welcome to our shop. Add this product to your cart now.</p><p>Free shipping on every "
                     "order over ten dollars, today only.</p>" for _ in range(40))
    return {"http://spam.example/": page(f"<p>{spam}</p>"), "http://blobs.example/": page(blobs),
            "http://farm.example/": page(farm), "http://numbers.example/": page(table),
            "http://boiler.example/": page(boiler)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    junk = write_warc(tmp / "junk.warc.gz", [(u, p, "text/html") for u, p in junk_pages().items()])
    out = tmp / "docs"
    stats = run_data([str(DOCS_WARC), str(junk)], out, DataConfig())
    rejects = {r["url"]: r for part in sorted((out / "rejects").glob("part-*.jsonl.zst")) for r in read_part(part)}
    return stats, {d["url"]: d for d in read_docs(out)}, rejects


def test_every_documentation_page_is_kept_with_its_language(run):
    _, kept, rejects = run
    docs = {u: r for u, r in {**kept, **rejects}.items() if "example" not in u}
    assert len(docs) == 16
    assert set(kept) == set(docs), {u: (r["reason"], r["signals"]) for u, r in rejects.items() if u in docs}
    expected = {u: ("zh" if "zh-cn" in u else u.rsplit(".", 2)[-2] if "debian.org" in u else "en") for u in docs}
    assert {u: d["lang"] for u, d in kept.items()} == expected
    assert set(expected.values()) == LANGS


def test_junk_is_still_rejected(run):
    _, kept, rejects = run
    for url in junk_pages():
        assert url not in kept and rejects[url]["stage"] in ("quality", "extract", "language"), url


def test_code_in_the_pages_is_kept_whole(run):
    # C4 removes lines of fewer than 3 words; inside code (`try:`, `pass`, `$ dquilt refresh`) it must not
    _, kept, _ = run
    text = kept["https://docs.python.org/3.11/library/asyncio-dev.html"]["text"]
    assert "import asyncio" in text and "asyncio.run(main(), debug=True)" in text
    guide = kept["https://www.debian.org/doc/manuals/maint-guide/modify.en.html"]["text"]
    assert "$ dquilt refresh" in guide


def test_tables_of_contents_and_navigation_bars_are_not_extracted():
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with open(DOCS_WARC, "rb") as f:
        for rec in ArchiveIterator(f, record_types=WarcRecordType.response):
            if rec.headers.get("WARC-Target-URI").endswith("basic-defs.de.html"):
                text = resiliparse_text(rec.reader.read().decode())
    # the chapter title was in the navigation bar and the table of contents as well as above the chapter
    assert text.count("Kapitel 1. Definitionen und Überblick") == 1
    assert text.count("1.1. Was ist diese FAQ?") == 1


def test_code_lines_are_marked_by_shape():
    text = ("Use the event loop as follows:\n\nimport asyncio\nasync def main():\n    await asyncio.sleep(1)\n"
            "    pass\n\nThis sentence is prose, and it ends with a full stop.\n\n$ sudo apt-get install foo\n\n"
            "Home\nAbout us\nContact")
    view = TextView(text)
    code = [ln.strip() for ln, c in zip(view.raw_lines, view.code) if c]
    assert code == ["Use the event loop as follows:", "import asyncio", "async def main():",
                    "await asyncio.sleep(1)", "pass", "$ sudo apt-get install foo"]
    assert view.prose_lines == ["This sentence is prose, and it ends with a full stop.", "Home", "About us", "Contact"]
