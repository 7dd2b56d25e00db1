"""Documents per CPU second on one core: Kiln's read + extract + language + quality gates vs datatrove's.

    DATATROVE_PYTHON=/path/to/venv/bin/python python -m benchmarks data_vs_datatrove

datatrove's environment (never Kiln's): `python3.11 -m venv DT && DT/bin/pip install 'datatrove[processing]==0.10.1'
orjson spacy aiohttp python-magic faust-cchardet warcio fasteners fasttext-numpy2-wheel lxml_html_clean resiliparse`
(without lxml_html_clean trafilatura does not import, and datatrove's extractor then waits out its timeout on
every page; a run that keeps no document stops the benchmark).

Inputs, the same WARC files for every side: the bundled sample (120 Debian Reference pages in 8 languages)
copied COPIES times, and the long-pages crawl of benchmarks/debian_docs.py (Debian handbook chapters in 26
languages, git's and R's manuals, the GNU standards; skipped when its packages are not installed).

- Kiln: `run_data` with one worker and near-dedup off (it writes its docs folder, stats and manifest):
  FastWARC + resiliparse + fastText (lid.176 lite) + every default gate.
- datatrove 0.10.1, stock: its FineWeb-style pipeline, WarcReader -> Trafilatura(favour_precision=True) ->
  LanguageFilter() (every language, score > 0.65) -> GopherRepetition -> GopherQuality -> C4Quality ->
  FineWebQuality -> JsonlWriter, on a one-task, one-worker LocalPipelineExecutor.
- datatrove, extraction-fair: the same pipeline with Kiln's extractor (resiliparse's
  `extract_plain_text(main_content=True)` inside a datatrove BaseExtractor) and Kiln's language setting
  (every language, score >= 0.5).

Each side runs in two modes:
- "as shipped": each pipeline drops a document at its first failing filter, so a side that drops early does
  less work per document (stock datatrove's Gopher quality filter drops every page of the sample: under 80% of
  the words of a page of commands and paths contain a letter). These rates are printed with the kept counts,
  and are not comparable between sides that keep different documents.
- "every step": every filter and gate runs on every document and none is dropped (datatrove's filters each
  wrapped in a step that computes the verdict, makes the filter's edits and passes the document on; Kiln's
  `apply_gates(drop=False)`; language ID runs with threshold 0 on both), and every extracted document is
  written. Both sides then do the whole work on the same documents: this is the headline ratio.

datatrove's WarcReader is told that XHTML is HTML (it reads none of the sample otherwise), and each side's
extractor timeout is 60 s (the stock 1 s drops pages of a loaded machine). Each run is a process of its own;
its CPU seconds are user + sys of that process and of its waited-for children (datatrove runs its extractor
in a child process), measured inside it around the work, so what other jobs take of a shared machine does
not count. The sides alternate, RUNS rounds (each round starting one side further), and the rates are
medians; the load average is printed. INPUTS=sample or INPUTS=long runs one input.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import _datatrove
from benchmarks.debian_docs import LONG_CORPORA, crawl

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sample.warc.gz"
COPIES = int(os.environ.get("COPIES", "2"))
RUNS = int(os.environ.get("RUNS", "3"))

PEER = r'''
import json, resource, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import WarcReader
from datatrove.pipeline.extractors import Trafilatura
from datatrove.pipeline.extractors.base import BaseExtractor
from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                        GopherRepetitionFilter, LanguageFilter)
from datatrove.pipeline.writers import JsonlWriter

import magic

# datatrove's WarcReader asks libmagic for the type of a record without WARC-Identified-Payload-Type
# and drops XHTML ("<?xml ..."), i.e. every page of the sample: let those through as HTML.
_guess = magic.from_buffer
magic.from_buffer = lambda buf, mime=False: "text/html" if buf.lstrip()[:5] == b"<?xml" else _guess(buf, mime=mime)


class Resiliparse(BaseExtractor):
    """Kiln's extractor inside datatrove: resiliparse's main-content text."""
    name = "resiliparse"

    def __init__(self, timeout: float = 60):
        super().__init__(timeout)

    def extract(self, text: str) -> str:
        from resiliparse.extract.html2text import extract_plain_text
        return extract_plain_text(text, main_content=True)


args = json.loads(sys.argv[1])
count = {"docs": 0}

def counter(data, rank=0, world_size=1):
    for doc in data:
        count["docs"] += 1
        yield doc

fair = args["extractor"] == "resiliparse"
every_step = args["mode"] == "every step"


def every_doc(step):
    """The filter's verdict computed (and its edits made) on every document; none dropped."""
    def run(data, rank=0, world_size=1):
        for doc in data:
            step.filter(doc)
            yield doc
    return run


extractor = Resiliparse() if fair else Trafilatura(favour_precision=True, timeout=60)
threshold = 0.0 if every_step else 0.5 if fair else 0.65
filters = [LanguageFilter(language_threshold=threshold), GopherRepetitionFilter(), GopherQualityFilter(),
           C4QualityFilter(filter_no_terminal_punct=False), FineWebQualityFilter()]
