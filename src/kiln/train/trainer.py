"""The training loop: composed from small parts (loader, schedule, guard, metrics, checkpoints).

Run as `kiln train CONFIG` or `torchrun --nproc_per_node=N -m kiln train CONFIG`.
A run resumes from the newest valid checkpoint under {out_dir}/run/checkpoints,
and from there produces the same losses as a run that was never interrupted.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.config import Config
from kiln.errors import KilnError
from kiln.eval import next_token_loss, sample_batches, summed_loss
from kiln.model import Llama, ModelArgs
from kiln.shards.format import ShardSet
from kiln.tokenizer import tokenizer_sha256
from kiln.train import checkpoint as ckpt
from kiln.train.loader import Loader
from kiln.train.metrics import MetricsLog
from kiln.train.parallel import Dist, all_reduce_mean, all_reduce_sum, init_distributed, unwrap, wrap_model
from kiln.train.schedule import warmup_cosine

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def build_model(cfg: Config, vocab_size: int) -> Llama:
    m = cfg.model
    args = ModelArgs(vocab_size=vocab_size, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                     ffn_hidden=m.ffn_hidden, multiple_of=m.multiple_of, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                     max_seq_len=cfg.pack.seq_len, tie_embeddings=m.tie_embeddings, init_std=m.init_std)
    return Llama(args)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on norms, biases and embeddings: decaying them only hurts (GPT-3, Llama)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "tok_embeddings" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class NonFiniteGuard:
    """Skip an optimizer step whose loss or gradient norm is NaN/inf. Every rank sees the same reduced values."""

    def __init__(self) -> None:
        self.skipped = 0

    def allows(self, loss: float, grad_norm: float) -> bool:
        ok = math.isfinite(loss) and math.isfinite(grad_norm)
        self.skipped += not ok
        return ok


class Trainer:
    def __init__(self, cfg: Config, d: Dist | None = None, log=print) -> None:
        self.cfg, self.log = cfg, log
        self.d = d or init_distributed()
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        torch.manual_seed(cfg.seed)
        self.run_dir = cfg.out / "run"
        self.ckpt_dir = self.run_dir / "checkpoints"
        shards, tok_dir = cfg.out / "shards", cfg.out / "tokenizer"
        self.tokenizer_file = tok_dir / "tokenizer.json"
        tok_sha = tokenizer_sha256(tok_dir)
        self.train_set = ShardSet(shards, "train", tok_sha)
        self.val_set = ShardSet(shards, "val", tok_sha)
        if self.train_set.sample_len != cfg.pack.seq_len + 1:
            raise KilnError(f"{shards}: samples of {self.train_set.sample_len} tokens, config says pack.seq_len={cfg.pack.seq_len}; re-run `kiln pack`")
        vocab = int(self.train_set.manifest["vocab_size"])

        micro = t.micro_batch_size or t.batch_size // self.d.world
        if micro < 1:
            raise KilnError(f"train.batch_size={t.batch_size} is smaller than the world size {self.d.world}")
        self.accum = t.batch_size // (micro * self.d.world)
        try:
            self.loader = Loader(self.train_set, t.batch_size, micro, self.d.rank, self.d.world, cfg.seed)
        except ValueError as exc:
            raise KilnError(str(exc)) from None
        self.model = build_model(cfg, vocab).to(self.d.device)
        self.ddp = wrap_model(self.model, self.d)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                           foreach=True)
        self.autocast = DTYPES[t.dtype]
        self.guard = NonFiniteGuard()
        self.step, self.tokens_seen = 0, 0
        self.history: dict[str, Any] = {"val_loss": {}}
        # Settings a checkpoint cannot be resumed under when they change (train.max_steps may change).
        self.config_hash = cfg.section_hash("model", "pack", "tokenizer")

    # --- checkpoints ----------------------------------------------------------------------

    def resume(self) -> Path | None:
        folder = ckpt.latest_valid(self.ckpt_dir, log=self.log if self.d.is_main else (lambda *_: None))
        if folder is None:
            return None
        data = ckpt.load_checkpoint(folder, verify=False)  # verified by latest_valid
        state = data["state"]
        if state.get("config_hash") != self.config_hash:
            raise KilnError(f"{folder} was written with different model/pack/tokenizer settings; "
                            f"use a new out_dir, or delete {self.ckpt_dir} to start over")
        if state["world_size"] != self.d.world:
            self.log(f"resuming a run saved with {state['world_size']} ranks on {self.d.world}; the sample order is kept")
        self.model.load_state_dict(data["model"])
        self.optimizer.load_state_dict(data["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.guard.skipped = state.get("skipped_steps", 0)
        self.history = state.get("history", self.history)
        rngs = data["rng"]
        ckpt.restore_rng(rngs[self.d.rank] if self.d.rank < len(rngs) else rngs[0])
        return folder

    def save(self) -> Path | None:
        rng = ckpt.rng_state()
        rngs = [rng]
        if self.d.world > 1:
            rngs = [None] * self.d.world
            dist.all_gather_object(rngs, rng)
        path = None
        if self.d.is_main:
            state = {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                     "world_size": self.d.world, "skipped_steps": self.guard.skipped, "config_hash": self.config_hash,
                     "history": self.history}
            path = ckpt.save_checkpoint(self.ckpt_dir, self.step, self.model.state_dict(), self.optimizer.state_dict(),
                                        rngs, state, self.cfg.to_yaml(), self.tokenizer_file, self.cfg.checkpoint.keep_last)
        if self.d.world > 1:
            dist.barrier()
        return path

    # --- evaluation -----------------------------------------------------------------------

    def evaluate(self) -> float:
        """Mean loss on the first `eval_batches` batches of the validation split (same samples every time)."""
        t = self.cfg.train
        n = min(len(self.val_set), t.eval_batches * self.loader.micro_batch * self.d.world)
        if n == 0:
            raise KilnError(f"{self.cfg.out / 'shards'}: the validation split has no samples; raise pack.val_fraction")
        mine = torch.arange(n)[self.d.rank::self.d.world].numpy()
        total, count = summed_loss(self.model, sample_batches(self.val_set, mine, self.loader.micro_batch),
                                   self.d.device, self.autocast)
        total, count = all_reduce_sum([total, count], self.d)
        return total / count

    # --- the loop -------------------------------------------------------------------------

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over `accum` micro-batches; gradients sync only on the last one."""
        micro_batches = self.loader.next_batch()
        loss_sum = 0.0
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = self.ddp.no_sync() if (self.d.world > 1 and not last) else nullcontext()
            with sync:
                loss = next_token_loss(self.ddp, batch.to(self.d.device, non_blocking=True), self.autocast)
                (loss / len(micro_batches)).backward()
            loss_sum += loss.item()
        clip = self.cfg.train.grad_clip or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        return all_reduce_mean(loss_sum / len(micro_batches), self.d), grad_norm

    def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        resumed = self.resume()
        if self.d.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        metrics = MetricsLog(self.run_dir / "metrics.jsonl", self.step if resumed else -1) if self.d.is_main else None
        if resumed:
            self.log(f"resumed from {resumed} (step {self.step})")
        elif self.step == 0:
            val = self.evaluate()
            self.history["val_loss"]["0"] = val
            metrics and metrics.write({"event": "eval", "step": 0, "val_loss": val})
            self.log(f"step 0 val_loss {val:.4f}")
        tokens_per_step = t.batch_size * (cfg.pack.seq_len)
        self.model.train()
        while self.step < t.max_steps:
            t0 = time.perf_counter()
            lr = warmup_cosine(self.step + 1, t.lr, t.warmup_steps, t.max_steps, t.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss, grad_norm = self.train_step()
            if self.guard.allows(loss, grad_norm):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.tokens_seen += tokens_per_step
            dt = time.perf_counter() - t0
            record = {"event": "step", "step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "tokens_seen": self.tokens_seen,
                      "skipped_steps": self.guard.skipped, "epoch": self.loader.state.epoch,
                      "data_position": self.loader.state.position}
            metrics and metrics.write(record)
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self.log(f"step {self.step}/{t.max_steps} loss {loss:.4f} lr {lr:.2e} "
                         f"grad_norm {grad_norm:.3f} {tokens_per_step / dt:,.0f} tok/s")
            if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps:
                val = self.evaluate()
                self.history["val_loss"][str(self.step)] = val
                metrics and metrics.write({"event": "eval", "step": self.step, "val_loss": val})
                self.log(f"step {self.step} val_loss {val:.4f}")
            if self.step % cfg.checkpoint.every == 0 or self.step == t.max_steps:
                self.save()
        metrics and metrics.close()
        last = ckpt.list_checkpoints(self.ckpt_dir)
        vals = self.history["val_loss"]
        return {"steps": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.guard.skipped,
                "val_loss_start": vals.get("0"), "val_loss_end": vals.get(str(self.step)),
                "checkpoint": str(last[-1]) if last else None, "params": self.model.num_params(non_embedding=False)}

