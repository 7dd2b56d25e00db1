"""The training loop, and nothing but the loop: for each step the parts' pre_step hooks, the engine's step
(engine.py), then the parts' post_step hooks; the loop asks its parts when to validate, save, roll back or stop.

Run as `kiln train CONFIG` or `torchrun --nproc_per_node=N -m kiln train CONFIG`. A run resumes from the newest
valid checkpoint under {out_dir}/run/checkpoints and from there produces bitwise the losses of an uninterrupted run.

The parts (train/parts/) and what they hold are listed once, in `Trainer._parts`; what they save goes through
the TrainState (train/checkpoint/checkpointer.py); the model is made parallel in one ordered function
(parallel/parallelize.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from kiln import env
from kiln.config import Config
from kiln.errors import KilnError
from kiln.scoring.mc import DownstreamTasks
from kiln.manifest import disk_full_message, is_disk_full, remove_stale_staging, write_atomic
from kiln.model.build import build_model
from kiln.model.loss import next_token_loss
from kiln.tokenizer import tokenizer_sha256
from kiln import checkpoint as ckpt
from kiln.train.checkpoint import Checkpointer, RunInputs, SaveClock, TrainState, config_hash, resume as resume_checks
from kiln.train.checkpoint.init_from import start_from
from kiln.train.console import TrainConsole, warnings_for
from kiln.train.cpu_memory import keep_freed_memory, require_host_memory
from kiln.train.data import open_splits
from kiln.train.determinism import layout, set_deterministic
from kiln.train.engine import attention_kernel_line, Engine
from kiln.train.loader import Loader
from kiln.train.loggers import check_loggers, open_sinks
from kiln.train.metrics import MetricsLog, peak_tflops, report_startup
from kiln.train.parallel import Dist, init_distributed, set_step_timeout
from kiln.train.parallel.ft import LOST, group_run_dir  # (torchft itself is imported only when asked for)
from kiln.train.parallel.mesh import build_mesh
from kiln.train.parallel.parallelize import Precision, parallelize
from kiln.train.parts.outcome import Outcome
from kiln.train.parts.budget import Budget
from kiln.train.parts.data_resets import DataResets
from kiln.train.parts.guards import Escalation, NonFiniteGuard, SpikeGuard
from kiln.train.parts.membership import Membership
from kiln.train.parts.metrics import StepLog
from kiln.train.parts.profiler import CollectorPause, Profiler
from kiln.train.parts.replicas import Replicas
from kiln.train.parts.sample_log import SampleLog
from kiln.train.parts.schedule_probe import ScheduleProbe
from kiln.train.parts.signals import StopRequests
from kiln.train.parts.threads import ThreadTuner
from kiln.train.parts.validator import Validator
from kiln.train.parts.warm_start import WarmStart
from kiln.train.parts.watchdog import Watchdog
from kiln.train.schedule import build_schedule
from kiln.train.telemetry import Telemetry

_MFU_NOTED: set[str] = set()  # the "MFU not reported" reasons this process has said (kiln ablate trains many runs)


class Trainer:
    def __init__(self, cfg: Config, d: Dist | None = None, log=print) -> None:
        self.cfg, self.log = cfg, log
        t = cfg.train
        set_deterministic(t.deterministic)  # before the first matmul: cuBLAS reads its setting once
        self.run_dir = group_run_dir(cfg)  # under torchft, group N >= 1 has a run folder of its own
        self.d = d or init_distributed(cfg.parallel.startup_timeout_s, self.run_dir)
        self.metrics: MetricsLog | None = None
        self.membership = Membership(self.d, self.run_dir, self.event, log)
        self.membership.admit()  # a rank on an excluded host: every rank stops here, before any work
        check_loggers(t.loggers)  # a logger asked for and not installed: before any work
        if isinstance(t.threads, int):  # before any torch work; `auto` is the ThreadTuner part's
            torch.set_num_threads(t.threads)
        if self.d.device.type == "cpu":
            keep_freed_memory()
        torch.manual_seed(cfg.seed)
        self._open_data()
        self.schedule = build_schedule(t)
        self.spikes, self.escalation = SpikeGuard(cfg.guards), Escalation(cfg.guards)
        manifest = self.train_set.manifest
        # On meta: parallelize splits it, then each rank draws its part only (kiln.model.init, from cfg.seed)
        model = build_model(cfg.model, int(manifest["vocab_size"]), cfg.pack.seq_len, manifest.get("eos_id"), "meta")
        g = self.mesh.degrees  # the node's memory must hold its ranks' start-up: one line before any work
        require_host_memory(model, self.d.device.type, g.dp_shard * g.tp * g.pp, self.d.world)
        kernel = attention_kernel_line(cfg, model, self.d.device)  # document masking's kernel, or None
        if kernel and self.d.is_main:
            self.log(kernel)
        self.flops_per_token = model.flops_per_token(cfg.pack.seq_len)
        self.params = sum(p.numel() for p in model.parameters())  # the whole model's, before a pipeline splits it
        parallel = parallelize(model, self.d, cfg.parallel, Precision.of(t), next_token_loss, self.mesh, self.pad_id,
                               seed=cfg.seed)
        if self.d.device.type == "cuda":
            # fp32 matmuls on tensor cores (TF32), which is what the peak table's fp32 figures assume.
            torch.set_float32_matmul_precision("high")
        self.engine = Engine(parallel, t, cfg.model.moe if cfg.model.moe.n_experts else None, self.d, self.pad_id,
                             guards=[NonFiniteGuard(), self.spikes], probes=[ScheduleProbe(self.schedule)],
                             event=self.event)
        self.model = self.engine.model
        self.parts = self._parts()
        self.state = TrainState(self.parts, self.d.world, config_hash(cfg))
        inputs = RunInputs(self.data_fingerprint, self.tokenizer_sha, self.tokenizer_file,
                           cfg.layout.shards / "manifest.json", layout(self.d, t.deterministic), env.fingerprint)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, self.state, self.engine, self.d, inputs,
                                         cfg.to_yaml(), self.validator.best_step, self.event, log, self.watchdog,
                                         clock=self.save_clock)

    def _open_data(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        tok_dir = cfg.layout.tokenizer
        self.tokenizer_file = tok_dir / "tokenizer.json"
        resume_checks.require_prepared(cfg)
        self.tokenizer_sha = tokenizer_sha256(tok_dir)
        self.train_set, self.val_set = open_splits(cfg, self.tokenizer_sha)
        if self.train_set.sample_len != cfg.pack.seq_len + 1:
            raise KilnError(f"{cfg.layout.shards}: samples of {self.train_set.sample_len} tokens, "
                            f"config says pack.seq_len={cfg.pack.seq_len}; re-run `kiln pack`")
        self.pad_id = self.train_set.manifest.get("pad_id")
        self.data_fingerprint = resume_checks.data_fingerprint(self.train_set)
        # The degrees, checked before any work; the loader shards rows by the data-parallel rank (mesh.py).
        self.mesh = mesh = build_mesh(cfg, self.d, int(self.train_set.manifest["vocab_size"]))
        try:  # the global batch on this world (loader.split_batch): one line if it cannot be split over it
            self.loader = Loader(self.train_set, t.batch_size, t.micro_batch_size, mesh.dp_rank, mesh.dp_world,
                                 cfg.seed, cfg.loader.prefetch)
        except ValueError as exc:
            raise KilnError(str(exc)) from None

    def _parts(self) -> list[Any]:
        """Every part of the loop, once: the hooks run in this order, and each with a state_key is saved."""
        cfg, t, d = self.cfg, self.cfg.train, self.d
        self.budget = Budget(cfg.budget, d.world, self.event, self.log)
        self.requests = StopRequests()
        self.watchdog = Watchdog(d, cfg.watchdog, self.run_dir, self.log, cfg.parallel.startup_timeout_s)
        self.peak, self.peak_source = peak_tflops(d.device, t.dtype, t.peak_tflops)
        self.step_log = StepLog(t, d, self.flops_per_token, self.peak, Telemetry.create(d, cfg.telemetry, self.log),
                                self.loader, self.escalation, self.budget, self.event, self.log)
        tasks = DownstreamTasks(cfg.eval.tasks, cfg.eval.tasks_every, self.tokenizer_file, cfg.tokenizer.eos_token,
                                cfg.pack.seq_len)
        self.validator = Validator(t, self.val_set, self.loader.micro_batch, self.engine.parallel, d, self.pad_id,
                                   self.schedule, tasks, cfg.pack.seq_len, cfg.layout.shards, self.event, self.log,
                                   self.watchdog.beat)
        self.data_resets = DataResets(self.loader, cfg.seed, self.event)
        self.warm_start = WarmStart(self.event)
        self.save_clock = SaveClock(cfg.checkpoint.every_seconds)
        samples = [SampleLog(self.loader, d, self.event)] if cfg.loader.record_samples else []
        p = self.engine.parallel  # torchft replica groups: last, after the parts that read this step's data split
        self.replicas = p.replicas and Replicas(p, self.engine, lambda: self.state, self.loader, self.mesh, t.outer,
                                                t.max_steps, self.event, self.log)
        return [self.loader, self.schedule, self.engine.scaling, self.spikes, self.escalation, self.budget,
                self.requests, self.save_clock, self.data_resets, self.warm_start, self.validator, self.step_log,
                *samples, self.membership, self.watchdog, Profiler(t.profile_steps, self.run_dir / "profile", d.rank),
                CollectorPause(t.gc_every), ThreadTuner(t.threads, d.device, self.log, self.event),
                *([self.replicas] if self.replicas else [])]

    def _hook(self, name: str, *args) -> list[Any]:
        return [getattr(part, name)(*args) for part in self.parts if hasattr(part, name)]

    @property
    def step(self) -> int:
        return self.state.step

    def event(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def lr_at(self, step: int) -> float:
        return self.schedule.lr(step) * self.escalation.lr_factor(step)

    def resume(self):
        """Resume this run's newest checkpoint; with none, start from train.init_from's weights if it is set."""
        resumed = self.checkpointer.resume(self.cfg.train, self.data_resets)
        if resumed is None and self.cfg.train.init_from:
            record = start_from(self.checkpointer, self.cfg, self.tokenizer_sha)
            self.warm_start.started(record)
            if self.d.is_main:
                what = "weights and optimizer state" if record["optimizer"] else "weights"
                self.log(f"starting from {record['checkpoint']} (step {record['checkpoint_step']}; its {what}; "
                         f"manifest sha256 {record['sha256'][:16]}…)")
        return resumed

    def save(self, reason: str = "schedule") -> None:
        self.checkpointer.save(reason)

    def flags(self) -> dict[str, bool]:
        """The parts' requests, agreed by every rank in the step's one all-reduce."""
        return {k: v for part_flags in self._hook("flags") for k, v in part_flags.items()}

    def run(self) -> dict[str, Any]:
        """Train to train.max_steps, holding the run folder's lock (rank 0) the whole time."""
        lock = resume_checks.lock_run(self.run_dir, self.d)
        try:
            if self.d.is_main:
                ckpt_dir = self.checkpointer.ckpt_dir
                for name in {p.name.split(".")[0] for p in ckpt_dir.glob("step-*.*-*")}:  # a killed save's
                    remove_stale_staging(ckpt_dir / name, "checkpoint")  # staging folders
            return self._run()
        except OSError as exc:  # a full disk that names no file (a C writer's): it is the run folder's filesystem
            if is_disk_full(exc):
                raise KilnError(disk_full_message(self.run_dir, exc)) from None
            raise
        finally:
            if lock is not None:
                lock.release()

    def _start(self) -> Any:
        """Resume (or evaluate step 0), open the metrics and console; returns the checkpoint resumed from."""
        cfg, t = self.cfg, self.cfg.train
        resumed = self.resume()
        self.membership.begin(resumed, self.step, self.loader.micro_batch, self.loader.accumulation)
        if self.d.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.run_dir / "config.yaml", cfg.to_yaml())
            write_atomic(self.run_dir / "env.json", json.dumps(env.fingerprint(), indent=1))
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", self.step if resumed else -1,
                                      self.run_dir / "tensorboard" if "tensorboard" in t.loggers else None,
                                      open_sinks(t.loggers, self.run_dir, cfg.model_dump(mode="json"), t.wandb_project))
        report_startup(self.model, self.d, self.event, self.log)  # built, split, initialised or loaded
        if resumed:
            self.log(f"resumed from {resumed} (step {self.step})")
        elif self.step == 0:
            self.validator.validate(0)
        if self.peak is None and self.d.is_main and self.step < t.max_steps and self.peak_source not in _MFU_NOTED:
            _MFU_NOTED.add(self.peak_source)  # once per process and device: an ablation's runs do not repeat it
            self.log(f"MFU not reported: {self.peak_source}")
        if self.d.is_main and self.step < t.max_steps:
            for warning in warnings_for(cfg, len(self.train_set)):
                self.log(f"warning: {warning}")
            self.step_log.console = TrainConsole(t.max_steps, t.log_every, self.step, self.log)
        return resumed

    def _run(self) -> dict[str, Any]:
        resumed = self._start()
        self.model.train()
        stopped = None
        try:
            self._hook("pre_train")
            while self.step < self.cfg.train.max_steps:
                stopped = self._one_step(first=self.step == 0 or resumed is not None)
                resumed = None
                if stopped:
                    break
        finally:
            self.checkpointer.wait()
            self._hook("close")
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
        return self.summary(stopped)

    def _one_step(self, first: bool) -> str | None:
        """One optimizer step and what follows it; returns why the run stops, if it does."""
        cfg, t, state = self.cfg, self.cfg.train, self.state
        tick = time.perf_counter()
        step = state.step + 1
        self._hook("pre_step", step)
        lr = self.lr_at(step)
        batches = self.loader.next_batch()
        t_data = time.perf_counter() - tick
        measured = {**self.engine.train_step(batches, self.flags), "time_data_s": t_data}
        result = self.engine.optimizer_step(step, lr, measured["loss"], step % t.update_ratio_every == 0)
        if result["skip_reason"] == LOST:  # torchft: a group was lost during this step; again, on the groups left
            return self.replicas.retry(step)
        if first:  # the first step of this process is over: from now on a long collective means a hung rank
            set_step_timeout(self.d, cfg.parallel.step_timeout_s)
        tokens = t.batch_size * cfg.pack.seq_len
        state.step, state.tokens_seen = step, state.tokens_seen + tokens
        reason = result["skip_reason"]
        rollback = bool(reason) and self.escalation.record_skip(step, escalate=reason != "fp16_overflow")
        outcome = Outcome(step, lr, time.perf_counter() - tick, tokens, state.tokens_seen, measured, result)
        self._hook("post_step", outcome)
        if rollback:
            self.checkpointer.rollback(f"{len(self.escalation.recent)} skipped steps within "
                                       f"{cfg.guards.rollback_window}", self.escalation, cfg.guards, self.loader)
            return None
        if self.validator.should_validate(step):
            self.schedule.observe_eval(step, self.validator.validate(step))
        if self.validator.tasks_due(step):
            self.validator.run_tasks(step)
        stopped = "SIGTERM" if measured["stop"] else "budget exhausted" if measured["budget_exhausted"] else None
        due = measured.get("save_due", False)  # checkpoint.every_seconds
        if self.checkpointer.should_save(step, last_step=step == t.max_steps, requested=bool(stopped) or
                                         measured["save"], due=due):
            self.checkpointer.save(stopped or ("signal" if measured["save"] else "time" if due else "schedule"))
            self.requests.save = False
        if stopped:
            self.event({"event": "stop", "step": step, "reason": stopped})
            self.log(f"step {step}: stopping cleanly ({stopped}); the same command resumes")
        return stopped

    def summary(self, stopped: str | None = None) -> dict[str, Any]:
        last = ckpt.list_checkpoints(self.checkpointer.ckpt_dir)
        vals = self.validator.val_loss
        end = max((int(s) for s in vals if int(s) <= self.step), default=None)  # the last eval (a stop between evals)
        return {"steps": self.step, "tokens_seen": self.state.tokens_seen,
                "skipped_steps": self.escalation.skipped_steps, "rollbacks": self.escalation.rollbacks,
                "stopped": stopped, "val_loss_start": vals.get("0"),
                "val_loss_end": None if end is None else vals[str(end)], "val_loss_end_step": end,
                "checkpoint": str(last[-1]) if last else None, "params": self.params}
