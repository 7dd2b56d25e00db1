"""What every run of an ablation is measured on, and the check that no arm trained on it.

An eval text set is a JSONL file of {"text"} rows (an "id" field is kept when present; .jsonl.gz and
.jsonl.zst too), a docs folder `kiln data` committed, a folder of UTF-8 files (each one document, its
relative path its id) or one UTF-8 text file (one document). A task is `kiln eval --mc`'s JSONL; for the
overlap check a question is its context followed by its right answer.

The overlap check (`find_overlap`) streams an arm's kept documents and asks, for every eval document, the two
questions the data stage's dedup asks: the same text (`text_key`: xxh3-128 of the whitespace- and
case-normalised text) or a near duplicate (MinHash LSH with the base config's data.dedup bands, rows, n-gram
and seed, each candidate confirmed by its exact Jaccard similarity against data.dedup.threshold). An eval
document found in any arm is dropped from that evaluation for every arm, and reported.

Memory: the eval sets, their shingles and band keys (a benchmark's size, not a corpus's); an arm's documents
stream through one at a time.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import zstandard

from kiln.config import DedupConfig
from kiln.data.dedup import text_key
from kiln.data.dedup.minhash import MinHasher
from kiln.data.dedup.shingles import jaccard, shingle_hashes
from kiln.data.docs import read_docs
from kiln.errors import KilnError
from kiln.manifest import MANIFEST, sha256_file, write_atomic

OVERLAP = "overlap.json"
OVERLAP_VERSION = 1  # in the fingerprint: a change in the test redoes it


@dataclass
class EvalSet:
    name: str
    kind: str  # "text" or "task"
    path: str
    ids: list[str]
    texts: list[str]  # text sets: the documents; tasks: each question's context + " " + right answer
    questions: list | None = None  # tasks: kiln.scoring.mc.Question rows

    def digest(self, keep: list[int] | None = None) -> str:
        """sha256 of the (id, text) rows, or of those at `keep`: what a measurement of them depends on."""
        h = hashlib.sha256(f"{self.kind}\0{self.name}\0".encode())
        for i in range(len(self.ids)) if keep is None else keep:
            h.update(json.dumps([self.ids[i], self.texts[i]], ensure_ascii=False).encode() + b"\n")
        return h.hexdigest()


def _open_text(path: Path) -> io.TextIOBase:
    raw = open(path, "rb")
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
    if path.name.endswith(".zst"):
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, str]]:
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise KilnError(f"{path}:{number}: not JSON ({exc}); an eval set's rows are {{\"text\": ...}}") \
                        from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise KilnError(f"{path}:{number}: a row needs a \"text\" string (an \"id\" is optional)")
                yield str(row.get("id", f"{path.name}:{number}")), row["text"]
    except (UnicodeDecodeError, EOFError, OSError, zstandard.ZstdError) as exc:
        raise KilnError(f"{path}: cannot read it as UTF-8 JSON lines ({str(exc)[:120]})") from None


def _file_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KilnError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); an eval document must be "
                        "UTF-8") from None


def _text_rows(path: Path) -> Iterator[tuple[str, str]]:
    if path.is_dir() and (path / MANIFEST).is_file():
        yield from ((str(d.get("id")), d["text"]) for d in read_docs(path))
    elif path.is_dir():
        for p in sorted(q for q in path.rglob("*") if q.is_file() and not q.name.startswith(".")):
            yield p.relative_to(path).as_posix(), _file_text(p)
    elif ".jsonl" in path.name:
        yield from _jsonl_rows(path)
    else:
        yield path.name, _file_text(path)


def load_eval_sets(text: dict[str, str], tasks: list) -> list[EvalSet]:
    """Every text set and task, read whole (one line naming the file on any problem, or on an empty set)."""
    from kiln.scoring.mc import DELIMITER, load_questions

    sets = []
    for name, where in text.items():
        path = Path(where)
        if not path.exists():
            raise KilnError(f"eval set {name!r}: {path} does not exist; give a JSONL of {{\"text\"}} rows, a folder "
                            "of text files or a docs folder")
        rows = [(i, t) for i, t in _text_rows(path) if t.strip()]
        if not rows:
            raise KilnError(f"eval set {name!r}: {path} holds no document with text; an eval set needs documents")
        sets.append(EvalSet(name, "text", str(path), [r[0] for r in rows], [r[1] for r in rows]))
    for task in tasks:
        questions = load_questions(task.path)  # names FILE:LINE on a bad row, and refuses an empty file
        sets.append(EvalSet(task.name, "task", task.path, [f"{Path(task.path).name}:{i + 1}" for i in
                                                            range(len(questions))],
                            [q.context + DELIMITER + q.choices[q.answer] for q in questions], questions))
    return sets


# --- the overlap check ----------------------------------------------------------------------------------------

class EvalIndex:
    """The eval documents' exact keys, shingles and MinHash band keys, for streaming a corpus past them."""

    def __init__(self, sets: list[EvalSet], dedup: DedupConfig) -> None:
        self.dedup, self.hasher = dedup, MinHasher(dedup.bands, dedup.rows, dedup.seed)
        self.docs = [(s.name, i, s.ids[i]) for s in sets for i in range(len(s.ids))]
        texts = [t for s in sets for t in s.texts]
        self.exact: dict[bytes, list[int]] = {}
        for k, t in enumerate(texts):
            self.exact.setdefault(text_key(t), []).append(k)
        self.shingles = [shingle_hashes(t, dedup.ngram, dedup.tokens) for t in texts]
        keys = self.hasher.band_keys(np.stack([self.hasher.signature(s) for s in self.shingles]))
        self.bands: dict[tuple[int, int], list[int]] = {}
        for k, row in enumerate(keys.tolist()):
            for band, key in enumerate(row):
                self.bands.setdefault((band, key), []).append(k)

    def matches(self, text: str) -> Iterator[tuple[int, str, float]]:
        """(eval document, "exact" or "near_duplicate", similarity) for every eval document `text` matches."""
        exact = set(self.exact.get(text_key(text), ()))
        for k in sorted(exact):
            yield k, "exact", 1.0
        shingles = shingle_hashes(text, self.dedup.ngram, self.dedup.tokens)
        row = self.hasher.band_keys(self.hasher.signature(shingles)[None, :])[0].tolist()
        candidates = {k for band, key in enumerate(row) for k in self.bands.get((band, key), ())} - exact
        for k in sorted(candidates):
            similarity = jaccard(shingles, self.shingles[k])
            if similarity >= self.dedup.threshold:
                yield k, "near_duplicate", round(similarity, 6)


