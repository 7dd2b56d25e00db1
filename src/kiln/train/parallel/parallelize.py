"""parallelize(): the one place a plain `Llama` becomes what the engine trains.

The model code knows nothing of this. `parallelize` applies, in one fixed order (each step says why it comes
where it does): the precision policy, tensor and expert parallel, activation checkpointing, the pipeline split,
FSDP2 sharding (fsdp.py), compilation, DDP wrapping. It returns a `Parallelized`: the module forward is called on, the
autocast dtype, the loss function, the mesh (mesh.py: this rank's data-parallel rank and world, which the loader
and the validator shard rows by), and how the weights and optimizer state are gathered and loaded (`no_sync`,
`full_states`, `load`), the gradient norms taken (`grad_norms`) and evaluation run (`summed_loss`). The parallel
mode is chosen here once, by the class it picks; nothing else in Kiln tests it.

A new parallelism is one more step in `parallelize` (and, if it changes how state is gathered, one more
`Parallelized` subclass).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kiln.config import ParallelConfig, TrainConfig
from kiln.errors import KilnError
from kiln.model.loss import summed_loss
from kiln.train.clip import GROUPS
from kiln.train.parallel.dist import Dist, all_reduce_, group_norms
from kiln.train.parallel.fsdp import apply_fsdp
from kiln.train.parallel.materialize import is_meta, materialize
from kiln.train.parallel.mesh import Mesh, resolve_degrees
from kiln.train.parallel.optimizer_state import by_name, by_number
from kiln.train.precision import apply_precision_policy

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The compute dtype (None: fp32, no autocast) and the module kinds kept in fp32 (train.fp32_modules)."""

    dtype: torch.dtype | None = None
    fp32_modules: tuple[str, ...] = ()

    @classmethod
    def of(cls, train: TrainConfig) -> "Precision":
        return cls(DTYPES[train.dtype], tuple(train.fp32_modules))


