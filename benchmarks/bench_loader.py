"""Loader tokens/s per process from local shards, against a bare numpy memmap slice loop, in the same run.

Writes ~300 MB of synthetic uint16 shards (vocabulary 32,000, seq_len 2,048) with
Kiln's own writer into a temporary folder, then times batches of 64 × 2,049
tokens in the same seeded random order:
  bare      np.memmap per shard; out[k] = mm[i*L:(i+1)*L] into a fresh int64 array per batch
  bare-view the same through plain ndarray views of the maps (np.asarray(mm)): slicing skips np.memmap's
            Python-level __array_finalize__, the floor of a Python per-row loop
  kiln      Loader.next_batch() (permutation, rank slice, int64 torch tensors, micro-batches), no prefetch
  kiln+pf   the same with the background prefetch thread (queue of 2), as the trainer runs it
Medians of 5 runs of 120 batches each (~31 M tokens) after a warm-up pass (page cache).

    python -m benchmarks loader
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kiln.manifest import write_manifest
from kiln.shards.format import BIN_HEADER, FORMAT_VERSION, IDX_ENTRY, ShardHeader, token_dtype, write_shard
from kiln.shards.reader import ShardSet
from kiln.train.loader import Loader

VOCAB, SEQ, BATCH, SHARDS, SAMPLES_PER_SHARD = 32_000, 2048, 64, 4, 18_000
RUNS, BATCHES = 5, 120


def write_synthetic(folder: Path) -> None:
    L = SEQ + 1
    rng = np.random.default_rng(0)
    files = []
    for k in range(SHARDS):
        tokens = rng.integers(0, VOCAB, SAMPLES_PER_SHARD * L, dtype=np.uint16)
        name = f"train/{k:05d}.bin"
        (folder / "train").mkdir(parents=True, exist_ok=True)
        write_shard(folder / name, tokens, ShardHeader(2, VOCAB, L, len(tokens), "0" * 64),
                    np.array([(0, len(tokens), k)], dtype=IDX_ENTRY))
        files.append(name)
    n = SHARDS * SAMPLES_PER_SHARD * L
    write_manifest(folder, stage="pack", format_version=FORMAT_VERSION, dtype="uint16", vocab_size=VOCAB, eos_id=1,
                   tokenizer_sha256="0" * 64, seq_len=SEQ, sample_len=L, mode="concat",
                   splits={"train": {"files": files, "tokens": n, "samples": n // L}},
                   documents=[{"id": str(k)} for k in range(SHARDS)])


def bare_loop(folder: Path, order: np.ndarray, view: bool = False) -> float:
    L = SEQ + 1
    maps = [np.memmap(folder / f"train/{k:05d}.bin", dtype=token_dtype(VOCAB), mode="r", offset=BIN_HEADER.size)
            for k in range(SHARDS)]
    if view:
        maps = [np.asarray(m) for m in maps]
    t0 = time.perf_counter()
    for b in range(BATCHES):
        out = np.empty((BATCH, L), dtype=np.int64)
        for r, i in enumerate(order[b * BATCH:(b + 1) * BATCH].tolist()):
            k, j = divmod(i, SAMPLES_PER_SHARD)
            out[r] = maps[k][j * L:(j + 1) * L]
    return BATCHES * BATCH * SEQ / (time.perf_counter() - t0)


def kiln_loop(samples: ShardSet, prefetch: int, seed: int) -> float:
    loader = Loader(samples, BATCH, BATCH // 8, 0, 1, seed=seed, prefetch=prefetch)
    loader.next_batch()  # start the thread and build the epoch's order outside the timing
    t0 = time.perf_counter()
    for _ in range(BATCHES):
        loader.next_batch()
    rate = BATCHES * BATCH * SEQ / (time.perf_counter() - t0)
    loader.close()
    return rate


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-loader-") as tmp:
        folder = Path(tmp) / "shards"
        write_synthetic(folder)
        size = sum(p.stat().st_size for p in folder.rglob("*.bin"))
        samples = ShardSet(folder, "train")
        results: dict[str, list[float]] = {"bare": [], "bare-view": [], "kiln": [], "kiln+pf": []}
        for run in range(RUNS + 1):  # run 0 warms the page cache
            seed = 100 + run
            # the same samples in the same order for all three: the loader's own order, skipping its first batch
            order = Loader(samples, BATCH, BATCH, 0, 1, seed=seed).plan.order(seed, 0)[BATCH:]
            rates = {"bare": bare_loop(folder, order), "bare-view": bare_loop(folder, order, view=True),
                     "kiln": kiln_loop(samples, 0, seed), "kiln+pf": kiln_loop(samples, 2, seed)}
            if run:
                for k, v in rates.items():
                    results[k].append(v)
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"shards: {size / 1e6:.0f} MB, batch {BATCH} x {SEQ + 1} tokens, {RUNS} runs x {BATCHES} batches")
        print(f"{'loop':10} {'median Mtok/s':>14} {'min':>8} {'max':>8} {'vs bare':>8} {'vs view':>8}")
        for k, v in results.items():
            print(f"{k:10} {med[k] / 1e6:14.1f} {min(v) / 1e6:8.1f} {max(v) / 1e6:8.1f} {med[k] / med['bare']:8.2f} "
                  f"{med[k] / med['bare-view']:8.2f}")


if __name__ == "__main__":
    main()
