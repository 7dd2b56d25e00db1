"""The training loop, composed from small parts: loader, schedule, guards, clipping, metrics,
checkpoints, watchdog, budget and stop requests.

Run as `kiln train CONFIG` or `torchrun --nproc_per_node=N -m kiln train CONFIG`.
A run resumes from the newest valid checkpoint under {out_dir}/run/checkpoints
and from there produces bitwise the losses of a run that was never interrupted.
"""

from __future__ import annotations

import functools
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.config import Config
from kiln.errors import KilnError
from kiln.eval import next_token_loss, sample_batches, summed_loss
from kiln.eval.mc import DownstreamTasks
from kiln.manifest import remove_stale_staging, write_atomic
from kiln.model import Llama, ModelArgs, MoEArgs, RopeScaling
from kiln.tokenizer import tokenizer_sha256
from kiln.train import checkpoint as ckpt
from kiln.train import consensus, parallel, pipeline_parallel
from kiln.train import resume as resume_checks
from kiln.train.budget import Budget
from kiln.train.clip import GROUPS, clip, group_norms, layer_groups
from kiln.train.console import TrainConsole, warnings_for
from kiln.train.cpu_memory import keep_freed_memory
from kiln.train.guards import Escalation, NonFiniteGuard, SpikeGuard
from kiln.train.data import open_splits
from kiln.train.determinism import layout, layout_warning, set_deterministic
from kiln.train.expert_parallel import ExpertParallel
from kiln.train.loader import Loader
from kiln.train.loggers import check_loggers, open_sinks
from kiln.train.mesh import build_mesh
from kiln.train.metrics import MetricsLog, mfu, peak_memory_gb, peak_tflops
from kiln.train.parallel import Dist, all_reduce_sum, init_distributed
from kiln.train.precision import apply_precision_policy
from kiln.train.schedule import build_schedule
from kiln.train.signals import StopRequests
from kiln.train.telemetry import Telemetry
from kiln.train.tensor_parallel import apply_tensor_parallel, vocab_parallel_loss
from kiln.train.watchdog import Watchdog

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# What must match for a checkpoint to be resumed exactly; the rest is reported as a warning.
ENV_KEYS = ("python", "torch", "cuda", "nccl", "gpus", "kiln")


def build_model(cfg: Config, vocab_size: int) -> Llama:
    m = cfg.model
    rope_scaling = RopeScaling(**m.rope_scaling.model_dump()) if m.rope_scaling else None
    moe = MoEArgs(n_experts=m.moe.n_experts, top_k=m.moe.top_k, capacity_factor=m.moe.capacity_factor,
                  every_n_layers=m.moe.every_n_layers, ffn_hidden=m.moe.ffn_hidden) if m.moe.n_experts else None
    args = ModelArgs(vocab_size=vocab_size, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                     ffn_hidden=m.ffn_hidden, multiple_of=m.multiple_of, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                     max_seq_len=cfg.pack.seq_len, tie_embeddings=m.tie_embeddings, init_std=m.init_std,
                     rope_scaling=rope_scaling, moe=moe)
    return Llama(args)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on norms, biases and embeddings: decaying them only hurts (GPT-3, Llama)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "tok_embeddings" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def env_fingerprint() -> dict[str, Any]:
    from kiln.ops.doctor import fingerprint

    fp = fingerprint()
    return {k: ([g.get("name") for g in fp[k]] if k == "gpus" else fp.get(k)) for k in ENV_KEYS}