class Parallelized:
    """One process: the plain model, under autocast. The base of the wrapped kinds below."""

    name = "none"  # for reports only (benchmarks, logs); code asks the object, never compares this
    sharded = False  # parameters are shards (DTensors): per-rank sums need one more all-reduce
    pipeline = None  # a pipeline.Pipeline: the engine then steps through its schedule (Engine.train_step)
    every_rank_reads = False  # a resume reads the full checkpoint on every rank (each keeps its part), not rank 0
    writes_sharded_checkpoints = True  # checkpoint.format=sharded can save it (checkpoint/sharded.py)
    splits_parameters = False  # some parameter is split over ranks: sharded checkpoints are then the default
    replicas = None  # parallel.fault_tolerance=torchft: ft.ReplicaGroups, this rank's torchft Manager

    def __init__(self, model: nn.Module, d: Dist, autocast: torch.dtype | None, loss_fn: Callable,
                 mesh: Mesh | None = None) -> None:
        self.model, self.d, self.autocast, self.loss_fn = model, d, autocast, loss_fn
        self.mesh = mesh or Mesh(resolve_degrees(ParallelConfig(), d.world), d.rank, d.device.type)
        self.module: nn.Module = model  # what forward is called on

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks: the ranks of one tensor-parallel group or one pipeline
        see the same rows."""
        return self.mesh.dp_rank

    @property
    def dp_world(self) -> int:
        return self.mesh.dp_world

    @contextmanager
    def no_sync(self, last: bool):
        """Around one micro-batch's forward/backward: gradients are reduced across ranks only on the `last`."""
        yield

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (every rank takes part; rank 0 writes them)."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole optimizer state keyed by parameter name (torch.distributed.checkpoint's full form, which
        every kind writes and loads): a full checkpoint from any layout loads on any other, by name."""
        return by_name(optimizer.state_dict(), self.model, optimizer)

    def full_states(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(weights, optimizer state) of the whole model, for the full checkpoint format; every rank takes part."""
        return self.state_dict(), self.optimizer_state_dict(optimizer)

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        """Load full (unsharded) weights and optimizer state, read by rank 0 (the others pass empty dicts)."""
        self.model.load_state_dict(model_sd)
        optimizer.load_state_dict(by_number(optim_sd, self.model, optimizer))

    def checkpoint_slices(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """For a sharded checkpoint: {parameter name: (offsets, local shape, global shape)} of the plain tensors
        that are a slice of the whole model's (DTensors say their place themselves; a pipeline stage's layers
        are whole tensors under the whole model's names)."""
        return {}

    def sum_shards_(self, t: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's parameters -> the sum over the whole model (in place; no host sync)."""
        return t

    def after_backward(self) -> None:
        """After the step's last backward, before the norms (expert parallel averages its experts' gradients)."""

    def agree_(self, t: torch.Tensor) -> torch.Tensor:
        """The step's one agreement (loss, flags) summed over the ranks in place (ft.FaultTolerant: and the
        gradients averaged across torchft replica groups)."""
        return all_reduce_(t, self.d)

    def step_guards(self) -> list:
        """Guards the engine asks before its own (ft.FaultTolerant: the cross-group commit)."""
        return []

    def grad_norms(self, groups: dict[str, list[nn.Parameter]]) -> dict[str, torch.Tensor]:
        """The whole model's gradient norm per layer group (dist.group_norms where every rank sees every group)."""
        return group_norms(groups)

    def summed_loss(self, batches, pad_id: int | None) -> tuple[float, int]:
        """(sum of token losses, predicted tokens) over `batches` of this rank's validation rows."""
        return summed_loss(self.module, batches, self.d.device, self.autocast, pad_id)


class DDPModel(Parallelized):
    """Every rank holds the whole model; DDP all-reduces gradients on the last micro-batch."""

    name = "ddp"

    def __init__(self, model: nn.Module, d: Dist, autocast: torch.dtype | None, loss_fn: Callable,
                 mesh: Mesh | None = None) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(model, d, autocast, loss_fn, mesh)
        self.module = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)

    def no_sync(self, last: bool):
        return nullcontext() if last else self.module.no_sync()

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        _load_broadcast(self.model, optimizer, model_sd, optim_sd, self.d.world)


class TensorParallelModel(Parallelized):
    """Parameters that are DTensors (tensor parallel, and the FSDP2 subclass below): the whole model's state
    is gathered and loaded by torch.distributed.checkpoint, and per-rank sums add over the ranks."""

    name = "tp"
    sharded = True
    splits_parameters = True

    def state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
        )

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        _load_broadcast(self.model, optimizer, model_sd, optim_sd, self.d.world)

    def sum_shards_(self, t: torch.Tensor) -> torch.Tensor:
        # Under HSDP each shard is counted once per replica, in every such sum alike, so ratios are unchanged
        # (under tensor parallel a replicated norm weight is counted once per tp rank: a small overcount).
        return all_reduce_(t, self.d)


class FSDPModel(TensorParallelModel):
    """FSDP2: each rank holds a shard of every parameter (a DTensor); a 2-D mesh is hybrid sharding (HSDP).
    With tensor parallel too, FSDP2 shards the tensor-parallel DTensors over the data-parallel dimensions."""

    name = "fsdp"

    @contextmanager
    def no_sync(self, last: bool):
        # FSDP2: gradients are reduce-scattered after every micro-batch, so each rank accumulates only its
        # shard (skipping that sync would hold unsharded fp32 gradients, 4 bytes per parameter, on every
        # rank). Under HSDP only the all-reduce across replicas waits for the last micro-batch.
        if last:
            yield
            return
        self.model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            self.model.set_requires_all_reduce(True)


