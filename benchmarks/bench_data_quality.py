"""How well `kiln data` (default settings) keeps good pages and removes junk and copies, on a crawl built
from Debian's documentation packages, with the truth kept here.

    python -m benchmarks data_quality
    KILN_BENCH_BEFORE=/path/to/older/src python -m benchmarks data_quality   # also score another Kiln

The crawl (benchmarks/debian_docs.py; skipped when the packages are not installed):
- clean pages: every page of the Debian FAQ (10 languages), the New Maintainers' Guide (4), the Debian
  Reference (8) and a seeded sample of 80 Python 3.11 documentation pages (code-heavy), each with at least
  `MIN_CHARS` characters of main text (resiliparse's plain extraction decides, the same for every Kiln);
  a manual's index pages (index.*.html: its table of contents) are navigation and are left out;
- exact copies of 20 clean pages and near copies of 30 (one word in every k of the main text edited,
  k chosen so that the word 5-gram Jaccard to the original, measured here, is 0.80-0.92), at other URLs,
  after their originals;
- junk: keyword spam, base64 blobs, link farms, number tables, repeated shop boilerplate, lorem ipsum,
  mojibake, hex dumps, minified JavaScript, navigation-only pages (`JUNK_EACH` of each kind);
- malformed records: binary payloads served as text/html, empty pages.

Scores: clean kept (clean pages kept / clean pages), junk rejected (junk and malformed rejected / all of
them), exact and near-dup recall (copies removed as duplicates / copies whose original was kept: a copy of
a dropped page is dropped with it, not by dedup) and precision (removed-as-duplicate
documents that are planted copies / all removed as duplicates), false dedup (clean pages removed as
duplicates / clean pages), language accuracy (kept clean pages with the right language / kept clean pages),
and the clean pages' losses by reason.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.debian_docs import CORPORA, find_pages, page_lang, page_url, write_warc

MIN_CHARS = 1500
PYTHON_PAGES = 80
EXACT, NEAR, JUNK_EACH = 20, 30, 4
SEED = 16
ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys
from pathlib import Path
from kiln.config import DataConfig
from kiln.data.docs import read_docs, read_part
from kiln.data.pipeline import run_data
inputs, out = json.loads(sys.argv[1]), Path(sys.argv[2])
run_data(inputs, out, DataConfig())
kept = {d["url"]: d["lang"] for d in read_docs(out)}
rejected = {r["url"]: f"{r['stage']}/{r['reason']}" for p in sorted((out / "rejects").glob("part-*.jsonl.zst"))
            for r in read_part(p)}
print(json.dumps({"kept": kept, "rejected": rejected}))
"""


def _plain_chars(html: bytes) -> int:
    from resiliparse.extract.html2text import extract_plain_text

    return len(extract_plain_text(html.decode("utf-8", "replace"), main_content=True).strip())


def _shingles(words: list[str], n: int = 5) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


_TEXT_NODE = re.compile(r">([^<]+)<")


def near_copy(html: bytes, rng: random.Random, low: float = 0.80, high: float = 0.92) -> tuple[bytes, float]:
    """Edit one word in every k of the page's text (its text nodes), k chosen so that the word 5-gram Jaccard of
    the extracted texts lands in [low, high]; (copy, Jaccard)."""
    from resiliparse.extract.html2text import extract_plain_text

    text = html.decode("utf-8", "replace")
    before = _shingles(extract_plain_text(text, main_content=True).split())
    target = rng.uniform(low + 0.02, high - 0.02)
    best = (text, 1.0)
    for k in range(20, 400, 5):
        counter = iter(range(10**9))

        def edit(m: re.Match, k: int = k, counter=counter) -> str:
            return ">" + " ".join(w + "x" if w.isalpha() and next(counter) % k == k // 2 else w
                                  for w in m.group(1).split(" ")) + "<"

        edited = _TEXT_NODE.sub(edit, text)
        after = _shingles(extract_plain_text(edited, main_content=True).split())
        j = len(before & after) / max(len(before | after), 1)
        if abs(j - target) < abs(best[1] - target):
            best = (edited, j)
        if j > target:  # larger k edits less: past the target
            break
    return best[0].encode(), best[1]


