"""The engine: model, optimizer and loss scaling, and the two halves of a step (OLMo-core's TrainModule).

`train_step(micro_batches, flags)` runs forward/backward over this rank's micro-batches (gradients reduced on
the last) and agrees on the loss and the parts' flags in one all-reduce. `optimizer_step(step, lr, loss)` is a
row of small steps, each one concern: set the lr, unscale (fp16), take group norms, let the schedule probe look
at the raw gradients, clip, ask the guards for a verdict, step through the loss scaling (measuring the update
ratio when asked, fp16 included), let the probes see the result, zero the gradients. The loop (trainer.py)
owns neither the model nor the optimizer; it calls these two and passes the numbers to its parts.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import torch

from kiln.config import Config, MoEConfig, TrainConfig
from kiln.errors import KilnError
from kiln.train.clip import clip, layer_groups
from kiln.train.parallel.dist import Dist
from kiln.train.parallel.parallelize import Parallelized


def attention_kernel_line(cfg: Config, model: torch.nn.Module, device: torch.device) -> str | None:
    """The line saying which kernel keeps attention inside documents (model.document_masking), or None when it
    is off; a one-line KilnError for a combination that cannot run, before any work."""
    if not cfg.model.document_masking:
        return None
    if model.eos_id is None:
        raise KilnError(f"{cfg.layout.shards}: the manifest names no eos_id, which model.document_masking "
                        "reads documents by; re-run `kiln pack`")
    kernel = model.attention_kernel(device)
    if kernel == "flex" and device.type == "cpu":
        raise KilnError(f"model.document_attention=flex: torch {torch.__version__} has no flex_attention "
                        "backward on a CPU; use model.document_attention=sdpa (or auto)")
    what = {"flex": "flex_attention (compiled)", "sdpa": "scaled_dot_product_attention with an exact mask"}
    chosen = cfg.model.document_attention
    return f"document masking: {what[kernel]} on {device.type} (model.document_attention={chosen})"


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on norms, biases and embeddings: decaying them only hurts (GPT-3, Llama)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "tok_embeddings" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, train: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    # On GPUs the fused kernel (one launch for every tensor; torchtitan's default, DTensors included); on
    # CPUs torch's per-tensor loop, where foreach took 60 ms a step against 33 ms for a 5 M-parameter model
    # (measured here). A GPU run confirms fused on the FSDP2 1B model.
    fused = True if device.type == "cuda" else None
    return torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr, betas=(train.beta1, train.beta2),
                             fused=fused)


class Guard(Protocol):
    """A guard (parts/guards.py): `check` names what is wrong with a step, or None; `accept` sees good steps."""

    def check(self, loss: float, grad_norm: float) -> str | None: ...


class LossScaling:
    """No loss scaling (fp32, bf16): the optimizer steps when the guards find nothing. Saved as `scaler`."""

    scaler: torch.amp.GradScaler | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def verdict(self, reason: str | None) -> str | None:
        return reason

    def step(self, optimizer: torch.optim.Optimizer, reason: str | None) -> tuple[float, float] | None:
        """Step unless `reason`; returns (old, new) loss scale when the scale changed."""
        if reason is None:
            optimizer.step()
        return None

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass


class Fp16Scaling(LossScaling):
    """fp16: torch.amp's GradScaler. An overflow is the scaler's normal business (lower the scale, skip).

    Under FSDP2 an overflow lands in one rank's shard, yet every rank skips the step together: the gradients
    are DTensors, whose dispatch all-reduces the scaler's found_inf (torch 2.13, found_inf_reduce_handler), so
    torch.amp's scaler needs no sharded twin (which would reduce it twice). tests/test_gpu_path.py holds every
    rank to the same verdict on 2 gloo ranks.
    """

    def __init__(self, device_type: str) -> None:
        self.scaler = torch.amp.GradScaler(device_type, init_scale=2.0**16)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def verdict(self, reason: str | None) -> str | None:
        return "fp16_overflow" if reason == "non_finite" else reason  # not escalated: no rollback for it

    def step(self, optimizer: torch.optim.Optimizer, reason: str | None) -> tuple[float, float] | None:
        scale = self.scaler.get_scale()
        if reason in (None, "fp16_overflow"):
            self.scaler.step(optimizer)  # skips the update itself on an overflow
        self.scaler.update()
        return (scale, self.scaler.get_scale()) if self.scaler.get_scale() != scale else None

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.scaler.load_state_dict(state)


def update_ratio(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                 sum_shards_: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """||Δw|| / ||w|| over all parameters: how far one step moved the weights.

    Squares are summed on the device over this rank's parts, and `sum_shards_` adds the ranks' shards when the
    parameters are sharded (Parallelized.sum_shards_). One host sync.
    """
    num = den = torch.zeros((), dtype=torch.float64, device=before[0].device if before else None)
    for a, b in zip(after, before):
        num = num + torch.linalg.vector_norm(a - b, dtype=torch.float64) ** 2
        den = den + torch.linalg.vector_norm(b, dtype=torch.float64) ** 2
    num, den = sum_shards_(torch.stack([num, den])).tolist()
    return (num / max(den, 1e-30)) ** 0.5


def local_part(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (its shard of an FSDP2 DTensor, no communication), detached."""
    p = p.detach()
    return p.to_local() if hasattr(p, "to_local") else p


