"""The distributed side of the sharded format (kiln.checkpoint.sharded has the files and their reading): every rank
saves its own pieces of the weights and optimizer state, and loads the pieces that overlap its share of any
world size and mesh. kiln.checkpoint.sharded's docstring says what each kind of parallelism writes.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import (STAGING_MARK, read_manifest, sha256_file, staging_dir, write_atomic,
                           write_manifest)
from kiln.checkpoint.sharded import FORMAT, INDEX, KINDS, model_shapes, read_folder, read_index
from kiln.checkpoint.folder import (sign_manifest, step_dir)
from kiln.train.checkpoint.saver import Saver, all_finite, snapshot
from kiln.checkpoint.storage import (Piece, PieceIndex, dtype_name, rank_file, write_index,
                                           write_pieces)
from kiln.train.parallel.dist import all_gather_objects, broadcast_object



def resolve_format(requested: str | None, sharded: bool) -> str:
    """checkpoint.format, or its default: sharded when some parameter is split over ranks, else full."""
    return requested or ("sharded" if sharded else "full")


# --- the checkpoint's own process group ------------------------------------------------------

_GROUP: dict[str, Any] = {}


def checkpoint_group(d, timeout_s: float):
    """A gloo group for the checkpoint's collectives, with the save's timeout: a background save talks over it
    while training uses the default group, and a long write on one rank is not a hung collective (the default
    group's timeout is parallel.step_timeout_s). Made on first use, by every rank at the same point."""
    if d.world == 1:
        return None
    if _GROUP.get("world") is not dist.group.WORLD:  # a new default group (a process that re-initialised)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        _GROUP.update(world=dist.group.WORLD, group=group)
    # Every time: parallel.set_step_timeout sets the step timeout on every group, this one too.
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), _GROUP["group"])
    return _GROUP["group"]


def _gather(d, group, value: Any) -> list[Any] | None:
    """Every rank's value on rank 0 (None elsewhere)."""
    if d.world == 1:
        return [value]
    out = [None] * d.world if d.is_main else None
    dist.gather_object(value, out, dst=0, group=group)
    return out


def save_barrier(d, watchdog, timeout_s: float) -> None:
    """The end of a save on every rank: a barrier with the save's timeout, while the watchdog knows a save is in
    progress (rank 0 may still be writing a full-format checkpoint while the others wait here)."""
    if d.world == 1:
        return
    with watchdog.saving(timeout_s) if watchdog is not None else nullcontext():
        dist.barrier(group=checkpoint_group(d, timeout_s))


# --- state dicts and pieces ------------------------------------------------------------------

def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, dict], list[dict]]:
    """{"model": {name: tensor}, "optimizer": {"name/state": tensor}} and the optimizer's param_groups, as
    torch.distributed.checkpoint.state_dict gives them: FSDP2's DTensors stay sharded, DDP's and a single
    process's are plain; names carry no wrapper prefixes (DDP's module., compile's, activation checkpointing's).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)
    flat = {}
    for fqn, entries in optim_sd["state"].items():
        for name, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise KilnError(f"optimizer state {fqn}/{name} is a {type(value).__name__}, not a tensor; "
                                "checkpoint.format=sharded stores tensors only: use checkpoint.format=full")
            flat[f"{fqn}/{name}"] = value
    return {"model": model_sd, "optimizer": flat}, optim_sd["param_groups"]


def _is_shard(placement) -> bool:
    """Shard or _StridedShard (FSDP2 over a tensor-parallel dimension; its is_shard() says False)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    return isinstance(placement, (Shard, _StridedShard))


