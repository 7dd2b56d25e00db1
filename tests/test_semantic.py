"""The semantic gate end to end through `kiln data`: word vectors trained on the corpus itself (floret
skipgram), keywords of the corpus's domain (Debian system administration); planted off-topic pages
(fluent cooking prose that passes every heuristic gate) score low and go to docs/review/ with their score
(`action: review`) or are dropped (`action: drop`); the Debian pages are kept with `semantic_score`, and
`kiln data explain` shows the score."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("floret")

from conftest import SAMPLE_WARC, write_warc

from kiln.cli import main as kiln
from kiln.data.docs import read_docs, read_part

COOKING = [
    "flour",
    "butter",
    "sugar",
    "oven",
    "bake",
    "dough",
    "recipe",
    "cream",
    "chocolate",
    "cake",
    "bread",
    "salt",
    "pepper",
    "garlic",
    "onion",
    "tomato",
    "sauce",
    "simmer",
    "roast",
    "chicken",
    "vegetables",
    "soup",
    "minutes",
    "bowl",
    "stir",
    "whisk",
]
KEYWORDS = ["debian", "package", "apt", "kernel", "system"]


def cooking(rng: random.Random, paragraphs: int = 14) -> str:
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(4):
            ws = [rng.choice(COOKING) for _ in range(rng.randint(9, 13))]
            ws.insert(2, "the")
            ws.insert(6, "and")
            sentences.append(" ".join(ws).capitalize() + ".")
        out.append("<p>" + " ".join(sentences) + "</p>")
    return "".join(out)


@pytest.fixture(scope="module")
def crawl(tmp_path_factory):
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    tmp = tmp_path_factory.mktemp("semantic")
    with open(SAMPLE_WARC, "rb") as f:
        debian = [(r.headers.get("WARC-Target-URI"), r.reader.read())
                  for r in ArchiveIterator(f, record_types=WarcRecordType.response)
                  if r.headers.get("WARC-Target-URI").endswith(".en.html")
                  and "index" not in r.headers.get("WARC-Target-URI")]
    rng = random.Random(4)
    food = [(f"http://kitchen{i}.example/", f"<html><body>{cooking(rng)}</body></html>".encode()) for i in range(4)]
    warc = write_warc(tmp / "crawl.warc.gz", [(u, p, "text/html") for u, p in debian + food])
    return tmp, warc, {u for u, _ in debian}, {u for u, _ in food}


def run(tmp, warc, name, *overrides):
    out = tmp / name
    assert kiln(["data", str(warc), "--out", str(out), "data.dedup.method=none",
                 f"data.quality.semantic.keywords={json.dumps(KEYWORDS)}", *overrides]) == 0
    return out


def test_review_sets_off_topic_pages_aside_with_their_score(crawl, capsys):
    tmp, warc, debian, food = crawl
    out = run(tmp, warc, "review")
    kept = {d["url"]: d for d in read_docs(out)}
    assert set(kept) == debian
    assert all(d["semantic_score"] >= 0.25 for d in kept.values())
    review = {r["url"]: r for p in sorted((out / "review").glob("part-*.jsonl.zst")) for r in read_part(p)}
    assert set(review) == food
    assert all(r["semantic_score"] < 0.25 and r["text"].startswith(r["text"][:20]) and len(r["text"]) > 1000
               for r in review.values())
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rejected_by_reason"]["quality/semantic_review"] == len(food)
    assert stats["documents"]["read"] == stats["documents"]["kept"] + stats["documents"]["rejected"]
    url = min(food)
    assert kiln(["data", "explain", url, "--out", str(out)]) == 0
    assert "semantic_review" in (text := capsys.readouterr().out) and "semantic_score = " in text
    assert kiln(["data", "explain", min(debian), "--out", str(out)]) == 0
    assert "semantic_score:" in capsys.readouterr().out


def test_drop_rejects_them_and_writes_no_review_folder(crawl):
    tmp, warc, debian, food = crawl
    out = run(tmp, warc, "drop", "data.quality.semantic.action=drop")
    assert {d["url"] for d in read_docs(out)} == debian
    rej = {r["url"]: r for p in sorted((out / "rejects").glob("part-*.jsonl.zst")) for r in read_part(p)}
    assert {u for u, r in rej.items() if r["reason"] == "semantic_below_min_cosine"} == food
    assert not (out / "review").exists()


def test_a_user_vectors_file(crawl, tmp_path):
    import floret

    tmp, warc, debian, _ = crawl
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    from kiln.data.extract import resiliparse_text

    with open(warc, "rb") as f:
        texts = [
            resiliparse_text(r.reader.read().decode()) for r in ArchiveIterator(f, record_types=WarcRecordType.response)
        ]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(t.lower().split()) for t in texts) + "\n")
    model = floret.train_unsupervised(
        str(corpus), model="skipgram", dim=32, minCount=1, bucket=20000, thread=1, verbose=0
    )
    model.save_model(str(tmp_path / "vectors.bin"))
    out = run(tmp, warc, "user", f"data.quality.semantic.vectors={tmp_path / 'vectors.bin'}")
    kept = {d["url"] for d in read_docs(out)}
    assert kept <= debian and len(kept) >= len(debian) - 2
    assert (
        kiln(
            [
                "data",
                str(warc),
                "--out",
                str(tmp_path / "bad"),
                f"data.quality.semantic.keywords={json.dumps(KEYWORDS)}",
                f"data.quality.semantic.vectors={tmp_path / 'none.bin'}",
            ]
        )
        == 2
    )