executor = LocalPipelineExecutor(pipeline=[
    WarcReader(args["folder"], glob_pattern="*.warc.gz"), counter, extractor,
    *([every_doc(f) for f in filters] if every_step else filters),
    JsonlWriter(args["tmp"] + "/out")], tasks=1, workers=1, logging_dir=args["tmp"] + "/logs")
def cpu():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
t0, c0 = time.perf_counter(), cpu()
executor.run()
seconds, used = time.perf_counter() - t0, cpu() - c0
import glob, gzip
kept = sum(1 for p in glob.glob(args["tmp"] + "/out/*") for _ in gzip.open(p, "rt"))
print(json.dumps({"docs": count["docs"], "kept": kept, "seconds": seconds, "cpu": used}))
'''

KILN = r'''
import functools, json, resource, shutil, sys, time
from pathlib import Path
from kiln.config import DataConfig
from kiln.data import steps
from kiln.data.pipeline import run_data

def cpu():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

folder, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
shutil.rmtree(out, ignore_errors=True)
cfg = DataConfig(workers=1, dedup={"method": "none"})
if mode == "every step":  # one worker runs the tasks in this process, so the steps module is the one they use
    steps.apply_gates = functools.partial(steps.apply_gates, drop=False)
    cfg = cfg.model_copy(update={"lang_threshold": 0.0})
t0, c0 = time.perf_counter(), cpu()
warcs = [str(p) for p in sorted(folder.glob("*.warc.gz"))]
stats = run_data(warcs, out, cfg)
print(json.dumps({"docs": stats["documents"]["read"], "kept": stats["documents"]["kept"],
                  "seconds": time.perf_counter() - t0, "cpu": cpu() - c0}))
'''


def kiln_once(folder: Path, out: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", KILN, str(folder), str(out), mode], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def inputs(root: Path) -> dict[str, Path]:
    """name -> a folder of WARC files."""
    which = os.environ.get("INPUTS", "sample,long").split(",")
    out = {}
    if "sample" in which:
        sample = root / "sample"
        sample.mkdir()
        for i in range(COPIES):
            shutil.copy(SAMPLE, sample / f"sample-{i}.warc.gz")
        out[f"sample x{COPIES}"] = sample
    if "long" in which and crawl(LONG_CORPORA, root / "long-pages" / "long-pages.warc.gz") is not None:
        out["long pages"] = root / "long-pages"
    return out


def line(name: str, runs: list[dict]) -> float:
    if not all(r["docs"] for r in runs):
        raise RuntimeError(f"{name} read no document in a run: {runs}")
    rate = statistics.median(r["docs"] / r["cpu"] for r in runs)
    print(f"  {name:<34} {runs[0]['docs']:>5} docs, {runs[0]['kept']:>5} kept  median {rate:7.1f} docs per CPU "
          f"second  (runs: {[round(r['docs'] / r['cpu'], 1) for r in runs]}; wall docs/s "
          f"{[round(r['docs'] / r['seconds'], 1) for r in runs]}; load {[r['load'] for r in runs]})", flush=True)
    return rate


def sides(folder: Path, tmp: Path) -> dict:
    """(mode, side) -> a function that runs it once."""
    out = {}
    for mode in ("every step", "as shipped"):
        out[mode, "kiln"] = lambda m=mode: kiln_once(folder, tmp / "docs", m)
        if _datatrove.python():
            for side, extractor in (("datatrove stock", "trafilatura"), ("datatrove fair", "resiliparse")):
                out[mode, side] = lambda m=mode, e=extractor: _datatrove.run(
                    PEER, {"folder": str(folder), "mode": m, "extractor": e})
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in inputs(Path(tmp)).items():
            todo = sides(folder, Path(tmp))
            runs: dict[tuple, list[dict]] = {key: [] for key in todo}
            order = list(todo)
            for k in range(RUNS):  # alternating, each round starting one side further
                for key in order[k % len(order):] + order[:k % len(order)]:
                    runs[key].append(todo[key]() | {"load": round(os.getloadavg()[0], 1)})
            print(f"{name}:")
            rates = {key: line(f"{key[1]}, {key[0]}", rs) for key, rs in runs.items()}
            if len(rates) == 2:
                print("  datatrove skipped: set DATATROVE_PYTHON to a python with datatrove 0.10.1")
                continue
            every = [runs["every step", side][0] for side in ("kiln", "datatrove stock", "datatrove fair")]
            if not all(r["kept"] for r in every):
                raise RuntimeError(f"a side kept no document with every step on: {every}")
            for mode in ("every step", "as shipped"):
                kiln = rates[mode, "kiln"]
                print(f"  {mode}: kiln / datatrove stock = {kiln / rates[mode, 'datatrove stock']:.1f}x, "
                      f"kiln / datatrove extraction-fair = {kiln / rates[mode, 'datatrove fair']:.1f}x per CPU second"
                      + ("" if mode == "every step" else " (each side's own drops: see kept)"))


if __name__ == "__main__":
    main()