def local_boxes(global_shape, mesh_shape, coordinate, placements) -> list[tuple[tuple, tuple, tuple]]:
    """The share of a DTensor at `coordinate` of its mesh as boxes of the global tensor: [(global offsets, shape,
    the box's slices of the local tensor)], empty boxes left out.

    The global indices each sharded dimension keeps are torch's own (`_get_shard_size_and_offsets`, from which
    compute_local_shape_and_global_offset returns only the first). Shard placements leave one box. A
    _StridedShard (FSDP2 on top of tensor parallel, both sharding dim 0) keeps consecutive rows when it comes
    first, as FSDP2 places it (the dp-th part of the tp-th part of the rows: one box again); after a Shard of
    the same dim it keeps rows with gaps, which are cut here into their runs of consecutive rows: one box per
    run (and per run of every other dimension). tests/test_sharded_checkpoint_parallel.py checks both against
    torch's shards.
    """
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    sizes, index = list(global_shape), {}
    for mesh_dim, p in enumerate(placements):
        if not _is_shard(p):
            continue
        size, ids = _get_shard_size_and_offsets(sizes[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim], p,
                                                index.get(p.dim), global_shape[p.dim], False)
        if size == 0:
            return []
        sizes[p.dim], index[p.dim] = size, ids
    runs = []  # per dimension: [(global start, local start, length)]
    for dim, size in enumerate(global_shape):
        ids = index[dim].tolist() if dim in index else None
        if ids is None:
            runs.append([(0, 0, size)])
            continue
        cuts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1] + 1] + [len(ids)]
        runs.append([(ids[a], a, b - a) for a, b in zip(cuts, cuts[1:])])
    boxes = []
    for combo in itertools.product(*runs):
        shape = tuple(n for _, _, n in combo)
        if all(shape):
            boxes.append((tuple(g for g, _, _ in combo), shape, tuple(slice(a, a + n) for _, a, n in combo)))
    return boxes


def _dtensor_boxes(t) -> list[tuple[tuple, tuple, tuple]]:
    mesh = t.device_mesh
    return local_boxes(tuple(t.shape), tuple(mesh.shape), mesh.get_coordinate(), t.placements)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


