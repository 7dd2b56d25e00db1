"""The stages of a run, in one list: what each reads and commits (folders of a `RunLayout`), its set-up, and the
fingerprint that skips it when its committed output was made from the same inputs and settings.

    data       data.inputs           -> docs/       read, extract, gate, dedup (kiln.data.pipeline)
    tokenizer  docs/ (or tokenizer.path) -> tokenizer/  byte-level BPE on a sample, or the user's own committed
    pack       docs/, tokenizer/     -> shards/     encode, split, pack; a down-weighted source's share applied
    train      shards/, tokenizer/   -> run/        the trainer, resuming from the newest valid checkpoint

`kiln run` runs them in order (kiln.flow.run_all); `kiln data`, `kiln tokenizer train` and `kiln pack` run one
stage on the folders they are given (`make_docs`, `make_tokenizer`, `make_shards`); `kiln ablate` runs them per arm
and seed. A stage's set-up (the few-documents check, the `tokenizer.path` branch, down-weighting) lives here only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.config import Config, DataConfig
from kiln.data.docs import DocsReader, content_fingerprint, read_docs
from kiln.data.pipeline import expand_inputs, fingerprint as data_fingerprint, run_data
from kiln.data.rejections import docs_stats, few_documents_message
from kiln.data.tables import down_weighted
from kiln.errors import KilnError
from kiln.manifest import MANIFEST, is_complete, read_manifest, sha256_file
from kiln.run_layout import DOCS, SHARDS, STAGE_FOLDERS, TOKENIZER
from kiln.shards.pack import pack
from kiln.terminal import stage_progress, stderr_is_terminal
from kiln.tokenizer import tokenizer_sha256, train_tokenizer, use_tokenizer

Log = Callable[[str], None]


class StageLog:
    """The `log` a stage is given: prints its lines, and notes when the stage found its output up to date (the
    summary then says "skipped", not the seconds it took to check)."""

    def __init__(self, log: Log) -> None:
        self.log, self.skipped = log, False

    def __call__(self, message: str) -> None:
        self.log(message)

    def skip(self, message: str) -> None:
        self.skipped = True
        self.log(message)


def _skip(log: Log, message: str) -> None:
    getattr(log, "skip", log)(message)  # a plain callable (tests, benchmarks) just prints


def _hash(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _docs_fingerprint(docs: Path, out: Path, *parts: str) -> tuple[str, bool]:
    """A later stage's fingerprint over the docs folder's content (`docs.content_fingerprint`: never its
    timings or pids), and whether `out` is complete and made from it; an `out` an older Kiln fingerprinted
    over the docs manifest's bytes counts while that manifest is unchanged."""
    manifest, _ = DocsReader(docs).parts()  # a folder `kiln data` did not commit is said in one line, first
    before = _hash(sha256_file(docs / MANIFEST), *parts)
    # A docs folder without stats.json (written by a tool of its own, or a PartWriter) is its manifest's bytes.
    fp = _hash(content_fingerprint(docs), *parts) if "stats.json" in manifest["files"] else before
    try:
        recorded = json.loads((out / MANIFEST).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return fp, False
    return fp, recorded in (fp, before) and is_complete(out, recorded)


def check_enough_documents(docs: Path, who: str = "") -> None:
    """Enough documents survived the data stage to train a tokenizer and hold out validation data."""
    if (Path(docs) / "stats.json").is_file() and (few := few_documents_message(docs_stats(docs), docs)):
        raise KilnError(f"{who}{few}")


# --- each stage on the folders it is given ------------------------------------------------------------------------

def make_docs(inputs: list[str], docs: Path, data: DataConfig, log: Log, workers: int | None = None,
              progress: bool | None = None) -> dict[str, Any]:
    """The docs folder `docs` from `inputs`, skipped when it is complete and was made from the same inputs and
    data settings; returns its stats.json. `progress`: None draws the bar when stderr is a terminal."""
    if not inputs:
        raise KilnError("data.inputs is empty; list WARC files or globs in the config (e.g. "
                        "examples/data/sample.warc.gz)")
    files = expand_inputs(inputs, data.storage_options)
    if is_complete(docs, data_fingerprint(files, data)):
        _skip(log, f"data: skipping, {docs} is complete and up to date")
    else:
        log(f"data: reading {len(files):,} input file{'' if len(files) == 1 else 's'} -> {docs}")
        run_data(inputs, docs, data, workers=workers, progress=stderr_is_terminal() if progress is None else progress)
    return json.loads((docs / "stats.json").read_text())


def make_tokenizer(cfg: Config, docs: Path, out: Path, log: Log) -> dict[str, Any]:
    """The tokenizer folder `out`: the user's own `tokenizer.path` committed as it is (no documents needed: an
    ablation's run has no docs/), else a byte-level BPE trained on a sample of `docs`; returns its manifest."""
    check_enough_documents(docs)
    if cfg.tokenizer.path:
        fp = _hash(tokenizer_sha256(cfg.tokenizer.path), cfg.section_hash("tokenizer"))
        if is_complete(out, fp):
            _skip(log, f"tokenizer: skipping, {out} is complete and up to date")
        else:
            log(f"tokenizer: using {cfg.tokenizer.path} -> {out}")
            use_tokenizer(out, cfg.tokenizer, fingerprint=fp)
        return read_manifest(out)
    fp, current = _docs_fingerprint(docs, out, cfg.section_hash("tokenizer"))
    if current:
        _skip(log, f"tokenizer: skipping, {out} is complete and up to date")
    else:
        log(f"tokenizer: training byte-level BPE (vocab {cfg.tokenizer.vocab_size}) -> {out}")
        with stage_progress(f"tokenizer: sampling up to {cfg.tokenizer.max_docs:,} documents and training"):
            train_tokenizer(read_docs(docs), out, cfg.tokenizer, cfg.seed, fingerprint=fp)
    return read_manifest(out)


def make_shards(cfg: Config, docs: Path, tokenizer: Path, out: Path, log: Log) -> dict[str, Any]:
    """The shards folder `out`: `docs` encoded with `tokenizer` and packed (pack.*), each source the data stage
    down-weighted kept at its weight; returns its manifest."""
    fp, current = _docs_fingerprint(docs, out, tokenizer_sha256(tokenizer), cfg.section_hash("pack"))
    if current:
        _skip(log, f"pack: skipping, {out} is complete and up to date")
    else:
        log(f"pack: encoding and packing into sequences of {cfg.pack.seq_len} -> {out}")
        pack(read_docs(docs), tokenizer, out, cfg.pack, fingerprint=fp, source_weights=down_weighted(docs))
    return read_manifest(out)


def train_run(cfg: Config, log: Log) -> dict[str, Any]:
    """`kiln train`'s loop on the config's shards; a run whose newest valid checkpoint reached train.max_steps is
    said to be skipped (the trainer returns at once)."""
    from kiln.checkpoint import latest_valid, step_of
    from kiln.train.trainer import Trainer

    latest = latest_valid(cfg.layout.checkpoints, log=log)
    if latest is not None and step_of(latest) >= cfg.train.max_steps:
        _skip(log, f"train: skipping, {latest} already reached train.max_steps={cfg.train.max_steps}")
    else:
        log(f"train: {cfg.train.max_steps} steps -> {cfg.layout.run}")
    return Trainer(cfg, log=log).run()


# --- the list: each stage on a config's RunLayout -----------------------------------------------------------------

def run_data_stage(cfg: Config, log: Log) -> dict[str, Any]:
    return make_docs(cfg.data.inputs, cfg.layout.docs, cfg.data, log)


def run_tokenizer_stage(cfg: Config, log: Log) -> dict[str, Any]:
    return make_tokenizer(cfg, cfg.layout.docs, cfg.layout.tokenizer, log)


def run_pack_stage(cfg: Config, log: Log) -> dict[str, Any]:
    return make_shards(cfg, cfg.layout.docs, cfg.layout.tokenizer, cfg.layout.shards, log)


def run_train_stage(cfg: Config, log: Log) -> dict[str, Any]:
    return train_run(cfg, log)


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...]  # the RunLayout folders it reads (data reads data.inputs)
    writes: str  # the RunLayout folder it commits
    run: Callable[[Config, Log], dict[str, Any]]

    def __call__(self, cfg: Config, log: Log) -> dict[str, Any]:
        return self.run(cfg, log)


_READS = {"data": (), "tokenizer": (DOCS,), "pack": (DOCS, TOKENIZER), "train": (SHARDS, TOKENIZER)}
_RUNS = {"data": run_data_stage, "tokenizer": run_tokenizer_stage, "pack": run_pack_stage, "train": run_train_stage}
STAGES: dict[str, Stage] = {name: Stage(name, _READS[name], folder, _RUNS[name])
                            for name, folder in STAGE_FOLDERS.items()}  # in order
