"""Documents per second on one core: Kiln's read + extract + language + quality gates vs datatrove's.

Same WARC files for both: the bundled sample (120 Debian Reference pages in 8 languages)
copied COPIES times. Kiln: `run_data` with one worker and near-dedup off (it still writes its
docs folder). datatrove 0.10.1: its FineWeb-style pipeline, WarcReader -> Trafilatura ->
LanguageFilter -> GopherRepetition -> GopherQuality -> C4Quality -> FineWebQuality -> JsonlWriter
on a one-task, one-worker LocalPipelineExecutor (its WarcReader is told that XHTML is HTML, or it
reads none of the sample). Medians of RUNS runs, side by side.

    DATATROVE_PYTHON=/path/to/venv/bin/python python -m benchmarks data_vs_datatrove
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import _datatrove
from kiln.config import DataConfig
from kiln.data.pipeline import run_data

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sample.warc.gz"
COPIES = int(os.environ.get("COPIES", "2"))
RUNS = int(os.environ.get("RUNS", "3"))

PEER = r'''
import json, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import WarcReader
from datatrove.pipeline.extractors import Trafilatura
from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                        GopherRepetitionFilter, LanguageFilter)
from datatrove.pipeline.writers import JsonlWriter

import magic

# datatrove's WarcReader asks libmagic for the type of a record without WARC-Identified-Payload-Type
# and drops XHTML ("<?xml ..."), i.e. every page of the sample: let those through as HTML.
_guess = magic.from_buffer
magic.from_buffer = lambda buf, mime=False: "text/html" if buf.lstrip()[:5] == b"<?xml" else _guess(buf, mime=mime)

args = json.loads(sys.argv[1])
count = {"docs": 0}

def counter(data, rank=0, world_size=1):
    for doc in data:
        count["docs"] += 1
        yield doc

executor = LocalPipelineExecutor(pipeline=[
    WarcReader(args["folder"], glob_pattern="*.warc.gz"), counter, Trafilatura(favour_precision=True),
    LanguageFilter(), GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter(filter_no_terminal_punct=False),
    FineWebQualityFilter(), JsonlWriter(args["tmp"] + "/out")], tasks=1, workers=1, logging_dir=args["tmp"] + "/logs")
t0 = time.perf_counter()
executor.run()
print(json.dumps({"docs": count["docs"], "seconds": time.perf_counter() - t0}))
'''


def kiln_once(folder: Path, out: Path) -> tuple[int, float]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    stats = run_data(
        [str(p) for p in sorted(folder.glob("*.warc.gz"))], out, DataConfig(workers=1, dedup={"method": "none"})
    )
    return stats["documents"]["read"], time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "warc"
        folder.mkdir()
        for i in range(COPIES):
            shutil.copy(SAMPLE, folder / f"sample-{i}.warc.gz")
        kiln = [kiln_once(folder, Path(tmp) / "docs") for _ in range(RUNS)]
        kiln_rate = statistics.median(d / s for d, s in kiln)
        print(
            f"kiln       {kiln[0][0]} docs, median {kiln_rate:8.1f} docs/s per core  "
            f"(runs: {[round(d / s, 1) for d, s in kiln]})"
        )
        if not _datatrove.python():
            print("datatrove  skipped: set DATATROVE_PYTHON to a python with datatrove 0.10.1")
            return
        peer = [_datatrove.run(PEER, {"folder": str(folder)}) for _ in range(RUNS)]
        peer_rate = statistics.median(r["docs"] / r["seconds"] for r in peer)
        print(f"datatrove  {peer[0]['docs']} docs, median {peer_rate:8.1f} docs/s per core  "
              f"(runs: {[round(r['docs'] / r['seconds'], 1) for r in peer]})")
        print(f"ratio      kiln / datatrove = {kiln_rate / peer_rate:.1f}x")


if __name__ == "__main__":
    main()
