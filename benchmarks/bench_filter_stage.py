"""The whole `kiln data` stage against reading and extraction alone, on the same pages, per CPU second, one worker.

    python -m benchmarks filter_stage          (RUNS=3 rounds, COPIES=10 copies of the sample, EXTRAS=1)

Issue 44's measure, taken from outside: each side runs as a process of its own, and its CPU seconds are user +
sys of that process and of every process under it (`getrusage(RUSAGE_CHILDREN)` around it), Python's start and
imports included on both sides:
- read + extract: FastWARC's ArchiveIterator over the files, each response's payload decoded (the HTTP charset,
  else resiliparse's detection) and its main-content text extracted by resiliparse with Kiln's settings
  (`extract.NAVIGATION` skipped, no alt texts); no Kiln import. What the stage cannot go faster than.
- kiln data: `kiln data FILES --out DIR --workers 1` with the default settings: read, extract, language, every
  default gate, the dedup signatures, the dedup stages, the distribution profiles, the merge and the commit.
A worker remembers the verdicts and signatures of the texts it saw (data.remember_texts): the sample's copies are
texts seen before, so FORGET=1 (the default) also runs the stage with data.remember_texts=0 in each round, every
page through language ID, the gates and signing, and prints that ratio too.
The ratio is docs per CPU second of kiln data over docs per CPU second of read + extract (CPU of read + extract
over CPU of kiln data), the median of RUNS rounds; in each round the two sides run back to back, the first one
alternating, so both meet the same load (the load average is printed). Target: >= 0.5.

Inputs: the bundled sample (120 Debian Reference pages in 8 languages) copied COPIES times (COPIES files; the
copies are exact duplicates, which dedup removes); the Debian documentation crawl and the long pages no gate was
tuned on (held out), both built here by benchmarks/debian_docs.py from installed Debian packages (an input whose
packages are missing is skipped: `apt-get install` the packages that module names); DEBIAN_COPIES=10 adds the Debian
crawl copied 10 times (issue 44 measured a held-out documentation crawl so).

Shares: one more run of the same stage per input, in a process that times each step on its own CPU clock
(`StepTimer(time.process_time)`; the Signer's calls): startup (interpreter and imports), read, extract,
language, gates, signatures (dedup signatures of the kept documents), outcome (the task's JSON lines, zstd and
atomic writes, what the loop does besides), dedup (the dedup stages), profiles (the distribution profiles), merge
(docs parts, stats, tables, manifest, commit); each as a share of that run's CPU, and "after extract": the CPU
of everything but read and extract over that of read + extract (under 1 is the target's other face).

EXTRAS=1 (the default) then measures, in this process: the bytes a data task leaves in the work folder per
document (`pipeline._run_task_once` into a temporary folder; docs/scale.md sizes a crawl's work folder from
them); language ID accuracy on the labelled pages (the language in the page's URL or folder,
`debian_docs.url_lang`): how many it names correctly with a score >= data.lang_threshold reading the sample
`language.language_sample` takes (what the stage runs) and the first 2,000 characters, and on how many the two
disagree; the learned gates' CPU ms per document on the sample: a floret classifier (60 sample pages against
their words shuffled), the semantic gate (skipgram vectors trained on the sample, five keywords) and the
perplexity gate (a dim-64, 2-layer Kiln model trained 20 steps on the sample).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.debian_docs import CORPORA, LONG_CORPORA, crawl, url_lang

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sample.warc.gz"
RUNS = int(os.environ.get("RUNS", os.environ.get("REPEATS", "3")))
REPEATS = RUNS  # the learned gates' rounds
COPIES = int(os.environ.get("COPIES", "10"))
EXTRAS = os.environ.get("EXTRAS", "1") != "0"
DEBIAN_COPIES = int(os.environ.get("DEBIAN_COPIES", "0"))  # also the Debian crawl copied this many times
FORGET = os.environ.get("FORGET", "1") != "0"  # also the ratio with data.remember_texts=0 (no text remembered)
FIRST_CHARS = 2000  # what language ID read before it sampled: the text's first 2,000 characters

READ_EXTRACT = r"""
import json, re, sys
from fastwarc.warc import ArchiveIterator, WarcRecordType
from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.encoding import bytes_to_str, detect_encoding
from resiliparse.parse.html import HTMLTree