class Engine:
    """What one optimizer step needs, and nothing of the loop around it.

    `parallel` is parallelize()'s result (model, forward module, autocast, loss function); `guards` are asked
    in order, the first verdict wins; `probes` (parts/schedule_probe.py) get `before_clip(engine)` with the
    raw gradients and `after_step(engine, step, grad_norm, out)` after the update; `event` writes a record.
    """

    def __init__(self, parallel: Parallelized, train: TrainConfig, moe: MoEConfig | None, d: Dist,
                 pad_id: int | None = None, guards: Sequence[Guard] = (), probes: Sequence[Any] = (),
                 event: Callable[[dict], None] = lambda record: None) -> None:
        self.parallel, self.train_cfg, self.moe, self.d = parallel, train, moe, d
        self.pad_id = pad_id  # padding (the shards' pad_id) is never a target
        self.model = parallel.model
        self.guards, self.probes, self.event = [*parallel.step_guards(), *guards], list(probes), event
        # After sharding: FSDP2 replaces the parameters with DTensors.
        self.groups = layer_groups(self.model, self.model.config.n_layers, train.upper_layers)
        self.optimizer = build_optimizer(self.model, train, d.device)
        self.scaling = Fp16Scaling(d.device.type) if train.dtype == "fp16" else LossScaling()
        # The one place the step's forward/backward is chosen: through a pipeline schedule, or per micro-batch.
        self._forward_backward = self._micro_batch if parallel.pipeline is None else self._pipeline_batch

    # --- forward/backward -------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[torch.Tensor],
                   flags: Callable[[], dict[str, bool]] = dict) -> dict:
        """Forward/backward over this rank's micro-batches, then agree on the mean loss and on the `flags()`
        asked for after backward (a request that came during it counts; any rank's True is every rank's) in one
        all-reduce: the one host sync of the step."""
        tick = time.perf_counter()
        n = len(micro_batches)
        loss_sum: torch.Tensor | float = 0.0  # sums stay on the device until the one sync below
        moe_sums: dict[str, Any] = {"aux_loss": 0.0, "z_loss": 0.0, "dropped_tokens": 0, "routed_tokens": 0}
        for i, batch in enumerate(micro_batches):
            loss_sum = loss_sum + self._forward_backward(batch.to(self.d.device, non_blocking=True), i == n - 1, n,
                                                         moe_sums)
        self.parallel.after_backward()
        t_fwd_bwd = time.perf_counter() - tick
        tick = time.perf_counter()
        flags = flags()
        agreed = torch.tensor([0.0, *map(float, flags.values())], dtype=torch.float64, device=self.d.device)
        agreed[0] = loss_sum / n
        local = [torch.as_tensor(v, dtype=torch.float64, device=self.d.device).reshape(1)
                 for v in moe_sums.values() if self.moe]
        loss_total, *rest = torch.cat([self.parallel.agree_(agreed), *local]).tolist()
        out = {"loss": loss_total / self.d.world, **{k: v > 0 for k, v in zip(flags, rest)},
               "time_fwd_bwd_s": t_fwd_bwd, "time_comm_s": time.perf_counter() - tick}
        if self.moe:  # this rank's router numbers: the balance a rank sees is what its experts get
            moe = rest[len(flags):]
            out.update({f"moe/{k}": v / n if "loss" in k else int(v) for k, v in zip(moe_sums, moe)})
        return out

    def _micro_batch(self, batch: torch.Tensor, last: bool, n: int, moe_sums: dict[str, Any]) -> torch.Tensor:
        """Forward and backward of one of `n` micro-batches; gradients reduced across ranks on the `last`."""
        p = self.parallel
        with p.no_sync(last=last):
            loss = p.loss_fn(p.module, batch, p.autocast, self.pad_id)
            total = loss + self._router_loss(moe_sums) if self.moe else loss
            self.scaling.scale(total / n).backward()
        return loss.detach()

    def _pipeline_batch(self, batch: torch.Tensor, last: bool, n: int, moe_sums: dict[str, Any]) -> torch.Tensor:
        """The pipeline-schedule variant: forward and backward of the batch over the schedule's micro-batches
        (parallel.pp_microbatches); the loss is the last stage's, agreed over the pipeline (fp16 is refused:
        the schedule's backward takes no GradScaler; mesh.check_model keeps one such batch per step)."""
        return self.parallel.pipeline.step(batch, self.parallel.autocast)

    def _router_loss(self, sums: dict[str, Any]) -> torch.Tensor:
        """MoE load-balancing and z losses of the last forward, weighted; their values are added to `sums`."""
        stats = self.model.moe_losses()
        for k in sums:
            value = stats[k]
            sums[k] = sums[k] + (value.detach() if isinstance(value, torch.Tensor) else value)
        return self.moe.aux_loss_coef * stats["aux_loss"] + self.moe.z_loss_coef * stats["z_loss"]

    # --- the optimizer step -----------------------------------------------------------------------

    def optimizer_step(self, step: int, lr: float, loss: float, measure_update: bool = False) -> dict[str, Any]:
        """Optimizer step number `step` (1-based). Returns grad norms, `skip_reason` and, when `measure_update`
        and the step was taken, `update_to_weight`."""
        tick = time.perf_counter()
        self._set_lr(lr)
        self.scaling.unscale_(self.optimizer)
        norms = self.parallel.grad_norms(self.groups)  # the whole model's (stages, expert slices added up)
        for probe in self.probes:
            probe.before_clip(self)  # the raw spread, before clipping
        t = self.train_cfg
        grad_norm = clip(self.groups, norms, t.grad_clip, t.grad_clip_groups)
        out: dict[str, Any] = {"grad_norm": grad_norm, **{f"grad_norm/{g}": float(n) for g, n in norms.items()}}
        reason = self.scaling.verdict(self.verdict(loss, grad_norm))
        self._update(step, reason, measure_update, out)
        if reason is None:
            for guard in self.guards:
                if hasattr(guard, "accept"):
                    guard.accept(loss, grad_norm)
        for probe in self.probes:
            probe.after_step(self, step, grad_norm, out)
        self.optimizer.zero_grad(set_to_none=True)
        out["skip_reason"] = reason
        out["time_optim_s"] = time.perf_counter() - tick
        return out

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """The first guard's objection, or None: every rank sees the same all-reduced numbers, so every rank
        reaches the same verdict without another collective."""
        for guard in self.guards:
            if reason := guard.check(loss, grad_norm):
                return reason
        return None

    def _update(self, step: int, reason: str | None, measure: bool, out: dict[str, Any]) -> None:
        """Step through the loss scaling; with `measure` and no objection, ||Δw|| / ||w|| (fp16 too)."""
        before = [local_part(p).clone() for p in self.model.parameters()] if measure and reason is None else None
        scale = self.scaling.step(self.optimizer, reason)
        if before is not None:
            after = [local_part(p) for p in self.model.parameters()]
            out["update_to_weight"] = update_ratio(before, after, self.parallel.sum_shards_)
        if scale is not None:
            self.event({"event": "scale", "step": step, "from": scale[0], "to": scale[1]})
