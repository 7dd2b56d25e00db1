"""One DeviceMesh from the parallel degrees: pipeline, data (replicate x shard) and tensor parallel.

The degrees `parallel.pp`, `dp_replicate`, `dp_shard` and `tp` multiply to the world size. Dimensions,
outermost first: pp, dp_replicate, dp_shard, tp (torchtitan's order):
- tp innermost: its collectives run inside every block, forward and backward (an all-gather and a
  reduce-scatter of the activations around attention and around the MLP), so its ranks must be neighbours
  (consecutive ranks = one node's GPUs over NVLink).
- dp_shard next: FSDP2 all-gathers weights and reduce-scatters gradients once per block, overlapped with
  compute; within a node or across a fast fabric.
- dp_replicate: one gradient all-reduce per step (HSDP's across-node dimension).
- pp outermost: one activation per micro-batch between neighbouring stages, the least traffic; it may cross
  the slowest links.

Rank r sits at coordinates (pp, rep, shard, tp) with r = ((pp·R + rep)·S + shard)·T + tp. The loader
and evaluation shard the data over the data-parallel ranks only (dp_rank = rep·S + shard): the ranks of
one tensor-parallel group, and of one pipeline, see the same batch.

Every invalid combination is a one-line ConfigError raised before any data is read or model built.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kiln.config import Config, ParallelConfig
from kiln.errors import ConfigError

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Degrees:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    mode: str = "none"  # how the data-parallel dimensions are applied: none | ddp | fsdp
    ep: int = 1  # expert parallel: MoE experts split over this many of the data-parallel (DDP) ranks

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.pp, self.dp_replicate, self.dp_shard, self.tp


def resolve_degrees(p: ParallelConfig, world: int) -> Degrees:
    """The four degrees and the data-parallel mode, checked against the world size."""
    model_parallel = p.tp * p.pp
    if world % model_parallel:
        raise ConfigError(f"parallel.tp={p.tp} x parallel.pp={p.pp} = {model_parallel} does not divide the {world} "
                          f"ranks; launch a multiple of {model_parallel} ranks or lower parallel.tp / parallel.pp")
    dp = world // model_parallel
    rep, shard = p.dp_replicate, p.dp_shard
    # auto: FSDP2 when asked to shard (dp_shard, or parallel.mesh: the HSDP shorthand), and under tensor parallel
    # (DDP cannot wrap DTensor parameters).
    fsdp = p.mode == "fsdp" or (p.mode == "auto" and (bool(p.mesh) or (shard or 1) > 1
                                                      or (p.tp > 1 and dp > 1 and rep is None)))
    if p.mode == "ddp" and shard not in (None, 1):
        raise ConfigError(f"parallel.dp_shard={shard} shards with FSDP2, but parallel.mode=ddp; "
                          "set parallel.mode=fsdp (or auto), or parallel.dp_shard=1")
    if p.mode == "ddp" and p.mesh:
        raise ConfigError(f"parallel.mesh={list(p.mesh)} is FSDP2's [replicate, shard] mesh, but parallel.mode=ddp; "
                          "set parallel.mode=fsdp (or auto), or remove parallel.mesh")
    if fsdp:
        if p.mesh and (rep, shard) == (None, None):
            if len(p.mesh) not in (1, 2):
                raise ConfigError(f"parallel.mesh={p.mesh} must be [shard] or [replicate, shard]")
            rep, shard = (p.mesh[0], p.mesh[1]) if len(p.mesh) == 2 else (1, p.mesh[0])
            if rep * shard != dp:
                ranks = f"{dp} data-parallel ranks (world / (tp·pp))" if model_parallel > 1 else f"{dp} ranks"
                raise ConfigError(f"parallel.mesh={list(p.mesh)} multiplies to {rep * shard}, not the {ranks}; "
                                  "give a [replicate, shard] whose product is that")
        elif p.mesh:
            raise ConfigError("parallel.mesh and parallel.dp_replicate/dp_shard both set; "
                              "keep one (parallel.mesh [R, S] means dp_replicate=R, dp_shard=S)")
        # FSDP2 shards over every data-parallel rank unless asked to replicate too; one given degree fixes the other.
        for known, key in ((shard, "parallel.dp_shard"), (rep, "parallel.dp_replicate")):
            if known is not None and (rep is None or shard is None) and dp % known:
                raise ConfigError(f"{key}={known} does not divide the {dp} data-parallel ranks (world / (tp·pp)); "
                                  "choose a divisor, or set both dp_replicate and dp_shard")
        if rep is None and shard is None:
            rep, shard = 1, dp
        elif rep is None:
            rep = dp // shard
        elif shard is None:
            shard = dp // rep
        mode = "fsdp"
    else:
        rep, shard = rep or dp, 1
        mode = "ddp" if rep > 1 else "none"
    if mode == "ddp" and p.tp > 1:
        raise ConfigError(f"parallel.tp={p.tp} composes with FSDP2, not DDP (which cannot wrap DTensor parameters); "
                          f"set parallel.dp_shard={dp} (or parallel.mode=fsdp, or auto)")
    degrees = Degrees(p.pp, rep, shard, p.tp, mode, p.ep)
    if degrees.world != world:
        raise ConfigError(f"parallel.dp_replicate={rep} x dp_shard={shard} x tp={p.tp} x pp={p.pp} = "
                          f"{degrees.world}, not the {world} ranks; set degrees whose product is the world size, "
                          "or leave dp_replicate/dp_shard unset to derive them")
    return degrees


def check_model(degrees: Degrees, cfg: Config, vocab_size: int, micro_batch: int) -> None:
    """The model and batch split the way the degrees ask, or a ConfigError naming the keys and the fix."""
    if degrees.tp > 1:
        _check_tensor_parallel(degrees.tp, cfg, vocab_size)
    if degrees.pp > 1:
        _check_pipeline(degrees, cfg, micro_batch)
    if cfg.parallel.ep > 1:
        _check_expert_parallel(degrees, cfg)


def _check_tensor_parallel(tp: int, cfg: Config, vocab_size: int) -> None:
    m = args = cfg.model  # the model config's derived widths (kv_heads, hidden) are the model's
    for key, value in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads),
                       ("the feed-forward width (model.ffn_hidden)", args.hidden),
                       ("the vocabulary (tokenizer.vocab_size)", vocab_size),
                       ("pack.seq_len (sequence-parallel norms split it)", cfg.pack.seq_len)):
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide {key} = {value}; "
                              f"choose a parallel.tp that divides it")
    if m.tie_embeddings:
        raise ConfigError("parallel.tp>1 shards the embedding by vocabulary rows and the output head by "
                          "vocabulary columns, which one tied weight cannot be; set model.tie_embeddings=false")
    if m.moe.n_experts:
        raise ConfigError("parallel.tp>1 does not shard MoE experts; use parallel.tp=1 for an MoE model")
    if cfg.eval.tasks:
        raise ConfigError("eval.tasks score rows of any length, which sequence parallelism (parallel.tp>1) "
                          "cannot split; run the tasks on the checkpoint with parallel.tp=1")


def _check_pipeline(degrees: Degrees, cfg: Config, micro_batch: int) -> None:
    m, p = cfg.model, cfg.parallel
    stages = degrees.pp * (2 if p.pp_schedule == "interleaved_1f1b" else 1)
    if m.n_layers % stages:
        raise ConfigError(f"model.n_layers={m.n_layers} does not split into {stages} pipeline stages of equal "
                          f"depth (parallel.pp={degrees.pp}, pp_schedule={p.pp_schedule}); choose a parallel.pp "
                          "whose stage count divides the layers")
    unsupported = [(degrees.tp > 1, "parallel.tp>1"), (m.tie_embeddings, "model.tie_embeddings (the first and "
                   "last stages would share one weight)"), (bool(m.moe.n_experts), "an MoE model"),
                   (p.compile, "parallel.compile"), (bool(cfg.eval.tasks), "eval.tasks"),
                   (bool(cfg.train.fp32_modules), "train.fp32_modules"),
                   (cfg.train.dtype == "fp16", "train.dtype=fp16 (the schedule's backward takes no GradScaler)"),
                   (m.document_masking, "model.document_masking (a later stage sees hidden states, not the tokens "
                    "its documents are read from)")]
    for on, what in unsupported:
        if on:
            raise ConfigError(f"parallel.pp>1 does not combine with {what} yet; turn one of them off")
    per_rank = cfg.train.batch_size // degrees.dp
    if cfg.train.micro_batch_size not in (None, per_rank):
        raise ConfigError(f"under parallel.pp>1 the pipeline cuts each rank's {per_rank} sequences into "
                          "parallel.pp_microbatches itself; unset train.micro_batch_size and set that instead")
    n_micro = p.pp_microbatches or degrees.pp
    if micro_batch % n_micro:
        raise ConfigError(f"parallel.pp_microbatches={n_micro} does not divide the {micro_batch} sequences each "
                          "pipeline takes per step (train.micro_batch_size, or train.batch_size / dp); "
                          "choose a divisor")
    if p.pp_schedule != "gpipe" and n_micro < degrees.pp:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule} needs parallel.pp_microbatches >= "
                          f"parallel.pp={degrees.pp} (got {n_micro}); raise it, or use gpipe")


def _check_expert_parallel(degrees: Degrees, cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if not m.moe.n_experts:
        raise ConfigError(f"parallel.ep={p.ep} splits MoE experts, but model.moe.n_experts=0; set parallel.ep=1")
    if m.moe.n_experts % p.ep or degrees.dp % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe.n_experts={m.moe.n_experts} and the "
                          f"{degrees.dp} data-parallel ranks; choose a divisor of both")
    unsupported = [(degrees.tp > 1, "parallel.tp>1"),
                   (degrees.pp > 1, "parallel.pp>1"), (p.compile, "parallel.compile"),
                   (bool(cfg.eval.tasks), "eval.tasks (rows of any length: ranks would send the all-to-all "
                    "different sizes)"),
                   (cfg.train.dtype == "fp16", "train.dtype=fp16 (an overflow in one rank's experts would "
                    "skip the step on that rank alone)")]
    for on, what in unsupported:
        if on:
            raise ConfigError(f"parallel.ep>1 does not combine with {what} yet; turn one of them off")


@dataclass
class Mesh:
    """Where this rank sits in the degrees, and the DeviceMesh (made on first use: a DDP run needs none). Every
    mode takes its device mesh from here: FSDP2/HSDP (`dp_mesh`), tensor parallel (`tp_mesh`), the pipeline
    (`pp_mesh`); nothing else calls init_device_mesh, so the rank order is this one everywhere."""

    degrees: Degrees
    rank: int
    device_type: str = "cpu"

    @property
    def coords(self) -> tuple[int, int, int, int]:
        out, r = [], self.rank
        for size in reversed(self.degrees.shape):
            out.append(r % size)
            r //= size
        return tuple(reversed(out))  # type: ignore[return-value]

    @property
    def dp_rank(self) -> int:
        _, rep, shard, _ = self.coords
        return rep * self.degrees.dp_shard + shard

    @property
    def dp_world(self) -> int:
        return self.degrees.dp

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def tp(self) -> int:
        return self.degrees.tp

    @property
    def pp(self) -> int:
        return self.degrees.pp

    @property
    def ep(self) -> int:
        return self.degrees.ep

    @property
    def model_parallel(self) -> bool:
        """The model itself is split over ranks (tensor or pipeline parallel): per-rank sums cover a part."""
        return self.degrees.tp > 1 or self.degrees.pp > 1

    @property
    def mode(self) -> str:
        return self.degrees.mode

    @cached_property
    def device_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, self.degrees.shape, mesh_dim_names=DIMS)

    @property
    def tp_mesh(self):
        return self.device_mesh["tp"]

    @property
    def pp_mesh(self):
        return self.device_mesh["pp"]

    @property
    def dp_mesh(self):
        """FSDP2's mesh, the data-parallel dimensions of the one DeviceMesh, in every mode (plain FSDP2/HSDP too):
        [dp_replicate, dp_shard] (HSDP) whenever dp_replicate > 1, else dp_shard alone. With dp_shard = 1 the
        2-D mesh is still HSDP: each replica holds the whole model (what parallel.mesh [R, 1] has always meant);
        FSDP2 given the replicate dimension alone would shard over it instead."""
        if self.degrees.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    @property
    def replicas_group(self):
        """The process group of the data-parallel replicas when parallel.mode is ddp (dp_shard = 1): ranks that
        average gradients themselves (a pipeline stage's replicas)."""
        return self.device_mesh["dp_replicate"].get_group()


def build_mesh(cfg: Config, d, vocab_size: int) -> Mesh:
    """The checked degrees for this run and this rank's place in them (`d`: a kiln.train.parallel.Dist);
    a ConfigError before any work."""
    degrees = resolve_degrees(cfg.parallel, d.world)
    t = cfg.train
    check_model(degrees, cfg, vocab_size, t.micro_batch_size or max(t.batch_size // degrees.dp, 1))
    return Mesh(degrees, d.rank, d.device.type)
