"""`kiln data` with default settings on real pages (Debian Reference, from the bundled crawl) with
planted trouble: an exact copy, a lightly edited copy, keyword spam, base64 noise, a link farm and a
number table. Every record is accounted for, the real pages are kept with the right languages, and
each planted page is removed with a reason."""

from __future__ import annotations

import base64
import random

import pytest
from fastwarc.warc import ArchiveIterator, WarcRecordType

from conftest import SAMPLE_WARC, write_warc
from kiln.config import DataConfig
from kiln.data.docs import read_docs
from kiln.data.pipeline import run_data

REAL = ["ch03.en.html", "ch04.de.html", "ch05.fr.html", "ch06.es.html", "ch08.it.html", "ch03.ja.html",
        "ch04.zh-cn.html", "ch04.pt.html"]
LANG = {"en": "en", "de": "de", "fr": "fr", "es": "es", "it": "it", "ja": "ja", "zh-cn": "zh", "pt": "pt"}


def real_pages() -> dict[str, bytes]:
    pages = {}
    with open(SAMPLE_WARC, "rb") as f:
        for rec in ArchiveIterator(f, record_types=WarcRecordType.response):
            url = rec.headers.get("WARC-Target-URI")
            if url.rsplit("/", 1)[-1] in REAL:
                pages[url] = rec.reader.read()
    return pages


def html(body: str, title: str) -> bytes:
    return f"<html><head><title>{title}</title></head><body>{body}</body></html>".encode()


def planted(original: bytes) -> dict[str, bytes]:
    rng = random.Random(3)
    parts = original.decode().split(" the ")  # edit prose only: one "the" in 25 becomes "a"
    edited = "".join(p + ("" if i == len(parts) - 1 else " a " if i % 25 == 0 else " the ")
                     for i, p in enumerate(parts)).encode()
    spam = " ".join(
        rng.choice(["buy", "cheap", "pills", "online", "best", "price", "casino", "bonus"]) for _ in range(3000)
    )
    blobs = "".join(f"<p>{base64.b64encode(rng.randbytes(600)).decode()}</p>" for _ in range(40))
    farm = (
        "<ul>"
        + "".join(f'<li><a href="http://farm{i}.example/">cheap loans {i}</a></li>' for i in range(400))
        + "</ul>"
    )
    table = "<table>" + "".join("<tr>" + "".join(f"<td>{rng.randint(0, 99999)}</td>" for _ in range(8)) + "</tr>"
                                for _ in range(300)) + "</table>"
    return {
        "http://mirror.example/exact-copy.html": original,
        "http://mirror.example/edited-copy.html": edited,
        "http://spam.example/": html(f"<p>{spam}</p>", "best deals"),
        "http://blobs.example/": html(blobs, "data"),
        "http://farm.example/": html(farm, "links"),
        "http://numbers.example/": html(table, "numbers"),
    }


@pytest.fixture(scope="module")
def crawl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crawl")
    real = real_pages()
    assert len(real) == len(REAL)
    first = next(iter(real.values()))
    a = write_warc(tmp / "real.warc.gz", [(u, p, "text/html; charset=UTF-8") for u, p in real.items()])
    b = write_warc(tmp / "planted.warc.gz", [(u, p, "text/html") for u, p in planted(first).items()])
    out = tmp / "docs"
    stats = run_data([str(a), str(b)], out, DataConfig())
    return real, stats, out


def test_every_record_is_accounted_for(crawl):
    real, stats, _ = crawl
    docs = stats["documents"]
    assert docs["read"] == len(real) + 6 == docs["kept"] + docs["rejected"]
    assert stats["warc_records"]["by_type"] == {"request": len(real) + 6, "response": len(real) + 6}


def test_real_pages_are_kept_with_their_languages(crawl):
    real, _, out = crawl
    kept = {d["url"]: d["lang"] for d in read_docs(out)}
    assert set(kept) == set(real)
    for url, lang in kept.items():
        assert lang == LANG[url.rsplit(".", 2)[-2]], url


def test_planted_pages_are_removed_with_reasons(crawl):
    _, _, out = crawl
    import io
    import json

    import zstandard

    rejects = {}
    for part in sorted((out / "rejects").glob("part-*.jsonl.zst")):
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(part, "rb")), encoding="utf-8"):
            rec = json.loads(line)
            rejects[rec["url"]] = (rec["stage"], rec["reason"])
    assert rejects["http://mirror.example/exact-copy.html"] == ("dedup", "exact_duplicate")
    assert rejects["http://mirror.example/edited-copy.html"] == ("dedup", "near_duplicate")
    for url in ("http://spam.example/", "http://blobs.example/", "http://farm.example/", "http://numbers.example/"):
        assert url in rejects and rejects[url][0] in ("quality", "extract", "language"), (url, rejects.get(url))