skip = json.loads(sys.argv[1])
charset = re.compile(r"charset=[\"']?([\w.:-]+)", re.I)
docs = chars = 0
for path in sys.argv[2:]:
    with open(path, "rb") as f:
        for rec in ArchiveIterator(f, record_types=WarcRecordType.response, parse_http=True):
            body = rec.reader.read()
            m = charset.search(rec.http_headers.get("Content-Type") or "")
            html = bytes_to_str(body, m.group(1) if m else detect_encoding(body, from_html_meta=True), errors="replace")
            text = extract_plain_text(HTMLTree.parse(html), main_content=True, alt_texts=False, skip_elements=skip)
            docs, chars = docs + 1, chars + len(text)
print(json.dumps({"docs": docs, "chars": chars}))
"""

SHARES = r"""
import time
started = time.process_time()
import functools, json, resource, sys
from pathlib import Path
from kiln.config import DataConfig
from kiln.data import pipeline
from kiln.data.dedup.signatures import Signer
from kiln.data.steps import StepTimer


def cpu():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


signing = [0.0]


def timed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            signing[0] += time.process_time() - t0
    return run


timers = []


def cpu_timer():
    timers.append(StepTimer(time.process_time))  # the task's steps on the CPU clock
    return timers[-1]


Signer.add, Signer.write = timed(Signer.add), timed(Signer.write)
pipeline.StepTimer = cpu_timer
startup = cpu()
stats = pipeline.run_data(sys.argv[2:], Path(sys.argv[1]), DataConfig(workers=1))
total = cpu()
if not timers or not signing[0]:  # the stage's code moved: these seconds would be wall time, or missing
    sys.exit("filter_stage: the data task no longer makes kiln.data.pipeline's StepTimer or calls Signer; "
             "point SHARES at where the task runs its steps")
steps, phases = stats["timings_s"]["steps"], stats["timings_s"]["cpu"]
parts = {"startup": startup, **{k: steps[k] for k in ("read", "extract", "language", "gates")},
         "signatures": signing[0]}
parts["outcome"] = phases["process"] - sum(v for k, v in parts.items() if k != "startup")
parts |= {"dedup": phases["dedup_stages"], "profiles": phases["profiles"],
          "merge": phases["merge"] + total - startup - sum(phases.values())}
