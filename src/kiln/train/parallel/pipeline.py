"""Pipeline parallel for Kiln's Llama with `torch.distributed.pipelining`: the model split by layers into
stages, one (or, interleaved, two) per rank of the pipeline dimension, driven by a schedule.

Stages. `n_stages` = parallel.pp (gpipe, 1f1b) or 2·pp (interleaved_1f1b, "virtual" stages: rank r holds
stages r and r + pp, torchtitan's loop order). Each stage holds n_layers / n_stages consecutive blocks; the
first also the embeddings, the last the final norm and the output head. A `ModelPart` keeps the full
model's parameter names (`layers.7.attention.wq.weight`: the blocks sit in a ModuleDict keyed by their
index), so a stage's state dict is a slice of the model's and a checkpoint's names do not depend on the
split.

Schedules, for M micro-batches (parallel.pp_microbatches) over P stages:
- gpipe: all M forwards, then all M backwards. Bubble (P-1)/(M+P-1) of the step; activations of all M
  micro-batches live at once.
- 1f1b: after P-1 warm-up forwards each rank alternates one forward and one backward: the same bubble,
  but at most P micro-batches' activations alive (the usual choice).
- interleaved_1f1b: two stages per rank shrink the bubble to (P-1)/(2M+P-1) for twice the point-to-point
  messages.

The loss exists on the last stage only (per micro-batch, kiln.model.loss's fp32 chunked cross-entropy);
`Pipeline.step` returns the mean over the micro-batches on every rank of the pipeline (one all-reduce of
one number). Gradients are scaled by 1/M by the schedule, so a step equals one process's step on the same
batch up to float order. Gradient norms for clipping are per stage: `reduce_norms` adds their squares over
the pipeline.

Memory: each rank holds only its stages' weights, gradients and optimizer state, plus the activations of
the micro-batches in flight (M for gpipe, up to P for 1f1b), each (micro_batch, seq, dim) at a stage edge.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kiln.errors import KilnError
from kiln.train.parallel.fsdp import apply_fsdp
from kiln.train.parallel.optimizer_state import numbered

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages rank `pp_rank` of the pipeline runs: r, and r + pp when interleaved."""
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def stage_layers(stage: int, n_stages: int, n_layers: int) -> list[int]:
    per = n_layers // n_stages  # kiln.train.parallel.mesh.check_model asks that n_stages divide n_layers
    return list(range(stage * per, (stage + 1) * per))


class Blocks(nn.ModuleDict):
    """Blocks keyed by their index in the whole model (so parameter names keep it); iterates over the blocks,
    as the model's ModuleList does, for code that walks `model.layers` (FSDP2 wrapping, the precision policy)."""

    def __iter__(self):
        return iter(self.values())


