"""The classifier gate end to end through `kiln data`: a floret model trained with
`kiln data classifier train` on planted good pages (real Debian Reference chapters) and bad ones
(fluent sales copy that passes every heuristic gate), then `kiln data` keeps the held-out good pages,
drops the sales pages with their score, and records `quality_score` in every kept document;
keep_top_fraction keeps that share of the corpus, deciding in the merge."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("floret")

from conftest import english_pages, write_warc

from kiln.cli import main as kiln
from kiln.data.docs import read_docs, read_part

SALES = [
    "amazing",
    "deal",
    "offer",
    "discount",
    "price",
    "buy",
    "today",
    "limited",
    "best",
    "quality",
    "product",
    "customers",
    "love",
    "our",
    "store",
    "shipping",
    "free",
    "order",
    "now",
    "save",
    "money",
    "premium",
    "brand",
    "exclusive",
    "bonus",
    "gift",
    "satisfaction",
    "guaranteed",
]


def sales_copy(rng: random.Random, paragraphs: int = 12) -> str:
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(4):
            ws = [rng.choice(SALES) for _ in range(rng.randint(8, 13))]
            ws.insert(2, "the")
            ws.insert(5, "and")
            sentences.append(" ".join(ws).capitalize() + ".")
        out.append(" ".join(sentences))
    return "\n\n".join(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clf")
    rng = random.Random(0)
    from kiln.data.extract import resiliparse_text

    pages = english_pages()
    train_pages, held_out = pages[:9], pages[9:]
    pos, neg = tmp / "pos.jsonl", tmp / "neg.jsonl"
    pos.write_text("".join(json.dumps({"text": resiliparse_text(p.decode())}) + "\n" for _, p in train_pages))
    neg.write_text("".join(json.dumps({"text": sales_copy(rng)}) + "\n" for _ in range(30)))
    model = tmp / "quality.bin"
    assert (
        kiln(["data", "classifier", "train", "--positive", str(pos), "--negative", str(neg), "--out", str(model)]) == 0
    )
    sales = [(f"http://shop{i}.example/", f"<html><body><p>{sales_copy(rng)}</p></body></html>".encode().replace(
        b"\n\n", b"</p><p>")) for i in range(4)]
    warc = write_warc(tmp / "crawl.warc.gz", [(u, p, "text/html") for u, p in held_out + sales])
    return tmp, model, warc, {u for u, _ in held_out}, {u for u, _ in sales}


def rejects(out):
    return {r["url"]: r for part in sorted((out / "rejects").glob("part-*.jsonl.zst")) for r in read_part(part)}


def test_without_a_model_the_sales_pages_pass_the_heuristics(trained):
    tmp, _, warc, good, sales = trained
    out = tmp / "plain"
    assert kiln(["data", str(warc), "--out", str(out), "data.dedup.method=none"]) == 0
    assert {d["url"] for d in read_docs(out)} == good | sales  # what the learned gate is for


def test_classifier_threshold_keeps_the_good_pages_and_scores_them(trained):
    tmp, model, warc, good, sales = trained
    out = tmp / "threshold"
    assert kiln(["data", str(warc), "--out", str(out), "data.dedup.method=none",
                 f"data.quality.classifier.model={model}", "data.quality.classifier.threshold=0.5"]) == 0
    kept = {d["url"]: d for d in read_docs(out)}
    assert set(kept) == good
    assert all(0.5 <= d["quality_score"] <= 1 for d in kept.values())
    rej = rejects(out)
    for url in sales:
        assert (rej[url]["stage"], rej[url]["reason"]) == ("quality", "classifier_below_threshold")
        assert 0 <= rej[url]["signals"]["quality_score"] < 0.5 and rej[url]["signals"]["min"] == 0.5
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rejected_by_reason"]["quality/classifier_below_threshold"] == len(sales)


def test_explain_shows_the_score(trained, capsys):
    tmp, _, _, good, sales = trained
    out = tmp / "threshold"  # written by the test above
    url = min(good)
    assert kiln(["data", "explain", url, "--out", str(out)]) == 0
    score = next(d["quality_score"] for d in read_docs(out) if d["url"] == url)
    assert f"quality_score: {score}" in capsys.readouterr().out
    assert kiln(["data", "explain", min(sales), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dropped by quality: classifier_below_threshold" in text and "quality_score = " in text


def test_keep_top_fraction_keeps_that_share_whatever_the_workers(trained):
    tmp, model, _, good, _ = trained
    pages = {u: p for u, p in english_pages()}
    # two tasks, each with good and sales pages: the cut must use both tasks' scores
    rng = random.Random(1)
    shop = [(f"http://store{i}.example/", f"<html><body><p>{sales_copy(rng)}</p></body></html>".encode())
            for i in range(4)]
    urls = sorted(good)
    a = write_warc(
        tmp / "a.warc.gz", [(u, pages[u], "text/html") for u in urls[:3]] + [(u, p, "text/html") for u, p in shop[:2]]
    )
    b = write_warc(
        tmp / "b.warc.gz", [(u, pages[u], "text/html") for u in urls[3:]] + [(u, p, "text/html") for u, p in shop[2:]]
    )
    outs = []
    for workers in (1, 2):
        out = tmp / f"top-{workers}"
        assert kiln(["data", str(a), str(b), "--out", str(out), "--workers", str(workers),
                     "data.dedup.method=none", f"data.quality.classifier.model={model}",
                     "data.quality.classifier.keep_top_fraction=0.5"]) == 0
        outs.append(out)
    kept = {d["url"] for d in read_docs(outs[0])}
    assert kept == good  # the top 5 of 9 (at least half) are the good pages
    cut = [r for r in rejects(outs[0]).values() if r["reason"] == "classifier_below_top_fraction"]
    assert {r["url"] for r in cut} == {u for u, _ in shop}
    assert all(r["signals"]["keep_top_fraction"] == 0.5 and r["signals"]["quality_score"] < r["signals"]["min"]
               for r in cut)
    for x, y in zip(sorted(outs[0].rglob("part-*.jsonl.zst")), sorted(outs[1].rglob("part-*.jsonl.zst"))):
        assert x.read_bytes() == y.read_bytes()


def test_keep_top_fraction_cuts_after_dedup_so_duplicates_are_found(trained):
    """The dedup stages number the kept documents before any cut; the cut must come after their verdicts, or a
    cut page ahead of a duplicate shifts the numbers: the duplicate is kept and another page dropped instead."""
    tmp, model, _, good, _ = trained
    pages = {u: p for u, p in english_pages()}
    rng = random.Random(2)
    shop = [(f"http://cheap{i}.example/", f"<html><body><p>{sales_copy(rng)}</p></body></html>".encode())
            for i in range(2)]
    urls = sorted(good)
    copy = "http://mirror.example/copy"
    records = shop + [(u, pages[u]) for u in urls[:1]] + [(copy, pages[urls[0]])] + [(u, pages[u]) for u in urls[1:]]
    warc = write_warc(tmp / "dup.warc.gz", [(u, p, "text/html") for u, p in records])
    out = tmp / "top-dedup"
    assert kiln(["data", str(warc), "--out", str(out), f"data.quality.classifier.model={model}",
                 "data.quality.classifier.keep_top_fraction=0.7"]) == 0
    assert {d["url"] for d in read_docs(out)} == good
    why = {u: r["reason"] for u, r in rejects(out).items()}
    assert why == {copy: "exact_duplicate", **{u: "classifier_below_top_fraction" for u, _ in shop}}, why


def test_classifier_config_errors(trained, tmp_path, capsys):
    _, model, warc, _, _ = trained
    assert kiln(["data", str(warc), "--out", str(tmp_path / "x"), f"data.quality.classifier.model={tmp_path}/none.bin",
                 "data.quality.classifier.threshold=0.5"]) == 2
    assert "none.bin: no such file; train one with `kiln data classifier train" in capsys.readouterr().err
    assert kiln(["data", str(warc), "--out", str(tmp_path / "y"), f"data.quality.classifier.model={model}"]) == 2
    assert "set exactly one of threshold and keep_top_fraction" in capsys.readouterr().err
    assert kiln(["data", str(warc), "--out", str(tmp_path / "z"), f"data.quality.classifier.model={model}",
                 "data.quality.classifier.threshold=0.5", "data.quality.classifier.label=__label__good"]) == 2
    assert "the model's labels are" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()


def test_classifier_train_replaces_only_a_model_and_leaves_no_temporary_files(trained, capsys):
    tmp, model, _, _, _ = trained
    pos, neg = tmp / "pos.jsonl", tmp / "neg.jsonl"
    thesis = tmp / "thesis.txt"
    thesis.write_text("my thesis\n")
    args = ["data", "classifier", "train", "--positive", str(pos), "--negative", str(neg), "--out"]
    assert kiln(args + [str(thesis)]) == 2
    assert thesis.read_text() == "my thesis\n" and "is not a floret/fastText model" in capsys.readouterr().err
    before = model.stat().st_mtime_ns
    assert kiln(args + [str(model)]) == 0  # an earlier model is replaced
    assert model.stat().st_mtime_ns >= before and not list(tmp.glob(".*tmp-*")) + list(tmp.glob(".*train-*"))


@pytest.mark.parametrize("keep", [0.75, 0.99])
def test_a_cut_model_is_refused_before_any_work_not_scored_zero(trained, tmp_path, capsys, keep):
    """A model file cut short loads in floret (its loader leaves the missing floats zero) and scored every
    document 0.0, so `kiln data` kept none of them, exit 0."""
    tmp, model, warc, _, _ = trained
    cut = tmp_path / "cut.bin"
    data = model.read_bytes()
    cut.write_bytes(data[: int(len(data) * keep)])
    out = tmp_path / "docs"
    assert kiln(["data", str(warc), "--out", str(out), f"data.quality.classifier.model={cut}",
                 "data.quality.classifier.threshold=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kiln: error: data.quality.classifier.model {cut}: the file is cut short or damaged")
    assert "\n" not in err and not out.exists()


def test_classifier_train_refuses_one_file_as_both_classes_and_binary_files(trained, tmp_path, capsys):
    tmp, _, _, _, _ = trained
    pos, neg = tmp / "pos.jsonl", tmp / "neg.jsonl"
    copy = tmp_path / "copy-of-pos.jsonl"
    copy.write_bytes(pos.read_bytes())
    blob = tmp_path / "random.bin"
    blob.write_bytes(random.Random(1).randbytes(50_000))
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"text\0with a NUL\n")
    fake = tmp_path / "binary.jsonl"
    fake.write_bytes(random.Random(2).randbytes(20_000))
    for positive, negative, words in [
        (pos, pos, f"{pos} (--positive) and {pos} (--negative) are the same file"),
        (pos, copy, f"{pos} (--positive) and {copy} (--negative) are the same bytes"),
        (pos, blob, f"{blob}: not UTF-8 text (byte"),
        (nul, neg, f"{nul}: holds NUL bytes, so it is binary"),
        (pos, fake, f"{fake}: no JSON record with a \"text\" string"),
    ]:
        out = tmp_path / "m.bin"
        assert kiln(["data", "classifier", "train", "--positive", str(positive), "--negative", str(negative),
                     "--out", str(out)]) == 2, words
        err = capsys.readouterr().err.strip()
        assert err.startswith("kiln: error: ") and words in err and "\n" not in err, err
        assert not out.exists()