def overlap_fingerprint(docs: Path, sets: list[EvalSet], dedup: DedupConfig) -> str:
    payload = [OVERLAP_VERSION, sha256_file(docs / MANIFEST), [s.digest() for s in sets],
               dedup.model_dump(mode="json")]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def find_overlap(docs: Path, sets: list[EvalSet], dedup: DedupConfig, out: Path,
                 log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The eval documents an arm's kept documents (`docs`) contain, one row each (the first training document
    found): {set, index, id, kind, similarity, train_id}. Kept in `out` (overlap.json) with its fingerprint,
    so a re-run with the same documents and eval sets reads it back."""
    fingerprint = overlap_fingerprint(docs, sets, dedup)
    if out.is_file():
        try:
            kept = json.loads(out.read_text())
            if kept.get("fingerprint") == fingerprint:
                return kept["matches"]
        except (OSError, ValueError, AttributeError):
            pass  # rewritten below
    log(f"overlap: checking {sum(len(s.ids) for s in sets):,} eval documents against {docs}")
    index, found = EvalIndex(sets, dedup), {}
    for doc in read_docs(docs):
        for k, kind, similarity in index.matches(doc.get("text") or ""):
            if k not in found:
                name, i, ident = index.docs[k]
                found[k] = {"set": name, "index": i, "id": ident, "kind": kind, "similarity": similarity,
                            "train_id": doc.get("id")}
    matches = [found[k] for k in sorted(found)]
    write_atomic(out, json.dumps({"fingerprint": fingerprint, "docs": str(docs), "matches": matches}, indent=1,
                                 ensure_ascii=False))
    return matches


def kept_units(sets: list[EvalSet], overlaps: dict[str, list[dict[str, Any]]]) -> dict[str, list[int]]:
    """Per set, the indices no arm trained on; an emptied set is a one-line error naming it and the arms."""
    dropped: dict[str, dict[int, set[str]]] = {}
    for arm, rows in overlaps.items():
        for row in rows:
            dropped.setdefault(row["set"], {}).setdefault(row["index"], set()).add(arm)
    keep = {}
    for s in sets:
        gone = dropped.get(s.name, {})
        keep[s.name] = [i for i in range(len(s.ids)) if i not in gone]
        if not keep[s.name]:
            arms = sorted(set().union(*gone.values()))
            names = ("arm " if len(arms) == 1 else "arms ") + ", ".join(repr(a) for a in arms)
            raise KilnError(f"eval set {s.name!r} ({s.path}): all {len(s.ids):,} of its documents are in the training "
                            f"data of {names} (exact or near duplicates); evaluate on text no arm trains on")
    return keep