class ModelPart(nn.Module):
    """Some consecutive blocks of a Llama, with the embeddings if `embeddings` and the final norm and head if
    `head`; the modules are the model's own (shared, not copied), under the model's names."""

    def __init__(self, model: nn.Module, layer_ids: list[int], embeddings: bool, head: bool) -> None:
        super().__init__()
        self.config, self.vocab_size = model.config, model.vocab_size
        self.tok_embeddings = model.tok_embeddings if embeddings else None
        self.layers = Blocks({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if head else None
        self.output = model.output if head else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) on the first stage, else the previous stage's hidden states (batch, seq, dim)."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        cos, sin = self.rope_cos[: h.shape[1]], self.rope_sin[: h.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)) if self.output is not None else h


def split_model(model: nn.Module, pp_rank: int, pp: int, schedule: str) -> tuple[ModelPart, list[ModelPart]]:
    """(everything this rank holds, as one part for the optimizer and the state dict; its stages, in order).
    Drop `model` afterwards: the blocks of other ranks' stages are then freed."""
    n_stages, n_layers = pp * stages_per_rank(schedule), len(model.layers)
    ids = stage_ids(pp_rank, pp, schedule)
    stages = [ModelPart(model, stage_layers(s, n_stages, n_layers), s == 0, s == n_stages - 1) for s in ids]
    mine = [i for s in ids for i in stage_layers(s, n_stages, n_layers)]
    return ModelPart(model, mine, 0 in ids, n_stages - 1 in ids), stages


class Pipeline:
    """This rank's stages and the schedule that drives them over `group` (the mesh's pp dimension)."""

    def __init__(self, stages: list[nn.Module], pp_rank: int, pp: int, group, schedule: str, n_microbatches: int,
                 device: torch.device, loss_fn) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        n_stages = pp * stages_per_rank(schedule)
        ids = stage_ids(pp_rank, pp, schedule)
        self.group, self.n_stages, self.ids = group, n_stages, ids
        self.first, self.last = 0 in ids, n_stages - 1 in ids
        self.n_microbatches = n_microbatches
        self.replicas = None  # (group, size, parameters) when data-parallel replicas average gradients here
        self.stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(stages, ids)]
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches, loss_fn=loss_fn)
        else:
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(self.stages[0], n_microbatches, loss_fn=loss_fn)

    def step(self, batch: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Forward and backward of one batch (batch, seq + 1) through the pipeline; every rank of the pipeline
        passes the same batch. Returns the mean loss over the micro-batches (fp64, on every rank)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        kwargs = {"target": targets, "losses": losses} if self.last else {}
        with torch.autocast(batch.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            self.schedule.step(*args, **kwargs)
        if self.replicas is not None:
            self._average_gradients(*self.replicas)
        mean = torch.stack([loss.detach() for loss in losses]).double().mean() if self.last else None
        total = torch.zeros((), dtype=torch.float64, device=batch.device) if mean is None else mean
        dist.all_reduce(total, group=self.group)  # only the last stage's is non-zero
        return total

    def find(self, part: nn.Module) -> None:
        """The replicas' parameters taken again from `part`: materialising a part built on meta (to_empty)
        replaces its parameters, and the ones listed at build time would never get a gradient."""
        if self.replicas is not None:
            group, n, _ = self.replicas
            self.replicas = (group, n, list(part.parameters()))

    @staticmethod
    def _average_gradients(group, n: int, params: list[torch.Tensor]) -> None:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in params if p.grad is not None]
        flat = _flatten_dense_tensors(grads)  # one message; memory: one more copy of this rank's gradients
        dist.all_reduce(flat, group=group)
        flat.div_(n)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def reduce_norms(self, norms: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Per-group gradient norms of the whole model from each stage's: the squares add over the pipeline.
        `names` (every group, in one order, the same on all ranks) lets one all-reduce serve every group; a
        group is kept where any stage holds it."""
        device = next(iter(norms.values())).device if norms else torch.device("cpu")
        sums = torch.zeros(2, len(names), dtype=torch.float64, device=device)  # squares; stages holding the group
        for i, g in enumerate(names):
            if g in norms:
                sums[0, i], sums[1, i] = norms[g].double() ** 2, 1.0
        dist.all_reduce(sums, group=self.group)
        held = sums[1].tolist()
        return {g: sums[0, i].sqrt().float() for i, g in enumerate(names) if held[i] > 0}


def pipeline_loss(pad_id: int | None):
    """The last stage's loss: kiln.model.loss's mean next-token cross-entropy in fp32, on (logits, targets)."""
    from kiln.model.loss import chunk_rows_for, chunked_cross_entropy

    ignore = -100 if pad_id is None else pad_id

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = chunk_rows_for(logits.device) or targets.numel()
        return chunked_cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore, rows)

    return loss


# --- the Trainer's seam: build, evaluate, and full-format checkpoints of a pipelined model -------------------

def build_pipeline(model: nn.Module, mesh, sharded: bool, d, cfg, precision, pad_id: int | None
                   ) -> tuple[ModelPart, Pipeline]:
    """Split `model` (a kiln Llama, activation checkpointing applied) for this rank of `mesh` (mesh.py), then,
    if `sharded`, shard each stage with FSDP2 over the data-parallel dimensions (one stage is one FSDP2 root: its
    blocks are gathered in its own forward), or, with DDP-style replicas, average the gradients after each step.
    `cfg`: the parallel section; `precision`: parallelize.Precision. Returns (this rank's part, the pipeline).
    In training `model` is on the meta device: parallelize materialises this rank's part only afterwards (the
    same weights as one process, kiln.model.init); a model with storage keeps it, and the other stages' blocks
    are freed once `model` is dropped."""
    schedule = cfg.pp_schedule
    part, stages = split_model(model, mesh.pp_rank, mesh.pp, schedule)
    if sharded:
        for stage in stages:
            apply_fsdp(stage, d, mesh, precision.dtype, list(precision.fp32_modules))
    n_micro = cfg.pp_microbatches or mesh.pp
    pipeline = Pipeline(stages, mesh.pp_rank, mesh.pp, mesh.pp_mesh.get_group(), schedule, n_micro, d.device,
                        pipeline_loss(pad_id))
    pipeline.n_microbatches = n_micro
    if not sharded and mesh.dp_world > 1:
        # Replicas average their gradients after the pipeline's step (DDP wrapping a stage trips DDP's reducer,
        # whose hooks fire once per micro-batch in torch 2.13). One all-reduce, not overlapped with backward:
        # on GPUs dp_shard (FSDP2, overlapped) is the better partner of pipeline parallel.
        pipeline.replicas = (mesh.replicas_group, mesh.dp_world, list(part.parameters()))
    return part, pipeline


@torch.no_grad()
def evaluate(pipeline: Pipeline, batches, device: torch.device, autocast_dtype: torch.dtype | None,
             pad_id: int | None) -> tuple[float, int]:
    """(sum of token losses, predicted tokens) over `batches`, forward only through the pipeline: the same
    numbers as kiln.model.loss.summed_loss on the whole model (each micro-batch's mean loss times its token count)."""
    total, count = 0.0, 0
    for batch in batches:
        batch = batch.to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        counts = [int((t != pad_id).sum()) if pad_id is not None else t.numel()
                  for t in targets.tensor_split(pipeline.n_microbatches)]  # the schedule's own split
        losses: list[torch.Tensor] = []
        args = (inputs,) if pipeline.first else ()
        kwargs = {"target": targets, "losses": losses} if pipeline.last else {}
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            pipeline.schedule.eval(*args, **kwargs)
        summed = torch.zeros((), dtype=torch.float64, device=device)
        if pipeline.last:
            summed += sum(float(loss) * n for loss, n in zip(losses, counts))
        dist.all_reduce(summed, group=pipeline.group)
        total += float(summed)
        count += sum(counts)
    return total, count


def _to_cpu(tree):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def gather_states(part: nn.Module, optimizer: torch.optim.Optimizer, mesh) -> tuple[dict, dict]:
    """The whole model's weights and optimizer state (keyed by parameter name) on global rank 0, for the full
    checkpoint format; other ranks get empty dicts. Every rank takes part.

    Each rank gathers its stage whole (FSDP2: an all-gather over the data-parallel ranks; without cpu_offload,
    which would keep the result on global rank 0 only), the first data-parallel rank of each stage sends it to
    rank 0. Memory: one stage's state per rank, the whole model's on rank 0 (as the full format always needs;
    the sharded format avoids both).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    mine = (_to_cpu(get_model_state_dict(part, options=opts)), _to_cpu(get_optimizer_state_dict(part, optimizer,
                                                                                                  options=opts)))
    leader = mesh.dp_rank == 0 and mesh.coords[3] == 0
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if leader else None, gathered, dst=0)
    if gathered is None:
        return {}, {}
    model_sd: dict = {}
    optim_sd: dict = {"state": {}, "param_groups": None}
    for stage_model, stage_optim in (g for g in gathered if g is not None):
        model_sd.update(stage_model)
        optim_sd["state"].update(stage_optim["state"])
        if optim_sd["param_groups"] is None:
            optim_sd["param_groups"] = [dict(g) for g in stage_optim["param_groups"]]
        else:
            for group, theirs in zip(optim_sd["param_groups"], stage_optim["param_groups"]):
                group["params"] = group["params"] + theirs["params"]
    return model_sd, optim_sd


def load_states(part: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load this rank's slice of full (gathered) weights and optimizer state; every rank has read them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    if numbered(optim_sd):  # a stage cannot know the whole model's numbering
        raise KilnError("this full checkpoint's optimizer state is keyed by number (an older Kiln wrote it); resume "
                        "it once without pipeline parallel (its next checkpoint is keyed by name), then with pp")
    names = set(part.state_dict())
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(part, {k: v for k, v in model_sd.items() if k in names}, options=opts)
    groups = [{**g, "params": [p for p in g["params"] if p in names]} for g in optim_sd["param_groups"]]
    state = {k: v for k, v in optim_sd["state"].items() if k in names}
    set_optimizer_state_dict(part, optimizer, {"state": state, "param_groups": groups}, options=opts)
