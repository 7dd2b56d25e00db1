"""The whole filter stage against reading and extraction alone, on the same records, one worker.

    python -m benchmarks filter_stage

Two inputs: the bundled sample (120 Debian Reference pages, 8 languages) and a larger real crawl built
here from Debian's documentation packages (the Python 3.11 docs, the Debian FAQ in 10 languages, the New
Maintainers' Guide in 4, the Debian Reference in 8: benchmarks/debian_docs.py; skipped when the packages
are not installed). For each, in one process and alternating, `REPEATS` times:

- read + extract: FastWARC records -> resiliparse main-content text (what the stage cannot go faster than);
- filter stage: read -> extract -> language -> every default gate (`pipeline.process_task`).

Then the learned gates' cost, ms/doc of CPU over every extracted page of the sample: a floret classifier
(`kiln data classifier train`, 60 sample pages as positives against their words shuffled), and the
semantic gate (skipgram vectors trained on the sample as `kiln data` trains them, five keywords).

The ratio is docs/s of the filter stage over docs/s of read + extract (medians), both in CPU seconds
of this process (`time.process_time`: one worker, and on a shared machine what other processes take
does not count); wall-clock docs/s are printed too. The per-step seconds come from the stage's own
StepTimer (wall clock), and the gates' cost per document is their seconds / documents.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.debian_docs import CORPORA, find_pages, page_url, write_warc

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "sample.warc.gz"
REPEATS = 3


def docs_crawl(folder: Path) -> Path | None:
    pages = [(page_url(p, c), p.read_bytes()) for c in CORPORA for p in find_pages(c)]
    if len(pages) < 200:
        return None
    return write_warc(folder / "debian-docs.warc.gz", pages)


def measure(path: Path) -> dict:
    from kiln.config import DataConfig
    from kiln.data.document import ReadReport
    from kiln.data.extract import extract
    from kiln.data.pipeline import Task, process_task, read_task
    from kiln.data.steps import StepTimer

    cfg, task = DataConfig(), Task(0, str(path))
    base, full, base_wall, full_wall, steps = [], [], [], [], []
    n = 0
    for _ in range(REPEATS):
        t0, w0 = time.process_time(), time.perf_counter()
        n = sum(1 for _ in extract(read_task(task, cfg, ReadReport()), cfg.max_page_bytes, cfg.extractor))
        base.append(time.process_time() - t0)
        base_wall.append(time.perf_counter() - w0)
        timer = StepTimer()
        t0, w0 = time.process_time(), time.perf_counter()
        assert sum(1 for _ in process_task(task, cfg, ReadReport(), timer)) == n
        full.append(time.process_time() - t0)
        full_wall.append(time.perf_counter() - w0)
        steps.append(timer.own())
    b, f = statistics.median(base), statistics.median(full)
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    share = med["gates"] / sum(med.values())  # the gates' share of the stage's wall time, applied to its CPU time
    return {"docs": n, "read_extract_docs_s": n / b, "filter_docs_s": n / f, "ratio": b / f, "steps_s": med,
            "wall_ratio": statistics.median(base_wall) / statistics.median(full_wall),
            "gates_ms_per_doc": 1000 * f * share / n}


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
        inputs = {"sample": SAMPLE, "debian-docs": docs_crawl(Path(tmp))}
        print(f"{'input':<12} {'docs':>5} {'read+extract/s':>15} {'filter/s':>9} {'ratio':>6} {'wall':>5} "
              f"{'gates ms/doc':>12}  steps (wall s)")
        for name, path in inputs.items():
            if path is None:
                print(f"{name:<12} skipped: install the packages in benchmarks/debian_docs.py")
                continue
            r = measure(path)
            print(f"{name:<12} {r['docs']:>5} {r['read_extract_docs_s']:>15.1f} {r['filter_docs_s']:>9.1f} "
                  f"{r['ratio']:>6.2f} {r['wall_ratio']:>5.2f} {r['gates_ms_per_doc']:>12.2f}  "
                  + " ".join(f"{k}={v:.2f}" for k, v in r["steps_s"].items()))
        costs = learned_gate_costs(SAMPLE, Path(tmp))
        print("learned gates: " + ("floret not installed" if costs is None else
                                   ", ".join(f"{k} {v:.2f} ms/doc" for k, v in costs.items()) + " (CPU, the sample)"))
        ppl = perplexity_cost(SAMPLE, Path(tmp))
        if ppl is not None:
            print(f"perplexity gate: {ppl['perplexity']:.2f} ms/doc (CPU, the sample, a dim-64 2-layer Kiln model)")
