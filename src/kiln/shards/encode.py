"""Encode documents with the tokenizer, in this process or in a pool of processes, in corpus order.

Chunks of `batch` documents go to `encode_batch`; with several workers each
chunk is encoded in a spawned process (a forked one would inherit the
tokenizer's thread pool) and results are taken back in submission order, at
most `2 × workers` chunks in flight, so the output is the same token stream,
byte for byte, for any number of workers. The workers end with the driver
(SIGTERM, SIGINT, an error, a consumer that stops early): `kiln.tasks.workers`.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from kiln.tasks.workers import ending_workers, worker_init

_worker_tokenizer = None


def _init_worker(tokenizer_file: str, threads: int) -> None:
    global _worker_tokenizer
    worker_init()  # ends with the driver (see kiln.tasks.workers)
    # tokenizers sizes its thread pool on first use: set before the first encode so workers do not oversubscribe.
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # rayon reads this name; RAYON_RS_NUM_THREADS is ignored
    from kiln.tokenizer import load_tokenizer

    _worker_tokenizer = load_tokenizer(tokenizer_file)


def encode_texts(tokenizer, texts: list[str], dtype: np.dtype, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """All documents' ids, each followed by EOS, as one flat array, and each document's length."""
    try:
        encs = tokenizer.encode_batch(texts, add_special_tokens=False)
    except TypeError:  # a lone surrogate cannot cross into Rust: replace it (U+FFFD) rather than fail the corpus
        encs = tokenizer.encode_batch(
            [t.encode("utf-8", "replace").decode("utf-8") for t in texts], add_special_tokens=False
        )
    ids = [e.ids for e in encs]  # each .ids access converts from Rust: once
    lengths = np.fromiter((len(i) + 1 for i in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(i + [eos] for i in ids), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def _encode_in_worker(texts: list[str], dtype: str, eos: int) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_worker_tokenizer, texts, np.dtype(dtype), eos)


def encode_documents(docs: Iterable[dict], tokenizer_file: Path, batch: int, workers: int, dtype: np.dtype,
                     eos: int, progress=None) -> Iterator[tuple[dict, np.ndarray]]:
    """Yield (document, its ids + EOS) in input order; `progress(documents, text_bytes)` after each chunk."""
    chunks = _chunks(docs, batch)
    if workers == 1:
        from kiln.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_file)
        results = ((chunk, encode_texts(tok, [d["text"] for d in chunk], dtype, eos)) for chunk in chunks)
        yield from _split(results, progress)
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(str(tokenizer_file), threads)) as pool, ending_workers(pool) as signals:
        yield from _split(_ordered(pool, signals, chunks, dtype.str, eos, 2 * workers), progress)


def _chunks(docs: Iterable[dict], batch: int) -> Iterator[list[dict]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, batch)):
        yield chunk


def _ordered(pool: ProcessPoolExecutor, signals, chunks: Iterator[list[dict]], dtype: str, eos: int, depth: int):
    pending: deque = deque()
    for chunk in chunks:
        pending.append((chunk, pool.submit(_encode_in_worker, [d["text"] for d in chunk], dtype, eos)))
        if len(pending) >= depth:
            chunk, fut = pending.popleft()
            yield chunk, signals.result(fut)
    while pending:
        chunk, fut = pending.popleft()
        yield chunk, signals.result(fut)


def _split(results, progress) -> Iterator[tuple[dict, np.ndarray]]:
    for chunk, (flat, lengths) in results:
        ends = np.cumsum(lengths)
        for doc, start, end in zip(chunk, (ends - lengths).tolist(), ends.tolist()):
            yield doc, flat[start:end]
        if progress:
            progress(len(chunk), sum(len(d["text"].encode("utf-8", "replace")) for d in chunk))
