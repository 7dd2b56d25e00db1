#!/usr/bin/env python3
"""Build the held-out eval sets of `examples/ablation.yaml`: ``examples/data/eval/handbook.jsonl`` (English
documents) and ``examples/data/eval/handbook-mc.jsonl`` (a multiple-choice task in `kiln eval --mc`'s format).

The text is the English HTML of *The Debian Administrator's Handbook* (Debian package ``debian-handbook``,
version 11.20220922; Raphaël Hertzog, Roland Mas, Freexian SARL; GPL-2.0+ or CC-BY-SA-3.0): the same
domain as the bundled sample crawl (Debian documentation), but other text, so no arm of the example trains on
it. Each page's main content (resiliparse, as `kiln data` extracts it) is cut into documents of about 1,500
characters at paragraph breaks; the first DOCS documents of PAGES, in that order, are kept.

The task completes a line of that text: its first half as the context, its second half against the second
halves of three other lines (`questions`, seeded). Reproducible byte for byte:

    sudo apt-get install debian-handbook        # or: apt-get download debian-handbook; dpkg -x *.deb root
    python scripts/make_ablation_eval.py [--html-dir root/usr/share/doc/debian-handbook/html/en-US]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

PAGES = ("sect.apt-get.html", "sect.manipulating-packages-with-dpkg.html", "sect.network-config.html",
         "sect.creating-accounts.html", "sect.backup.html", "sect.monitoring.html", "sect.filesystem-hierarchy.html",
         "sect.kernel-compilation.html", "sect.http-web-server.html", "sect.firewall-packet-filtering.html")
DOCS, QUESTIONS = 60, 40
OUT = Path(__file__).resolve().parents[1] / "examples" / "data" / "eval"


def chunks(text: str, size: int = 1500) -> list[str]:
    """Paragraphs joined into documents of about `size` characters."""
    out, current = [], ""
    for para in re.split(r"\n\s*\n", text):
        if current and len(current) + len(para) > size:
            out.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    return out + ([current] if current.strip() else [])


def questions(texts: list[str], n: int, seed: int = 0) -> list[dict]:
    """Complete a line (of 8 to 24 words: a choice fits a small model's window): its first half, its true second
    half against those of three other lines, drawn among the ten whose second halves are nearest it in length
    (so that length alone does not give the answer away)."""
    rng = random.Random(seed)
    lines = [ln.split() for doc in texts for ln in doc.splitlines() if 8 <= len(ln.split()) <= 24]
    rng.shuffle(lines)
    endings = [" ".join(o[len(o) // 2:]) for o in lines[n:]]
    rows = []
    for words in lines[:n]:
        cut = len(words) // 2
        right = " ".join(words[cut:])
        near = sorted(endings, key=lambda e: abs(len(e) - len(right)))[:10]
        choices = rng.sample(near, 3) + [right]
        rng.shuffle(choices)
        rows.append({"context": " ".join(words[:cut]), "choices": choices, "answer": choices.index(right)})
    return rows


def main() -> None:
    from resiliparse.extract.html2text import extract_plain_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html-dir", default="/usr/share/doc/debian-handbook/html/en-US")
    args = parser.parse_args()
    docs = []
    for page in PAGES:
        html = (Path(args.html_dir) / page).read_text(encoding="utf-8")
        docs += [(page, c) for c in chunks(extract_plain_text(html, main_content=True))]
    docs = docs[:DOCS]
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"{page}#{i}", "text": text} for i, (page, text) in enumerate(docs)]
    (OUT / "handbook.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                        encoding="utf-8")
    (OUT / "handbook-mc.jsonl").write_text("".join(
        json.dumps(q, ensure_ascii=False) + "\n" for q in questions([t for _, t in docs], QUESTIONS)), encoding="utf-8")
    print(f"{len(docs)} documents, {QUESTIONS} questions -> {OUT}")


if __name__ == "__main__":
    main()