def _load_broadcast(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                    world: int) -> None:
    """Rank 0 broadcasts what it read; each rank keeps its shard (FSDP2) or the whole (DDP), so host memory
    holds one copy per node's rank 0, not one per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1)
    set_model_state_dict(model, model_sd, options=opts)
    # torch's full form is keyed by name: a state keyed by number (an older Kiln's full checkpoint) would load
    # as entries attached to no parameter, and AdamW would start again from step 1.
    set_optimizer_state_dict(model, optimizer, by_name(optim_sd, model, optimizer) if optim_sd else optim_sd,
                             options=opts)


class _ExpertHooks:
    """What expert parallel adds to a data-parallel kind (DDP or FSDP2): `self.experts` (expert.ExpertParallel)
    syncs the experts' gradients, adds their squares to the clipping norms and names their checkpoint boxes."""

    experts: Any

    def checkpoint_slices(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        return self.experts.checkpoint_slices()

    def after_backward(self) -> None:
        self.experts.sync_gradients()

    def grad_norms(self, groups: dict[str, list[nn.Parameter]]) -> dict[str, torch.Tensor]:
        return self.experts.group_norms(groups)


class ExpertParallelModel(_ExpertHooks, DDPModel):
    """Expert parallel (parallel.ep) over DDP replicas: each rank holds n_experts/ep of every MoE block's experts
    (expert.py). DDP skips the expert weights, whose gradients the ranks holding the same experts average after
    backward; the clipping norms add the experts' squares over the expert group; a sharded checkpoint (the
    default) has each rank write its experts as a box of the whole (n_experts, ...) tensor; full checkpoints
    gather the experts whole, and a resume (every rank reads the checkpoint) slices them again."""

    name = "ddp+ep"
    every_rank_reads = True
    splits_parameters = True

    def __init__(self, model: nn.Module, d: Dist, autocast: torch.dtype | None, loss_fn: Callable,
                 mesh: Mesh | None = None, experts=None) -> None:
        self.experts = experts
        experts.keep_out_of_ddp(model)  # before DDP registers its hooks
        super().__init__(model, d, autocast, loss_fn, mesh)

    def full_states(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return self.experts.full_states(self.state_dict(), self.optimizer_state_dict(optimizer))

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        model_sd, optim_sd = self.experts.local_states(model_sd, by_name(optim_sd, self.model, optimizer))
        self.model.load_state_dict(model_sd)
        optimizer.load_state_dict(by_number(optim_sd, self.model, optimizer))


class ExpertFSDPModel(_ExpertHooks, FSDPModel):
    """Expert parallel (parallel.ep) with FSDP2/HSDP: FSDP2 shards the dense weights over the data-parallel
    dimensions; the experts, n_experts/ep per rank (expert.py), stay out of it (`ignored_params`): each rank holds
    its share already, and FSDP2 would shard it again over ranks that hold other experts. As under DDP, their
    gradients are averaged over the ranks holding the same experts after backward, and the clipping norms add the
    experts' squares over the expert group (the dense weights' from FSDP2's shards). A sharded checkpoint (the
    default) holds FSDP2's shards of the dense weights and each rank's experts as a box of the whole tensor
    (`checkpoint_slices`). Full checkpoints: FSDP2 gathers the dense weights onto rank 0 and the expert group
    gathers the experts whole (one tensor at a time); a resume (every rank reads the checkpoint) slices the
    experts again and keeps its shard of the rest.
    Per-rank sums (`sum_shards_`) count each expert once per replica: a small overcount in update ratios."""

    name = "fsdp+ep"
    every_rank_reads = True

    def __init__(self, model: nn.Module, d: Dist, autocast: torch.dtype | None, loss_fn: Callable,
                 mesh: Mesh | None = None, experts=None) -> None:
        super().__init__(model, d, autocast, loss_fn, mesh)
        self.experts = experts

    def full_states(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        model_sd, optim_sd = self.state_dict(), self.optimizer_state_dict(optimizer)  # on rank 0 (cpu_offload)
        for name, p in zip(self.experts.names, self.experts.params):  # every rank takes part in each gather
            whole = self.experts._gather(p.detach()).cpu()
            moments = {k: self.experts._gather(v).cpu() for k, v in optimizer.state.get(p, {}).items()
                       if k != "step" and v.ndim > 0}
            if self.d.is_main:
                model_sd[name] = whole
                optim_sd["state"].get(name, {}).update(moments)
        return model_sd, optim_sd

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        names, cut = set(self.experts.names), self.experts._slice
        optim_sd = by_name(optim_sd, self.model, optimizer)  # every rank read it
        model_sd = {k: cut(v) if k in names else v for k, v in model_sd.items()}
        state = {k: {n: cut(t) if n != "step" and t.ndim > 0 else t for n, t in v.items()} if k in names else v
                 for k, v in optim_sd["state"].items()}
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)  # every rank read it whole
        set_model_state_dict(self.model, model_sd, options=opts)
        set_optimizer_state_dict(self.model, optimizer, {**optim_sd, "state": state}, options=opts)


class PipelineModel(Parallelized):
    """Pipeline parallel (parallel.pp): this rank's stages only (`model` is the part the optimizer sees), driven
    by the schedule in Engine.train_step; each stage is sharded by FSDP2 or its replicas average gradients after
    the step (pipeline.build_pipeline). The loss is the last stage's, agreed over the pipeline; gradient norms add
    their squares over the stages; evaluation runs forward only through the schedule; sharded checkpoints (the
    default) have each stage write its own layers under the whole model's names; full ones gather every stage on
    rank 0, and a resume (every rank reads) keeps each stage's part."""

    name = "pp"
    every_rank_reads = True
    splits_parameters = True

    def __init__(self, model: nn.Module, d: Dist, autocast: torch.dtype | None, loss_fn: Callable,
                 mesh: Mesh | None = None, pipeline=None) -> None:
        super().__init__(model, d, autocast, loss_fn, mesh)
        self.pipeline = pipeline
        self.sharded = any(hasattr(p, "device_mesh") for p in model.parameters())

    def full_states(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        from kiln.train.parallel.pipeline import gather_states

        return gather_states(self.model, optimizer, self.mesh)

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        from kiln.train.parallel.pipeline import load_states

        load_states(self.model, optimizer, model_sd, optim_sd)

    def sum_shards_(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_(t, self.d)  # stages (and FSDP2 shards) are parts of the whole model

    def grad_norms(self, groups: dict[str, list[nn.Parameter]]) -> dict[str, torch.Tensor]:
        return self.pipeline.reduce_norms(group_norms(groups), GROUPS)

    def summed_loss(self, batches, pad_id: int | None) -> tuple[float, int]:
        from kiln.train.parallel.pipeline import evaluate

        return evaluate(self.pipeline, batches, self.d.device, self.autocast, pad_id)


def kind_for(mesh: Mesh) -> type[Parallelized]:
    """The degrees' data-parallel mode (mesh.py: `auto` is DDP on several ranks, nothing on one, FSDP2 when asked
    to shard or under tensor parallel) and the model-parallel degrees -> the kind."""
    if mesh.pp > 1:
        return PipelineModel
    if mesh.mode == "fsdp":
        return ExpertFSDPModel if mesh.ep > 1 else FSDPModel
    if mesh.tp > 1:
        return TensorParallelModel
    if mesh.ep > 1:
        return ExpertParallelModel
    return DDPModel if mesh.mode == "ddp" else Parallelized


def fault_tolerant(kind: type[Parallelized], cfg: ParallelConfig, d: Dist) -> type[Parallelized]:
    """Step 8 of parallelize: under parallel.fault_tolerance=torchft the group's own kind with ft.FaultTolerant's
    cross-group all-reduce and commit, and this rank's torchft Manager (ft.ReplicaGroups, joined at once); the
    kind as it is otherwise."""
    if cfg.fault_tolerance != "torchft":
        return kind
    from kiln.train.parallel.ft import FaultTolerant, ReplicaGroups

    return type(f"FaultTolerant{kind.__name__}", (FaultTolerant, kind),
                {"name": f"{kind.name}+torchft", "replicas": ReplicaGroups(cfg.torchft, d)})


def parallelize(model: nn.Module, d: Dist, cfg: ParallelConfig, precision: Precision, loss_fn: Callable,
                mesh: Mesh | None = None, pad_id: int | None = None, seed: int | None = None) -> Parallelized:
    """Apply the parallel section to `model` (on its device, or on the meta device: then `seed` draws its initial
    weights in step 5b), on `mesh` (mesh.build_mesh, checked before any work; None: the data-parallel degrees of
    `cfg` on d.world ranks), in this order (torchtitan's, but for compile, which #14 measured after FSDP2):

    1. precision policy (autocast kinds): wraps the fp32 modules' bound forwards, first, so that checkpointing
       and compilation see the wrapped forwards. Under FSDP2, which casts parameters instead of autocasting,
       the fp32 modules become shard groups of their own in step 5.
    2. tensor parallel, expert parallel: they change what a block's parameters are (DTensors sharded over the
       mesh's tp dimension; a rank's share of the experts), so everything after must wrap the changed blocks:
       checkpointing then recomputes TP's collectives and the all-to-all in backward, and FSDP2 shards the
       tensor-parallel DTensors over the data-parallel dimensions of the same mesh.
    3. activation checkpointing: wraps each block before the split and before sharding, so each FSDP2 unit is
       one checkpointed block and the recomputed forward gathers its own shard.
    4. the pipeline split: this rank keeps its stages only; each stage is its own FSDP2 root (sharded there, as
       step 5 does for the whole model), or its replicas average gradients after the schedule's step.
    5. FSDP2 sharding, in place: replaces the parameters by DTensors, which everything after must see.
    5b. materialisation (a model built on meta): storage on the device for this rank's part only, drawn by
       kiln.model.init's rule (materialize.py): after every split, so no rank holds the whole model; before
       compilation and DDP, which broadcasts rank 0's weights when it wraps.
    6. compilation: one process compiles model and loss in one graph; otherwise the model alone, after
       sharding, so the wrapper's hooks stay outside the compiled blocks (torchtitan compiles each block
       before fully_shard, to the same effect: FSDP2's hooks are module hooks outside the blocks' graphs).
    7. DDP wrapping, last: DDP registers its gradient hooks on the final parameters (the experts kept out).
    """
    mesh = mesh or Mesh(resolve_degrees(cfg, d.world), d.rank, d.device.type)
    kind = fault_tolerant(kind_for(mesh), cfg, d)  # 8, from the start: torchft replica groups (ft.py) when asked
    autocast, extra = precision.dtype, {}
    if precision.fp32_modules and mesh.mode != "fsdp":
        apply_precision_policy(model, list(precision.fp32_modules))  # 1
    loss_fn = _model_parallel(model, mesh, cfg, loss_fn, extra)  # 2
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)  # 3
    if kind is PipelineModel:
        from kiln.train.parallel.pipeline import build_pipeline

        sharded = mesh.mode == "fsdp"
        model, extra["pipeline"] = build_pipeline(model, mesh, sharded, d, cfg, precision, pad_id)  # 4 (and 5)
        autocast = None if sharded else autocast
    elif issubclass(kind, FSDPModel):
        experts = set(extra["experts"].params) if "experts" in extra else set()  # already split: FSDP2 keeps out
        try:
            apply_fsdp(model, d, mesh, precision.dtype, list(precision.fp32_modules), experts)  # 5
        except ValueError as exc:
            raise KilnError(str(exc)) from None
        autocast = None  # FSDP2's mixed-precision policy casts parameters instead
    if is_meta(model) and seed is not None:  # 5b (no seed: left on meta, for `kiln plan --trace`'s fake tensors)
        stages = [s.submod for s in extra["pipeline"].stages] if "pipeline" in extra else []
        materialize(model, d.device, seed, stages)
        for listed in ("experts", "pipeline"):  # to_empty replaced the parameters they listed (experts FSDP2
            if listed in extra:  # leaves out; those whose gradients a stage's replicas average)
                extra[listed].find(model)
    if cfg.compile and kind is Parallelized:  # 6
        # Model and loss in one graph: the upcast and log-softmax over the vocabulary fuse too
        # (+9-14% over compiling the model alone, BENCHMARKS.md), in one piece.
        loss_fn = torch.compile(functools.partial(loss_fn, chunk_rows=None))
    elif cfg.compile:
        model.compile()
    return kind(model, d, autocast, loss_fn, mesh, **extra)  # 7 (DDPModel wraps here)


def _model_parallel(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, loss_fn: Callable, extra: dict) -> Callable:
    """Step 2 of parallelize: tensor parallel (the loss then comes from vocabulary shards) and expert parallel
    (its groups go into `extra` for ExpertParallelModel). Returns the loss function."""
    if mesh.tp > 1:
        from kiln.train.parallel.tensor import apply_tensor_parallel, vocab_parallel_loss

        apply_tensor_parallel(model, mesh.tp_mesh)
        loss_fn = vocab_parallel_loss
    if mesh.ep > 1:  # this rank's share of every MoE block's experts, reached by all-to-all
        from kiln.train.parallel.expert import ExpertParallel

        extra["experts"] = ExpertParallel(model, mesh.dp_rank, mesh.dp_world, mesh.ep)
    return loss_fn


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward: memory for compute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    # An MoE block records its router numbers on the module in forward. Under checkpointing dynamo refuses
    # that side effect (it would be replayed when the forward is recomputed in backward) and breaks the
    # graph: the MoE blocks then ran eagerly. Recomputing gives the same numbers, so the replay may be skipped
    # (torchtitan sets the same).
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
