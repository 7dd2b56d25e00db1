"""The data stage: WARC files -> read -> extract -> language -> quality gates -> exact dedup -> docs/.

Covered here, on real files (the bundled sample crawl and gzipped WARCs written with warcio):
- the sample: record and document accounting (read == kept + rejected), kept-document fields,
  the eight languages, and provenance (offset/length give back the gzip member of the record);
- bad input: a truncated file, files that are not WARCs, invalid UTF-8, other charsets,
  binary payloads labelled text/html, pages over data.max_page_bytes, non-HTML content types;
- every rejection reason with its signals in rejects/part-00000.jsonl.zst;
- exact dedup across files; byte-identical output for workers=1 and workers=2;
- resume after a killed run; the atomic, manifest-verified commit of the docs folder;
- read_docs on a folder without parts;
- properties (hypothesis): decode_html never raises, looks_binary/binary_fraction, text_key.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import shutil
import zlib
from collections import Counter
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from warcio.archiveiterator import ArchiveIterator

import kiln.data.pipeline as pipeline
from conftest import html_page, write_warc
from kiln.config import DataConfig
from kiln.data.dedup import text_key
from kiln.data.extract import binary_fraction, decode_html, looks_binary
from kiln.data.gates import low_letters, repetitive_lines, too_short
from kiln.data.docs import read_docs
from kiln.data.pipeline import expand_inputs, run_data
from kiln.data.tables import table
from kiln.errors import KilnError
from kiln.manifest import MANIFEST, read_manifest, sha256_file, verify_folder

KEPT_FIELDS = {"id", "text", "url", "source", "offset", "length", "lang", "lang_score"}
REJECT_FIELDS = {"id", "url", "source", "offset", "stage", "reason", "signals"}
SAMPLE_LANGS = {"en", "de", "fr", "es", "it", "ja", "zh", "pt"}

# --- helpers -----------------------------------------------------------------------------------

_NOUNS = ("river mill garden bridge harbour valley forest library market station castle meadow baker teacher "
          "doctor farmer painter sailor village school church tower orchard kitchen window letter story song "
          "winter summer morning evening storm lantern wagon horse basket ribbon candle mirror clock").split()
_VERBS = "visited painted repaired watched carried described remembered followed opened crossed found built".split()
_ADJS = "old quiet busy narrow bright crowded distant gentle famous hidden wooden small".split()


def english(seed: int, sentences: int = 8) -> str:
    """A paragraph of plain English, varied enough for Gopher's repetition rules; distinct per seed."""
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        a, b, c = rng.sample(_NOUNS, 3)
        out.append(f"The {rng.choice(_ADJS)} {a} {rng.choice(_VERBS)} a {rng.choice(_ADJS)} {b} "
                   f"with the {c} in {1800 + seed * 10 + i}, and {rng.choice(['we', 'they', 'everyone'])} "
                   f"{rng.choice(_VERBS)} it {rng.choice(['twice', 'again', 'slowly', 'at dawn', 'after lunch'])}.")
    return " ".join(out)


GERMAN = " ".join(
    f"Der Fluss fließt am alten Mühlrad vorbei und die Kinder spielen jeden Sommer am grünen Ufer, Nummer {i}."
    for i in range(8)
)


def page(*paragraphs: str, charset: str = "utf-8") -> bytes:
    return html_page("".join(f"<p>{p}</p>" for p in paragraphs), charset=charset)


def html(url: str, payload: bytes, ctype: str = "text/html; charset=utf-8") -> tuple[str, bytes, str]:
    return (url, payload, ctype)


# The published-rule gates (Gopher, C4, FineWeb, noise, residue, PII) have their own tests
# (test_gates.py); here only the basic gates run, so these tests pin reading, extraction,
# language, dedup and execution, whatever those gates' thresholds become.
BASIC_GATES_ONLY = {
    name: {"enabled": False}
    for name in ("gopher_quality", "gopher_repetition", "c4", "fineweb", "noise", "residue", "pii")
}


def cfg(**kw) -> DataConfig:
    return DataConfig(**{"min_chars": 200, "quality": BASIC_GATES_ONLY, **kw})


