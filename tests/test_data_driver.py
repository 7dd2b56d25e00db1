"""The data stage's driver holds nothing that grows with the removed documents or the sources.

The dedup verdicts are written one file per data task by the verdicts task on a worker and read one task at a
time (kiln.data.dedup.stages), and the per-source tables are side files written as they are counted
(kiln.data.tables); each task's distribution profile part is copied from its file piece by piece. The driver's
Python allocations (tracemalloc, which numpy reports to; the pool's workers are forked with it stopped) are
compared for a corpus like the data_scale benchmark's default (5,000 removed documents, 10 sources) and one with
100x the removed documents and 5,000x the sources (hosts). Two fixed slabs are reached on the way and do not grow
after: the profile report's sums of at most 512 sources x 4 x top_tokens floats (`SpilledProfiles`; top_tokens 20
here, so 0.3 MB) and at most 4,096 sources' counts before they spill (`SpilledCounts.HELD`, ~0.7 MB).
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest

from kiln.config import DataConfig
from kiln.tasks import executor
from kiln.data.pipeline import run_data
from kiln.data.tables import rows

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "po", "ra", "se", "ti", "vu", "ze") for b in
         ("ban", "cor", "dil", "fen", "gor", "hal", "jim", "kel", "lun", "mor", "nek", "pil", "ros", "tun", "vel")]


def write_corpus(path: Path, originals: int, exact: int, near: int, hosts: int) -> int:
    """`originals` documents of 60 words, each followed by `exact` exact copies and `near` near copies (one word
    changed: 5-gram Jaccard ~0.85), all on the host of their original (one of `hosts`); returns how many the
    dedup should remove."""
    rng = random.Random(originals)
    with open(path, "w") as out:
        k = 0
        for i in range(originals):
            words = rng.choices(WORDS, k=60)
            texts = [" ".join(words)] * (1 + exact)
            for j in range(near):
                edited = list(words)
                edited[rng.randrange(60)] = f"w{i}x{j}"
                texts.append(" ".join(edited))
            for text in texts:
                out.write(json.dumps({"id": f"d{k}", "text": text, "url": f"https://h{i % hosts}.example/{k}"}) + "\n")
                k += 1
    return originals * (exact + near)


def driver_peak(tmp: Path, monkeypatch, name: str, **corpus) -> tuple[int, dict]:
    inputs = [str(tmp / f"{name}.jsonl")]
    removed = write_corpus(Path(inputs[0]), **corpus)
    real_init = executor.worker_init

    def untraced() -> None:  # a worker forked while the driver traces stops tracing: only the driver is measured
        tracemalloc.stop()
        real_init()

    monkeypatch.setattr(executor, "worker_init", untraced)
    cfg = DataConfig(workers=2, min_chars=50, lang_threshold=0.0, distribution={"source_key": "host", "top_tokens": 20},
                     quality={k: {"enabled": False} for k in ("gopher_quality", "gopher_repetition", "c4", "fineweb",
                                                              "noise", "residue", "pii")})
    tracemalloc.start()
    try:
        stats = run_data(inputs, tmp / name / "docs", cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    dedup = stats["dedup"]
    assert dedup["exact_removed"] + dedup["near_removed"] >= 0.98 * removed
    return peak, stats


@pytest.mark.slow  # 560,000 short documents through the data stage: ~10 minutes on 2 busy cores
def test_the_driver_is_flat_in_the_removed_documents_and_the_sources(tmp_path, monkeypatch):
    small, s = driver_peak(tmp_path, monkeypatch, "small", originals=5000, exact=1, near=0, hosts=10)
    large, big = driver_peak(tmp_path, monkeypatch, "large", originals=50_000, exact=8, near=2, hosts=50_000)
    sources = sum(1 for _ in rows(tmp_path / "large" / "docs", "source_weights"))
    gone = big["dedup"]["exact_removed"] + big["dedup"]["near_removed"]
    print(f"driver peak: {small / 1e6:.1f} MB ({s['documents']['read']:,} documents, "
          f"{s['dedup']['exact_removed']:,} removed, 10 sources), {large / 1e6:.1f} MB "
          f"({big['documents']['read']:,} documents, {gone:,} removed, {sources:,} sources)")
    assert gone > 490_000 and sources == 50_000 and big["tasks"] > 4
    # held per removed document (~100 bytes) and per source (~2.5 KB), the driver would grow by ~175 MB; a task's
    # profile part held whole, by ~1.5 KB per source of the largest task (+12 MB here)
    assert large - small < 2.5e6, (small, large)
