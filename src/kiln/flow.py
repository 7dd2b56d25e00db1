"""`kiln run`: every stage in order; a stage whose committed output matches its inputs is skipped."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

from kiln.config import Config, DataConfig
from kiln.data.docs import content_fingerprint, read_docs
from kiln.data.pipeline import expand_inputs, fingerprint as data_fingerprint, run_data
from kiln.data.rejections import few_documents_message
from kiln.data.tables import down_weighted
from kiln.errors import ConfigError, KilnError
from kiln.terminal import stage_progress, stderr_is_terminal
from kiln.manifest import MANIFEST, is_complete, read_manifest, sha256_file
from kiln.shards.pack import pack
from kiln.tokenizer import tokenizer_sha256, train_tokenizer, use_tokenizer


def _hash(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class StageLog:
    """The `log` run_all gives a stage: prints its lines, and notes when the stage found its output up to date
    (the summary then says "skipped", not the seconds it took to check)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.skipped = log, False

    def __call__(self, message: str) -> None:
        self.log(message)

    def skip(self, message: str) -> None:
        self.skipped = True
        self.log(message)


def _skip(log: Callable[[str], None], message: str) -> None:
    getattr(log, "skip", log)(message)  # a plain callable (tests, benchmarks) just prints


def make_docs(inputs: list[str], docs: Path, data: DataConfig, log: Callable[[str], None],
              workers: int | None = None, progress: bool | None = None) -> dict[str, Any]:
    """The docs folder `docs` from `inputs` (`kiln run`'s data stage and `kiln data`), skipped when it is complete
    and was made from the same inputs and data settings; returns its stats.json. `progress`: None draws the
    bar when stderr is a terminal."""
    files = expand_inputs(inputs, data.storage_options)
    if is_complete(docs, data_fingerprint(files, data)):
        _skip(log, f"data: skipping, {docs} is complete and up to date")
    else:
        log(f"data: reading {len(files):,} input file{'' if len(files) == 1 else 's'} -> {docs}")
        run_data(inputs, docs, data, workers=workers, progress=stderr_is_terminal() if progress is None else progress)
    return json.loads((docs / "stats.json").read_text())


def run_data_stage(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    if not cfg.data.inputs:
        raise KilnError(
            "data.inputs is empty; list WARC files or globs in the config (e.g. examples/data/sample.warc.gz)"
        )
    return make_docs(cfg.data.inputs, cfg.layout.docs, cfg.data, log)


def _docs_fingerprint(docs: Path, out: Path, *parts: str) -> tuple[str, bool]:
    """A later stage's fingerprint over the docs folder's content (`docs.content_fingerprint`: never its
    timings or pids), and whether `out` is complete and made from it; an `out` an older Kiln fingerprinted
    over the docs manifest's bytes counts while that manifest is unchanged."""
    fp, before = _hash(content_fingerprint(docs), *parts), _hash(sha256_file(docs / MANIFEST), *parts)
    try:
        recorded = json.loads((out / MANIFEST).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return fp, False
    return fp, recorded in (fp, before) and is_complete(out, recorded)


def run_tokenizer_stage(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    docs, out = cfg.layout.docs, cfg.layout.tokenizer
    # The user's own tokenizer needs no documents: an out_dir with no docs/ (an ablation's run) gets it too.
    if (not cfg.tokenizer.path or (docs / "stats.json").is_file()) and \
            (few := few_documents_message(json.loads((docs / "stats.json").read_text()), docs)):
        raise KilnError(few)
    if cfg.tokenizer.path:  # the user's own: committed as it is, with the names of its special tokens
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


def run_pack_stage(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    docs, tok, out = cfg.layout.docs, cfg.layout.tokenizer, cfg.layout.shards
    fp, current = _docs_fingerprint(docs, out, tokenizer_sha256(tok), cfg.section_hash("pack"))
    if current:
        _skip(log, f"pack: skipping, {out} is complete and up to date")
    else:
        log(f"pack: encoding and packing into sequences of {cfg.pack.seq_len} -> {out}")
        pack(read_docs(docs), tok, out, cfg.pack, fingerprint=fp, source_weights=down_weighted(docs))
    return read_manifest(out)


def run_train_stage(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    from kiln.checkpoint import latest_valid, step_of
    from kiln.train.trainer import Trainer

    latest = latest_valid(cfg.layout.checkpoints, log=log)
    if latest is not None and step_of(latest) >= cfg.train.max_steps:
        _skip(log, f"train: skipping, {latest} already reached train.max_steps={cfg.train.max_steps}")
    else:
        log(f"train: {cfg.train.max_steps} steps -> {cfg.layout.run}")
    return Trainer(cfg, log=log).run()


STAGES = {"data": run_data_stage, "tokenizer": run_tokenizer_stage, "pack": run_pack_stage, "train": run_train_stage}


def run_all(cfg: Config, log: Callable[[str], None] = print, until: str = "train") -> dict[str, Any]:
    """Run the stages in order up to and including `until`; returns each stage's result by name, its wall
    time (`timings_s`) and the stages that were already up to date (`skipped`)."""
    if until == "train":  # what would stop the last stage, before the first one's work
        from kiln.train.loggers import check_loggers

        if cfg.pack.format != "kiln":
            raise ConfigError(f"pack.format: {cfg.pack.format} packs for another trainer, which kiln train does not "
                              "read; add --until pack, or set pack.format: kiln to train with Kiln")

        check_loggers(cfg.train.loggers)
    results: dict[str, Any] = {"timings_s": {}, "skipped": []}
    for name, stage in STAGES.items():
        start = time.perf_counter()
        stage_log = StageLog(log)
        results[name] = stage(cfg, stage_log)
        results["timings_s"][name] = round(time.perf_counter() - start, 3)
        if stage_log.skipped:
            results["skipped"].append(name)
        if name == until:
            break
    return results
