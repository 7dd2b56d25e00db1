"""The whole filter stage against reading and extraction alone, on the same records, one worker.

    python -m benchmarks filter_stage

Three inputs, measured side by side in one run: the bundled sample (120 Debian Reference pages, 8
languages); a crawl built here from Debian's documentation packages (the Python 3.11 docs, the Debian FAQ in
10 languages, the New Maintainers' Guide in 4, the Debian Reference in 8); and a crawl of long pages from
packages no gate was tuned on (the Debian Administrator's Handbook's chapters in 26 languages, git's manual
pages, R's manuals, the GNU coding standards). benchmarks/debian_docs.py builds the crawls; an input whose
packages are not installed is skipped. `REPEATS` rounds, each measuring every input in turn, in one process:

- read + extract: FastWARC records -> resiliparse main-content text (what the stage cannot go faster than);
- filter stage: read -> extract -> language -> every default gate (`pipeline.process_task`);
- task: what a data task does with one worker (`pipeline._run_task_once`): the filter stage, then the kept
  documents' dedup signatures and the zstd JSONL of every outcome; the bytes of the files it leaves in the
  work folder are printed per document (docs/scale.md sizes a crawl's work folder from them).

The ratios are docs/s of the filter stage (or the task) over docs/s of read + extract (medians), both in CPU
seconds of this process (`time.process_time`: one worker, and on a shared machine what other processes take
does not count); the wall-clock ratio is printed too, and "steps": the same ratio from the filter stage's own
per-step CPU seconds (read + extract over the four steps, median of the rounds), which times every step on the
same documents at the same moments: on a loaded machine the separate runs meet different loads. The per-step
seconds come from the stage's own StepTimer, run on this process's CPU clock (the task's on the wall clock,
as the stage runs it).

Language ID accuracy on the labelled pages (the language in the page's URL or folder, `debian_docs.url_lang`):
how many it names correctly with a score >= data.lang_threshold, reading the sample `language.language_sample`
takes (what the stage runs) and the first 2,000 characters (what it read before), and on how many pages the
two readings disagree (language, or which side of the threshold).

Then the learned gates' cost, ms/doc of CPU over every extracted page of the sample: a floret classifier
(`kiln data classifier train`, 60 sample pages as positives against their words shuffled), and the
semantic gate (skipgram vectors trained on the sample as `kiln data` trains them, five keywords).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.debian_docs import CORPORA, LONG_CORPORA, crawl, url_lang

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sample.warc.gz"
REPEATS = int(os.environ.get("REPEATS", "3"))
FIRST_CHARS = 2000  # what language ID read before it sampled: the text's first 2,000 characters


def inputs(folder: Path) -> dict[str, Path | None]:
    return {"sample": SAMPLE, "debian-docs": crawl(CORPORA, folder / "debian-docs.warc.gz"),
            "long-pages": crawl(LONG_CORPORA, folder / "long-pages.warc.gz")}


def _timed(run) -> tuple[float, float, object]:
    t0, w0 = time.process_time(), time.perf_counter()
    out = run()
    return time.process_time() - t0, time.perf_counter() - w0, out


def measure_once(path: Path) -> dict:
    """One round on one input: read + extract, the filter stage, a whole task (CPU and wall seconds)."""
    from kiln.config import DataConfig
    from kiln.data.document import ReadReport
    from kiln.data.extract import extract
    from kiln.data.pipeline import Task, _run_task_once, process_task, read_task
    from kiln.data.steps import StepTimer

    cfg, task, timer = DataConfig(), Task(0, str(path)), StepTimer(time.process_time)
    base = _timed(lambda: sum(1 for _ in extract(read_task(task, cfg, ReadReport()), cfg.max_page_bytes,
                                                 cfg.extractor)))
    full = _timed(lambda: sum(1 for _ in process_task(task, cfg, ReadReport(), timer)))
    with tempfile.TemporaryDirectory() as work:  # the task writes its outcome and signatures here, as on a worker
        whole = _timed(lambda: _run_task_once(task, cfg, Path(work)))
    summary = whole[2]
    files = {suffix: rec["size"] for suffix, rec in summary["files"].items()}
    assert base[2] == full[2] == summary["documents"]
    return {"docs": base[2], "base": base[:2], "full": full[:2], "task": whole[:2], "steps": timer.own(),
            "task_steps": summary["steps_s"], "input_bytes": Path(path).stat().st_size,
            "work_bytes": files}


def summarise(rounds: list[dict]) -> dict:
    med = lambda key, i: statistics.median(r[key][i] for r in rounds)  # noqa: E731
    n, b, f, t = rounds[0]["docs"], med("base", 0), med("full", 0), med("task", 0)
    steps = {k: statistics.median(r["steps"][k] for r in rounds) for k in rounds[0]["steps"]}
    task_steps = {k: statistics.median(r["task_steps"][k] for r in rounds) for k in rounds[0]["task_steps"]}
    return {"docs": n, "read_extract_docs_s": n / b, "filter_docs_s": n / f, "ratio": b / f,
            "wall_ratio": med("base", 1) / med("full", 1), "task_ratio": b / t, "steps_s": steps,
            "gates_ms_per_doc": 1000 * steps["gates"] / n, "language_ms_per_doc": 1000 * steps["language"] / n,
            "signatures_share": task_steps["signatures"] / sum(task_steps.values()),
            # the same ratio from one run's steps (read and extract over all four): every step timed on the same
            # documents at the same moments, so a change of the machine's load between runs does not enter it
            "steps_ratio": statistics.median((r["steps"]["read"] + r["steps"]["extract"]) / sum(r["steps"].values())
                                             for r in rounds),
            "runs": [round(r["base"][0] / r["full"][0], 3) for r in rounds],
            "task_docs_s": n / t, "input_kb_per_doc": rounds[0]["input_bytes"] / n / 1e3,
            "work_kb_per_doc": {k: v / n / 1e3 for k, v in rounds[0]["work_bytes"].items()}}


def measure(path: Path) -> dict:
    return summarise([measure_once(path) for _ in range(REPEATS)])


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
    from kiln.flow import run_data_stage, run_pack_stage, run_tokenizer_stage
    from kiln.train.checkpoint import list_checkpoints
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
        paths = {name: path for name, path in inputs(Path(tmp)).items() if path is not None}
        rounds: dict[str, list[dict]] = {name: [] for name in paths}
        for _ in range(REPEATS):  # every input in each round: a change of the machine's load meets them all
            for name, path in paths.items():
                rounds[name].append(measure_once(path))
        print(f"{'input':<12} {'docs':>5} {'read+extract/s':>15} {'filter/s':>9} {'ratio':>6} {'wall':>5} "
              f"{'steps':>5} {'task':>5} {'lang ms':>7} {'gates ms':>8}  ratio per round; steps (CPU s)")
        for name, r in ((name, summarise(rs)) for name, rs in rounds.items()):
            print(f"{name:<12} {r['docs']:>5} {r['read_extract_docs_s']:>15.1f} {r['filter_docs_s']:>9.1f} "
                  f"{r['ratio']:>6.2f} {r['wall_ratio']:>5.2f} {r['steps_ratio']:>5.2f} {r['task_ratio']:>5.2f} "
                  f"{r['language_ms_per_doc']:>7.2f} {r['gates_ms_per_doc']:>8.2f}  {r['runs']}; "
                  + " ".join(f"{k}={v:.2f}" for k, v in r["steps_s"].items())
                  + f"; signatures {100 * r['signatures_share']:.0f}% of the task")
        print("\na task's files in the work folder, KB per document (its WARC.gz input, KB per document; task docs/s "
              "per CPU second):")
        for name, rs in rounds.items():
            r = summarise(rs)
            print(f"{name:<12} input {r['input_kb_per_doc']:.1f}; task {r['task_docs_s']:.1f} docs/s; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["work_kb_per_doc"].items())
                  + f"; all {sum(r['work_kb_per_doc'].values()):.2f}")
        missing = [name for name in ("debian-docs", "long-pages") if name not in paths]
        if missing:
            print(f"skipped {', '.join(missing)}: install the packages in benchmarks/debian_docs.py")
        print(f"\nlanguage ID, labelled pages named right (score >= threshold): the sample it reads / the first "
              f"{FIRST_CHARS:,} characters (pages where the two disagree; pages kept, any language)")
        for name, path in paths.items():
            a = language_accuracy(path)
            print(f"{name:<12} {a['labelled']:>5} pages: {a['sampled']} / {a['first']} ({a['differ']} differ; "
                  f"kept {a['sampled_kept']} / {a['first_kept']})")
        costs = learned_gate_costs(SAMPLE, Path(tmp))
        print("learned gates: " + ("floret not installed" if costs is None else
                                   ", ".join(f"{k} {v:.2f} ms/doc" for k, v in costs.items()) + " (CPU, the sample)"))
        ppl = perplexity_cost(SAMPLE, Path(tmp))
        if ppl is not None:
            print(f"perplexity gate: {ppl['perplexity']:.2f} ms/doc (CPU, the sample, a dim-64 2-layer Kiln model)")
