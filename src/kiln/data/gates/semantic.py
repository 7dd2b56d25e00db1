"""Semantic gate (SEEDS): a document far from the corpus's domain goes to a review queue (or is dropped).

    data.quality.semantic: {keywords: [debian, package, kernel], min_cosine: 0.25, action: review}

A document's embedding is the mean of its normalised word vectors (floret's sentence vector of its first
`max_chars` characters) less the vectors' common direction (`common_direction`); the domain is the
normalised mean of the keywords' embeddings; the score is their cosine (`semantic_score` in kept records, in
rejections' signals and in `kiln data explain`). Below `min_cosine`, `action: drop` rejects the document
(`quality/semantic_below_min_cosine`) and `action: review`
sets it aside (`quality/semantic_review`): it is counted as a rejection, so stats.json still adds up, and
its full record with the score is written to `docs/review/part-NNNNN.jsonl.zst` for a person to judge.

The word vectors come from `vectors` (a floret/fastText model file; it must be readable by every worker),
or, when that is null, are trained on the corpus itself before the tasks run (`prepare`): floret skipgram
on the first `sample_docs` documents of the inputs in canonical order, on one thread (deterministic), saved in
the run's work folder (so local workers read it; with Ray give `vectors`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.data.gates.text import TextView, as_view
from kiln.data.gates.types import Gate, Score, drop

REVIEW = "semantic_review"
def _model(path: str):
    from kiln.data.gates.classifier import load_floret

    return load_floret(path, "data.quality.semantic.vectors", "give a floret/fastText model file, or leave it "
                       "null to train vectors on the corpus")


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    return v / norm if norm else v


COMMON_WORDS = 50_000  # the most frequent words whose mean vector is the common direction


def common_direction(model) -> np.ndarray:
    """The mean of the model's normalised word vectors (its most frequent words first). Word vectors share a
    large common component, so that every document is close to every other (cosines of 0.99 on a small
    corpus); embeddings are taken relative to it (Mu & Viswanath 2018, "All-but-the-top")."""
    vecs = np.array([model.get_word_vector(w) for w in model.get_words()[:COMMON_WORDS]], dtype=np.float64)
    norms = np.linalg.norm(vecs, axis=1)
    vecs = vecs[norms > 0] / norms[norms > 0, None]
    return vecs.mean(axis=0) if len(vecs) else np.zeros(model.get_dimension())


def embed(model, text: str, common: np.ndarray) -> np.ndarray:
    return _unit(model.get_sentence_vector(text) - common)


def centroid(model, keywords: list[str], common: np.ndarray) -> np.ndarray:
    """The domain: the normalised mean of the keywords' normalised embeddings."""
    return _unit(sum(embed(model, k.lower(), common) for k in keywords))


_COMMON: dict[str, np.ndarray] = {}


def semantic_gate(cfg) -> Gate:
    model = _model(cfg.vectors)
    common = _COMMON.get(cfg.vectors)
    if common is None:
        common = _COMMON[cfg.vectors] = common_direction(model)
    domain = centroid(model, cfg.keywords, common)

    def gate(text: "str | TextView"):
        line = " ".join(as_view(text).text[: cfg.max_chars * 2].split())[: cfg.max_chars].lower()
        score = round(float(embed(model, line, common) @ domain), 4)
        if score < cfg.min_cosine:
            reason = REVIEW if cfg.action == "review" else "semantic_below_min_cosine"
            return drop(reason, {"semantic_score": score}, min=cfg.min_cosine)
        return Score("semantic_score", score)
    return gate


def prepare(cfg, files: list[str], work: Path):
    """The DataConfig the tasks run with: when the semantic gate needs vectors trained on the corpus, train
    them (once per work folder) and point `data.quality.semantic.vectors` at them. Memory: one document at a
    time is read; the sample is written to disk for floret."""
    sem = cfg.quality.semantic
    if not sem.keywords or sem.vectors:
        return cfg
    from kiln.data.gates.classifier import _floret, save_floret

    path = work / "semantic-vectors.bin"
    if not path.is_file():
        from kiln.data.document import ReadReport
        from kiln.data.extract import extract
        from kiln.data.plan import Task, read_task

        corpus, n = work / "semantic-corpus.txt", 0
        with open(corpus, "w", encoding="utf-8") as f:
            for source in files:
                for doc in extract(read_task(Task(0, source), cfg, ReadReport()), cfg.max_page_bytes, cfg.extractor):
                    if doc.rejection is None and doc.text:
                        f.write(" ".join(doc.text[: sem.max_chars * 2].split())[: sem.max_chars].lower() + "\n")
                        n += 1
                    if n >= sem.sample_docs:
                        break
                if n >= sem.sample_docs:
                    break
        # floret mode: subword vectors in a small hashed table (50k rows x dim), not fastText's 2M buckets
        model = _floret().train_unsupervised(str(corpus), model="skipgram", mode="floret", bucket=50_000,
                                             hashCount=2, minn=3, maxn=5, dim=sem.dim, epoch=sem.epoch,
                                             minCount=2, thread=1, verbose=0)
        save_floret(model, path)
        corpus.unlink()
    semantic = sem.model_copy(update={"vectors": str(path)})
    return cfg.model_copy(update={"quality": cfg.quality.model_copy(update={"semantic": semantic})})