def read_jsonl_zst(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8").read()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rejects(docs_dir: Path) -> list[dict]:
    return read_jsonl_zst(docs_dir / "rejects" / "part-00000.jsonl.zst")


def by_url(records: list[dict]) -> dict[str, dict]:
    return {r["url"]: r for r in records}


def members(path: Path) -> list[dict]:
    """Every record of a gzipped WARC with the offset and length of its gzip member (warcio's view)."""
    out = []
    with open(path, "rb") as f:
        it = ArchiveIterator(f)
        for rec in it:
            out.append({"type": rec.rec_type, "url": rec.rec_headers.get_header("WARC-Target-URI"),
                        "id": rec.rec_headers.get_header("WARC-Record-ID"),
                        "offset": it.get_record_offset(), "length": it.get_record_length()})
    return out


def responses(path: Path) -> dict[str, dict]:
    return {m["url"]: m for m in members(path) if m["type"] == "response"}


def read_member(path: Path, offset: int, length: int) -> dict[str, str]:
    """Decompress exactly one gzip member at [offset, offset+length) and return its WARC headers."""
    with open(path, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    assert len(blob) == length
    d = zlib.decompressobj(31)
    raw = d.decompress(blob)
    assert d.eof and d.unused_data == b"", "offset/length do not span exactly one gzip member"
    head = raw.split(b"\r\n\r\n", 1)[0].decode("utf-8")
    lines = head.split("\r\n")
    assert lines[0].startswith("WARC/")
    return dict(line.split(": ", 1) for line in lines[1:])


def output_files(docs_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(docs_dir).as_posix(): p.read_bytes() for p in sorted(docs_dir.rglob("*")) if p.is_file()}


def assert_same_output(a: Path, b: Path) -> None:
    """Byte-identical docs folders, except the timings (and resume count) in stats.json."""
    fa, fb = output_files(a), output_files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        if name not in ("stats.json", MANIFEST):
            assert fa[name] == fb[name], f"{name} differs"
    volatile = ("timings_s", "tasks_resumed", "tasks", "dedup_tasks")  # how the work ran, not what it produced
    sa, sb = (json.loads(x["stats.json"]) for x in (fa, fb))
    assert {k: v for k, v in sa.items() if k not in volatile} == {k: v for k, v in sb.items() if k not in volatile}
    ma, mb = read_manifest(a), read_manifest(b)
    assert {k: v for k, v in ma["files"].items() if k != "stats.json"} == {
        k: v for k, v in mb["files"].items() if k != "stats.json"
    }
    assert (ma["fingerprint"], ma["inputs"], ma["documents"]) == (mb["fingerprint"], mb["inputs"], mb["documents"])


# --- the bundled sample ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample_run(tmp_path_factory, sample_warc):
    out = tmp_path_factory.mktemp("sample") / "docs"
    stats = run_data([str(sample_warc)], out, cfg())
    return stats, out, list(read_docs(out))


def test_sample_accounting(sample_run):
    stats, out, docs = sample_run
    d = stats["documents"]
    assert d["read"] == 120 == d["kept"] + d["rejected"]
    assert d["kept"] == len(docs) > 100
    assert stats["warc_records"] == {"total": 241, "by_type": {"request": 120, "response": 120, "warcinfo": 1}}
    assert (stats["files"], stats["file_errors"], stats["truncated"], stats["tasks_resumed"]) == (1, [], [], 0)
    assert sum(stats["rejected_by_reason"].values()) == d["rejected"] == len(rejects(out))
    assert sum(stats["kept_by_lang"].values()) == d["kept"]
    assert stats["kept_chars"] == sum(len(doc["text"]) for doc in docs)
    assert json.loads((out / "stats.json").read_text())["documents"] == d


def test_sample_kept_documents(sample_run, sample_warc):
    stats, _, docs = sample_run
    assert len({doc["id"] for doc in docs}) == len(docs)
    urls = responses(sample_warc)
    for doc in docs:
        assert KEPT_FIELDS <= set(doc)
        assert doc["source"] == str(sample_warc)
        assert doc["url"] in urls and doc["offset"] == urls[doc["url"]]["offset"]
        assert doc["length"] == urls[doc["url"]]["length"] > 0
        assert isinstance(doc["text"], str) and len(doc["text"]) >= 200
        assert 0.5 <= doc["lang_score"] <= 1.0
    assert [doc["offset"] for doc in docs] == sorted(doc["offset"] for doc in docs), "not in file order"


def test_sample_languages(sample_run):
    stats, _, docs = sample_run
    langs = Counter(doc["lang"] for doc in docs)
    assert SAMPLE_LANGS <= set(langs)
    assert langs == Counter(stats["kept_by_lang"])
    # The page name carries its language (ch01.de.html, index.zh-cn.html): ID agrees but for two partly translated
    # chapters read under the threshold whole, most of whose text is still English (docs/quality.md).
    differ = sorted(doc["url"].rsplit("/", 1)[-1] for doc in docs
                    if re.search(r"\.([a-z]+)(-[a-z]+)?\.html$", doc["url"]).group(1) != doc["lang"])
    assert differ == ["ch07.fr.html", "ch07.pt.html"]
    assert all(doc["lang"] == "en" for doc in docs if doc["url"].rsplit("/", 1)[-1] in differ)


def test_sample_provenance(sample_run, sample_warc):
    _, _, docs = sample_run
    picks = docs[::9] + [docs[-1]]
    assert len(picks) >= 10
    for doc in picks:
        headers = read_member(Path(doc["source"]), doc["offset"], doc["length"])
        assert headers["WARC-Type"] == "response"
        assert headers["WARC-Target-URI"] == doc["url"]
        assert doc["id"] in headers["WARC-Record-ID"]


def test_sample_last_record_length_runs_to_end_of_file(sample_run, sample_warc):
    _, out, docs = sample_run
    last = max(docs + rejects(out), key=lambda r: r["offset"])
    assert last["offset"] + last["length"] == sample_warc.stat().st_size


# --- bad input ---------------------------------------------------------------------------------

def four_pages(prefix: str, seed: int) -> list[tuple[str, bytes, str]]:
    return [html(f"https://{prefix}.example/{i}", page(english(seed + i))) for i in range(4)]


@pytest.mark.parametrize("cut", ["half", "header", "trailer"])
def test_truncated_file_keeps_earlier_records(tmp_path, cut):
    full = write_warc(tmp_path / "full.warc.gz", four_pages("t", 10))
    last = members(full)[-1]
    assert last["type"] == "response"
    at = {"half": last["length"] // 2, "header": 5, "trailer": last["length"] - 3}[cut]
    cut_file = tmp_path / "cut.warc.gz"
    cut_file.write_bytes(full.read_bytes()[: last["offset"] + at])
    other = write_warc(tmp_path / "other.warc.gz", four_pages("o", 50))

    out = tmp_path / "docs"
    stats = run_data([str(cut_file), str(other)], out, cfg())
    assert stats["truncated"] == [{"source": str(cut_file), "offset": last["offset"]}]
    assert stats["file_errors"] == []
    kept = list(read_docs(out))
    kept_urls = {d["url"] for d in kept}
    assert {f"https://t.example/{i}" for i in range(3)} <= kept_urls
    assert {f"https://o.example/{i}" for i in range(4)} <= kept_urls
    assert "https://t.example/3" not in kept_urls
    d = stats["documents"]
    assert d["read"] == d["kept"] + d["rejected"] and d["kept"] == 7
    cut_rejects = [r for r in rejects(out) if r["url"] == "https://t.example/3"]
    assert len(cut_rejects) == (0 if cut == "header" else 1)  # a member cut in its header yields no record
    for r in cut_rejects:  # when the reader yields the cut record at all, it is rejected, not kept
        assert (r["stage"], r["reason"], r["offset"]) == ("read", "unreadable", last["offset"])
    # kept documents of the cut file still point at their own, complete gzip members
    for doc in kept:
        if doc["source"] == str(cut_file):
            assert read_member(cut_file, doc["offset"], doc["length"])["WARC-Target-URI"] == doc["url"]


def test_files_that_are_not_warcs_are_reported_and_the_rest_processed(tmp_path):
    plain = tmp_path / "notes.txt"
    plain.write_text("hello world\nthis is not a WARC file\n" * 20)
    gz = tmp_path / "notes.txt.gz"
    gz.write_bytes(gzip.compress(b"hello world\nthis is not a WARC file either\n" * 20))
    good = write_warc(tmp_path / "good.warc.gz", four_pages("g", 20))

    out = tmp_path / "docs"
    stats = run_data([str(plain), str(good), str(gz)], out, cfg())
    assert stats["files"] == 3
    assert [e["source"] for e in stats["file_errors"]] == [str(plain), str(gz)]
    for e in stats["file_errors"]:
        assert e["source"] in e["error"] and "WARC" in e["error"]
    assert stats["warc_records"]["by_type"] == {"request": 4, "response": 4}
    assert stats["documents"] == {"read": 4, "kept": 4, "rejected": 0}
    assert {d["url"] for d in read_docs(out)} == {f"https://g.example/{i}" for i in range(4)}
    verify_folder(out)


def test_invalid_utf8_is_replaced_not_fatal(tmp_path):
    good = "Grüße aus Köln: 日本語のテキストもあります. "
    text = english(30)
    junk = [b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80", b"\xe6\x97"]  # stray, overlong, surrogate, lone, cut
    body = (
        good.encode()
        + b" ".join(text.encode()[i * 40 : (i + 1) * 40] + j for i, j in enumerate(junk))
        + text.encode()[200:]
    )
    payload = b"<html><head><meta charset=\"utf-8\"></head><body><p>" + body + b"</p></body></html>"
    src = write_warc(tmp_path / "bad-utf8.warc.gz", [html("https://u.example/", payload)])
    out = tmp_path / "docs"
    stats = run_data([str(src)], out, cfg(lang_threshold=0))
    assert stats["documents"] == {"read": 1, "kept": 1, "rejected": 0}
    [doc] = read_docs(out)
    assert doc["text"].startswith(good.strip())
    assert "\ufffd" in doc["text"] and text[220:300] in doc["text"]
    assert doc["text"].encode("utf-8")  # no lone surrogates reached the output


@pytest.mark.parametrize(
    "charset, ctype, words",
    [
        (
            "windows-1252",
            "text/html; charset=windows-1252",
            "Señor Muñoz pagó 5 € por el café, ¡qué día! «Sí», dijo él.",
        ),
        ("iso-8859-1", "text/html; charset=ISO-8859-1", "Grüße aus Köln, sagte die Äbtissin: Straße, Maß und Fuß."),
        ("shift_jis", "text/html; charset=Shift_JIS", "会社概要：東京都港区の小さな会社です。お問い合わせはこちら。"),
        ("euc-kr", "text/html; charset=euc-kr", "한국어 페이지입니다. 회사 소개와 연락처를 확인하세요."),
    ],
)
def test_declared_charset_is_decoded(tmp_path, charset, ctype, words):
    payload = page(*(f"{words} ({i})" for i in range(6)), charset=charset)
    assert words.encode(charset) in payload and words.encode("utf-8") not in payload
    src = write_warc(tmp_path / "cs.warc.gz", [html("https://c.example/", payload, ctype)])
    out = tmp_path / "docs"
    run_data([str(src)], out, cfg(min_chars=0, lang_threshold=0))
    [doc] = read_docs(out)
    assert f"{words} (0)" in doc["text"] and f"{words} (5)" in doc["text"]
    assert "\ufffd" not in doc["text"]


_SHORT = [("Señor Muñoz", "windows-1252"), ("会社概要", "shift_jis")]  # short enough that uchardet guesses wrong


@pytest.mark.parametrize("words, charset", _SHORT)
def test_quoted_charset_in_content_type_is_used(words, charset):
    assert decode_html(words.encode(charset), f'text/html; charset="{charset}"') == words


@pytest.mark.parametrize("words, charset", _SHORT)
def test_meta_charset_is_used_when_http_header_has_none(words, charset):
    assert f"<article>{words}</article>" in decode_html(html_page(words, charset=charset), "text/html")


# --- every rejection reason, with its signals ---------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + random.Random(1).randbytes(600)
NUL_BYTES = random.Random(2).randbytes(40) + b"\x00" + random.Random(3).randbytes(800)
SHORT = "The river flows past the old mill and the children play on its banks."
DIGITS = " ".join(f"{i * 7919 % 100000:05d}-{i * 104729 % 1000:03d}" for i in range(150)) + " price list"
REPEATED = "Buy now and save big on every product in our store today."
GIBBERISH = "xkq zvbn plmq wrtz ghjk qqxz"
MAX_PAGE = 20_000


def padded(payload: bytes, size: int) -> bytes:
    assert len(payload) <= size
    return payload + b" " * (size - len(payload))


@pytest.fixture(scope="module")
def reasons_warc(tmp_path_factory) -> Path:
    pages = [
        html("https://r.example/kept", page(english(1))),
        html("https://r.example/at-limit", padded(page(english(2)), MAX_PAGE)),
        html("https://r.example/too-large", padded(page(english(3)), MAX_PAGE + 1)),
        html("https://r.example/png", PNG, "text/html"),
        html("https://r.example/nul", NUL_BYTES, "text/html; charset=utf-8"),
        html("https://r.example/image", PNG, "image/png"),
        html("https://r.example/short", page(SHORT)),
        html("https://r.example/digits", page(DIGITS)),
        html("https://r.example/repeated", page(*[REPEATED] * 10, english(4))),
        html("https://r.example/german", page(GERMAN)),
        html("https://r.example/gibberish", page(GIBBERISH)),
    ]
    return write_warc(tmp_path_factory.mktemp("reasons") / "reasons.warc.gz", pages)


def check_reject_records(out: Path, src: Path, stats: dict) -> dict[str, dict]:
    recs = rejects(out)
    members_by_url = responses(src)
    for r in recs:
        assert REJECT_FIELDS <= set(r) and "text" not in r
        assert r["source"] == str(src)
        assert r["offset"] == members_by_url[r["url"]]["offset"]
        assert r["id"] in members_by_url[r["url"]]["id"]
    assert Counter(f"{r['stage']}/{r['reason']}" for r in recs) == Counter(stats["rejected_by_reason"])
    assert stats["documents"]["read"] == stats["documents"]["kept"] + len(recs) == 11
    return by_url(recs)


def test_extract_and_quality_reasons(tmp_path, reasons_warc):
    out = tmp_path / "docs"
    stats = run_data([str(reasons_warc)], out, cfg(max_page_bytes=MAX_PAGE, lang_threshold=0))
    r = check_reject_records(out, reasons_warc, stats)
    reason = lambda url: (r[url]["stage"], r[url]["reason"])  # noqa: E731
    signals = lambda url: r[url]["signals"]  # noqa: E731

    assert reason("https://r.example/too-large") == ("extract", "too_large")
    assert signals("https://r.example/too-large") == {"bytes": MAX_PAGE + 1, "max_page_bytes": MAX_PAGE}
    assert reason("https://r.example/png") == ("extract", "binary_payload")
    assert signals("https://r.example/png") == {
        "content_type": "text/html",
        "control_fraction": round(binary_fraction(PNG), 4),
    }
    assert reason("https://r.example/nul") == ("extract", "binary_payload")
    assert signals("https://r.example/nul")["control_fraction"] == round(binary_fraction(NUL_BYTES), 4) > 0
    assert reason("https://r.example/image") == ("extract", "not_html")
    assert signals("https://r.example/image") == {"content_type": "image/png"}

    assert reason("https://r.example/short") == ("quality", "too_short")
    assert signals("https://r.example/short") == {"chars": len(SHORT), "min_chars": 200}
    assert reason("https://r.example/digits") == ("quality", "low_letters")
    visible = DIGITS.replace(" ", "")
    assert signals("https://r.example/digits") == {
        "letter_frac": round(sum(c.isalpha() for c in visible) / len(visible), 4),
        "min": 0.5,
    }
    assert reason("https://r.example/repeated") == ("quality", "repetitive_lines")
    assert signals("https://r.example/repeated") == {"dup_line_frac": round(1 - 2 / 11, 4), "max": 0.3}

    assert reason("https://r.example/gibberish") == ("quality", "too_short")  # no language filter here

    kept = by_url(list(read_docs(out)))
    assert set(kept) == {"https://r.example/kept", "https://r.example/at-limit", "https://r.example/german"}
    assert kept["https://r.example/kept"]["lang"] == "en"
    assert kept["https://r.example/german"]["lang"] == "de"


def test_language_reasons(tmp_path, reasons_warc):
    out = tmp_path / "docs"
    stats = run_data([str(reasons_warc)], out, cfg(max_page_bytes=MAX_PAGE, languages=["en"], lang_threshold=0.6))
    r = check_reject_records(out, reasons_warc, stats)

    german = r["https://r.example/german"]
    assert (german["stage"], german["reason"]) == ("language", "lang_not_allowed")
    assert german["signals"]["lang"] == "de" and german["signals"]["score"] > 0.9
    for url in ("https://r.example/gibberish", "https://r.example/digits"):
        rec = r[url]
        assert (rec["stage"], rec["reason"]) == ("language", "low_lang_score")
        assert rec["signals"]["threshold"] == 0.6 and 0 <= rec["signals"]["score"] < 0.6
        assert isinstance(rec["signals"]["lang"], str)
    kept = list(read_docs(out))
    assert {d["lang"] for d in kept} == {"en"} and all(d["lang_score"] >= 0.6 for d in kept)
    assert {d["url"] for d in kept} == {"https://r.example/kept", "https://r.example/at-limit"}


# --- exact dedup -------------------------------------------------------------------------------

def test_exact_duplicate_across_files(tmp_path):
    text = english(40)
    a = write_warc(
        tmp_path / "a.warc.gz",
        [html("https://a.example/1", page(text)), html("https://a.example/2", page(english(41)))],
    )
    b = write_warc(
        tmp_path / "b.warc.gz",
        [
            html(
                "https://b.example/1", page(text.upper().replace(" ", "  \n\t "))
            ),  # same text: case and whitespace differ
            html(
                "https://b.example/2", page(text[: len(text) // 2] + english(43)[len(text) // 2 :])
            ),  # shares half: no duplicate
        ],
    )
    out = tmp_path / "docs"
    stats = run_data([str(a), str(b)], out, cfg())
    assert stats["documents"] == {"read": 4, "kept": 3, "rejected": 1}
    kept = by_url(list(read_docs(out)))
    [dup] = rejects(out)
    assert (dup["url"], dup["source"], dup["stage"], dup["reason"]) == (
        "https://b.example/1",
        str(b),
        "dedup",
        "exact_duplicate",
    )
    assert dup["signals"] == {"duplicate_of": kept["https://a.example/1"]["id"]}
    assert dup["offset"] == responses(b)["https://b.example/1"]["offset"]
    assert set(kept) == {"https://a.example/1", "https://a.example/2", "https://b.example/2"}


def test_same_warc_under_two_paths_is_deduplicated(tmp_path):
    a = write_warc(tmp_path / "a.warc.gz", four_pages("d", 60))
    copy = tmp_path / "mirror" / "a.warc.gz"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    stats = run_data([str(a), str(copy)], tmp_path / "docs", cfg())
    kept = list(read_docs(tmp_path / "docs"))
    assert len({d["id"] for d in kept}) == len(kept)
    assert stats["documents"] == {"read": 8, "kept": 4, "rejected": 4}


# --- determinism, resume, atomic commit ----------------------------------------------------------

@pytest.fixture(scope="module")
def three_inputs(tmp_path_factory, sample_warc) -> list[str]:
    d = tmp_path_factory.mktemp("inputs")
    shared = english(70)  # duplicated across files, so dedup order matters
    a = write_warc(d / "a.warc.gz", [html("https://a.example/s", page(shared))] + four_pages("a", 80))
    b = write_warc(d / "b.warc.gz", four_pages("b", 90) + [html("https://b.example/s", page(shared.lower())),
                                                            html("https://b.example/x", PNG, "text/html")])
    return [str(a), str(sample_warc), str(b)]


# slow: test_data_execution.py::test_dedup_stages_identical_on_pool_and_ray_for_any_worker_count keeps 1 and 2
# workers (and Ray) byte-identical in the default suite
@pytest.mark.slow
def test_output_is_identical_for_one_and_two_workers(tmp_path, three_inputs):
    one, two = tmp_path / "w1" / "docs", tmp_path / "w2" / "docs"
    s1 = run_data(three_inputs, one, cfg(docs_per_part=50), workers=1)
    s2 = run_data(three_inputs, two, cfg(docs_per_part=50), workers=2)
    # 129 kept documents (120 + 5 + 4) over parts of 50: the sample's three half-translated chapters that scored
    # en 0.30-0.44 read as one line get their largest language since its windows are labelled one by one
    assert s1["parts"] == s2["parts"] == 3
    assert s1["documents"]["kept"] == 129 and s1["rejected_by_reason"]["dedup/exact_duplicate"] == 1
    assert_same_output(one, two)
    assert len(list(read_docs(one))) == s1["documents"]["kept"]


def test_resume_redoes_only_unfinished_files(tmp_path, three_inputs, monkeypatch):
    config = cfg()
    fresh = tmp_path / "fresh" / "docs"
    run_data(three_inputs, fresh, config)

    # a killed run: task 0 finished (output + done marker), tasks 1 and 2 never ran
    out = tmp_path / "resumed" / "docs"
    tasks = pipeline.plan_tasks(expand_inputs(three_inputs), config)
    key = pipeline.work_key(pipeline.fingerprint(expand_inputs(three_inputs), config), config)
    work = out.parent / f".{out.name}-work-{key}"
    work.mkdir(parents=True)
    pipeline._commit(work, pipeline.run_task((tasks[0], config, str(work))))
    (work / "task-00001.jsonl.zst").write_bytes(b"a killed worker's file, with no marker: redone")
    assert sorted(p.name for p in work.iterdir()) == [  # the outcome and the dedup signatures, the marker last
        f"task-00000.{kind}" for kind in ("bands.npy", "done.json", "exact.npy", "ids.json", "jsonl.zst",
                                          "keys.npy")] + [
        "task-00001.jsonl.zst"]  # no shingle sets (#44): the dedup stages derive the candidates' from the outcome

    ran = []
    real = pipeline.run_task
    monkeypatch.setattr(pipeline, "run_task", lambda args: ran.append(args[0].index) or real(args))
    stats = run_data(three_inputs, out, config, workers=1)
    assert ran == [1, 2]
    assert stats["tasks_resumed"] == 1
    assert_same_output(fresh, out)
    assert not work.exists()


def test_docs_folder_is_committed_atomically(tmp_path, three_inputs, monkeypatch):
    out = tmp_path / "docs"
    stats = run_data(three_inputs, out, cfg())
    manifest = verify_folder(out)
    assert manifest["stage"] == "data" and manifest["documents"] == stats["documents"]["kept"]
    assert manifest["inputs"] == three_inputs
    assert set(manifest["files"]) == {
        "part-00000.jsonl.zst",
        "rejects/part-00000.jsonl.zst",
        "stats.json",
        "dedup_ledger.jsonl.zst",
        "by_source.jsonl.zst",  # the per-source tables (kiln.data.tables), hashed like the rest
        "composition_by_source.jsonl.zst",
        "source_weights.jsonl.zst",
    }
    assert manifest["tables"] == stats["tables"] and stats["tables"]["by_source"] == {
        "file": "by_source.jsonl.zst", "rows": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]  # no .tmp- folder, no work folder
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    before = output_files(out)

    # a crash while merging leaves the committed folder untouched and no staging folder behind ...
    def crash(*_args, **_kw):
        raise RuntimeError("killed during merge")

    monkeypatch.setattr(pipeline, "_merge", crash)
    with pytest.raises(RuntimeError):
        run_data(three_inputs, out, cfg())
    assert output_files(out) == before
    verify_folder(out)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    [work] = [p for p in tmp_path.iterdir() if p.name.startswith(".docs-work-")]
    assert len(list(work.glob("task-*.done.json"))) == 3

    # ... and the next run reuses every finished task
    monkeypatch.undo()
    again = run_data(three_inputs, out, cfg())
    assert again["tasks_resumed"] == 3
    after = output_files(out)
    assert {k: v for k, v in after.items() if k not in ("stats.json", MANIFEST)} == \
        {k: v for k, v in before.items() if k not in ("stats.json", MANIFEST)}
    assert {k: v for k, v in again.items() if k not in ("timings_s", "tasks_resumed")} == \
        {k: v for k, v in stats.items() if k not in ("timings_s", "tasks_resumed")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


def test_verify_folder_catches_a_changed_part(tmp_path, three_inputs):
    out = tmp_path / "docs"
    run_data(three_inputs[:1], out, cfg())
    part = out / "part-00000.jsonl.zst"
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(KilnError, match="part-00000.jsonl.zst"):
        verify_folder(out)


# --- reading and inputs ------------------------------------------------------------------------

def test_read_docs_without_parts_raises(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(KilnError, match=re.escape(str(folder))):
            list(read_docs(folder))


def test_expand_inputs(tmp_path):
    for name in ("b.warc.gz", "a.warc.gz"):
        (tmp_path / name).write_bytes(b"")
    assert expand_inputs([str(tmp_path / "*.warc.gz")]) == [str(tmp_path / "a.warc.gz"), str(tmp_path / "b.warc.gz")]
    with pytest.raises(KilnError, match="matches no file"):
        expand_inputs([str(tmp_path / "*.nothing")])
    with pytest.raises(KilnError, match=re.escape(str(tmp_path / "gone.warc.gz"))):
        expand_inputs([str(tmp_path / "gone.warc.gz")])
    with pytest.raises(KilnError, match="no input files"):
        expand_inputs([])


# --- properties --------------------------------------------------------------------------------

CHARSETS = ["utf-8", "UTF-8", "windows-1252", "iso-8859-1", "shift_jis", "euc-jp", "gbk", "big5", "koi8-r", "utf-16",
            "utf-16le", "utf-32", "utf-7", "x-user-defined", "replacement", "bogus-charset", "", "..", "ü"]
CONTENT_TYPES = st.one_of(
    st.none(),
    st.text(max_size=40),
    st.sampled_from(CHARSETS).map(lambda c: f"text/html; charset={c}"),
    st.sampled_from(CHARSETS).map(lambda c: f'text/html; charset="{c}"'),
)
PROPS = settings(max_examples=300, deadline=None)


@PROPS
@given(payload=st.binary(max_size=600), ctype=CONTENT_TYPES)
def test_decode_html_never_raises(payload, ctype):
    text = decode_html(payload, ctype)
    assert isinstance(text, str)
    text.encode("utf-8")  # encodable: no lone surrogates


@PROPS
@given(
    text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=200).filter(
        lambda t: not t.startswith("\ufeff")
    )
)
def test_decode_html_round_trips_utf8(text):
    assert decode_html(text.encode("utf-8"), "text/html; charset=utf-8") == text


@PROPS
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs", "Cc")) | st.sampled_from("\t\n\r"), max_size=300))
def test_html_text_never_looks_binary(text):
    payload = f"<!doctype html><html><body>{text}</body></html>".encode("utf-8")
    assert not looks_binary(payload)
    assert binary_fraction(payload) == 0.0


@PROPS
@given(payload=st.binary(max_size=5000))
def test_binary_fraction_counts_control_bytes(payload):
    head = payload[:4096]
    controls = sum(b < 32 and b not in (9, 10, 11, 12, 13) for b in head)
    assert binary_fraction(payload) == (controls / len(head) if head else 0.0)
    if b"\x00" in head or controls / max(len(head), 1) > 0.05:
        assert looks_binary(payload)


@PROPS
@given(prefix=st.sampled_from([b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"%PDF", b"PK\x03\x04", b"\x1f\x8b", b"\x7fELF"]),
       rest=st.binary(max_size=200), space=st.sampled_from([b"", b"  \r\n"]))
def test_known_magic_looks_binary(prefix, rest, space):
    assert looks_binary(space + prefix + rest)


@PROPS
@given(words=st.lists(st.text(alphabet="abcdefghij0123456789ÄÖÜäöü", min_size=1, max_size=8), min_size=1, max_size=20),
       seps=st.lists(st.sampled_from([" ", "  ", "\n", "\t", " \r\n "]), min_size=20, max_size=20))
def test_text_key_ignores_case_and_whitespace(words, seps):
    spaced = "".join(w + s for w, s in zip(words, seps))
    assert text_key(" ".join(words)) == text_key("\n " + spaced.upper())
    assert text_key(" ".join(words)) != text_key(" ".join(words) + " x")


@PROPS
@given(
    lines=st.lists(
        st.text(alphabet="abcxyz \r\u2028", min_size=1, max_size=10).filter(str.strip), min_size=1, max_size=30
    )
)
def test_quality_gates_signals(lines):
    # lines end at "\n" only, as in every other line rule (text.lines, Gopher's reference); "\r" and
    # U+2028 inside a line do not split it
    text = "\n".join(lines)
    stripped = [ln.strip() for ln in lines]
    dup = round(1 - len(set(stripped)) / len(stripped), 4)
    verdict = repetitive_lines(0.3)(text)
    assert verdict == (
        ("repetitive_lines", {"dup_line_frac": dup, "max": 0.3})
        if 1 - len(set(stripped)) / len(stripped) > 0.3
        else None
    )
    assert too_short(len(text) + 1)(text) == ("too_short", {"chars": len(text), "min_chars": len(text) + 1})
    assert too_short(len(text))(text) is None
    assert low_letters(0.5)(text) is None  # letters only
    assert low_letters(0.5)("12 34 \n 5") == ("low_letters", {"letter_frac": 0.0, "min": 0.5})


def test_low_letters_counts_what_isalpha_and_isspace_accept_for_every_code_point():
    # the gate counts with C-speed string operations; this is the definition it must match
    text = "".join(chr(i) for i in range(0x110000) if not 0xD800 <= i < 0xE000)
    visible = sum(not c.isspace() for c in text)
    frac = round(sum(c.isalpha() for c in text) / visible, 4)
    assert low_letters(1.0)(text) == ("low_letters", {"letter_frac": frac, "min": 1.0})


def test_near_duplicates_across_files_are_removed_in_the_stage_with_a_ledger(tmp_path):
    """The global near-duplicate step inside `kiln data`: a lightly edited copy in another file is
    rejected as dedup/near_duplicate pointing at the first; distinct pages stay; the ledger is committed."""
    import zstandard

    base = " ".join(english(seed) for seed in range(40, 46))
    words = base.split()
    edited = " ".join(f"zebra{i}" if i % 150 == 0 else w for i, w in enumerate(words))  # Jaccard well above 0.8
    a = write_warc(
        tmp_path / "a.warc.gz",
        [
            ("http://a.example/orig", html_page(base), "text/html"),
            ("http://a.example/other", html_page(" ".join(english(s) for s in range(60, 66))), "text/html"),
        ],
    )
    b = write_warc(tmp_path / "b.warc.gz", [("http://b.example/copy", html_page(edited), "text/html")])
    out = tmp_path / "docs"
    stats = run_data([str(a), str(b)], out, cfg(lang_threshold=0))
    assert stats["rejected_by_reason"].get("dedup/near_duplicate") == 1
    kept = {d["url"] for d in read_docs(out)}
    assert kept == {"http://a.example/orig", "http://a.example/other"}
    rows = [json.loads(line) for line in zstandard.ZstdDecompressor().decompress(
        (out / "dedup_ledger.jsonl.zst").read_bytes(), max_output_size=1 << 24).decode().splitlines() if line]
    by_id = {d["id"]: d["url"] for d in read_docs(out)}
    assert len(rows) == 1 and by_id[rows[0]["survivor"]] == "http://a.example/orig" and rows[0]["similarity"] >= 0.8
    weights = table(out, "source_weights")
    assert str(a) in weights and {"weight", "z"} <= set(weights[str(a)])


def test_kiln_data_keeps_a_complete_folder_and_a_rewrite_has_the_same_content_fingerprint(tmp_path, capsys):
    """Issue 45.2: a second `kiln data` on the same inputs and settings skips, as `kiln run` does; a docs folder
    written again (new timings and worker pids in stats.json) fingerprints as the same content."""
    from kiln.cli import main as kiln
    from kiln.data.docs import content_fingerprint

    warc = write_warc(tmp_path / "a.warc.gz", four_pages("a", 80))
    out = tmp_path / "docs"
    args = ["data", str(warc), "--out", str(out), "--", "data.min_chars=200", "data.workers=1"]
    assert kiln(args) == 0
    first, stamp, fp = output_files(out), (out / MANIFEST).stat().st_mtime_ns, content_fingerprint(out)
    capsys.readouterr()
    assert kiln(args) == 0
    said = capsys.readouterr()
    assert f"kiln data: {out} is complete and up to date" in said.err
    assert json.loads(said.out)["documents"] == json.loads(first["stats.json"])["documents"]
    assert output_files(out) == first and (out / MANIFEST).stat().st_mtime_ns == stamp
    assert kiln([*args, "data.min_chars=201"]) == 0 and (out / MANIFEST).stat().st_mtime_ns != stamp  # other settings
    shutil.rmtree(out)
    assert kiln(args) == 0
    again = json.loads((out / "stats.json").read_text())
    again["timings_s"]["task_cpu_by_worker"] = {"elsewhere:1": 9.0}  # another run's pids and seconds ...
    again["tasks_resumed"] = 1
    (out / "stats.json").write_text(json.dumps(again))
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["stats.json"] = {"size": (out / "stats.json").stat().st_size,
                                       "sha256": sha256_file(out / "stats.json")}
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert content_fingerprint(out) == fp  # ... are not content
    again["documents"]["kept"] += 1  # a count is
    (out / "stats.json").write_text(json.dumps(again))
    manifest["files"]["stats.json"]["sha256"] = sha256_file(out / "stats.json")
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert content_fingerprint(out) != fp
