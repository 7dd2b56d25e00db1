"""Every gate's decision on every page, recorded so that a faster gate can be checked to decide the same.

For each page of a WARC (read -> extract -> language as the pipeline does), under two configurations (the
defaults, and one with the optional rules on and the scalings off, so that other branches run):

- each gate alone on the extracted text: None, ["drop", reason, signals], ["edit", sha256 of the text, counts]
  or ["score", field, value];
- the chain (`apply_gates`, as the stage runs it): the ledger record the task would write (the kept record
  with its text hashed, or the reject record).

Besides the pages, `synthetic_texts` builds (seeded) pages out of the sample's lines with junk mixed in:
base64, entities and tags, mojibake, hex dumps, minified JavaScript, e-mail and IP addresses, repeated
paragraphs and n-grams, bullets, CJK, RTL and emoji, so that every rule meets text that breaks it.

    python tests/gate_decisions.py record WARC OUT.json.gz   # before a change
    python tests/gate_decisions.py check WARC OUT.json.gz    # after it: the first difference, or "identical"

test_gate_decisions.py checks the bundled sample and tests/data against tests/data/gate_decisions.json.gz.
Memory: one WARC's decisions (a few KB a page).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_WARC = ROOT / "examples" / "data" / "sample.warc.gz"
DOCS_WARC = ROOT / "tests" / "data" / "docs_pages.warc.gz"
GOLDEN = ROOT / "tests" / "data" / "gate_decisions.json.gz"


def configs() -> dict[str, Any]:
    from kiln.config import DataConfig

    strict = {"c4": {"require_terminal_punct": True, "min_sentences": 5, "drop_curly_brace": True},
              "gopher_repetition": {"cjk_ngram_scale": 1, "code_page_ngram_scale": 1},
              "noise": {"long_token_chars": 20, "window": 3}}
    return {"default": DataConfig(), "strict": DataConfig(quality=strict)}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:20]


def _result(result) -> Any:
    from kiln.data.gates.types import Edit, Score

    if result is None:
        return None
    if isinstance(result, Edit):
        return ["edit", _sha(result.text), result.counts]
    if isinstance(result, Score):
        return ["score", result.field, result.value]
    return ["drop", result[0], result[1]]


def _record(doc) -> dict[str, Any]:
    rec = doc.kept_record() if doc.rejection is None else doc.reject_record()
    if rec.get("text") is not None:
        rec["text"] = _sha(rec["text"])
    if rec.get("source"):  # the file's name: the checkout's path is not the gates' decision
        rec["source"] = Path(rec["source"]).name
    return rec


def page_decisions(doc, cfgs) -> dict[str, Any]:
    """One document (extracted, language set): each gate alone, then the chain, under every configuration."""
    import copy

    from kiln.data.gates import apply_gates, default_gates
    from kiln.data.gates.text import TextView

    out: dict[str, Any] = {"id": doc.id, "lang": doc.lang, "lang_score": doc.lang_score}
    if doc.rejection is not None:
        out["record"] = _record(doc)
        return out
    for name, cfg in cfgs.items():
        gates = default_gates(cfg)
        view = TextView(doc.text, doc.lang)
        out[name] = [_result(g(doc.url if getattr(g, "reads_url", False) else view)) for g in gates]
        chained = next(apply_gates(iter([copy.deepcopy(doc)]), gates))
        out[f"{name}_record"] = _record(chained)
    return out


def warc_decisions(path: Path) -> list[dict[str, Any]]:
    from kiln.data.document import ReadReport
    from kiln.data.extract import extract
    from kiln.data.language import identify_language
    from kiln.data.pipeline import Task, read_task

    cfgs = configs()
    cfg = cfgs["default"]
    docs = extract(read_task(Task(0, str(path)), cfg, ReadReport()), cfg.max_page_bytes, cfg.extractor)
    docs = identify_language(docs, cfg.languages, cfg.lang_threshold, cfg.lang_max_chars, cfg.lang_model)
    return [page_decisions(d, cfgs) for d in docs]


_JUNK = [
    lambda r: base64.b64encode(r.randbytes(r.randint(20, 200))).decode(),
    lambda r: " ".join(r.choice(["&amp;", "&nbsp;", "&#8217;", "&#x27;", "<div class=\"a\">", "</span>", "<br/>"])
                       for _ in range(r.randint(1, 12))),
    lambda r: "Ã©tÃ© â€™ Â© \ufffd\u00ef\u00bb\u00bf " * r.randint(1, 5),
    lambda r: " ".join(f"{r.getrandbits(16):04x}" for _ in range(r.randint(6, 16))),
    lambda r: "0000010: 0300 3e00 0100 0000 8010 0000 0000 0000",
    lambda r: "!function(e){var t={};function n(r){if(t[r])return t[r].exports;var o=t[r]={i:r,l:!1,exports:{}};"
              "return e[r].call(o.exports,o,o.exports,n),o.l=!0,o.exports}n.m=e,n.c=t}([]);" * r.randint(1, 3),
    lambda r: f"write to user{r.randint(0, 99)}@example.org or admin@{r.choice(['kiln.dev', 'a.b.co.uk'])}",
    lambda r: f"server {r.randint(1, 223)}.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(0, 255)} "
              f"and 192.168.{r.randint(0, 255)}.1, version 1.2.3.4.5, 999.1.1.1",
    lambda r: "https://example.com/" + "a" * r.randint(30, 90) + " /usr/share/" + "b/" * r.randint(10, 30),
    lambda r: "FZF_COMPLETION_PATH=/usr/share/" + "x" * 50 + " (" + "y" * 45 + ")",
    lambda r: "supercalifragilistic" * r.randint(2, 5),
    lambda r: "这是一个没有空格的中文句子，它很长很长，包含了很多汉字和标点符号。" * r.randint(1, 4),
    lambda r: "日本語の文章にはスペースがありません。passwd(5) を参照してください。" * r.randint(1, 3),
    lambda r: "مرحبا بالعالم هذا نص عربي من اليمين إلى اليسار " * r.randint(1, 3),
    lambda r: "emoji 🎉🔥 text 👍🏽 with flags 🇩🇪 and math 𝒜𝒞 " * r.randint(1, 3),
    lambda r: "\ud800 lone surrogate \udfff escaped",
    lambda r: "- item one\n- item two\n* item three\n\u2022 bullet",
    lambda r: "and so on...\nwhat next\u2026\nthe end...",
    lambda r: "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
    lambda r: "Please enable JavaScript to view this page.\nThis site uses cookies. Read our privacy policy.",
    lambda r: '{"key": "value", "n": 1}\n{"broken": [1, 2,\n["a", "b":',
    lambda r: "| a | b | c |\n| 1 | 2 |\n| x | y | z | w |",
    lambda r: ">>> import os\n>>> os.path.join(a, b)\n'a/b'\n$ ls -la\n# comment\nx = f(y)\n}",
    lambda r: "# # # ### hash heavy ... ... …",
    lambda r: "buy now cheap " * r.randint(5, 40),
    lambda r: "a" * r.randint(2000, 6000),
    lambda r: "\t \u3000 \u00a0 \u2028 mixed\u2029spaces\x0bhere\x0c",
    lambda r: "",
]


def synthetic_texts(lines: list[str], count: int = 60, seed: int = 0) -> list[str]:
    """Seeded pages: runs of real lines (some repeated, some paragraphs doubled) with junk lines between."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        parts: list[str] = []
        for _ in range(rng.randint(1, 40)):
            roll = rng.random()
            if roll < 0.5 and lines:
                start = rng.randrange(len(lines))
                parts.append("\n".join(lines[start:start + rng.randint(1, 8)]))
            elif roll < 0.8:
                parts.append(rng.choice(_JUNK)(rng))
            elif parts:
                parts.append(rng.choice(parts))  # a repeat: duplicated lines, paragraphs and n-grams
        sep = rng.choice(["\n", "\n\n", " ", "\n \n"])
        out.append(sep.join(parts) if i % 7 else " ".join(parts))  # every 7th: one very long line
    return out + ["", " ", "\n\n\n", "word", "a" * 10_000]


