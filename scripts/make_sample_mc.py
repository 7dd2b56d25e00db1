"""Write examples/data/sample-mc.jsonl: multiple-choice questions from the English pages of the bundled crawl,
for `kiln eval RUN --mc FILE` and `eval.tasks` (the README runs them).

A question is a sentence of the Debian Reference cut after its middle word: the context is the first half, the
right choice its second half, and three wrong choices the second halves of other sentences. Deterministic
(seeded; the pages are read in the WARC's order), so it is rebuilt byte for byte:

    python scripts/make_sample_mc.py
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from fastwarc.warc import ArchiveIterator, WarcRecordType

from kiln.data.extract import decode_html, resiliparse_text

ROOT = Path(__file__).resolve().parents[1]
WARC, OUT = ROOT / "examples" / "data" / "sample.warc.gz", ROOT / "examples" / "data" / "sample-mc.jsonl"
QUESTIONS, SEED = 40, 26


def english_sentences() -> list[str]:
    sentences = []
    with open(WARC, "rb") as f:
        for record in ArchiveIterator(f, record_types=WarcRecordType.response):
            if not record.headers.get("WARC-Target-URI", "").endswith(".en.html"):
                continue
            text = resiliparse_text(decode_html(record.reader.read(), "text/html; charset=utf-8"))
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
                words = sentence.split(" ")
                if 8 <= len(words) <= 20 and sentence[0].isupper() and sentence.endswith(".") \
                        and sentence not in sentences:
                    sentences.append(sentence)
    return sentences


def main() -> None:
    sentences = english_sentences()
    rng = random.Random(SEED)
    rows = []
    for sentence in rng.sample(sentences, QUESTIONS):
        words = sentence.split(" ")
        cut = len(words) // 2
        others = rng.sample([s for s in sentences if s != sentence], 3)
        choices = [" ".join(words[cut:]), *(" ".join(o.split(" ")[len(o.split(" ")) // 2:]) for o in others)]
        right = choices[0]
        rng.shuffle(choices)
        rows.append({"context": " ".join(words[:cut]), "choices": choices, "answer": choices.index(right)})
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{OUT}: {len(rows)} questions from {len(sentences)} sentences")


if __name__ == "__main__":
    main()
