"""parallelize(): the one place a plain `Llama` becomes what the engine trains.

The model code knows nothing of this. `parallelize` applies, in one fixed order (each step says why it comes
where it does): the precision policy, activation checkpointing, FSDP2 sharding, compilation, DDP wrapping. It
returns a `Parallelized`: the module forward is called on, the autocast dtype, the loss function, and how the
weights and optimizer state are gathered and loaded (`no_sync`, `state_dict`, `load`). The parallel mode is
chosen here once, by the class it picks; nothing else in Kiln tests it.

A new parallelism is one more step in `parallelize` (and, if it changes how state is gathered, one more
`Parallelized` subclass).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kiln.config import ParallelConfig, TrainConfig
from kiln.errors import KilnError
from kiln.train.parallel.dist import Dist, all_reduce_, init_single_process_group
from kiln.train.precision import apply_precision_policy, modules_of_kind

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

    def __init__(self, model: nn.Module, d: Dist, autocast: torch.dtype | None, loss_fn: Callable) -> None:
        self.model, self.d, self.autocast, self.loss_fn = model, d, autocast, loss_fn
        self.module: nn.Module = model  # what forward is called on

    @contextmanager
    def no_sync(self, last: bool):
        """Around one micro-batch's forward/backward: gradients are reduced across ranks only on the `last`."""
        yield

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (every rank takes part; rank 0 writes them)."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        """Load full (unsharded) weights and optimizer state, read by rank 0 (the others pass empty dicts)."""
        self.model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)

    def sum_shards_(self, t: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's parameters -> the sum over the whole model (in place; no host sync)."""
        return t


class DDPModel(Parallelized):
    """Every rank holds the whole model; DDP all-reduces gradients on the last micro-batch."""

    name = "ddp"

    def __init__(self, model: nn.Module, d: Dist, autocast: torch.dtype | None, loss_fn: Callable) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(model, d, autocast, loss_fn)
        self.module = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)

    def no_sync(self, last: bool):
        return nullcontext() if last else self.module.no_sync()

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        _load_broadcast(self.model, optimizer, model_sd, optim_sd, self.d.world)


class FSDPModel(Parallelized):
    """FSDP2: each rank holds a shard of every parameter (a DTensor); a 2-D mesh is hybrid sharding (HSDP)."""

    name = "fsdp"
    sharded = True

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
        # Under HSDP each shard is counted once per replica, in every such sum alike, so ratios are unchanged.
        return all_reduce_(t, self.d)


def _load_broadcast(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                    world: int) -> None:
    """Rank 0 broadcasts what it read; each rank keeps its shard (FSDP2) or the whole (DDP), so host memory
    holds one copy per node's rank 0, not one per rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1)
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)


def kind_for(cfg: ParallelConfig, d: Dist) -> type[Parallelized]:
    """parallel.mode -> the kind: `auto` is DDP on several ranks, nothing on one; DDP on one rank is nothing."""
    if cfg.mode == "fsdp":
        return FSDPModel
    return DDPModel if d.world > 1 else Parallelized


def parallelize(model: nn.Module, d: Dist, cfg: ParallelConfig, precision: Precision,
                loss_fn: Callable) -> Parallelized:
    """Apply the parallel section to `model` (on its device), in this order:

    1. precision policy (autocast kinds): wraps the fp32 modules' bound forwards, first, so that checkpointing
       and compilation see the wrapped forwards. Under FSDP2, which casts parameters instead of autocasting,
       the fp32 modules become shard groups of their own in step 3.
    2. activation checkpointing: wraps each block before sharding, so each FSDP2 unit is one checkpointed block
       and the recomputed forward gathers its own shard (torchtitan's order: AC, then compile, then FSDP).
    3. FSDP2 sharding, in place: replaces the parameters by DTensors, which everything after must see.
    4. compilation: one process compiles model and loss in one graph; under DDP/FSDP2 the model alone, after
       sharding, so the wrapper's hooks stay outside the compiled blocks.
    5. DDP wrapping, last: DDP registers its gradient hooks on the final parameters.
    """
    kind = kind_for(cfg, d)
    autocast = precision.dtype
    if precision.fp32_modules and kind is not FSDPModel:
        apply_precision_policy(model, list(precision.fp32_modules))  # 1
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)  # 2
    if kind is FSDPModel:
        try:
            apply_fsdp(model, d, cfg.mesh, precision.dtype, list(precision.fp32_modules))  # 3
        except ValueError as exc:
            raise KilnError(str(exc)) from None
        autocast = None  # FSDP2's mixed-precision policy casts parameters instead
    if cfg.compile and kind is Parallelized:  # 4
        # Model and loss in one graph: the upcast and log-softmax over the vocabulary fuse too
        # (+9-14% over compiling the model alone, BENCHMARKS.md), in one piece.
        loss_fn = torch.compile(functools.partial(loss_fn, chunk_rows=None))
    elif cfg.compile:
        model.compile()
    return kind(model, d, autocast, loss_fn)  # 5 (DDPModel wraps here)


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


def apply_fsdp(model: nn.Module, d: Dist, mesh_shape: list[int] | None, param_dtype: torch.dtype | None,
               fp32_kinds: list[str] = ()) -> None:
    """FSDP2: shard each block, then the root; a 2-D mesh [replicate, shard] gives hybrid sharding (HSDP).

    `fp32_kinds` (train.fp32_modules) are sharded as groups of their own whose parameters are gathered in
    fp32 and whose inputs are cast to fp32: FSDP2's counterpart of running them outside autocast. Their
    outputs return in the compute dtype, which the rest of the block expects, except the output head's:
    fp32 logits are why one keeps the head in fp32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if model.config.tie_embeddings and {"output", "embeddings"} & set(fp32_kinds):
        raise ValueError("train.fp32_modules with 'output' or 'embeddings' needs untied embeddings under FSDP2 "
                        "(one weight cannot sit in two shard groups of different dtypes); set "
                        "model.tie_embeddings: false, or use parallel.mode=ddp")
    init_single_process_group(d)  # FSDP2 on one device (no torchrun)
    shape = tuple(mesh_shape) if mesh_shape else (d.world,)
    if int(torch.tensor(shape).prod()) != d.world:
        raise ValueError(
            f"parallel.mesh={list(shape)} multiplies to {int(torch.tensor(shape).prod())}, not the {d.world} ranks"
        )
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh(d.device.type, shape, mesh_dim_names=names)
    # Parameters are gathered in the compute dtype; gradients are reduced in fp32 so small updates survive.
    # Inputs are not cast: a block's activations are already in the compute dtype, and casting would turn the
    # fp32 RoPE tables to bf16 in every block, which DDP under autocast does not do (torchtitan: the same).
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if param_dtype is not None and param_dtype != torch.float32:
        for kind in fp32_kinds:
            keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=None if kind == "output" else param_dtype)
            for module in modules_of_kind(model, kind):
                fully_shard(module, mesh=mesh, mp_policy=keep)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # The root group (embeddings, final norm, head) is used again at once by backward: resharding it after
    # forward would only gather it again. A GPU run confirms the memory/communication trade on the 1B model.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