print(json.dumps({"docs": stats["documents"]["read"], "kept": stats["documents"]["kept"], "cpu": total,
                  "parts": parts}))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _measured(cmd: list[str]) -> tuple[float, float, str]:
    """(CPU seconds of `cmd` and every process under it, wall seconds, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}): {done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall, done.stdout


def read_extract(files: list[str]) -> dict:
    from kiln.data.extract import NAVIGATION

    cpu, wall, out = _measured([sys.executable, "-c", READ_EXTRACT, json.dumps(NAVIGATION), *files])
    return {"cpu": cpu, "wall": wall, "docs": json.loads(out.strip().splitlines()[-1])["docs"]}


def kiln_data(files: list[str], out: Path, *overrides: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cpu, wall, stdout = _measured([sys.executable, "-m", "kiln", "data", *files, "--out", str(out), "--workers", "1",
                                   *(["--", *overrides] if overrides else [])])
    stats = json.loads(stdout)
    shutil.rmtree(out, ignore_errors=True)
    return {"cpu": cpu, "wall": wall, "docs": stats["documents"]["read"], "kept": stats["documents"]["kept"]}


def shares(files: list[str], out: Path) -> dict:
    """One run of the stage with each step timed on its CPU clock (the module docstring's "Shares")."""
    shutil.rmtree(out, ignore_errors=True)
    _, _, stdout = _measured([sys.executable, "-c", SHARES, str(out), *files])
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(stdout.strip().splitlines()[-1])


def inputs(folder: Path) -> dict[str, list[str]]:
    """name -> its WARC files."""
    sample = folder / "sample"
    sample.mkdir(parents=True, exist_ok=True)
    for i in range(COPIES):
        shutil.copy(SAMPLE, sample / f"sample-{i}.warc.gz")
    out = {f"sample x{COPIES}": [str(p) for p in sorted(sample.glob("*.warc.gz"))]}
    for name, corpora in (("debian-docs", CORPORA), ("long-pages", LONG_CORPORA)):
        path = crawl(corpora, folder / f"{name}.warc.gz")
        if path is not None:
            out[name] = [str(path)]
    if DEBIAN_COPIES and "debian-docs" in out:  # the crawl copied, as issue 44 measured a held-out one
        copies = folder / "debian-copies"
        copies.mkdir(exist_ok=True)
        for i in range(DEBIAN_COPIES):
            shutil.copy(out["debian-docs"][0], copies / f"debian-docs-{i}.warc.gz")
        out[f"debian x{DEBIAN_COPIES}"] = [str(p) for p in sorted(copies.glob("*.warc.gz"))]
    return out


def compare(files: list[str], out: Path) -> dict:
    """RUNS rounds of both sides (the first side alternating) and one shares run: the ratio and each step's share."""
    rounds = []
    for k in range(RUNS):
        load = os.getloadavg()[0]
        if k % 2:
            data = kiln_data(files, out)
            base = read_extract(files)
        else:
            base = read_extract(files)
            data = kiln_data(files, out)
        if base["docs"] != data["docs"]:
            raise RuntimeError(f"read + extract saw {base['docs']} documents, kiln data {data['docs']}")
        rounds.append({"base": base, "data": data, "ratio": base["cpu"] / data["cpu"], "load": round(load, 1)})
        if FORGET:  # the same stage remembering no text: every page through language ID, the gates and signing
            rounds[-1]["forget"] = base["cpu"] / kiln_data(files, out, "data.remember_texts=0")["cpu"]
    parts = shares(files, out)
    base_cpu = statistics.median(r["base"]["cpu"] for r in rounds)
    after = sum(v for k, v in parts["parts"].items() if k not in ("read", "extract"))
    return {"docs": rounds[0]["data"]["docs"], "kept": rounds[0]["data"]["kept"], "base_cpu": base_cpu,
            "data_cpu": statistics.median(r["data"]["cpu"] for r in rounds),
            "ratio": statistics.median(r["ratio"] for r in rounds), "runs": [round(r["ratio"], 3) for r in rounds],
            "forget": statistics.median(r["forget"] for r in rounds) if FORGET else None,
            "wall_ratio": statistics.median(r["base"]["wall"] / r["data"]["wall"] for r in rounds),
            "loads": [r["load"] for r in rounds], "parts": parts["parts"], "parts_cpu": parts["cpu"],
            "after_extract": after / (parts["parts"]["read"] + parts["parts"]["extract"])}


def work_bytes(path: Path) -> dict:
    """A data task on one file into a temporary work folder: the bytes of each file it leaves there, per
    document, and the input's."""
    from kiln.config import DataConfig
    from kiln.data.pipeline import Task, _run_task_once

    with tempfile.TemporaryDirectory() as work:
        summary = _run_task_once(Task(0, str(path)), DataConfig(), Path(work))
    n = summary["documents"]
    return {"input_kb_per_doc": path.stat().st_size / n / 1e3,
            "work_kb_per_doc": {suffix: rec["size"] / n / 1e3 for suffix, rec in summary["files"].items()}}


def language_accuracy(path: Path) -> dict[str, int]:
    """Labelled pages, how many language ID names right (score >= the threshold) reading the sample and
    reading the first FIRST_CHARS characters, on how many the two disagree, and how many each keeps (score >=
    the threshold, whatever the language)."""
    from kiln.config import DataConfig
    from kiln.data.document import ReadReport
    from kiln.data.extract import extract
    from kiln.data.language import detect_language
    from kiln.data.pipeline import Task, read_task

    cfg = DataConfig()
    out = {"labelled": 0, "sampled": 0, "first": 0, "differ": 0, "sampled_kept": 0, "first_kept": 0}
    for doc in extract(read_task(Task(0, str(path)), cfg, ReadReport()), cfg.max_page_bytes, cfg.extractor):
        label = url_lang(doc.url or "")
        if doc.rejection is not None or label is None:
            continue
        sampled = detect_language(doc.text, cfg.lang_max_chars)
        first = detect_language(" ".join(doc.text[:2 * FIRST_CHARS].split())[:FIRST_CHARS], FIRST_CHARS)
        decided = [(lang, score >= cfg.lang_threshold) for lang, score in (sampled, first)]
        out["labelled"] += 1
        out["sampled"] += decided[0] == (label, True)
        out["first"] += decided[1] == (label, True)
        out["differ"] += decided[0] != decided[1]
        out["sampled_kept"] += decided[0][1]
        out["first_kept"] += decided[1][1]
    return out


def learned_gate_costs(path: Path, folder: Path) -> dict[str, float] | None:
    """CPU ms per document of the classifier and semantic gates on the input's pages (None without floret)."""
    import json
    import random

    from kiln.data.document import ReadReport
    from kiln.data.extract import extract
    from kiln.data.pipeline import Task, read_task
    from kiln.errors import KilnError

    try:
        from kiln.config import ClassifierConfig, DataConfig
        from kiln.data.gates.classifier import classifier_gate, train
    except ImportError:  # a Kiln without the learned gates
        return None
    cfg = DataConfig()
    texts = [d.text for d in extract(read_task(Task(0, str(path)), cfg, ReadReport()), cfg.max_page_bytes)
             if d.rejection is None]
    rng = random.Random(0)
    pos, neg = folder / "pos.jsonl", folder / "neg.jsonl"
    pos.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:60]))
    neg.write_text("".join(json.dumps({"text": " ".join(rng.sample(t.split(), len(t.split())))}) + "\n"
                           for t in texts[:60]))
    try:
        train([str(pos)], [str(neg)], folder / "quality.bin")
    except KilnError:  # floret missing: ConfigError
        return None
    from kiln.config import SemanticConfig
    from kiln.data.gates.semantic import prepare, semantic_gate

    sem = prepare(DataConfig(quality={"semantic": {"keywords": ["debian", "package", "apt", "kernel", "system"]}}),
                  [str(path)], folder).quality.semantic
    out = {}
    for name, gate in (
        ("classifier", classifier_gate(ClassifierConfig(model=str(folder / "quality.bin"), threshold=0.5))),
        ("semantic", semantic_gate(SemanticConfig(**sem.model_dump()))),
    ):
        t0 = time.process_time()
        for _ in range(REPEATS):
            for t in texts:
                gate(t)
        out[name] = 1000 * (time.process_time() - t0) / (REPEATS * len(texts))
    return out