Slices = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def _plain_box(slices: Slices, kind: str, key: str, t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, global shape) of a plain tensor: the whole tensor, or the slice of a larger one that the
    parallel kind says this rank holds (`Parallelized.checkpoint_slices`: {parameter name: (offsets, local shape,
    global shape)}, expert parallel's experts); an optimizer state of the parameter's shape is sliced alike."""
    box = slices.get(key if kind == "model" else key.rsplit("/", 1)[0])
    if box is not None and tuple(t.shape) == tuple(box[1]):
        return tuple(box[0]), tuple(box[2])
    return (0,) * t.ndim, tuple(t.shape)


def _my_pieces(d, group, states: dict[str, dict], slices: Slices) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                                         dict[str, dict[str, tuple]]]:
    """The pieces this rank writes: {kind: {stored key: tensor}} and {kind: {stored key: (tensor key, offsets,
    global shape)}}; the stored key is the tensor's, or `{key}#{n}` for each box of a share that is several.

    A DTensor's share is written by the ranks at coordinate 0 of each replicated mesh dimension; a plain
    tensor, or a plain slice (`slices`), held whole by several ranks by one holder: largest first, each to the
    holder with the fewest bytes so far (the same choice on every rank, from one all_gather of the plain
    pieces' names and sizes). A pipeline stage's tensors have one holder per data-parallel replica.
    """
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in states}
    boxes: dict[str, dict[str, tuple]] = {k: {} for k in states}
    plain: dict[str, int] = {}
    mine: dict[str, tuple] = {}
    for kind, sd in states.items():
        for key, t in sd.items():
            if _is_dtensor(t):
                coord = t.device_mesh.get_coordinate()
                if any(c and not _is_shard(p) for c, p in zip(coord, t.placements)):
                    continue  # a replica of a piece the rank at coordinate 0 writes
                local = t.to_local()
                parts = _dtensor_boxes(t)
                for n, (offsets, _, where) in enumerate(parts):
                    stored = key if len(parts) == 1 else f"{key}#{n}"
                    tensors[kind][stored], boxes[kind][stored] = local[where], (key, offsets, tuple(t.shape))
            else:
                offsets, glob = _plain_box(slices, kind, key, t)
                name = f"{kind}:{key}@{list(offsets)}"
                plain[name], mine[name] = t.numel() * t.element_size(), (kind, key, offsets, glob)
    held = all_gather_objects(d, plain, group)
    load = [0] * len(held)
    for name in sorted(set().union(*held), key=lambda n: (-max(h.get(n, 0) for h in held), n)):
        writer = min((r for r, h in enumerate(held) if name in h), key=lambda r: (load[r], r))
        load[writer] += held[writer][name]
        if writer == d.rank:
            kind, key, offsets, glob = mine[name]
            tensors[kind][key], boxes[kind][key] = states[kind][key], (key, offsets, glob)
    return tensors, boxes


def _merged_groups(everyone: list[list[dict]]) -> list[dict]:
    """The optimizer's param_groups of the whole model from every rank's: a pipeline stage's groups name its own
    parameters only, so each group's params are the union (in rank order); the hyperparameters are the same."""
    if len({len(groups) for groups in everyone}) > 1:
        raise KilnError("the ranks' optimizers have different numbers of parameter groups; "
                        "checkpoint.format=sharded needs one layout on every rank (use checkpoint.format=full)")
    return [{**g, "params": list(dict.fromkeys(p for groups in everyone for p in groups[i]["params"]))}
            for i, g in enumerate(everyone[0])]


def _jsonable_groups(groups: list[dict]) -> list[dict]:
    out = []
    for g in groups:
        entry = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            try:
                json.dumps(v)
            except TypeError:
                raise KilnError(f"optimizer param_groups' {k!r} is a {type(v).__name__}, which a sharded "
                                "checkpoint stores as JSON only; use checkpoint.format=full") from None
            entry[k] = v
        out.append(entry)
    return out


# --- saving ----------------------------------------------------------------------------------

class ShardedCheckpoint:
    """checkpoint.format=sharded, the four methods of full.FullCheckpoint: every rank gathers nothing but its own
    pieces and writes them (`every_rank_writes`); the save's collectives use the checkpoint's own gloo group
    with checkpoint.save_timeout_s. Memory: this rank's pieces, once more when async (the snapshot)."""

    every_rank_writes = True

    def __init__(self, d, timeout_s: float) -> None:
        self.d, self.timeout_s = d, timeout_s

    def gather(self, parallel, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """This rank's pieces {kind: {key: local tensor}} and {"boxes", "param_groups"}; every rank calls it,
        after the previous background save ended (the checkpoint group is free again)."""
        return self.pieces(parallel.model, optimizer, parallel.checkpoint_slices())

    def pieces(self, model: nn.Module, optimizer: torch.optim.Optimizer, slices: Slices | None = None
               ) -> tuple[dict, dict]:
        states, param_groups = _state_dicts(model, optimizer)
        group = checkpoint_group(self.d, self.timeout_s)
        tensors, boxes = _my_pieces(self.d, group, states, slices or {})
        groups = _merged_groups(all_gather_objects(self.d, _jsonable_groups(param_groups), group))
        return tensors, {"boxes": boxes, "param_groups": groups}

    def write(self, root: Path, step: int, weights: tuple[dict, dict], rngs: list, state: dict, config_yaml: str,
              tokenizer_file: Path, fields: dict, signing_key: str | None) -> Path:
        """Every rank, at the same step (in the background when async): rank 0 makes the staging folder, every
        rank writes its files into it, rank 0 the small files and the manifest, and commits."""
        d, (tensors, meta) = self.d, weights
        group = checkpoint_group(d, self.timeout_s)
        final = step_dir(root, step)
        stage, tmp = None, None
        try:
            stage, tmp = _open_stage(d, group, final)
            index = {"format": FORMAT, "version": 1, "world_size": d.world, "kinds": list(KINDS),
                     "index_files": [rank_file("index", r, "json") for r in range(d.world)],
                     "param_groups": meta["param_groups"]}
            small = {"state": state, "rngs": rngs, "config_yaml": config_yaml, "tokenizer_file": tokenizer_file,
                     "fields": {**fields, "checkpoint_format": "sharded"}, "index": index, "step": step}
            _write_job(d, group, tmp, stage, tensors, meta["boxes"], small, signing_key)
        except RuntimeError as exc:  # a collective failed: gloo's words when a rank went away mid-save
            if not _peer_gone(exc):
                raise
            raise _lost_rank(d, final, stage, tmp, exc) from None
        return final

    def read(self, folder: Path, d, every_rank: bool = False) -> dict[str, Any]:
        """The small files; "model" holds meta tensors of the weights' shapes (the vocabulary check). Every rank
        reads them (`every_rank` is FullCheckpoint's choice; here each rank reads its own slices in `load`)."""
        data = read_folder(folder, verify=False, weights=False)
        return {**data, "model": model_shapes(folder), "folder": Path(folder)}

    def load(self, parallel, optimizer: torch.optim.Optimizer, data: dict[str, Any]) -> None:
        """`data["optimizer_state"]` False: the weights only (train.init_from without init_optimizer)."""
        load(data["folder"], parallel.model, optimizer, self.d, self.timeout_s, parallel.checkpoint_slices(),
             data.get("optimizer_state", True))


def _open_stage(d, group, final: Path):
    """Rank 0 opens the staging folder every rank writes into (an error there is every rank's); every rank gets
    its path. Returns (rank 0's staging_dir context, or None; the folder)."""
    stage, tmp = None, None
    if d.is_main:
        try:
            stage = staging_dir(final)
            tmp = str(stage.__enter__())
        except BaseException as exc:  # every rank must hear of it (broadcast below), or they would hang
            tmp = KilnError(f"{final}: cannot create its staging folder ({exc})")
    tmp = broadcast_object(d, tmp, group)
    if isinstance(tmp, KilnError):
        raise tmp
    return stage, Path(tmp)


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, d, saver: Saver, *,
         state: dict[str, Any], rng: dict[str, Any], config_yaml: str, tokenizer_file: Path,
         manifest_fields: dict[str, Any], signing_key: str | None, timeout_s: float,
         after_commit: Callable[[], Any] = lambda: None) -> tuple[float, str | None]:
    """A sharded save of a bare model (benchmarks, tests), as checkpointer.Checkpointer.save does it with this format;
    every rank calls this at the same step. Returns (the stall in seconds, a refusal or None): refused, and
    written by no rank, when any rank's pieces hold NaN/inf. `after_commit` runs on rank 0 after the commit."""
    t0 = time.perf_counter()
    saver.wait()  # the checkpoint group is free again: no background save talks over it
    fmt = ShardedCheckpoint(d, timeout_s)
    weights = fmt.pieces(model, optimizer)
    group = checkpoint_group(d, timeout_s)
    gathered = all_gather_objects(d, (rng, all_finite(*weights)), group)
    if not all(finite for _, finite in gathered):
        return time.perf_counter() - t0, "non-finite weights or optimizer state"
    if saver.async_save:  # the snapshot must not change while the thread writes
        weights = snapshot(weights)

    def write() -> None:
        fmt.write(root, step, weights, [r for r, _ in gathered], state, config_yaml, tokenizer_file,
                  manifest_fields, signing_key)
        if d.is_main:
            after_commit()

    return time.perf_counter() - t0 + saver.save(write), None


_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "timed out", "timeout")


def _peer_gone(exc: BaseException) -> bool:
    """A collective's error that means another rank is gone or silent (killed, its host lost), not a bug."""
    return any(words in str(exc).lower() for words in _PEER_GONE)


def _lost_rank(d, final: Path, stage, tmp: Path | None, exc: BaseException) -> KilnError:
    """One line for a rank lost during a save, instead of gloo's traceback: which rank stopped answering, and
    whether the checkpoint was committed (rank 0 removes its staging folder; the next run removes what is left)."""
    if stage is not None and tmp is not None and tmp.exists():
        try:
            stage.__exit__(type(exc), exc, exc.__traceback__)  # removes the staging folder, then re-raises
        except BaseException:  # (the re-raised error: what happened is said below)
            pass
    lost = _silent_ranks(d, final.name)
    who = f"rank {', '.join(map(str, lost))}" if lost else "another rank"
    said = " ".join(str(exc).split())[:160]
    committed = final.is_dir() and not (tmp is not None and tmp.exists())
    return KilnError(f"{final}: {who} stopped answering during the sharded save (rank {d.rank} saw: {said}); "
                     + ("the checkpoint was committed before that" if committed else
                        "the checkpoint was not committed (nothing of it is kept)")
                     + ": run the same command again, it resumes from the newest committed checkpoint")


def _silent_ranks(d, tag: str, wait_s: float = 3.0) -> list[int]:
    """The ranks that do not answer within `wait_s` on the run's rendezvous store: each rank that sees the save
    fail says so there; the ones that never do are gone (or stuck elsewhere). Empty when the store is gone too."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"kiln/save-failed/{tag}/{d.rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            silent = [r for r in range(d.world) if not store.check([f"kiln/save-failed/{tag}/{r}"])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.1)
    except (RuntimeError, ValueError, OSError, AttributeError):  # no store (it lived in the lost rank)
        return []


def _write_rank_files(d, tmp: Path, tensors: dict, boxes: dict) -> dict[str, dict]:
    """This rank's pieces, index and their sizes and sha256 (hashed here: every rank hashes its own files)."""
    if not (tmp / STAGING_MARK).is_file():
        raise KilnError(f"rank {d.rank} on host {d.host} does not see the staging folder {tmp}: "
                        "checkpoint.format=sharded needs out_dir on a filesystem every rank shares "
                        "(or use checkpoint.format=full)")
    pieces: dict[str, dict[str, Piece | list[Piece]]] = {}
    names = []
    for kind in KINDS:
        name = rank_file(kind, d.rank)
        write_pieces(tmp / name, tensors[kind])
        pieces[kind] = {}
        for stored, (key, offsets, glob) in boxes[kind].items():
            t = tensors[kind][stored]
            if stored == key:
                pieces[kind][key] = Piece(name, offsets, tuple(t.shape), glob, dtype_name(t.dtype))
            else:  # one of several boxes of this rank's share
                pieces[kind].setdefault(key, []).append(Piece(name, offsets, tuple(t.shape), glob,
                                                              dtype_name(t.dtype), stored))
        names.append(name)
    name = rank_file("index", d.rank, "json")
    write_index(tmp / name, pieces)
    names.append(name)
    return {n: {"size": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in names}


def _write_job(d, group, tmp: Path, stage, tensors: dict, boxes: dict, small: dict, signing_key: str | None) -> None:
    """Every rank: its own files, then rank 0 the rest and the commit. Every rank takes part in each collective
    whatever happened before it (an error is sent, not raised), so a failure on one rank never hangs another;
    each rank raises the first failure."""
    files, error = {}, None
    try:
        files = _write_rank_files(d, tmp, tensors, boxes)
    except BaseException as exc:  # sent to rank 0 below
        error = f"rank {d.rank} on host {d.host or socket.gethostname()}: {exc}"
    reports = _gather(d, group, (files, error))
    outcome = None
    if d.is_main:
        try:
            failed = [e for _, e in reports if e]
            if failed:
                raise KilnError("sharded checkpoint not written: " + "; ".join(failed))
            hashed = {name: meta for f, _ in reports for name, meta in f.items()}
            for name, meta in hashed.items():  # what another rank wrote is here, as large as it said
                if not (tmp / name).is_file() or (tmp / name).stat().st_size != meta["size"]:
                    raise KilnError(f"{tmp / name}: written by another rank but not seen here as written; "
                                    "checkpoint.format=sharded needs a filesystem every rank shares")
            _write_small_files(tmp, small, hashed, signing_key)
            stage.__exit__(None, None, None)
        except BaseException as exc:  # broadcast below, so every rank raises it instead of hanging
            outcome = str(exc) or type(exc).__name__
            if stage is not None and tmp.exists():
                try:
                    stage.__exit__(type(exc), exc, exc.__traceback__)  # removes the staging folder
                except KilnError as plain:  # a full disk, said as staging_dir says it, and on which rank
                    where = "; ".join(e.split(":", 1)[0] for _, e in reports if e) or f"rank 0 on host {d.host}"
                    outcome = f"{where}: {plain}"
                except BaseException:  # the staging folder is gone either way; the outcome above is what counts
                    pass
    outcome = broadcast_object(d, outcome, group)
    if outcome:
        raise KilnError(outcome)


def _write_small_files(tmp: Path, small: dict, hashed: dict[str, dict], signing_key: str | None) -> None:
    import shutil

    state = small["state"]
    torch.save(small["rngs"], tmp / "rng.pt")
    write_atomic(tmp / "state.json", json.dumps(state, indent=1))
    write_atomic(tmp / "config.yaml", small["config_yaml"])
    shutil.copyfile(small["tokenizer_file"], tmp / "tokenizer.json")
    write_atomic(tmp / INDEX, json.dumps(small["index"], indent=1))
    write_manifest(tmp, hashed=hashed, stage="checkpoint", step=small["step"], tokens_seen=state.get("tokens_seen"),
                   world_size=len(small["rngs"]), **small["fields"])
    if signing_key:
        sign_manifest(tmp, signing_key)


def _fill(p: PieceIndex, kind: str, key: str, t: torch.Tensor, slices: Slices) -> None:
    """Read this rank's part of tensor `key` (its DTensor share, the slice `slices` names, or the whole of a plain
    tensor) into `t`."""
    if _is_dtensor(t):
        glob, local = tuple(t.shape), t.to_local()
        parts = [(offsets, where) for offsets, _, where in _dtensor_boxes(t)]
    else:
        (offsets, glob), local = _plain_box(slices, kind, key, t), t
        parts = [(offsets, (slice(None),) * t.ndim)] if t.numel() or not t.ndim else []
    if tuple(p.global_shape(key)) != glob:
        raise KilnError(f"{p.folder}: {key} is {list(p.global_shape(key))} in the checkpoint and "
                        f"{list(glob)} in this model; it was written for a model of another size")
    for offsets, where in parts:
        view = local[where]
        if view.device.type == "cpu":
            p.read_box(key, view, offsets)
        else:
            view.copy_(p.read_box(key, torch.empty(view.shape, dtype=view.dtype), offsets))


def _raise_first(errors: list[str | None]) -> None:
    """The ranks' errors (every rank has them all): the first one raised, on every rank."""
    errors = [e for e in errors if e]
    if errors:
        raise IntegrityError(errors[0] if len(errors) == 1 else f"{errors[0]} (and {len(errors) - 1} more ranks)")


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, d, timeout_s: float = 1800,
         slices: Slices | None = None, optimizer_state: bool = True) -> None:
    """Fill the model and optimizer (any world size and mesh: FSDP2/HSDP, DDP, tensor parallel, a pipeline stage,
    expert slices, one process) from a sharded checkpoint.

    Every rank reads only the slices of its own share (`slices`: Parallelized.checkpoint_slices, the plain
    tensors that are parts of larger ones; a pipeline stage's model holds its own layers only). Every rank calls
    this; a failure on any rank stops every rank with its message. Memory: one box at a time on GPU runs (a CPU
    staging buffer), nothing extra on CPU. Without `optimizer_state` (train.init_from without init_optimizer)
    the weights only: the optimizer's moments are neither read nor made.
    """
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    folder, slices = Path(folder), slices or {}
    group = checkpoint_group(d, timeout_s)
    error, index, optim_sd = None, {}, {"param_groups": []}
    try:
        files = read_manifest(folder)["files"]
        index = read_index(folder, files)
        with torch.no_grad(), PieceIndex(folder, index["index_files"], "model", files) as p:
            model_sd = get_model_state_dict(model)
            for key, t in model_sd.items():
                _fill(p, "model", key, t, slices)
        set_model_state_dict(model, model_sd)
        if optimizer_state:
            optim_sd = get_optimizer_state_dict(model, optimizer)  # builds the state to fill (a zero step)
            with torch.no_grad(), PieceIndex(folder, index["index_files"], "optimizer", files) as p:
                for fqn, entries in optim_sd["state"].items():
                    for name, t in entries.items():
                        _fill(p, "optimizer", f"{fqn}/{name}", t, slices)
    except (KilnError, OSError, RuntimeError, ValueError) as exc:
        error = f"rank {d.rank}: {exc}"
    if not optimizer_state:  # every rank takes this branch alike: the weights' errors, then done
        return _raise_first(all_gather_objects(d, error, group))
    # Each rank's parameter names too: a pipeline stage's groups are a part of the checkpoint's.
    held = all_gather_objects(d, (error, [g["params"] for g in optim_sd["param_groups"]]), group)
    _raise_first([e for e, _ in held])
    try:
        optim_sd["param_groups"] = _restore_groups(index["param_groups"], optim_sd["param_groups"],
                                                   [params for _, params in held], folder)
        set_optimizer_state_dict(model, optimizer, optim_sd)
    except (KilnError, OSError, RuntimeError, ValueError) as exc:
        error = f"rank {d.rank}: {exc}"
    _raise_first(all_gather_objects(d, error, group))


def _restore_groups(saved: list[dict], current: list[dict], everyone: list[list[list[str]]], folder: Path
                    ) -> list[dict]:
    """The saved param_groups' settings for this rank's groups, with JSON's lists back to tuples where the
    optimizer has tuples (betas). The saved groups' parameters must be those of every rank's groups together
    (a pipeline stage holds some of them)."""
    union = [sorted(set().union(*(ranks[i] for ranks in everyone))) for i in range(len(current))]
    if len(saved) != len(current) or [sorted(g["params"]) for g in saved] != union:
        raise KilnError(f"{folder}: the optimizer's parameter groups differ from this model's; it was written "
                        "for another model")
    out = []
    for s, c in zip(saved, current):
        settings = {k: tuple(v) if isinstance(c.get(k), tuple) and isinstance(v, list) else v for k, v in s.items()}
        out.append({**settings, "params": c["params"]})
    return out
