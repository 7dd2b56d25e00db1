"""train.init_from: a new run starts from another run's checkpoint (continued pretraining, the annealing phase).

What comes across: the weights, and with train.init_optimizer the AdamW moments (this run's own lr, betas and
weight decay still apply). Never the step, the schedule, the loader's position, the guards or the RNG states:
the run starts at step 0 with its own schedule, data and out_dir, and once it has checkpoints of its own it
resumes those (init_from is then not read again; the record below travels in its state).

The checkpoint is read through the path a resume reads through: rank 0 finds it (a checkpoint folder; a run
folder or out_dir: its newest valid checkpoint), every rank verifies its share of the files and the small
files it reads itself against the manifest (agreement.agreed_checkpoint, with checkpoint.public_key's signature
check when set), and it is read in the format it was written in, on any world size. Refused in one line: a
path with no checkpoint, a checkpoint that does not verify, a model of another shape (the keys that differ,
else the first tensor), a checkpoint trained with another tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import MANIFEST, read_manifest, sha256_file
from kiln.train.checkpoint import agreement
from kiln.checkpoint.folder import checkpoint_config, checkpoint_root, step_of
from kiln.checkpoint.sharded import CheckpointWeights
from kiln.train.parallel import broadcast_object
from kiln.train.parallel.optimizer_state import settings_kept

# The model keys (and resolved sizes) that decide the weights' shapes.
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "kv_heads", "hidden", "tie_embeddings", "moe.n_experts",
              "moe.every_n_layers", "moe.ffn_hidden")


def start_from(checkpointer, cfg, tokenizer_sha: str) -> dict[str, Any]:
    """Load train.init_from's checkpoint into the checkpointer's engine (every rank); returns the record of where
    the run started: run folder, checkpoint, sha256 of its manifest.json, checkpoint_step, optimizer (whether
    its state came)."""
    folder = agreed_source(checkpointer, Path(cfg.train.init_from))
    check_fits(folder, cfg, checkpointer.engine.model.vocab_size, tokenizer_sha)
    load_weights(checkpointer, folder, cfg.train.init_optimizer)
    return {"run": str(folder.parent.parent), "checkpoint": str(folder), "sha256": sha256_file(folder / MANIFEST),
            "checkpoint_step": step_of(folder), "optimizer": cfg.train.init_optimizer}


def agreed_source(checkpointer, path: Path) -> Path:
    """The checkpoint `path` names that every rank verifies (rank 0 looks; every rank gets its answer or its
    error, so none waits in a collective for a rank that gave up)."""
    d, found, error = checkpointer.d, None, None
    if d.is_main:
        try:
            found = checkpoint_root(path)
        except KilnError as exc:
            error = str(exc)
    found, error = broadcast_object(d, (found, error))
    if error:
        raise KilnError(f"train.init_from: {error}")
    root, exact = found
    skipped: list[str] = []
    with checkpointer.saving():
        folder = agreement.agreed_checkpoint(d, root, skipped.append, checkpointer.cfg.public_key,
                                             before=None if exact is None else step_of(exact) + 1,
                                             timeout_s=checkpointer.cfg.save_timeout_s)
    if folder is None or (exact is not None and step_of(folder) != step_of(exact)):
        why = skipped[0] if skipped else "no checkpoint there verifies"
        raise IntegrityError(f"train.init_from: {exact or root} cannot be started from ({why}); "
                             f"see `kiln ckpt verify {exact or root}`")
    return folder


def check_fits(folder: Path, cfg, vocab_size: int, tokenizer_sha: str) -> None:
    """The checkpoint's weights have this run's model's names and shapes, and its tokenizer is this run's."""
    from kiln.model.build import build_model

    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in build_model(cfg.model, vocab_size, cfg.pack.seq_len).state_dict().items()}
    with CheckpointWeights(folder) as weights:
        theirs = {k: weights.shape(k) for k in weights.keys()}
    if ours != theirs:
        raise KilnError(f"train.init_from: {folder} holds a model of another shape "
                        f"({_shape_difference(folder, cfg, ours, theirs)}); it starts only a run whose model section "
                        "gives the same shapes")
    saved = read_manifest(folder)["files"].get("tokenizer.json", {}).get("sha256")
    if saved != tokenizer_sha:
        raise KilnError(f"train.init_from: {folder} was trained with another tokenizer (sha256 {str(saved)[:12]}…, "
                        f"this run's {tokenizer_sha[:12]}…), whose ids mean other text; set tokenizer.path to "
                        f"{folder / 'tokenizer.json'} and pack this run's data with it")


def _shape_difference(folder: Path, cfg, ours: dict, theirs: dict) -> str:
    """What differs, in the config's words where the config says it, else the first tensor."""
    src, mine = checkpoint_config(folder).model, cfg.model

    def value(model, key: str) -> Any:
        for part in key.split("."):
            model = getattr(model, part)
        return model

    keys = [f"model.{k} {value(src, k)} there, {value(mine, k)} here" for k in SHAPE_KEYS
            if value(src, k) != value(mine, k)]
    embeddings = "tok_embeddings.weight"
    if theirs.get(embeddings, (0,))[0] != ours[embeddings][0]:
        keys.append(f"a vocabulary of {theirs.get(embeddings, (0,))[0]} there, {ours[embeddings][0]} here")
    if keys:
        return "; ".join(keys)
    name = next(k for k in sorted(ours.keys() | theirs.keys()) if ours.get(k) != theirs.get(k))
    return f"{name} is {theirs.get(name, 'absent')} there, {ours.get(name, 'absent')} here"


def load_weights(checkpointer, folder: Path, optimizer_state: bool) -> None:
    """The weights (and, with `optimizer_state`, the AdamW moments) of `folder`, read in its own format; this
    run's optimizer settings stay. A sharded checkpoint is read as a sharded resume reads it: each rank only the
    slices of its own part, one box at a time, and without `optimizer_state` no moment is read or made. A full
    checkpoint is the whole-model format: rank 0 reads it whole, as a full resume does."""
    engine = checkpointer.engine
    fmt = checkpointer.reader(folder)
    data = {**fmt.read(folder, checkpointer.d, engine.parallel.every_rank_reads), "optimizer_state": optimizer_state}
    optimizer = engine.optimizer
    with settings_kept(optimizer):
        fmt.load(engine.parallel, optimizer, data)
    if not optimizer_state:
        optimizer.state.clear()  # AdamW makes its moments afresh at the first step