class Trainer:
    def __init__(self, cfg: Config, d: Dist | None = None, log=print) -> None:
        self.cfg, self.log = cfg, log
        t = cfg.train
        set_deterministic(t.deterministic)  # before the first matmul: cuBLAS reads its setting once
        self.d = d or init_distributed(cfg.parallel.startup_timeout_s, cfg.out / "run")
        check_loggers(t.loggers)  # a logger asked for and not installed: before any work
        if t.threads:
            torch.set_num_threads(t.threads)
        if self.d.device.type == "cpu":
            keep_freed_memory()
        torch.manual_seed(cfg.seed)
        self.run_dir = cfg.out / "run"
        self.ckpt_dir = self.run_dir / "checkpoints"
        shards, tok_dir = cfg.out / "shards", cfg.out / "tokenizer"
        self.tokenizer_file = tok_dir / "tokenizer.json"
        resume_checks.require_prepared(cfg)
        tok_sha = self.tokenizer_sha = tokenizer_sha256(tok_dir)
        self.train_set, self.val_set = open_splits(cfg, tok_sha)
        if self.train_set.sample_len != cfg.pack.seq_len + 1:
            raise KilnError(
                f"{shards}: samples of {self.train_set.sample_len} tokens, "
                f"config says pack.seq_len={cfg.pack.seq_len}; re-run `kiln pack`"
            )
        vocab = self.vocab_size = int(self.train_set.manifest["vocab_size"])
        self.pad_id = self.train_set.manifest.get("pad_id")
        self.data_fingerprint = resume_checks.data_fingerprint(self.train_set)
        self.data_resets: list[dict[str, Any]] = []  # resumes onto new data (train.resume_on_new_data)
        self.data_reset_now: dict[str, Any] | None = None

        self.mesh = build_mesh(cfg, self.d, vocab)  # degrees checked before any work; data shards by dp rank
        micro = t.micro_batch_size or t.batch_size // self.mesh.dp_world
        if micro < 1:
            raise KilnError(f"train.batch_size={t.batch_size} is smaller than the data-parallel world size "
                            f"{self.mesh.dp_world}")
        try:
            self.loader = Loader(self.train_set, t.batch_size, micro, self.mesh.dp_rank, self.mesh.dp_world, cfg.seed,
                                 cfg.loader.prefetch)
        except ValueError as exc:
            raise KilnError(str(exc)) from None

        self.model = build_model(cfg, vocab).to(self.d.device)
        self.flops_per_token = self.model.flops_per_token(cfg.pack.seq_len)
        self.moe = cfg.model.moe.n_experts > 0
        self.mode = self.mesh.mode
        self.autocast = DTYPES[t.dtype]
        if t.fp32_modules and self.mode != "fsdp":  # under FSDP2, shard groups of their own (apply_fsdp)
            apply_precision_policy(self.model, t.fp32_modules)
        self.experts = None
        if cfg.parallel.ep > 1:  # this rank's share of every MoE block's experts, reached by all-to-all
            self.experts = ExpertParallel(self.model, self.mesh.dp_rank, self.mesh.dp_world, cfg.parallel.ep)
        if self.mesh.tp > 1:  # first: activation checkpointing, compile and FSDP2 wrap the sharded blocks
            apply_tensor_parallel(self.model, self.mesh.tp_mesh)
        if cfg.parallel.activation_checkpointing:
            parallel.apply_activation_checkpointing(self.model)
        self.pipeline = None
        if self.mesh.pp > 1:  # this rank's stages only, each sharded (FSDP2) or replicated (DDP) by itself
            self.model, self.pipeline = pipeline_parallel.build_pipeline(self.model, self.mesh, self.mode, self.d, cfg,
                                                                         self.autocast, self.pad_id)
            self.autocast = None if self.mode == "fsdp" else self.autocast
        if self.mode == "fsdp" and self.pipeline is None:
            try:
                parallel.apply_fsdp(self.model, self.d, cfg.parallel.mesh, self.autocast, t.fp32_modules,
                                    self.mesh.dp_mesh)
            except ValueError as exc:
                raise KilnError(str(exc)) from None
            self.autocast = None  # FSDP2's mixed-precision policy casts parameters instead
        self.loss_fn = vocab_parallel_loss if self.mesh.tp > 1 else next_token_loss
        if cfg.parallel.compile and self.mode == "none" and self.mesh.tp == 1:
            # Model and loss in one graph: the upcast and log-softmax over the vocabulary fuse too
            # (+9-14% over compiling the model alone, BENCHMARKS.md), in one piece.
            self.loss_fn = torch.compile(functools.partial(next_token_loss, chunk_rows=None))
        elif cfg.parallel.compile:
            self.model.compile()  # under DDP/FSDP2 the wrapper's hooks stay outside the compiled blocks
        if self.experts is not None:
            self.experts.keep_out_of_ddp(self.model)
        self.wrapped = parallel.wrap_model(self.model, self.d, self.mode if self.pipeline is None else "none")
        # After sharding: FSDP2 replaces the parameters with DTensors.
        self.groups = layer_groups(self.model, cfg.model.n_layers, t.upper_layers)
        if self.d.device.type == "cuda":
            # fp32 matmuls on tensor cores (TF32), which is what the peak table's fp32 figures assume.
            torch.set_float32_matmul_precision("high")
        # On GPUs the fused kernel (one launch for every tensor; torchtitan's default, DTensors included); on
        # CPUs torch's per-tensor loop, where foreach took 60 ms a step against 33 ms for a 5 M-parameter model
        # (measured here). A GPU run confirms fused on the FSDP2 1B model.
        fused = True if self.d.device.type == "cuda" else None
        self.optimizer = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                           fused=fused)
        # Under FSDP2 an overflow lands in one rank's shard, yet every rank skips the step together: the
        # gradients are DTensors, whose dispatch all-reduces the scaler's found_inf (torch 2.13,
        # found_inf_reduce_handler), so torch.amp's scaler needs no sharded twin (which would reduce it
        # twice). tests/test_gpu_path.py holds every rank to the same verdict on 2 gloo ranks.
        self.scaler = torch.amp.GradScaler(self.d.device.type, init_scale=2.0**16) if t.dtype == "fp16" else None

        self.non_finite = NonFiniteGuard()
        g = cfg.guards
        self.spikes = SpikeGuard(g.spike_zscore, g.grad_spike_zscore, g.spike_window, g.spike_min_history)
        self.escalation = Escalation(cfg.guards)
        self.schedule = build_schedule(cfg)
        self.budget = Budget(cfg.budget, self.d.world)
        self.saver = ckpt.Saver(cfg.checkpoint.async_save, log)
        self.requests = StopRequests()
        self.watchdog = Watchdog(self.d, cfg.watchdog, self.run_dir, log, cfg.parallel.startup_timeout_s)
        self.peak, self.peak_source = peak_tflops(self.d.device, t.dtype, t.peak_tflops)
        self.tasks = DownstreamTasks(cfg.eval.tasks, cfg.eval.tasks_every, self.tokenizer_file, cfg.tokenizer.eos_token)
        self.telemetry = Telemetry.create(self.d, cfg.telemetry, log)
        self.metrics: MetricsLog | None = None
        self.console: TrainConsole | None = None
        self.step, self.tokens_seen = 0, 0
        self.history: dict[str, Any] = {"val_loss": {}}
        # Settings a checkpoint cannot be resumed under when they change (train.max_steps may change).
        self.config_hash = cfg.section_hash("model", "pack", "tokenizer")
        self.layout = layout(self.d, t.deterministic)

    # --- small helpers ----------------------------------------------------------------------

    def event(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def lr_at(self, step: int) -> float:
        return self.schedule.lr(step) * self.escalation.lr_factor(step)

    # --- checkpoints ------------------------------------------------------------------------

    def _load(self, folder: Path, resume: bool) -> dict[str, Any]:
        # Verified by consensus.agreed_checkpoint; only rank 0 reads the weights, and broadcasts them.
        every_rank = self.pipeline is not None or self.experts is not None  # each keeps its own part
        data = ckpt.load_checkpoint(folder, verify=False, weights=self.d.is_main or every_rank)
        state = data["state"]
        if state.get("config_hash") != self.config_hash:
            raise KilnError(f"{folder} was written with different model/pack/tokenizer settings; "
                            f"use a new out_dir, or delete {self.ckpt_dir} to start over")
        resume_checks.check_vocab_size(data["model"], self.vocab_size, folder)
        if self.pipeline is not None:  # every rank read the full state and keeps its stages' part
            pipeline_parallel.load_states(self.model, self.optimizer, data["model"], data["optimizer"])
        elif self.experts is not None:  # every rank read the full state and keeps its experts
            model_sd, optim_sd = self.experts.local_states(data["model"], data["optimizer"], self.optimizer)
            self.model.load_state_dict(model_sd)
            self.optimizer.load_state_dict(optim_sd)
        else:
            parallel.load_states(self.wrapped, self.optimizer, self.mode, data["model"], data["optimizer"],
                                 self.d.world)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if resume:
            self.data_resets = state.get("data_resets", [])
            self.loader.load_state_dict(state["loader"])
            self.spikes.load_state_dict(state["spikes"])
            self.escalation.load_state_dict(state["escalation"])
            self.budget.load_state_dict(state["budget"])
            self.history = state["history"]
            rngs = data["rng"]
            ckpt.restore_rng(rngs[self.d.rank] if self.d.rank < len(rngs) else rngs[0], self.d.device)
        if "schedule" in state:  # on rollback too: the breathing phases rewind with the step
            self.schedule.load_state_dict(state["schedule"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        return state

    def resume(self) -> Path | None:
        quiet = self.log if self.d.is_main else (lambda *_: None)
        consensus.check_same_inputs(self.d, {"data": (self.data_fingerprint, self.cfg.out / "shards" / "manifest.json"),
                                             "tokenizer": (self.tokenizer_sha, self.tokenizer_file)})
        folder = consensus.agreed_checkpoint(self.d, self.ckpt_dir, quiet, self.cfg.checkpoint.public_key)
        if folder is None:
            if self.cfg.checkpoint.public_key and ckpt.list_checkpoints(self.ckpt_dir):
                raise KilnError(f"{self.ckpt_dir}: no checkpoint carries a valid signature for checkpoint.public_key")
            return None
        manifest = json.loads((folder / "manifest.json").read_text())
        self._check_env(manifest.get("env", {}), folder)
        changes = resume_checks.check_resume_data(manifest, folder, self.data_fingerprint, self.tokenizer_sha,
                                                  self.cfg.train.resume_on_new_data, quiet)
        if (warning := layout_warning(manifest.get("env", {}).get("layout"), self.layout)) and self.d.is_main:
            self.log(f"warning: {folder}: {warning}")
        state = self._load(folder, resume=True)
        if changes:  # the old position means nothing on other shards: start the loader clean, and say so
            self.loader.load_state_dict({"seed": self.cfg.seed, "epoch": 0, "position": 0})
            self.data_reset_now = {"step": self.step, "from": folder.name, "changed": changes,
                                   "data_fingerprint": self.data_fingerprint, "tokenizer_sha256": self.tokenizer_sha}
            self.data_resets.append(self.data_reset_now)
        for note in resume_checks.resume_notes(folder, self.cfg, self.step):
            quiet(note)
        if state["world_size"] != self.d.world:
            quiet(f"resuming a run saved with {state['world_size']} ranks on {self.d.world}; the sample order is kept")
        return folder

    def _check_env(self, saved: dict[str, Any], folder: Path) -> None:
        now = env_fingerprint()
        diff = {k: (saved.get(k), now[k]) for k in ENV_KEYS if saved.get(k) != now[k]}
        if not diff:
            return
        text = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        if self.cfg.checkpoint.strict_env:
            raise KilnError(f"{folder} was written under another environment ({text}); "
                            "set checkpoint.strict_env=false to resume anyway")
        if self.d.is_main:
            self.log(f"warning: resuming {folder} under another environment: {text}")

    def save(self, reason: str = "schedule") -> None:
        """Every rank takes part (FSDP2 gathers); rank 0 writes, in the background when async."""
        if self.pipeline is not None:  # each stage's gathered, then sent to rank 0
            model_state, optim_state = pipeline_parallel.gather_states(self.model, self.optimizer, self.mesh)
        else:
            model_state = parallel.full_state_dict(self.wrapped, self.mode)
            optim_state = parallel.optimizer_state(self.wrapped, self.optimizer, self.mode)
            if self.experts is not None:  # the experts' slices gathered whole over the expert group
                model_state, optim_state = self.experts.full_states(model_state, optim_state, self.optimizer)
        rng = ckpt.rng_state(self.d.device)
        rngs = [rng]
        if self.d.world > 1:
            rngs = [None] * self.d.world
            dist.all_gather_object(rngs, rng)
        if self.d.is_main:
            if not ckpt.all_finite(model_state, optim_state):
                self.event({"event": "save", "step": self.step, "refused": "non-finite weights or optimizer state"})
                self.log(f"step {self.step}: not saving a checkpoint with non-finite weights or optimizer state")
            else:
                self._write(model_state, optim_state, rngs, reason)
        self.watchdog.beat(self.step)
        if self.d.world > 1:
            dist.barrier()

    def _write(self, model_state, optim_state, rngs, reason: str) -> None:
        cfg = self.cfg
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                 "world_size": self.d.world, "config_hash": self.config_hash, "history": self.history,
                 "spikes": self.spikes.state_dict(), "escalation": self.escalation.state_dict(),
                 "budget": self.budget.state_dict(), "schedule": self.schedule.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler else None, "data_resets": self.data_resets}
        fields = {"config_hash": self.config_hash, "data_fingerprint": self.data_fingerprint,
                  "env": {**env_fingerprint(), "layout": self.layout}}
        vals = {int(s): v for s, v in self.history["val_loss"].items() if int(s) > 0}
        best = min(vals, key=vals.get) if (cfg.checkpoint.keep_best and vals) else None
        if self.saver.async_save:  # the snapshot must not change while the thread writes
            model_state, optim_state = ckpt.snapshot(model_state), ckpt.snapshot(optim_state)
        step = self.step

        def write() -> None:
            ckpt.write_checkpoint(self.ckpt_dir, step, model_state, optim_state, rngs, state, cfg.to_yaml(),
                                  self.tokenizer_file, fields, cfg.checkpoint.signing_key)
            ckpt.retain(self.ckpt_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every, best)

        stall = self.saver.save(write)
        self.event({"event": "save", "step": step, "reason": reason, "stall_s": round(stall, 4),
                    "async": self.saver.async_save})

    # --- evaluation -------------------------------------------------------------------------

    def evaluate(self) -> float:
        """Mean loss on the first `eval_batches` batches of the validation split (same samples every time)."""
        t, w = self.cfg.train, self.mesh.dp_world  # a tensor-parallel group evaluates the same rows
        n = min(len(self.val_set), t.eval_batches * self.loader.micro_batch * w) // w * w
        if n == 0:
            raise KilnError(
                f"{self.cfg.out / 'shards'}: the validation split has too few samples; raise pack.val_fraction"
            )
        mine = torch.arange(n)[self.mesh.dp_rank::w].numpy()  # equal counts: FSDP2 needs every rank in every forward
        batches = sample_batches(self.val_set, mine, self.loader.micro_batch)
        if self.pipeline is not None:
            total, count = pipeline_parallel.evaluate(self.pipeline, batches, self.d.device, self.autocast, self.pad_id)
        else:
            total, count = summed_loss(self.wrapped, batches, self.d.device, self.autocast, self.pad_id)
        total, count = all_reduce_sum([total, count], self.d)
        self.watchdog.beat(self.step)
        return total / count

    def run_eval(self) -> float:
        val = self.evaluate()
        self.history["val_loss"][str(self.step)] = val
        self.event({"event": "eval", "step": self.step, "val_loss": val})
        self.log(f"step {self.step} val_loss {val:.4f}")
        return val

    def run_tasks(self) -> None:
        """The downstream tasks of eval.tasks (kiln.eval.mc), one `task` event each."""
        reduce = functools.partial(all_reduce_sum, d=self.d)
        for name, result in self.tasks.run(self.wrapped, self.cfg.pack.seq_len, self.d.device, self.autocast,
                                           self.d.rank, self.d.world, reduce):
            self.event({"event": "task", "step": self.step, "task": name, **result})
            self.log(f"step {self.step} {name}: acc {result['acc']:.4f} acc_norm {result['acc_norm']:.4f} "
                     f"(n {result['n']})")
        self.watchdog.beat(self.step)

    # --- one optimizer step -----------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        """Forward/backward over this rank's micro-batches (gradients sync on the last), then agree on
        the loss and any stop/save request in one all-reduce. Returns the step's numbers."""
        tick = time.perf_counter()
        micro_batches = self.loader.next_batch()
        t_data = time.perf_counter() - tick
        tick = time.perf_counter()
        # Sums stay on the device: one host sync a step (below), not one per micro-batch and MoE layer.
        loss_sum: torch.Tensor | float = 0.0
        moe_sums: dict[str, Any] = {"aux_loss": 0.0, "z_loss": 0.0, "dropped_tokens": 0, "routed_tokens": 0}
        for i, batch in enumerate(micro_batches):
            if self.pipeline is not None:  # forward and backward over the pipeline's micro-batches, loss agreed
                loss_sum = loss_sum + self.pipeline.step(batch.to(self.d.device), self.autocast)
                continue
            with parallel.gradient_sync(self.wrapped, self.mode, enabled=i == len(micro_batches) - 1):
                loss = self.loss_fn(
                    self.wrapped, batch.to(self.d.device, non_blocking=True), self.autocast, self.pad_id
                )
                total = loss + self._router_loss(moe_sums) if self.moe else loss
                scaled = total / len(micro_batches)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum = loss_sum + loss.detach()
        if self.experts is not None:  # DDP left the expert gradients alone: their replicas average them
            self.experts.sync_gradients()
        t_fwd_bwd = time.perf_counter() - tick
        tick = time.perf_counter()
        # The budget flag is every rank's verdict on the steps so far: one rank alone must never stop (it
        # would enter save()'s collectives while the others start the next step's).
        flags = [float(self.requests.stop), float(self.requests.save), float(self.budget.exhausted())]
        dev = self.d.device
        agreed = torch.tensor([0.0, *flags], dtype=torch.float64, device=dev)
        agreed[0] = loss_sum / len(micro_batches)
        local = [torch.as_tensor(v, dtype=torch.float64, device=dev).reshape(1) for v in moe_sums.values()
                 if self.moe]
        loss_total, stop, save, budget, *moe = torch.cat([parallel.all_reduce_(agreed, self.d), *local]).tolist()
        t_comm = time.perf_counter() - tick
        out = {"loss": loss_total / self.d.world, "stop": stop > 0, "save": save > 0, "budget_exhausted": budget > 0,
               "time_data_s": t_data, "time_fwd_bwd_s": t_fwd_bwd, "time_comm_s": t_comm}
        if self.moe:  # this rank's router numbers: the balance a rank sees is what its experts get
            out.update({f"moe/{k}": v / len(micro_batches) if "loss" in k else int(v) for k, v in zip(moe_sums, moe)})
        return out

    def _router_loss(self, sums: dict[str, float]) -> torch.Tensor:
        """MoE load-balancing and z losses of the last forward, weighted; their values are added to `sums`."""
        m, stats = self.cfg.model.moe, self.model.moe_losses()
        for k in sums:
            value = stats[k]
            sums[k] = sums[k] + (value.detach() if isinstance(value, torch.Tensor) else value)
        return m.aux_loss_coef * stats["aux_loss"] + m.z_loss_coef * stats["z_loss"]

    def optimizer_step(self, lr: float, loss: float, measure_update: bool) -> dict[str, Any]:
        """Clip, judge with the guards, step or skip. Returns grad norms, verdict and update ratio."""
        tick = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norms = group_norms(self.groups) if self.experts is None else self.experts.group_norms(self.groups)
        if self.pipeline is not None:  # each stage's norms: the squares add over the pipeline
            norms = self.pipeline.reduce_norms(norms, GROUPS)
        layer_norms = None
        if self.schedule.wants_layer_norms():  # before clipping: the calibrator measures the raw spread
            blocks = {str(i): list(b.parameters()) for i, b in enumerate(self.model.layers)}
            layer_norms = [float(n) for n in group_norms(blocks).values()]
        t = self.cfg.train
        grad_norm = clip(self.groups, norms, t.grad_clip, t.grad_clip_groups)
        out: dict[str, Any] = {"grad_norm": grad_norm, **{f"grad_norm/{g}": float(n) for g, n in norms.items()}}
        reason = self.non_finite.check(loss, grad_norm) or self.spikes.check(loss, grad_norm)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            if reason == "non_finite":
                reason = "fp16_overflow"  # the scaler's normal business: lower the scale, no escalation
            if reason in (None, "fp16_overflow"):
                self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() != scale:
                self.event({"event": "scale", "step": self.step + 1, "from": scale, "to": self.scaler.get_scale()})
        elif reason is None:
            before = [_local(p).clone() for p in self.model.parameters()] if measure_update else None
            self.optimizer.step()
            if before is not None:
                out["update_to_weight"] = _update_ratio(before, [_local(p) for p in self.model.parameters()], self.d,
                                                        sharded=self.mode == "fsdp" or self.mesh.model_parallel)
        if reason is None:
            self.spikes.accept(loss, grad_norm)
        if self.schedule.measures_noise:  # the breathing schedule's gradient noise is grad_norm / param_norm
            out["param_norm"] = float(
                parallel.local_tensor(torch.nn.utils.get_total_norm([p.detach() for p in self.model.parameters()]))
            )
        self.schedule.observe_step(self.step + 1, grad_norm, out.get("param_norm", 0.0), layer_norms)
        self.optimizer.zero_grad(set_to_none=True)
        out["skip_reason"] = reason
        out["time_optim_s"] = time.perf_counter() - tick
        return out

    # --- rollback ---------------------------------------------------------------------------

    def rollback(self, reason: str) -> None:
        """Back to the newest good checkpoint, keeping the data position: the window that caused the
        trouble is skipped, and the learning rate is lowered for a while."""
        self.saver.wait()
        trouble = self.escalation.first_recent_skip()
        folder = consensus.agreed_checkpoint(self.d, self.ckpt_dir, lambda *_: None, self.cfg.checkpoint.public_key,
                                             before=trouble)
        logs = self.run_dir / "metrics.jsonl"
        if folder is None:
            raise KilnError(
                f"step {self.step}: {reason}, and no checkpoint from before step {trouble} to roll back to; see {logs}"
            )
        position, epoch, at = self.loader.state.position, self.loader.state.epoch, self.step
        self._load(folder, resume=False)  # the loader keeps its position
        stop = self.escalation.record_rollback(self.step)
        self.event({"event": "rollback", "step": at, "to_step": self.step, "reason": reason,
                    "data_position": position, "epoch": epoch, "rollbacks": self.escalation.rollbacks})
        self.log(f"step {at}: {reason}; rolled back to {folder.name}, skipping the data since, "
                 f"lr x{self.cfg.guards.rollback_lr_factor} for {self.cfg.guards.rollback_lr_steps} steps")
        if stop:
            raise KilnError(f"training diverged: {self.escalation.rollbacks} rollbacks (guards.max_rollbacks="
                            f"{self.cfg.guards.max_rollbacks}), last at step {at} ({reason}); "
                            f"the skip and rollback events are in {logs}")

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to train.max_steps, holding the run folder's lock (rank 0) the whole time."""
        lock = resume_checks.lock_run(self.run_dir, self.d)
        try:
            if self.d.is_main:
                for name in {p.name.split(".")[0] for p in self.ckpt_dir.glob("step-*.*-*")}:  # a killed save's
                    remove_stale_staging(self.ckpt_dir / name, "checkpoint")  # staging folders
            return self._run()
        finally:
            if lock is not None:
                lock.release()

    def _run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        resumed = self.resume()
        if self.d.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.run_dir / "config.yaml", cfg.to_yaml())
            write_atomic(self.run_dir / "env.json", json.dumps(env_fingerprint(), indent=1))
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", self.step if resumed else -1,
                                      self.run_dir / "tensorboard" if "tensorboard" in t.loggers else None,
                                      open_sinks(t.loggers, self.run_dir, cfg.model_dump(mode="json"), t.wandb_project))
        if resumed:
            self.log(f"resumed from {resumed} (step {self.step})")
            if self.data_reset_now is not None:
                self.event({"event": "resume_on_new_data", **self.data_reset_now})
        elif self.step == 0:
            self.run_eval()
        if self.peak is None and self.d.is_main and self.step < t.max_steps:
            self.log(f"MFU not reported: {self.peak_source}")
        if self.d.is_main and self.step < t.max_steps:
            for warning in warnings_for(cfg, len(self.train_set)):
                self.log(f"warning: {warning}")
            self.console = TrainConsole(t.max_steps, t.log_every, self.step, self.log)
        self.requests.install()
        self.watchdog.start()
        profiler = _Profiler(t.profile_steps, self.run_dir / "profile", self.d.rank)
        tokens_per_step = t.batch_size * cfg.pack.seq_len
        self.model.train()
        stopped = None
        # Python's collector off in the loop and run at the same steps on every rank: a collection at a
        # random moment on one rank makes every other rank wait for it in the next collective.
        gc_paused = bool(t.gc_every) and gc.isenabled()
        if gc_paused:
            gc.disable()
        try:
            while self.step < t.max_steps:
                tick = time.perf_counter()
                profiler.before(self.step + 1)
                lr = self.lr_at(self.step + 1)
                measured = self.train_step()
                result = self.optimizer_step(lr, measured["loss"], (self.step + 1) % t.update_ratio_every == 0)
                profiler.after(self.step + 1)
                if self.step == 0 or resumed:
                    parallel.set_step_timeout(self.d, cfg.parallel.step_timeout_s)
                    resumed = None
                self.step += 1
                self.tokens_seen += tokens_per_step
                dt = time.perf_counter() - tick
                self.budget.spend(dt)
                self.watchdog.beat(self.step)
                if self.telemetry is not None:
                    self.telemetry.observe(dt, measured["time_comm_s"])
                if gc_paused and self.step % t.gc_every == 0:
                    gc.collect(1)
                reason = result["skip_reason"]
                rollback = bool(reason) and self.escalation.record_skip(self.step, escalate=reason != "fp16_overflow")
                self._record(measured, result, lr, dt, tokens_per_step)
                if rollback:
                    self.rollback(f"{len(self.escalation.recent)} skipped steps within {cfg.guards.rollback_window}")
                    continue
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps \
                        or self.schedule.wants_eval(self.step):
                    self.schedule.observe_eval(self.step, self.run_eval())
                if self.tasks.due(self.step, t.max_steps):
                    self.run_tasks()
                stopped = self._stop_reason(measured)
                if stopped or measured["save"] or self.step % cfg.checkpoint.every == 0 or self.step == t.max_steps:
                    self.save(stopped or ("signal" if measured["save"] else "schedule"))
                    self.requests.save = False
                if stopped:
                    self.event({"event": "stop", "step": self.step, "reason": stopped})
                    self.log(f"step {self.step}: stopping cleanly ({stopped}); the same command resumes")
                    break
        finally:
            if gc_paused:
                gc.enable()
            self.saver.wait()
            self.loader.close()
            self.watchdog.stop()
            self.requests.uninstall()
            profiler.close()
            if self.console is not None:
                self.console.close()
                self.console = None
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
        return self.summary(stopped)

    def _stop_reason(self, measured: dict[str, Any]) -> str | None:
        for fraction in self.budget.new_warnings():
            self.event({"event": "budget", "step": self.step, "fraction": fraction, "cost": self.budget.cost})
            self.log(
                f"budget: {fraction:.0%} of budget.device_hours spent "
                f"({self.budget.device_hours:.3f} h, cost {self.budget.cost:.2f})"
            )
        if measured["stop"]:
            return "SIGTERM"
        if measured["budget_exhausted"]:  # any rank's (train_step): every rank stops at the same step
            return "budget exhausted"
        return None

    def _record(self, measured: dict, result: dict, lr: float, dt: float, tokens: int) -> None:
        tps = tokens / dt
        moe = {k: v for k, v in measured.items() if k.startswith("moe/")}
        record = {"event": "step", "step": self.step, "loss": measured["loss"], "lr": lr, **result, **moe,
                  "tokens_per_s": tps, "step_time_s": dt, "tokens_seen": self.tokens_seen,
                  "mfu": mfu(self.flops_per_token, tps, self.peak, self.d.world),
                  "mem_peak_gb": peak_memory_gb(self.d.device),
                  "time_data_s": measured["time_data_s"], "time_fwd_bwd_s": measured["time_fwd_bwd_s"],
                  "time_optim_s": result["time_optim_s"], "time_comm_s": measured["time_comm_s"],
                  "skipped_steps": self.escalation.skipped_steps, "epoch": self.loader.state.epoch,
                  "data_position": self.loader.state.position,
                  "device_hours": self.budget.device_hours, "cost_so_far": self.budget.cost,
                  "cost_per_1k_steps": self.budget.cost / self.step * 1000}
        record.pop("skip_reason")
        log_step = self.step % self.cfg.train.log_every == 0 or self.step == self.cfg.train.max_steps
        alerts = []
        if self.telemetry is not None and log_step:  # every rank: the ranks' figures meet in one all-gather
            fields, alerts = self.telemetry.sample(self.step, tokens)
            record.update(fields)
        self.event(record)
        for alert in alerts:
            self.event(alert)
            if self.d.is_main:
                self.log(f"warning: step {self.step}: {alert['message']}")
        if result["skip_reason"]:  # with the data position, so `kiln shards inspect` can show the batch
            self.event({"event": "skip", "step": self.step, "reason": result["skip_reason"], "loss": measured["loss"],
                        "grad_norm": result["grad_norm"], "data_position": self.loader.state.position,
                        "epoch": self.loader.state.epoch})
        if self.console is not None:  # the live line, and a printed one every log_every steps
            self.console.step(record, result["skip_reason"])

    def summary(self, stopped: str | None = None) -> dict[str, Any]:
        last = ckpt.list_checkpoints(self.ckpt_dir)
        vals = self.history["val_loss"]
        return {"steps": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.escalation.skipped_steps,
                "rollbacks": self.escalation.rollbacks, "stopped": stopped,
                "val_loss_start": vals.get("0"), "val_loss_end": vals.get(str(self.step)),
                "checkpoint": str(last[-1]) if last else None,
                "params": sum(p.numel() for p in self.model.parameters())}


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (its shard of an FSDP2 DTensor), detached."""
    p = p.detach()
    return p.to_local() if hasattr(p, "to_local") else p


def _update_ratio(before: list[torch.Tensor], after: list[torch.Tensor], d: Dist, sharded: bool) -> float:
    """||Δw|| / ||w|| over all parameters: how far one step moved the weights.

    Squares are summed on the device over this rank's parts; sharded, one all-reduce adds the shards (under
    HSDP each shard is counted once per replica, in both sums alike, so the ratio is the same). One host sync.
    """
    zero = torch.zeros((), dtype=torch.float64, device=d.device)
    num, den = zero, zero
    for a, b in zip(after, before):
        num = num + torch.linalg.vector_norm(a - b, dtype=torch.float64) ** 2
        den = den + torch.linalg.vector_norm(b, dtype=torch.float64) ** 2
    sums = torch.stack([num, den])
    if sharded:
        parallel.all_reduce_(sums, d)
    num, den = sums.tolist()
    return (num / max(den, 1e-30)) ** 0.5


class _Profiler:
    """A torch.profiler trace of steps [first, last] when train.profile_steps asks for one."""

    def __init__(self, window: list[int] | None, out: Path, rank: int) -> None:
        self.window, self.out, self.rank, self.prof = window, out, rank, None

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self.prof = torch.profiler.profile(record_shapes=True, with_stack=False)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is not None and step == self.window[-1]:
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.out.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.out / f"trace-rank{self.rank:05d}.json"))
            self.prof = None
