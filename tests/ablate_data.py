"""Known-answer data for `kiln ablate` tests, made from the bundled sample crawl (nothing fetched).

- clean prose: the English pages of examples/data/sample.warc.gz (resiliparse main content), cut into
  documents of about 1,500 characters at paragraph breaks as the example's eval sets are
  (scripts/make_ablation_eval.py); `HELD_OUT` pages are the reference eval set,
  the rest the clean training text;
- junk: boilerplate menus, base64 blobs and shuffled words, its words made up (seeded) and checked to share
  none with the reference set's vocabulary. NOTES.md: a tiny model learns word statistics first, so junk
  shuffled from the eval domain's own words *lowers* the reference bits per byte; junk must carry none of them;
- GATES_OFF: every gate off (language ID's threshold too, or junk with no real word is dropped whole as
  language/low_lang_score), so each arm trains on exactly the text it names;
- a multiple-choice task from the reference text, built as the example's is (scripts/make_ablation_eval.py).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import random
import re
from pathlib import Path

from conftest import ROOT, english_pages

HELD_OUT = ("ch09.en.html", "pr01.en.html", "apa.en.html")
GATES_OFF = {"data.languages": None, "data.lang_threshold": 0.0, "data.min_chars": 0, "data.max_dup_line_frac": 1.0,
             "data.min_letter_frac": 0.0, "data.dedup.method": "none", "data.distribution.enabled": False,
             **{f"data.quality.{g}.enabled": False for g in ("gopher_quality", "gopher_repetition", "c4", "fineweb",
                                                            "noise", "residue", "pii")}}


def example_builder():
    """scripts/make_ablation_eval.py, which builds the example's eval sets: its `chunks` and `questions`."""
    spec = importlib.util.spec_from_file_location("make_ablation_eval", ROOT / "scripts" / "make_ablation_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose() -> tuple[list[str], list[str]]:
    """(clean training documents, reference documents), from different pages."""
    from resiliparse.extract.html2text import extract_plain_text

    train, reference = [], []
    for url, body in english_pages():
        text = extract_plain_text(body.decode("utf-8", "replace"), main_content=True)
        (reference if url.rsplit("/", 1)[-1] in HELD_OUT else train).extend(example_builder().chunks(text))
    return train, reference


def vocabulary(texts: list[str]) -> set[str]:
    return {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)}


def made_up_words(n: int, avoid: set[str], rng: random.Random) -> list[str]:
    consonants, vowels = "bdfgkmnprstvxz", "aeiouy"
    words: list[str] = []
    while len(words) < n:
        word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 4)))
        if word not in avoid and word not in words:
            words.append(word)
    return words


def junk(n_chars: int, avoid: set[str], seed: int = 0) -> list[str]:
    """About `n_chars` of junk documents (a third each menus, base64, shuffled words), none of `avoid`'s words."""
    rng = random.Random(seed)
    lexicon = made_up_words(400, avoid, rng)
    docs, total, kind = [], 0, 0
    while total < n_chars:
        if kind % 3 == 0:  # a navigation menu, repeated down the page
            items = rng.sample(lexicon, 8)
            doc = "\n".join(" | ".join(rng.sample(items, len(items))) for _ in range(30))
        elif kind % 3 == 1:  # base64 blobs
            doc = "\n".join(base64.b64encode(rng.randbytes(57)).decode() for _ in range(20))
        else:  # shuffled words, in sentences
            doc = " ".join(" ".join(rng.choices(lexicon, k=12)).capitalize() + "." for _ in range(25))
        docs.append(doc)
        total, kind = total + len(doc), kind + 1
    return docs


def questions(reference: list[str], n: int = 40, seed: int = 0) -> list[dict]:
    """The example's task builder on the reference text."""
    return example_builder().questions(reference, n, seed)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"{path.stem}-{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path