def junk_pages(rng: random.Random) -> dict[str, tuple[str, bytes]]:
    """{url: (kind, payload)}."""
    def page(body: str, title: str = "page") -> bytes:
        return f"<html><head><title>{title}</title></head><body>{body}</body></html>".encode()

    words = [
        "buy",
        "cheap",
        "pills",
        "online",
        "best",
        "price",
        "casino",
        "bonus",
        "free",
        "win",
        "money",
        "now",
        "deal",
    ]
    kinds = {
        "spam": lambda: page("<p>" + " ".join(rng.choice(words) for _ in range(2500)) + "</p>"),
        "base64": lambda: page("".join(f"<p>{base64.b64encode(rng.randbytes(500)).decode()}</p>" for _ in range(30))),
        "link_farm": lambda: page(
            "<ul>"
            + "".join(
                f'<li><a href="http://f{i}.example/">cheap loans {rng.randint(0, 999)}</a></li>' for i in range(300)
            )
            + "</ul>"
        ),
        "numbers": lambda: page(
            "<table>"
            + "".join(
                "<tr>" + "".join(f"<td>{rng.randint(0, 99999)}</td>" for _ in range(8)) + "</tr>" for _ in range(200)
            )
            + "</table>"
        ),
        "boilerplate": lambda: page(
            "".join(
                "<p>Welcome to our shop. Add this product to your cart now.</p>"
                "<p>Free shipping on every order over ten dollars.</p>"
                for _ in range(40)
            )
        ),
        "lorem": lambda: page(
            "<p>"
            + " ".join(
                [
                    (
                        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do "
                        "eiusmod tempor incididunt ut labore et dolore magna aliqua."
                    )
                ]
                * 30
            )
            + "</p>"
        ),
        "mojibake": lambda: page("<p>" + " ".join("Ã©tÃ© Ã  cÃ´tÃ© â€™ Â©" for _ in range(300)) + "</p>"),
        "hexdump": lambda: page(
            "<pre>"
            + "\n".join(f"{i * 16:08x}  " + " ".join(f"{b:02x}" for b in rng.randbytes(16)) for i in range(200))
            + "</pre>"
        ),
        "minified_js": lambda: page(
            "<p>"
            + "".join(
                f"var a{i}=function(e,t){{return e[t]||(e[t]={{i:{i},l:!1}})}};if(a{i}(x,{i})){{y.push({i})}}"
                for i in range(300)
            )
            + "</p>"
        ),
        "navigation": lambda: page(
            "".join(f"<div><a href='/{w}'>{w.title()}</a> | <a href='/{w}/more'>More {w}</a></div>" for w in words * 8)
        ),
    }
    out = {}
    for kind, make in kinds.items():
        for i in range(JUNK_EACH):
            out[f"http://{kind.replace('_', '-')}{i}.junk.example/"] = (kind, make())
    for i in range(JUNK_EACH):
        out[f"http://binary{i}.junk.example/"] = ("binary", b"\x89PNG\r\n\x1a\n" + rng.randbytes(3000))
        out[f"http://empty{i}.junk.example/"] = ("empty", b"<html><body></body></html>")
    return out