def synthetic_decisions(pages: list[dict[str, Any]], path: Path = SAMPLE_WARC) -> list[dict[str, Any]]:
    """The decisions on synthetic_texts built from the lines of `path`'s pages (language ID run on each)."""
    from kiln.data.document import Document, ReadReport
    from kiln.data.extract import extract
    from kiln.data.language import detect_language
    from kiln.data.pipeline import Task, read_task

    cfgs = configs()
    cfg = cfgs["default"]
    texts = [d.text for d in extract(read_task(Task(0, str(path)), cfg, ReadReport()), cfg.max_page_bytes)
             if d.rejection is None]
    lines = [ln for t in texts for ln in t.split("\n")]
    docs = [Document(f"synthetic-{i}", "synthetic", 0, 0, text=t, url=f"https://s.invalid/{i}")
            for i, t in enumerate(synthetic_texts(lines))]
    for doc in extract(iter(docs), cfg.max_page_bytes):
        if doc.rejection is None:  # fastText takes no lone surrogates: the language of the text without them
            doc.lang, doc.lang_score = detect_language(doc.text.encode("utf-8", "replace").decode(),
                                                       cfg.lang_max_chars, cfg.lang_model)
    return [page_decisions(d, cfgs) for d in docs]


def all_decisions(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    out = {p.name: warc_decisions(p) for p in paths}
    if SAMPLE_WARC in paths:
        out["synthetic"] = synthetic_decisions(out[SAMPLE_WARC.name])
    return out


def _canonical(obj) -> Any:
    return json.loads(json.dumps(obj, ensure_ascii=False))  # tuples -> lists, as the file holds them


def first_difference(expected: dict, got: dict) -> str | None:
    """Where `got` first differs from `expected` (input, page, field), or None when they are identical."""
    got = _canonical(got)
    for name in expected.keys() | got.keys():
        a, b = expected.get(name, []), got.get(name, [])
        if len(a) != len(b):
            return f"{name}: {len(a)} pages recorded, {len(b)} now"
        for pa, pb in zip(a, b):
            if pa != pb:
                for key in pa.keys() | pb.keys():
                    if pa.get(key) != pb.get(key):
                        return f"{name} {pa.get('id')} {key}:\n  recorded {pa.get(key)}\n  now      {pb.get(key)}"
    return None


def write(path: Path, decisions: dict) -> None:
    path.write_bytes(gzip.compress(json.dumps(decisions, ensure_ascii=False, sort_keys=True).encode(), mtime=0))


def read(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    inputs = [Path(p).resolve() for p in argv[1].split(",")]
    got = all_decisions(inputs)
    if argv[0] == "record":
        write(Path(argv[2]), got)
        print(f"recorded {sum(map(len, got.values()))} pages to {argv[2]}")
        return 0
    diff = first_difference(read(Path(argv[2])), got)
    print("identical" if diff is None else diff)
    return diff is not None


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main(sys.argv[1:]))