def perplexity_cost(path: Path, folder: Path) -> dict[str, float] | None:
    """CPU ms per document of the perplexity gate on the input's pages, with a tiny Kiln model (dim 64, 2 layers,
    64-token context, vocabulary 1,024) trained 20 steps on the input itself (None in a Kiln without the gate)."""
    from kiln.config import build_config
    from kiln.data.document import Document, ReadReport
    from kiln.data.extract import extract
    from kiln.data.pipeline import Task, read_task

    try:
        from kiln.data.gates.perplexity import score_perplexity, scorer
    except ImportError:
        return None
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage
    from kiln.checkpoint import list_checkpoints
    from kiln.train.trainer import Trainer

    quiet = lambda *_: None  # noqa: E731
    cfg = build_config({"seed": 7, "out_dir": str(folder / "ref"), "data": {"inputs": [str(path)], "workers": 1},
                        "tokenizer": {"vocab_size": 1024}, "pack": {"seq_len": 64, "val_fraction": 0.1},
                        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
                        "train": {"max_steps": 20, "batch_size": 8, "warmup_steps": 2, "eval_every": 0, "threads": 1},
                        "checkpoint": {"every": 20}})
    run_data_stage(cfg, quiet)
    run_tokenizer_stage(cfg, quiet)
    run_pack_stage(cfg, quiet)
    Trainer(cfg, log=quiet).run()
    checkpoint = list_checkpoints(cfg.out / "run" / "checkpoints")[-1]
    ppl = cfg.data.quality.perplexity.model_copy(update={"checkpoint": str(checkpoint)})
    texts = [d.text for d in extract(read_task(Task(0, str(path)), cfg.data, ReadReport()), cfg.data.max_page_bytes)
             if d.rejection is None]
    scorer(ppl.checkpoint)  # loaded once per worker: not a per-document cost
    t0 = time.process_time()
    for _ in range(REPEATS):
        docs = [Document(str(i), str(path), 0, 0, text=t) for i, t in enumerate(texts)]
        assert sum(1 for _ in score_perplexity(iter(docs), ppl)) == len(texts)
    return {"perplexity": 1000 * (time.process_time() - t0) / (REPEATS * len(texts))}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-filter-") as tmp:
        found = inputs(Path(tmp))
        print(f"{'input':<12} {'docs':>5} {'kept':>5} {'read+extract CPU s':>18} {'kiln data CPU s':>15} "
              f"{'ratio':>6} {'wall':>5}  ratio per round (load); each step's CPU s (share), shares run (its CPU s)")
        results = {}
        for name, files in found.items():
            r = results[name] = compare(files, Path(tmp) / "docs")
            total = sum(r["parts"].values())
            print(f"{name:<12} {r['docs']:>5} {r['kept']:>5} {r['base_cpu']:>18.2f} {r['data_cpu']:>15.2f} "
                  f"{r['ratio']:>6.2f} {r['wall_ratio']:>5.2f}  {r['runs']} ({r['loads']}); "
                  + " ".join(f"{k} {v:.2f} ({100 * v / total:.0f}%)" for k, v in r["parts"].items())
                  + f" ({r['parts_cpu']:.2f}); after extract {r['after_extract']:.2f}x read+extract"
                  + (f"; remembering no text: ratio {r['forget']:.2f}" if FORGET else ""), flush=True)
        missing = [name for name in ("debian-docs", "long-pages") if name not in found]
        if missing:
            print(f"skipped {', '.join(missing)}: install the packages in benchmarks/debian_docs.py")
        if not EXTRAS:
            return
        single = {"sample": SAMPLE, **{name: Path(files[0]) for name, files in found.items()
                                       if name in ("debian-docs", "long-pages")}}
        print("\na task's files in the work folder, KB per document (its WARC.gz input, KB per document):")
        for name, path in single.items():
            w = work_bytes(path)
            print(f"{name:<12} input {w['input_kb_per_doc']:.1f}; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in w["work_kb_per_doc"].items())
                  + f"; all {sum(w['work_kb_per_doc'].values()):.2f}")
        print(f"\nlanguage ID, labelled pages named right (score >= threshold): the sample it reads / the first "
              f"{FIRST_CHARS:,} characters (pages where the two disagree; pages kept, any language)")
        for name, path in single.items():
            a = language_accuracy(path)
            print(f"{name:<12} {a['labelled']:>5} pages: {a['sampled']} / {a['first']} ({a['differ']} differ; "
                  f"kept {a['sampled_kept']} / {a['first_kept']})")
        costs = learned_gate_costs(SAMPLE, Path(tmp))
        print("learned gates: " + ("floret not installed" if costs is None else
                                   ", ".join(f"{k} {v:.2f} ms/doc" for k, v in costs.items()) + " (CPU, the sample)"))
        ppl = perplexity_cost(SAMPLE, Path(tmp))
        if ppl is not None:
            print(f"perplexity gate: {ppl['perplexity']:.2f} ms/doc (CPU, the sample, a dim-64 2-layer Kiln model)")