def build(folder: Path) -> tuple[list[str], dict] | None:
    rng = random.Random(SEED)
    clean: list[tuple[str, bytes, str]] = []  # url, payload, language
    for corpus in CORPORA:
        pages = find_pages(corpus)
        if corpus == "python":
            pages = sorted(rng.sample(pages, min(PYTHON_PAGES, len(pages))))
        for p in pages:
            if p.name.startswith("index."):
                continue
            html = p.read_bytes()
            if _plain_chars(html) >= MIN_CHARS:
                clean.append((page_url(p, corpus), html, page_lang(p)))
    if len(clean) < 100:
        return None
    copies = rng.sample(range(len(clean)), EXACT + NEAR)
    exact = [(clean[i][0].replace("://", "://mirror.") + "?copy", clean[i][1]) for i in copies[:EXACT]]
    near, jaccard = [], []
    for i in copies[EXACT:]:
        payload, j = near_copy(clean[i][1], rng)
        near.append((clean[i][0].replace("://", "://mirror.") + "?edited", payload))
        jaccard.append(j)
    original = {u: clean[i][0] for (u, _), i in zip(exact + near, copies)}
    junk = junk_pages(rng)
    a = write_warc(folder / "docs.warc.gz", [(u, p) for u, p, _ in clean])
    b = write_warc(folder / "copies.warc.gz", exact + near)
    c = write_warc(folder / "junk.warc.gz", [(u, p) for u, (_, p) in junk.items()])
    truth = {"clean": {u: lang for u, _, lang in clean}, "exact": [u for u, _ in exact], "near": [u for u, _ in near],
             "junk": {u: kind for u, (kind, _) in junk.items()}, "jaccard": (min(jaccard), max(jaccard)),
             "original": original}
    return [str(a), str(b), str(c)], truth


def score(result: dict, truth: dict) -> dict:
    kept, rejected = result["kept"], result["rejected"]
    clean = truth["clean"]
    dedup = {u for u, r in rejected.items() if r.startswith("dedup/")}
    planted = set(truth["exact"]) | set(truth["near"])
    kept_clean = [u for u in clean if u in kept]

    def recall(copies: list[str], reasons: tuple[str, ...]) -> float:
        judged = [u for u in copies if truth["original"][u] in kept]
        return sum(rejected.get(u) in reasons for u in judged) / max(len(judged), 1)

    return {
        "clean_pages": len(clean),
        "clean_kept": len(kept_clean) / len(clean),
        "junk_rejected": sum(u in rejected for u in truth["junk"]) / len(truth["junk"]),
        "exact_recall": recall(truth["exact"], ("dedup/exact_duplicate",)),
        "near_recall": recall(truth["near"], ("dedup/near_duplicate", "dedup/exact_duplicate")),
        "dedup_precision": len(dedup & planted) / len(dedup) if dedup else 1.0,
        "false_dedup": len(dedup & set(clean)) / len(clean),
        "lang_accuracy": sum(kept[u] == clean[u] for u in kept_clean) / max(len(kept_clean), 1),
        "clean_lost_by": dict(Counter(rejected[u] for u in clean if u in rejected).most_common()),
        "junk_kept": sorted({truth["junk"][u] for u in truth["junk"] if u in kept}),
    }


def run(inputs: list[str], out: Path, src: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(inputs), str(out)], capture_output=True, text=True,
                       env=env, cwd=ROOT, check=False)
    if r.returncode:
        raise SystemExit(f"kiln data failed ({src}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-quality-") as tmp:
        built = build(Path(tmp))
        if built is None:
            print("skipped: install the packages in benchmarks/debian_docs.py")
            return
        inputs, truth = built
        print(f"crawl: {len(truth['clean'])} clean pages in {len(set(truth['clean'].values()))} languages, "
              f"{len(truth['exact'])} exact and {len(truth['near'])} near copies (Jaccard "
              f"{truth['jaccard'][0]:.2f}-{truth['jaccard'][1]:.2f}), {len(truth['junk'])} junk/malformed")
        contenders = {"this Kiln": ROOT / "src"}
        if os.environ.get("KILN_BENCH_BEFORE"):
            contenders = {"before": Path(os.environ["KILN_BENCH_BEFORE"]), **contenders}
        keys = ("clean_kept", "junk_rejected", "exact_recall", "near_recall", "dedup_precision", "false_dedup",
                "lang_accuracy")
        print(f"{'':<10}" + "".join(f"{k:>16}" for k in keys))
        for name, src in contenders.items():
            s = score(run(inputs, Path(tmp) / f"out-{len(name)}", src), truth)
            print(f"{name:<10}" + "".join(f"{s[k]:>16.3f}" for k in keys))
            print(f"{'':<10}clean pages lost by: {s['clean_lost_by']}; junk kept: {s['junk_kept']}")
