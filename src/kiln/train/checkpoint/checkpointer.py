"""The loop's checkpointing: `TrainState` (where the run is and what its parts hold) and `Checkpointer`, the one path
by which it is saved, resumed and rolled back (OLMo-core's trainer state over its callbacks).

A checkpoint's state.json is `{"step", "tokens_seen", "world_size", "config_hash", **{key: part.state_dict()}}`
for every registered part (a part is registered by having a `state_key`, see train/parts/__init__.py); a
resume restores each part by its key, a rollback only the parts with `restore_on_rollback`. The keys are the
ones Kiln has always written (loader, spikes, escalation, budget, schedule, scaler, history, data_resets), so
checkpoints written before this registry resume unchanged. A part a checkpoint has no entry for keeps its fresh
state.

The weights and the optimizer state go through a checkpoint format with four methods (gather, write, read,
load), chosen by checkpoint.format: `full.FullCheckpoint` (whole tensors gathered on every rank and written by
rank 0) or `sharded.ShardedCheckpoint` (every rank writes its own pieces; any world size reads them). A
checkpoint is read back by the format it was written in, whatever the run's checkpoint.format.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from kiln import env
from kiln.config import CheckpointConfig, GuardConfig, TrainConfig
from kiln.errors import ConfigError, KilnError
from kiln.train.checkpoint import agreement
from kiln.train.checkpoint import resume as resume_checks
from kiln.checkpoint.folder import list_checkpoints, restore_rng, retain, rng_state
from kiln.train.checkpoint.full import FullCheckpoint
from kiln.checkpoint.remote import RemoteCheckpoints
from kiln.train.checkpoint.saver import Saver, all_finite, snapshot
from kiln.checkpoint.sharded import is_sharded
from kiln.train.checkpoint.sharded import ShardedCheckpoint, checkpoint_group, resolve_format, save_barrier
from kiln.train.determinism import layout_warning
from kiln.train.parallel import Dist, all_gather_objects, broadcast_object
from kiln.train.parallel.optimizer_state import settings_kept
from kiln.train.parallel.parallelize import Parallelized
from kiln.run_layout import checkpoints_of


# The settings a checkpoint cannot be resumed under when they change (train.max_steps, say, may change).
RESUME_SECTIONS = ("model", "pack", "tokenizer")


def config_hash(cfg) -> str:
    return cfg.section_hash(*RESUME_SECTIONS)


class TrainState:
    """step, tokens_seen and the registered parts, by key."""

    def __init__(self, parts: Iterable[Any], world: int, config_hash: str) -> None:
        self.step, self.tokens_seen = 0, 0
        self.world, self.config_hash = world, config_hash
        self.parts: dict[str, Any] = {}
        for part in parts:
            key = getattr(part, "state_key", None)
            if key is None:
                continue
            if key in self.parts or key in ("step", "tokens_seen", "world_size", "config_hash"):
                raise ValueError(f"two parts save their state as {key!r}")
            self.parts[key] = part

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.world,
                "config_hash": self.config_hash, **{key: part.state_dict() for key, part in self.parts.items()}}

    def load_state_dict(self, state: dict[str, Any], rollback: bool = False) -> None:
        """Restore every part the state has an entry for (on a rollback only those that rewind with the step)."""
        for key, part in self.parts.items():
            if key in state and (not rollback or getattr(part, "restore_on_rollback", False)):
                part.load_state_dict(state[key])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]


@dataclass(frozen=True)
class RunInputs:
    """What a checkpoint must have been trained on to be resumed as is (resume.check_resume_data)."""

    data_fingerprint: str
    tokenizer_sha: str
    tokenizer_file: Path
    manifest: Path  # the shards' manifest.json
    layout: dict[str, Any]  # determinism.layout
    env: Callable[[], dict[str, Any]]  # env.fingerprint: what a checkpoint records of the environment

    def manifest_fields(self, config_hash: str) -> dict[str, Any]:
        """What a checkpoint's manifest.json records of them, for the next resume's checks."""
        return {"config_hash": config_hash, "data_fingerprint": self.data_fingerprint,
                "env": {**self.env(), "layout": self.layout}}


def checkpoint_format(cfg: CheckpointConfig, parallel: Parallelized, d: Dist) -> FullCheckpoint | ShardedCheckpoint:
    """checkpoint.format, or its default: sharded whenever some parameter is split over ranks
    (`splits_parameters`: FSDP2/HSDP shards, tensor parallel, pipeline stages, expert slices, and their
    combinations), else full; one process and DDP may ask for sharded too (each tensor is one piece). A kind
    that cannot write its pieces (`writes_sharded_checkpoints` False; none today) refuses sharded."""
    can = parallel.writes_sharded_checkpoints
    if resolve_format(cfg.format, parallel.splits_parameters and can) == "full":
        return FullCheckpoint()
    if not can:
        raise ConfigError(f"checkpoint.format=sharded is not supported with parallel {parallel.name!r}; "
                          "set checkpoint.format: full")
    return ShardedCheckpoint(d, cfg.save_timeout_s)


class SaveClock:
    """checkpoint.every_seconds, a part of the loop (train/parts/): its flag `save_due` asks for a save once that
    many seconds have passed since the last save began, or since the loop started (start-up and resume are no work
    to lose). Any rank's True is every rank's (the step's one all-reduce), so no rank's clock decides alone."""

    def __init__(self, every_seconds: float | None) -> None:
        self.every_seconds = every_seconds
        self.since = time.monotonic()

    def pre_train(self) -> None:
        self.since = time.monotonic()

    def flags(self) -> dict[str, bool]:
        return {} if self.every_seconds is None else {"save_due": time.monotonic() - self.since >= self.every_seconds}

    def saved(self) -> None:
        self.since = time.monotonic()


class Checkpointer:
    """Saves, resumes and rolls back through the TrainState; the loop asks `should_save(step, last_step=...)`.

    `engine` supplies the parallelized model and the optimizer; `watchdog` (parts/watchdog.py) is told of each
    step saved (`beat`) and of a save in progress (`saving`: judged against checkpoint.save_timeout_s, not as a
    stalled rank); `clock` (a SaveClock among the loop's parts) is told of each save.
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, state: TrainState, engine, d: Dist, inputs: RunInputs,
                 config_yaml: str, best_step: Callable[[], int | None], event: Callable[[dict], None],
                 log: Callable[[str], None], watchdog, fmt: FullCheckpoint | ShardedCheckpoint | None = None,
                 clock: SaveClock | None = None) -> None:
        self.cfg, self.run_dir, self.ckpt_dir = cfg, run_dir, checkpoints_of(run_dir)
        self.state, self.engine, self.d, self.inputs, self.config_yaml = state, engine, d, inputs, config_yaml
        self.best_step, self.event, self.log, self.watchdog = best_step, event, log, watchdog
        self.format = fmt or checkpoint_format(cfg, engine.parallel, d)
        self.saver = Saver(cfg.async_save, log)
        self.saver.busy = self.saving
        self.clock = clock or SaveClock(cfg.every_seconds)
        # checkpoint.dir (a URL): rank 0 uploads each checkpoint there and resumes from there (remote.py)
        self.remote = RemoteCheckpoints(cfg.dir, cfg.storage_options) if cfg.dir and d.is_main else None

    def saving(self):
        """The context a save (or the wait for a background one) runs in: the watchdog knows of it."""
        return self.watchdog.saving(self.cfg.save_timeout_s)

    def should_save(self, step: int, last_step: bool, requested: bool = False, due: bool = False) -> bool:
        """`requested`: a signal or a stop; `due`: the SaveClock's agreed flag (checkpoint.every_seconds)."""
        return requested or due or last_step or step % self.cfg.every == 0

    # --- save -------------------------------------------------------------------------------------

    def save(self, reason: str = "schedule") -> None:
        """Every rank takes part (FSDP2 gathers, the RNG states and the finiteness verdicts meet); the writers
        (rank 0, or every rank for a sharded checkpoint) write, in the background when async. Weights or
        optimizer state that are not finite on any writer are refused, not written."""
        step, every = self.state.step, self.format.every_rank_writes
        self.clock.saved()
        with self.saving():
            # A sharded gather talks over the checkpoint group, which a background save may still be using.
            waited = self.saver.wait() if every else 0.0
            weights = self.format.gather(self.engine.parallel, self.engine.optimizer)
            mine = (rng_state(self.d.device), all_finite(*weights) if every or self.d.is_main else True)
            gathered = all_gather_objects(self.d, mine)
            if not all(finite for _, finite in gathered):
                self.event({"event": "save", "step": step, "refused": "non-finite weights or optimizer state"})
                if self.d.is_main:
                    self.log(f"step {step}: not saving a checkpoint with non-finite weights or optimizer state")
            elif every or self.d.is_main:
                self._write(weights, [rng for rng, _ in gathered], reason, waited)
        self.watchdog.beat(step)
        if not every:  # a sharded write ends in a collective of every rank (and, async, talks over the group)
            save_barrier(self.d, self.watchdog, self.cfg.save_timeout_s)

    def _write(self, weights: tuple[dict, dict], rngs: list, reason: str, waited: float) -> None:
        state, step, cfg = self.state.state_dict(), self.state.step, self.cfg
        fields = self.inputs.manifest_fields(self.state.config_hash)
        best = self.best_step() if cfg.keep_best else None
        if self.saver.async_save:  # the snapshot must not change while the thread writes
            weights = (snapshot(weights[0]), snapshot(weights[1]))

        def write() -> None:
            folder = self.format.write(self.ckpt_dir, step, weights, rngs, state, self.config_yaml,
                                       self.inputs.tokenizer_file, fields, cfg.signing_key)
            if self.d.is_main:
                self._retain(folder, best)

        stall = waited + self.saver.save(write)
        record = {"event": "save", "step": step, "reason": reason, "stall_s": round(stall, 4),
                  "async": self.saver.async_save}
        self.event({**record, "format": "sharded"} if self.format.every_rank_writes else record)

    def _retain(self, folder: Path, best: int | None) -> None:
        """Rank 0, after a commit: retention; with checkpoint.dir the upload first, retention there, and the local
        folder kept as a cache of the newest checkpoint only."""
        cfg = self.cfg
        if self.remote is None:
            retain(self.ckpt_dir, cfg.keep_last, cfg.keep_every, best)
            return
        self.remote.upload(folder)
        self.remote.upload_run_files(self.run_dir)  # an out_dir URL's metrics.jsonl, config.yaml, env.json
        self.remote.retain(cfg.keep_last, cfg.keep_every, best)
        retain(self.ckpt_dir, 1, None, None)

    def _sync(self, log: Callable[[str], None], before: int | None) -> None:
        """checkpoint.dir: rank 0 brings the newest committed checkpoint there into the local cache (remote.sync)
        before the ranks agree on the local folder; a failure there is every rank's."""
        outcome = None
        if self.remote is not None:
            try:
                if before is None:  # a resume on another machine gets the run's metrics.jsonl back
                    self.remote.fetch_metrics(self.run_dir, log)
                self.remote.sync(self.ckpt_dir, log, before)
            except KilnError as exc:
                outcome = str(exc)
        outcome = broadcast_object(self.d, outcome, checkpoint_group(self.d, self.cfg.save_timeout_s))
        if outcome is not None:
            raise KilnError(outcome)

    def wait(self) -> None:
        self.saver.wait()

    # --- load -------------------------------------------------------------------------------------

    def load(self, folder: Path, rollback: bool = False) -> dict[str, Any]:
        """Weights, optimizer state and the parts' states from `folder`; on a resume the RNG states too."""
        fmt = self.reader(folder)
        data = fmt.read(folder, self.d, self.engine.parallel.every_rank_reads)
        state = data["state"]
        resume_checks.check_settings(state.get("config_hash"), self.state.config_hash, folder, self.config_yaml,
                                     RESUME_SECTIONS)
        resume_checks.check_vocab_size(data["model"], self.engine.model.vocab_size, folder)
        with settings_kept(self.engine.optimizer):  # the moments from the checkpoint, the settings this config's
            fmt.load(self.engine.parallel, self.engine.optimizer, data)
        self.state.load_state_dict(state, rollback=rollback)
        if not rollback:
            rngs = data["rng"]
            restore_rng(rngs[self.d.rank] if self.d.rank < len(rngs) else rngs[0], self.d.device)
        return state

    def reader(self, folder: Path) -> FullCheckpoint | ShardedCheckpoint:
        """The format `folder` was written in (a sharded one is read on any world size and mesh)."""
        if is_sharded(folder):
            return self.format if isinstance(self.format, ShardedCheckpoint) else ShardedCheckpoint(
                self.d, self.cfg.save_timeout_s)
        return self.format if isinstance(self.format, FullCheckpoint) else FullCheckpoint()

    def agreed(self, before: int | None = None) -> Path | None:
        """The newest checkpoint every rank can read (agreement.agreed_checkpoint), or None. The ranks hash their
        shares of it under `saving`: judged against checkpoint.save_timeout_s, like a save (a rollback's watchdog
        is running)."""
        quiet = self.log if self.d.is_main and before is None else (lambda *_: None)
        with self.saving():
            if self.cfg.dir:
                self._sync(quiet, before)
            return agreement.agreed_checkpoint(self.d, self.ckpt_dir, quiet, self.cfg.public_key, before=before,
                                               timeout_s=self.cfg.save_timeout_s)

    def check_env(self, saved: dict[str, Any], folder: Path) -> None:
        """A checkpoint from another environment (env.PINNED): refused under checkpoint.strict_env, else a warning."""
        diff = env.resume_mismatches(saved, self.inputs.env())
        if not diff:
            return
        text = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        if self.cfg.strict_env:
            raise KilnError(f"{folder} was written under another environment ({text}); "
                            "set checkpoint.strict_env=false to resume anyway")
        if self.d.is_main:
            self.log(f"warning: resuming {folder} under another environment: {text}")

    def read_manifest(self, folder: Path) -> dict[str, Any]:
        return json.loads((folder / "manifest.json").read_text())

    # --- resume and rollback ----------------------------------------------------------------------

    def resume(self, train: TrainConfig, data_resets) -> Path | None:
        """Resume from the newest checkpoint every rank agrees on (None: start fresh). Refuses a checkpoint of
        other settings or, unless train.resume_on_new_data, other data; on new data the loader starts over
        (`data_resets`, parts/data_resets.py)."""
        quiet = self.log if self.d.is_main else (lambda *_: None)
        i = self.inputs
        agreement.check_same_inputs(self.d, {"data": (i.data_fingerprint, i.manifest),
                                             "tokenizer": (i.tokenizer_sha, i.tokenizer_file)})
        folder = self.agreed()
        if folder is None:
            if self.cfg.public_key and list_checkpoints(self.ckpt_dir):
                raise KilnError(f"{self.ckpt_dir}: no checkpoint carries a valid signature for checkpoint.public_key")
            return None
        manifest = self.read_manifest(folder)
        self.check_env(manifest.get("env", {}), folder)
        resume_checks.check_settings(manifest.get("config_hash", self.state.config_hash), self.state.config_hash,
                                     folder, self.config_yaml, RESUME_SECTIONS)  # before the data: named keys
        changes = resume_checks.check_resume_data(manifest, folder, i.data_fingerprint, i.tokenizer_sha,
                                                  train.resume_on_new_data, quiet, i.tokenizer_file)
        if (warning := layout_warning(manifest.get("env", {}).get("layout"), i.layout)) and self.d.is_main:
            self.log(f"warning: {folder}: {warning}")
        state = self.load(folder)
        if changes:  # the old position means nothing on other shards: start the loader clean, and say so
            data_resets.reset(self.state.step, folder.name, changes, i.data_fingerprint, i.tokenizer_sha)
        for note in resume_checks.resume_notes(folder, train, self.state.step):
            quiet(note)
        if state["world_size"] != self.d.world:
            quiet(f"resuming a run saved with {state['world_size']} ranks on {self.d.world}; the sample order is kept")
        return folder

    def rollback(self, reason: str, escalation, guards: GuardConfig, loader) -> None:
        """Back to the newest good checkpoint, keeping the data position: the window that caused the trouble is
        skipped, and the learning rate is lowered for a while (escalation.lr_factor)."""
        self.saver.wait()
        trouble = escalation.first_recent_skip()
        folder = self.agreed(before=trouble)
        logs = self.run_dir / "metrics.jsonl"
        at = self.state.step
        if folder is None:
            raise KilnError(f"step {at}: {reason}, and no checkpoint from before step {trouble} to roll back to; "
                            f"see {logs}")
        position, epoch = loader.state.position, loader.state.epoch
        self.load(folder, rollback=True)  # the loader keeps its position
        stop = escalation.record_rollback(self.state.step)
        self.event({"event": "rollback", "step": at, "to_step": self.state.step, "reason": reason,
                    "data_position": position, "epoch": epoch, "rollbacks": escalation.rollbacks})
        self.log(f"step {at}: {reason}; rolled back to {folder.name}, skipping the data since, "
                 f"lr x{guards.rollback_lr_factor} for {guards.rollback_lr_steps} steps")
        if stop:
            raise KilnError(f"training diverged: {escalation.rollbacks} rollbacks (guards.max_rollbacks="
                            f"{guards.max_rollbacks}), last at step {at} ({reason}); "
                            f"the skip and rollback events are in {logs}")
