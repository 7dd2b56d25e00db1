"""Running an ablation: Kiln's own stages for every arm and seed, in an order that keeps the arms fair.

1. data: each arm's data stage (`kiln.stages.run_data_stage`) into ARM/docs;
2. tokenizer: one tokenizer for every arm, trained (`kiln.tokenizer.train_tokenizer`) on a seeded sample drawn
   evenly from every arm's kept documents into out_dir/tokenizer (or the base config's own tokenizer.path);
3. overlap: every task's choices checked to fit the model's window under that tokenizer, and every eval
   document against every arm's kept documents (`evalsets.find_overlap`); what any arm contains is dropped
   from that evaluation for all arms;
4. pack: each arm's tokenizer (a committed copy of the shared one) and shards (`run_tokenizer_stage`,
   `run_pack_stage`); each run's tokenizer copy and its resolved config, ARM/seed-N/config.yaml, so a run can
   also be trained on its own (`torchrun --nproc_per_node=8 -m kiln train ARM/seed-N/config.yaml`, on any
   machine that sees out_dir): the next `kiln ablate` finds it finished and measures it;
5. runs: each arm x seed trained (`run_train_stage`, which resumes from the newest valid checkpoint) and
   measured on its final checkpoint (`measure.measure_checkpoint`) into ARM/seed-N/eval.json. SIGTERM stops
   the ablation as it stops `kiln train`: the run checkpoints, the ablation says so and exits 0.

Every step is skipped when its output is complete and matches its inputs (the stage fingerprints `kiln run`
uses; eval.json carries the checkpoint's and the eval sets' hashes), so a killed ablation re-run continues
where it stopped. `only` limits steps 4 and 5 to some arms (one job per arm); steps 1-3 always cover every arm
(they need every arm's documents) and are skipped once done.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from kiln.ablate.evalsets import OVERLAP, EvalSet, find_overlap, kept_units
from kiln.ablate.plan import CONFIG, EVAL, Plan, RunPlan
from kiln.data.docs import read_docs
from kiln.errors import KilnError
from kiln.stages import check_enough_documents, run_data_stage, run_pack_stage, run_tokenizer_stage, run_train_stage
from kiln.manifest import MANIFEST, is_complete, read_manifest, sha256_file, write_atomic

MEASURE_VERSION = 1  # in eval.json's fingerprint: a change in how runs are measured measures them again


class StoppedBySignal(Exception):
    """A run stopped on SIGTERM (checkpointed): the ablation stops there, cleanly."""


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class Timer:
    """Seconds spent per step (ablation.json's `timings_s`: the one part that differs between runs)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, step: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[step] = round(timer.seconds.get(step, 0.0) + time.perf_counter() - self.start, 3)

        return _Span()


def shared_tokenizer(plan: Plan, log: Callable[[str], None]) -> None:
    """Train out_dir/tokenizer on a seeded sample drawn evenly from every arm's kept documents (max_docs in all,
    the same share from each arm's data), unless it is complete for these documents and settings."""
    from kiln.tokenizer import sample_documents, train_tokenizer

    if not plan.shared_tokenizer:
        return
    arms = plan.data_arms()
    for arm in arms:
        check_enough_documents(arm.layout.docs, f"arm {arm.name!r}: ")
    cfg = plan.baseline.cfg
    settings = cfg.tokenizer.model_copy(update={"path": None})
    fp = _hash([sha256_file(a.layout.docs / MANIFEST) for a in arms], settings.model_dump(mode="json"), cfg.seed)
    out = plan.tokenizer.parent
    if is_complete(out, fp):
        log(f"tokenizer: skipping, {out} is complete and up to date")
        return
    share = max(1, settings.max_docs // len(arms))
    log(f"tokenizer: training byte-level BPE (vocab {settings.vocab_size}) on up to {share:,} documents of each of "
        f"{len(arms)} arm(s) -> {out}")
    sample = itertools.chain.from_iterable(sample_documents(read_docs(a.layout.docs), share, cfg.seed) for a in arms)
    train_tokenizer(sample, out, settings, cfg.seed, fingerprint=fp)


def check_tasks(plan: Plan, sets: list[EvalSet]) -> None:
    """Every task's choices fit the model's window under the shared tokenizer: a one-line error now, not after
    the first run has trained (kiln.scoring.mc.choice_tokens raises it)."""
    from kiln.scoring.mc import choice_tokens
    from kiln.tokenizer import eos_id, load_tokenizer

    tasks = [s for s in sets if s.kind == "task"]
    if not tasks:
        return
    cfg = plan.baseline.cfg
    tok = load_tokenizer(plan.tokenizer)
    eos = eos_id(tok, cfg.tokenizer.eos_token)
    for task in tasks:
        for question in task.questions:
            choice_tokens(tok, eos, question, cfg.pack.seq_len)


def finished_checkpoint(run: RunPlan) -> Path | None:
    """The run's newest valid checkpoint when it reached train.max_steps on this run's data and settings, else
    None. One trained on other shards, tokenizer or model settings (an arm edited since) is refused with the
    trainer's own message: the ablation never measures, or replaces, a run it did not plan."""
    from kiln.checkpoint import latest_valid, step_of
    from kiln.train.checkpoint import config_hash
    from kiln.train.checkpoint.resume import check_resume_data

    latest = latest_valid(run.cfg.layout.checkpoints, log=lambda *_: None)
    if latest is None or step_of(latest) < run.cfg.train.max_steps:
        return None
    manifest = json.loads((latest / MANIFEST).read_text())
    tokenizer = run.cfg.layout.tokenizer / "tokenizer.json"
    check_resume_data(manifest, latest, data_fingerprint(run.cfg, tokenizer), sha256_file(tokenizer), False,
                      lambda *_: None)
    if manifest.get("config_hash") != config_hash(run.cfg):
        raise KilnError(f"{latest} was trained with other model, pack or tokenizer settings; move {run.folder} away "
                        "to train this run again")
    return latest


def data_fingerprint(cfg, tokenizer: Path) -> str:
    """The data fingerprint the trainer records for the config's loader.sources (one source: its manifest's
    hash; several mixed by weight, as `kiln mix` trains: each one's location, weight and manifest)."""
    from kiln.train.checkpoint.resume import data_fingerprint as of_train_set
    from kiln.train.data import open_splits

    sources = cfg.loader.sources
    if len(sources) == 1 and sources[0].weight is None:
        return sha256_file(Path(sources[0].path) / MANIFEST)
    return of_train_set(open_splits(cfg, sha256_file(tokenizer))[0])


def shard_files(cfg) -> Any:
    """The shard files (name, sha256) the run trains on: one source's list, or [weight, list] per source."""
    tables = [sorted((n, m["sha256"]) for n, m in read_manifest(Path(s.path))["files"].items())
              for s in cfg.loader.sources]
    return tables[0] if len(tables) == 1 else [[s.weight, t] for s, t in zip(cfg.loader.sources, tables)]


def run_record(run: RunPlan, checkpoint: Path) -> dict[str, Any]:
    """What identifies a finished run: its final checkpoint (and its manifest's hash, which eval.json checks),
    the validation loss the loop measured at that step, and two content hashes that are the same whenever the
    run is (stats.json's timings, which reach the shards' manifest, do not): `fingerprint` of the config hash
    the checkpoint recorded, the seed, the shard files and the tokenizer; `weights_sha256` of its weights."""
    from kiln.checkpoint import checkpoint_table

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    row = next(r for r in checkpoint_table(checkpoint.parent) if Path(r["path"]).name == checkpoint.name)
    weights = sorted((n, m["sha256"]) for n, m in manifest["files"].items() if n.startswith("model"))
    return {"checkpoint": checkpoint.name, "step": manifest.get("step", row["step"]),
            "checkpoint_sha256": sha256_file(checkpoint / MANIFEST),
            "fingerprint": _hash(manifest.get("config_hash"), run.seed, shard_files(run.cfg),
                                 manifest["files"].get("tokenizer.json", {}).get("sha256")),
            "weights_sha256": hashlib.sha256(json.dumps(weights).encode()).hexdigest(), "val_loss": row.get("val_loss")}


def measure_run(run: RunPlan, sets: list[EvalSet], keep: dict[str, list[int]], log: Callable[[str], None]) -> dict:
    """Train the run to its end (resuming) and measure it, unless eval.json already holds this checkpoint's
    measurement on these eval units; returns eval.json's content."""
    from kiln.ablate.measure import measure_checkpoint

    out = run.folder / EVAL
    run_tokenizer_stage(run.cfg, log)
    checkpoint = finished_checkpoint(run)
    if checkpoint is None:
        summary = run_train_stage(run.cfg, log) or {}
        checkpoint = finished_checkpoint(run)
        if checkpoint is None and summary.get("stopped") == "SIGTERM":
            raise StoppedBySignal(f"{run.folder} checkpointed at step {summary.get('steps')}")
        if checkpoint is None:
            raise KilnError(f"{run.folder}: training stopped before train.max_steps={run.cfg.train.max_steps} "
                            "(see its run/metrics.jsonl); run the same command again to resume it")
    record = run_record(run, checkpoint)
    fingerprint = _hash(MEASURE_VERSION, record["checkpoint_sha256"], [s.digest(keep[s.name]) for s in sets])
    if out.is_file():
        try:
            done = json.loads(out.read_text())
            if done.get("measure_fingerprint") == fingerprint:
                return done
        except ValueError:
            pass  # a damaged eval.json is measured again
    log(f"measure: {run.folder.name} of {run.owner} on {len(sets)} eval set(s)")
    result = {"measure_fingerprint": fingerprint, **record, **measure_checkpoint(checkpoint, sets, keep)}
    write_atomic(out, json.dumps(result))
    return result


@contextmanager
def arm_context(name: str) -> Iterator[None]:
    """A stage's one-line error says which arm it was running for."""
    try:
        yield
    except KilnError as exc:
        raise type(exc)(f"arm {name!r}: {exc}") from None


def prepare(plan: Plan, sets: list[EvalSet], log: Callable[[str], None], timer: Timer, until: str,
            only: list[str] | None) -> dict[str, list[int]] | None:
    """Steps 1-4; returns the eval units every arm is measured on (None when `until` stops before them)."""
    with timer("data"):
        for arm in plan.data_arms():
            with arm_context(arm.name):
                run_data_stage(arm.cfg, log)
    if until == "data":
        return None
    with timer("tokenizer"):
        shared_tokenizer(plan, log)
    check_tasks(plan, sets)
    with timer("overlap"):
        dedup = plan.baseline.cfg.data.dedup  # one test for every arm, whatever dedup an arm ablates
        overlaps = {a.name: find_overlap(a.layout.docs, sets, dedup, a.data / OVERLAP, log) for a in plan.data_arms()}
        keep = kept_units(sets, overlaps)
    if until == "tokenizer":
        return None
    with timer("pack"):
        for arm in plan.data_arms(only):
            with arm_context(arm.name):
                run_tokenizer_stage(arm.cfg, log)
                run_pack_stage(arm.cfg, log)
        for run in plan.runs(only):
            ready_run(run, log)
    return keep


def ready_run(run: RunPlan, log: Callable[[str], None]) -> None:
    """A run ready for `kiln train FOLDER/config.yaml` (under torchrun too): its tokenizer copy and config."""
    run_tokenizer_stage(run.cfg, log)
    if not (run.folder / CONFIG).is_file() or (run.folder / CONFIG).read_text() != run.cfg.to_yaml():
        write_atomic(run.folder / CONFIG, run.cfg.to_yaml())


def run_ablation(plan: Plan, sets: list[EvalSet], log: Callable[[str], None], until: str = "train",
                 only: list[str] | None = None) -> dict[str, Any] | None:
    """Every step up to `until` for the arms in `only` (all when None); then, when every arm ran, the
    comparison: ablation.json and ablation.html under out_dir. Returns ablation.json's content (or None)."""
    from kiln.ablate.results import write_results

    timer = Timer()
    keep = prepare(plan, sets, log, timer, until, only)
    if keep is None or until == "pack":
        return None
    with timer("train and measure"):
        try:
            for run in plan.runs(only):
                with arm_context(run.owner):
                    measure_run(run, sets, keep, log)
        except StoppedBySignal as stop:
            log(f"stopped by SIGTERM: {stop}; run the same command again to resume the ablation")
            return None
    if only:
        log(f"done: {', '.join(only)}; `kiln ablate report {plan.out}` compares the runs finished so far")
        return None
    with timer("report"):
        return write_results(plan, sets, keep, timer.seconds)
