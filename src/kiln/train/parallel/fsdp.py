"""FSDP2 sharding of a kiln Llama: each block, then the root, over the run's data-parallel mesh dimensions. Both
`parallelize` (the whole model) and the pipeline (each of this rank's stages) apply it."""

from __future__ import annotations

import torch
from torch import nn

from kiln.train.parallel.dist import Dist, init_single_process_group
from kiln.train.parallel.mesh import Degrees, Mesh
from kiln.train.precision import modules_of_kind


def apply_fsdp(model: nn.Module, d: Dist, mesh: Mesh | None = None, param_dtype: torch.dtype | None = None,
               fp32_kinds: list[str] = (), ignored: set[nn.Parameter] = frozenset()) -> None:
    """FSDP2: shard each block, then the root, over `mesh.dp_mesh` (mesh.py): the data-parallel dimensions of the
    run's one DeviceMesh, [dp_replicate, dp_shard] for hybrid sharding (HSDP). `mesh` None: plain FSDP2 over all
    d.world ranks (benchmarks and tests of a bare model), a Mesh all the same.

    `fp32_kinds` (train.fp32_modules) are sharded as groups of their own whose parameters are gathered in
    fp32 and whose inputs are cast to fp32: FSDP2's counterpart of running them outside autocast. Their
    outputs return in the compute dtype, which the rest of the block expects, except the output head's:
    fp32 logits are why one keeps the head in fp32. `ignored`: parameters FSDP2 leaves whole and local (expert
    parallel's experts, each rank's own share already).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if model.config.tie_embeddings and {"output", "embeddings"} & set(fp32_kinds):
        raise ValueError("train.fp32_modules with 'output' or 'embeddings' needs untied embeddings under FSDP2 "
                        "(one weight cannot sit in two shard groups of different dtypes); set "
                        "model.tie_embeddings: false, or use parallel.mode=ddp")
    init_single_process_group(d)  # FSDP2 on one device (no torchrun), before the DeviceMesh is made
    dp_mesh = (mesh or Mesh(Degrees(dp_shard=d.world, mode="fsdp"), d.rank, d.device.type)).dp_mesh
    # Parameters are gathered in the compute dtype; gradients are reduced in fp32 so small updates survive.
    # Inputs are not cast: a block's activations are already in the compute dtype, and casting would turn the
    # fp32 RoPE tables to bf16 in every block, which DDP under autocast does not do (torchtitan: the same).
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if param_dtype is not None and param_dtype != torch.float32:
        for kind in fp32_kinds:
            keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=None if kind == "output" else param_dtype)
            for module in modules_of_kind(model, kind):
                fully_shard(module, mesh=dp_mesh, mp_policy=keep, ignored_params=set(ignored))
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, ignored_params=set(ignored))
    # The root group (embeddings, final norm, head) is used again at once by backward: resharding it after
    # forward would only gather it again. A GPU run confirms the memory/communication trade on the 1B model.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=set(ignored))
