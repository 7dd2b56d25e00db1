"""A real-text dedup corpus: the pages of benchmarks/debian_docs.py's crawls cut into documents, with planted copies.

The synthetic corpus of bench_data_scale draws its words from a 3,000-word vocabulary, so a per-process cache of
token hashes always hits; real text has a long tail of words (and Han, kana, Cyrillic, Arabic). Here:

- the text: every page of the Debian documentation crawl and of the long-pages crawl (`debian_docs.CORPORA`,
  `LONG_CORPORA`: 26 languages), extracted as `kiln data` extracts it, cut at line ends into documents of at
  least MIN_WORDS words or MIN_CHARS characters (Han and kana run without spaces);
- no natural near copies: documentation repeats itself (untranslated chapters of a translated manual, the same
  note on every page), so every document with word 5-gram Jaccard >= 0.7 to an earlier one is left out, found
  by a MinHash index of 40 bands x 3 rows (P(candidate) > 0.999999 at 0.7) and confirmed exactly;
- planted copies, each placed after its original: near copies of 8% of the documents (words replaced by
  words of the corpus until the Jaccard is about a target in 0.78-0.97, measured exactly), chains A < B < C
  (1%; A and B near copies of C, not of each other) and exact copies (1%, spacing changed), as bench_data_scale
  plants them. The truth: a planted copy with Jaccard >= 0.8 to its original must go; one below 0.8 is not
  judged; every other document must stay.

Written as JSONL files of FILE_DOCS documents. Deterministic for the same installed packages.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.debian_docs import CORPORA, LONG_CORPORA, crawl

MIN_WORDS, MIN_CHARS = 150, 1500
FILE_DOCS = 5000
_TOKEN = re.compile(r"(\s+)")


def pages() -> list[str]:
    """The extracted text of every page of both crawls (empty when the packages are not installed)."""
    from kiln.config import DataConfig
    from kiln.data.document import ReadReport
    from kiln.data.extract import extract
    from kiln.data.pipeline import Task, read_task

    cfg, texts = DataConfig(), []
    with tempfile.TemporaryDirectory() as tmp:
        for name, corpora in (("docs", CORPORA), ("long", LONG_CORPORA)):
            path = crawl(corpora, Path(tmp) / f"{name}.warc.gz", min_pages=1)
            if path is None:
                continue
            texts += [d.text for d in extract(read_task(Task(0, str(path)), cfg, ReadReport()), cfg.max_page_bytes)
                      if d.rejection is None and d.text]
    return texts


def cut(text: str) -> list[str]:
    """The text in documents of whole lines, each at least MIN_WORDS words or MIN_CHARS characters (the rest of
    the page joins the last one)."""
    docs, lines, words, chars = [], [], 0, 0
    for line in text.split("\n"):
        lines.append(line)
        words, chars = words + len(line.split()), chars + len(line)
        if words >= MIN_WORDS or chars >= MIN_CHARS:
            docs.append("\n".join(lines).strip())
            lines, words, chars = [], 0, 0
    tail = "\n".join(lines).strip()
    if tail and docs:
        docs[-1] += "\n" + tail
    elif tail:
        docs.append(tail)
    return docs


def without_near_copies(docs: list[str], threshold: float = 0.7) -> list[str]:
    """`docs` less every one with Jaccard >= threshold to an earlier one."""
    from kiln.data.dedup.minhash import MinHashDedup

    index = MinHashDedup(bands=40, rows=3, threshold=threshold)
    for i, text in enumerate(docs):
        index.add(str(i), text)
    gone = {int(k) for k in index.duplicates()}
    return [t for i, t in enumerate(docs) if i not in gone]


def replace_words(text: str, k: int, vocabulary: list[str], rng: np.random.Generator) -> str:
    """`text` with k of its words (whitespace tokens) replaced by words drawn from `vocabulary`, its spacing kept."""
    parts = _TOKEN.split(text)
    words = [i for i in range(0, len(parts), 2) if parts[i]]
    for i in rng.choice(words, size=min(k, len(words)), replace=False).tolist():
        parts[i] = vocabulary[int(rng.integers(0, len(vocabulary)))]
    return "".join(parts)


def near_copy(text: str, target: float, vocabulary: list[str], rng: np.random.Generator) -> str:
    """Words replaced as many as take the word 5-gram Jaccard to about `target` (a replacement changes up to five
    shingles: J = (S - d) / (S + d) for d changed shingles)."""
    d = len(text.split()) * (1 - target) / (1 + target)
    return replace_words(text, max(1, round(d / 5)), vocabulary, rng)


def build(folder: Path, seed: int = 0) -> dict:
    """Write the corpus as JSONL files under `folder`; returns the truth {"go": {id: (original, jaccard)},
    "unplanned": [...], "documents": n}."""
    from kiln.data.dedup.shingles import jaccard, shingle_hashes

    rng = np.random.default_rng(seed)
    texts = without_near_copies([doc for text in pages() for doc in cut(text)])
    vocabulary = sorted({w for t in texts for w in t.split()})
    n_chain = int(0.01 * len(texts)) // 3
    originals, bases = texts[:len(texts) - n_chain], texts[len(texts) - n_chain:]  # bases: each chain's C
    n_orig = len(originals)
    docs = [(float(i), f"d{i}", t) for i, t in enumerate(originals)]
    go, unplanned = {}, []

    def sim(a: str, b: str) -> float:
        return jaccard(shingle_hashes(a), shingle_hashes(b))

    for k in range(int(0.08 * n_orig)):
        o = int(rng.integers(0, n_orig))
        text = near_copy(originals[o], float(rng.uniform(0.78, 0.97)), vocabulary, rng)
        j = sim(originals[o], text)
        (go.__setitem__(f"near{k}", (f"d{o}", j)) if j >= 0.8 else unplanned.append(f"near{k}"))
        docs.append((float(rng.uniform(o + 1, n_orig)), f"near{k}", text))
    for k, c in enumerate(bases):  # A and B near copies of C (not of each other), in the order A < B < C
        a, b = (near_copy(c, 0.86, vocabulary, rng) for _ in range(2))
        at = np.sort(rng.uniform(0, n_orig, 3))
        docs += [(float(at[0]), f"chainA{k}", a), (float(at[1]), f"chainB{k}", b), (float(at[2]), f"chainC{k}", c)]
        if sim(a, c) >= 0.8 and sim(b, c) >= 0.8:
            go[f"chainB{k}"], go[f"chainC{k}"] = (f"chainA{k}", sim(a, b)), (f"chainA{k}", sim(a, c))
        else:
            unplanned += [f"chainB{k}", f"chainC{k}"]
    for k in range(int(0.01 * n_orig)):
        o = int(rng.integers(0, n_orig))
        docs.append((float(rng.uniform(o + 1, n_orig)), f"exact{k}", originals[o].replace(" ", "  ", 5)))
        go[f"exact{k}"] = (f"d{o}", 1.0)
    docs.sort(key=lambda d: d[0])
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(0, len(docs), FILE_DOCS):
        with open(folder / f"part-{f // FILE_DOCS:05d}.jsonl", "w") as out:
            for _, doc_id, text in docs[f:f + FILE_DOCS]:
                out.write(json.dumps({"id": doc_id, "text": text, "url": f"https://debian.example/{doc_id}"},
                                     ensure_ascii=False) + "\n")
    return {"go": go, "unplanned": unplanned, "documents": len(docs)}
