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


# --- the merge's driver step, fed directly (issue 44.1) ---------------------------------------------------------

GROUP = 6  # a fed task's documents come in groups: a survivor, a chain of four near copies, an exact copy


def fed_merge(work: Path, removed: int, tasks: int = 20) -> None:
    """A work folder as the merge finds it after the dedup stages, written directly: `tasks` data tasks (their
    outcomes, every document kept by the gates), each task's verdict file removing five of every six."""
    import zstandard

    from kiln.config import DedupConfig
    from kiln.data.dedup.signatures import Part
    from kiln.data.dedup.stages import Layout, VerdictFiles

    per_task = removed * GROUP // 5 // tasks
    layout = Layout([Part(str(work), f"task-{k:05d}", per_task) for k in range(tasks)], DedupConfig(), work)
    (layout.results / "verdicts").mkdir(parents=True)
    summaries = []
    for k in range(tasks):
        source = f"/crawl/file-{k // 4:04d}.jsonl"  # four tasks an input
        docs = [json.dumps({"id": f"d{k}-{n}", "text": f"page {n} of task {k} " * 8, "source": source,
                            "url": f"https://h{n % 97}.example/", "lang": "en", "lang_score": 0.99})
                for n in range(per_task)]
        rows = []
        for n in range(per_task):
            if n % GROUP == 5:
                rows.append({"n": n, "reason": "exact_duplicate", "signals": {"duplicate_of": f"d{k}-{n - 5}"}})
            elif n % GROUP:
                ledger = {"member": f"d{k}-{n}", "survivor": f"d{k}-{n - n % GROUP}", "linked_to": f"d{k}-{n - 1}",
                          "similarity": 0.9, "link_similarity": 0.9, "cluster": n // GROUP, "position": n}
                rows.append({"n": n, "reason": "near_duplicate", "ledger": ledger,
                             "signals": {"duplicate_of": ledger["survivor"], "similarity": 0.9, "cluster": n // GROUP}})
        for path, lines in ((work / f"task-{k:05d}.jsonl.zst", docs),
                            (VerdictFiles(layout).path(k), [json.dumps(r) for r in rows])):
            path.write_bytes(zstandard.ZstdCompressor(level=1).compress(("\n".join(lines) + "\n").encode()))
        summaries.append({"index": k, "source": source, "documents": per_task, "kept": per_task, "error": None,
                          "records_by_type": {}, "truncated_at": None, "steps_s": dict.fromkeys(
                              ("read", "extract", "language", "gates", "signatures"), 0.0)})
    (work / "summaries.json").write_text(json.dumps(summaries))
    layout.save()


MERGE = """
import json, sys, tracemalloc
from pathlib import Path
from kiln.config import DataConfig
from kiln.data.dedup.stages import Layout, VerdictFiles
from kiln.data.merge import merge
from kiln.manifest import write_manifest
from kiln.tasks import executor
real_init = executor.worker_init
def untraced():  # the pool's workers are forked while this process traces: only the driver is measured
    tracemalloc.stop()
    real_init()
executor.worker_init = untraced
work, out = Path(sys.argv[1]), Path(sys.argv[2])
summaries = json.loads((work / "summaries.json").read_text())
verdicts = VerdictFiles(Layout.load(work))
verdicts.counts = {"exact_removed": 0}
out.mkdir()
cfg = DataConfig(workers=2, docs_per_part=20_000, distribution={"source_key": "host"})
tracemalloc.start()
stats, hashed = merge(work, summaries, out, cfg, verdicts, None, 2)
write_manifest(out, hashed, stage="data", documents=stats["documents"]["kept"], tables=stats["tables"])
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent (the test, which wrote the corpus)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"peak": tracemalloc.get_traced_memory()[1], "rss": hwm, "documents": stats["documents"],
                  "parts": stats["parts"], "reasons": stats["rejected_by_reason"]}))
"""


def merge_peak(tmp: Path, removed: int) -> dict:
    import subprocess
    import sys

    work = tmp / f"fed-{removed}" / "work"
    fed_merge(work, removed)
    done = subprocess.run([sys.executable, "-c", MERGE, str(work), str(work.parent / "docs")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def merge_is_flat(tmp: Path, small: int, large: int) -> None:
    from kiln.data.docs import read_docs

    a, b = merge_peak(tmp, small), merge_peak(tmp, large)
    for got, removed in ((a, small), (b, large)):
        assert got["documents"] == {"read": removed * GROUP // 5, "kept": removed // 5, "rejected": removed}
        assert got["reasons"] == {"dedup/exact_duplicate": removed // 5, "dedup/near_duplicate": removed * 4 // 5}
        assert got["parts"] == -(-removed // 5 // 20_000)
    kept = read_docs(tmp / f"fed-{large}" / "docs")
    assert sum(1 for _ in kept) == large // 5  # every part there, as its manifest lists it
    print(f"merge driver: {small:,} removed: {a['peak'] / 1e6:.2f} MB allocated, {a['rss'] / 1e3:.0f} MB RSS; "
          f"{large:,}: {b['peak'] / 1e6:.2f} MB, {b['rss'] / 1e3:.0f} MB")
    assert b["peak"] <= 1.1 * a["peak"] and b["rss"] <= 1.1 * a["rss"], (a, b)


def test_the_merge_driver_step_is_flat_in_the_removed_documents(tmp_path):
    # issue 44.1: the driver merged every document itself; now it sums the merge tasks' counts and renames parts.
    # What it holds goes with the tasks (20 here at both sizes) and the parts (a manifest row each, as before)
    merge_is_flat(tmp_path, 10_000, 100_000)


@pytest.mark.slow  # ~2 minutes on 2 busy cores: 1,200,000 documents through the merge tasks (1.17 -> 1.22 MB, 57 MB)
def test_the_merge_driver_step_is_flat_from_100_000_to_1_000_000_removed_documents(tmp_path):
    merge_is_flat(tmp_path, 100_000, 1_000_000)
