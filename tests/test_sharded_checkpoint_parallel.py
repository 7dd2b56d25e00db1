"""Sharded checkpoints of tensor, pipeline and expert parallel runs (the default format whenever a parameter is
split over ranks): each rank writes its own pieces under the whole model's names, `kiln ckpt verify` catches a
flipped byte in any rank's file, `kiln export --hf` assembles them, and the checkpoint resumes on another mesh.

Every multi-rank run is real torch.distributed on gloo (CPU ranks under torchrun). A GPU run would add: NCCL as
the training group beside the checkpoint's gloo group, pinned-memory snapshots of CUDA DTensor shards for async
saves, and tensor-parallel groups within a node while FSDP2 and the pipeline span nodes.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main as kiln
from kiln.errors import IntegrityError
from kiln.manifest import read_manifest, write_manifest
from kiln.checkpoint import list_checkpoints, load_checkpoint, verify_checkpoint
from kiln.checkpoint.storage import Piece, PieceIndex, write_index, write_pieces
from kiln.train.checkpoint.sharded import local_boxes
from test_resilience import clone, events, finish, launch, write_config

LAST, EVERY = 6, 3  # 6 steps, checkpoints at 3 and 6: a resume continues steps 4-6 from step 3
STEPS = {"max_steps": LAST, "eval_every": 0}
TP_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
PP_MODEL = {"n_layers": 4}
MOE_MODEL = {"moe": {"n_experts": 4, "top_k": 2}}


# --- boxes of DTensor placements, without ranks ----------------------------------------------------

def _placements():
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    return [
        ((8, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP2 over tensor parallel
        ((7, 5), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # the same, uneven
        ((8, 6), (2, 2), (Shard(0), _StridedShard(0, split_factor=2))),  # rows with gaps: several boxes
        ((9, 5), (2, 2), (Shard(0), Shard(1))),
        ((3, 5), (2, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),  # HSDP x TP, a rank empty
    ]


@pytest.mark.parametrize("glob,mesh,placements", _placements())
def test_local_boxes_tile_the_global_tensor_once_and_match_torchs_shards(glob, mesh, placements):
    """For every coordinate of the mesh: the boxes' elements are the ones DTensor gives that rank (torch's
    own per-dimension indices, whose first offset compute_local_shape_and_global_offset returns), and over all
    coordinates of the shard dimensions every element of the global tensor is in exactly one box."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    full = torch.arange(torch.Size(glob).numel()).reshape(glob)
    count = torch.zeros(glob, dtype=torch.int64)
    for coord in itertools.product(*[range(n) for n in mesh]):
        boxes = local_boxes(glob, mesh, list(coord), placements)
        local_shape, _ = _compute_local_shape_and_global_offset(glob, mesh, list(coord), placements)
        local = torch.full(local_shape, -1, dtype=torch.int64)
        for offsets, shape, where in boxes:
            box = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
            local[where] = full[box]
            if all(c == 0 for c, p in zip(coord, placements) if type(p).__name__ == "Replicate"):
                count[box] += 1
        assert (local >= 0).all()  # the boxes fill the local tensor
        if type(placements[1]).__name__ == "_StridedShard" and type(placements[0]).__name__ == "Shard":
            assert len(boxes) == 2  # rows {0, 2} of its half: not one box
    assert (count == 1).all()


def test_a_share_of_several_boxes_is_stored_and_read_back(tmp_path):
    """Two ranks, each holding rows with gaps (Shard(0) then _StridedShard(0) on a 2 x 2 mesh, the coordinate
    of the second dimension fixed): the index lists each box under `{key}#n`, and any box assembles."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    full = torch.randn(8, 6)
    names = []
    for rank, coord in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        boxes = local_boxes((8, 6), (2, 2), list(coord), (Shard(0), _StridedShard(0, split_factor=2)))
        file = f"model-{rank:05d}.safetensors"
        tensors, pieces = {}, []
        for n, (offsets, shape, _) in enumerate(boxes):
            tensors[f"w#{n}"] = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))].clone()
            pieces.append(Piece(file, offsets, shape, (8, 6), "float32", f"w#{n}"))
        write_pieces(tmp_path / file, tensors)
        write_index(tmp_path / f"index-{rank:05d}.json", {"model": {"w": pieces}})
        names.append(f"index-{rank:05d}.json")
    write_manifest(tmp_path)  # PieceIndex reads only files a manifest lists (kiln.names)
    with PieceIndex(tmp_path, names, "model") as p:
        p.check_complete()
        p.check_files()
        assert len(p.pieces["w"]) == 8 and torch.equal(p.full("w"), full)
        assert torch.equal(p.read_box("w", torch.empty(3, 6), (2, 0)), full[2:5])


def test_every_split_of_the_parameters_defaults_to_sharded_and_full_stays_a_choice():
    # The choice reads only the kind's class attributes, so the classes themselves stand in for a built model.
    from kiln.config import CheckpointConfig
    from kiln.train.parallel.dist import Dist
    from kiln.train.parallel.parallelize import (DDPModel, ExpertParallelModel, FSDPModel, Parallelized,
                                                 PipelineModel, TensorParallelModel)
    from kiln.train.checkpoint.sharded import ShardedCheckpoint
    from kiln.train.checkpoint import FullCheckpoint, checkpoint_format

    d = Dist()
    for kind in (TensorParallelModel, FSDPModel, PipelineModel, ExpertParallelModel):
        assert isinstance(checkpoint_format(CheckpointConfig(), kind, d), ShardedCheckpoint), kind
        assert isinstance(checkpoint_format(CheckpointConfig(format="full"), kind, d), FullCheckpoint), kind
    for kind in (Parallelized, DDPModel):  # nothing split: full by default, sharded when asked
        assert isinstance(checkpoint_format(CheckpointConfig(), kind, d), FullCheckpoint)
        assert isinstance(checkpoint_format(CheckpointConfig(format="sharded"), kind, d), ShardedCheckpoint)


# --- runs --------------------------------------------------------------------------------------------

def _fresh_out(prepared, tmp_path_factory, name: str) -> Path:
    out = tmp_path_factory.mktemp(name) / "out"
    for part in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / part, out / part)
    return out


def _run(out: Path, nproc: int, **sections) -> Path:
    sections.setdefault("train", STEPS)
    cfg = write_config(out.parent / f"{out.parent.name}-{nproc}.yaml", out, **sections)
    finish(launch(cfg, nproc=nproc))
    return out


def _resume_from_the_middle(run: Path, dst: Path, nproc: int, **sections) -> Path:
    """A copy of `run` with its last checkpoint removed, continued from step EVERY on `nproc` processes."""
    out = clone(run, dst)
    shutil.rmtree(out / "run" / "checkpoints" / f"step-{LAST:08d}")
    return _run(out, nproc, **sections)


def _step_losses(out: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(out, "step")}


def _assert_close(resumed: Path, run: Path, rel: float = 1e-3) -> None:
    a, b = _step_losses(resumed), _step_losses(run)
    assert sorted(a) == list(range(1, LAST + 1))
    for s in range(EVERY + 1, LAST + 1):
        assert abs(a[s] - b[s]) <= rel * abs(b[s]), (s, a[s], b[s])


def _last(out: Path) -> Path:
    return list_checkpoints(out / "run" / "checkpoints")[-1]


def _loader_state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())["loader"]


def _ranks_files(folder: Path, world: int) -> None:
    manifest = read_manifest(folder)
    assert manifest["world_size"] == world and manifest["checkpoint_format"] == "sharded"
    for rank in range(world):
        for kind in ("model", "optimizer"):
            assert f"{kind}-{rank:05d}.safetensors" in manifest["files"]
        assert f"index-{rank:05d}.json" in manifest["files"]
    assert "model.safetensors" not in manifest["files"]


def _flip_each_rank_file_is_caught(folder: Path, world: int) -> None:
    for rank in range(world):
        for name in (f"model-{rank:05d}.safetensors", f"optimizer-{rank:05d}.safetensors", f"index-{rank:05d}.json"):
            path = folder / name
            original = path.read_bytes()
            data = bytearray(original)
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
            try:
                with pytest.raises(IntegrityError, match=name.replace(".", r"\.")):
                    verify_checkpoint(folder)
                assert kiln(["ckpt", "verify", str(folder)]) != 0
            finally:
                path.write_bytes(original)


@pytest.fixture(scope="module")
def tp_run(prepared, tmp_path_factory):
    """parallel.tp=2 on 2 gloo ranks to step 6, checkpoints every 3, checkpoint.format left to its default."""
    out = _fresh_out(prepared, tmp_path_factory, "tp")
    return _run(out, 2, model=TP_MODEL, parallel={"tp": 2}, checkpoint={"every": EVERY})


def test_tp2_writes_each_ranks_half_verifies_exports_and_resumes_on_one_process(tp_run, tmp_path):
    """The fast default test of tensor parallel: rank r's pieces of a column-parallel weight are rows
    [r·n/2, (r+1)·n/2), of a row-parallel one columns; a replicated norm weight is written once; the pieces
    assemble into what `kiln export --hf` writes; a flipped byte in any rank's file is caught; one process
    continues from step 3 within 1e-3 of the tp=2 run, from the same loader position."""
    folder = _last(tp_run)
    _ranks_files(folder, 2)
    index = [json.loads((folder / f"index-{r:05d}.json").read_text())["pieces"] for r in (0, 1)]
    for rank in (0, 1):
        model = index[rank]["model"]
        wq, wo = model["layers.0.attention.wq.weight"], model["layers.0.attention.wo.weight"]
        assert wq["offsets"] == [rank * 32, 0] and wq["shape"] == [32, 64] and wq["global_shape"] == [64, 64]
        assert wo["offsets"] == [0, rank * 32] and wo["shape"] == [64, 32]
        emb = index[rank]["model"]["tok_embeddings.weight"]  # row-wise over the vocabulary
        assert emb["offsets"] == [rank * 512, 0] and emb["shape"] == [512, 64]
        moment = index[rank]["optimizer"]["layers.0.attention.wq.weight/exp_avg"]
        assert moment["offsets"] == wq["offsets"] and moment["shape"] == wq["shape"]
        assert load_file(str(folder / f"model-{rank:05d}.safetensors"))["layers.0.attention.wq.weight"].shape == (
            32, 64)
    norm = [("layers.0.attention_norm.weight" in index[r]["model"]) for r in (0, 1)]
    assert norm == [True, False]  # Replicate over tp: the rank at coordinate 0 writes it
    assert kiln(["ckpt", "verify", str(folder)]) == 0
    _flip_each_rank_file_is_caught(folder, 2)
    whole = load_checkpoint(folder)["model"]
    assert whole["layers.0.attention.wq.weight"].shape == (64, 64)
    assert kiln(["export", "--hf", str(folder), str(tmp_path / "hf")]) == 0
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(hf["model.embed_tokens.weight"], whole["tok_embeddings.weight"])
    assert torch.equal(hf["model.layers.1.mlp.down_proj.weight"], whole["layers.1.feed_forward.w2.weight"])

    one = _resume_from_the_middle(tp_run, tmp_path / "one", 1, model=TP_MODEL)
    _assert_close(one, tp_run)
    assert _loader_state(_last(one)) == _loader_state(folder)


@pytest.mark.slow
def test_tp2_resumes_bitwise_on_tp2_and_async_writes_the_same_files(tp_run, tmp_path):
    """The same mesh: steps 4-6 are the same floats, and an async save (snapshot at the step boundary, written
    in the background) writes byte-identical files. A GPU run adds the pinned-memory snapshot of CUDA shards."""
    same = _resume_from_the_middle(tp_run, tmp_path / "same", 2, model=TP_MODEL, parallel={"tp": 2},
                               checkpoint={"every": EVERY, "async_save": True})
    assert _step_losses(same) == _step_losses(tp_run)
    saves = events(same, "save")
    assert saves[-1]["step"] == LAST and saves[-1]["async"] and saves[-1]["format"] == "sharded"
    a, b = _last(same), _last(tp_run)
    verify_checkpoint(a)
    for name in ("model-00000.safetensors", "model-00001.safetensors", "optimizer-00000.safetensors",
                 "optimizer-00001.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_tp2(prepared, tmp_path_factory, tp_run, tmp_path):
    single = _run(_fresh_out(prepared, tmp_path_factory, "single"), 1, model=TP_MODEL,
                  checkpoint={"every": EVERY, "format": "sharded"})
    two = _resume_from_the_middle(single, tmp_path / "two", 2, model=TP_MODEL, parallel={"tp": 2})
    _assert_close(two, single)
    _ranks_files(_last(two), 2)


@pytest.fixture(scope="module")
def pp_run(prepared, tmp_path_factory):
    """parallel.pp=2 (1f1b) on 2 gloo ranks to step 6, 4 layers: stage 0 holds layers 0-1 and the embeddings,
    stage 1 layers 2-3, the final norm and the head."""
    out = _fresh_out(prepared, tmp_path_factory, "pp")
    return _run(out, 2, model=PP_MODEL, parallel={"pp": 2}, checkpoint={"every": EVERY})


def test_pp2_stages_write_their_own_layers_under_the_whole_models_names_and_resume_on_one_process(pp_run, tmp_path):
    folder = _last(pp_run)
    _ranks_files(folder, 2)
    index = [json.loads((folder / f"index-{r:05d}.json").read_text())["pieces"] for r in (0, 1)]
    layers = [{k.split(".")[1] for k in index[r]["model"] if k.startswith("layers.")} for r in (0, 1)]
    assert layers == [{"0", "1"}, {"2", "3"}]
    assert "tok_embeddings.weight" in index[0]["model"] and "output.weight" in index[1]["model"]
    assert "layers.3.attention.wq.weight/exp_avg_sq" in index[1]["optimizer"]
    groups = json.loads((folder / "index.json").read_text())["param_groups"]  # the stages' groups, merged
    assert {"layers.0.attention.wq.weight", "layers.3.attention.wq.weight"} <= set(groups[0]["params"])
    assert kiln(["ckpt", "verify", str(folder)]) == 0
    _flip_each_rank_file_is_caught(folder, 2)
    assert kiln(["export", "--hf", str(folder), str(tmp_path / "hf")]) == 0
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(hf["model.layers.3.mlp.down_proj.weight"],
                       load_file(str(folder / "model-00001.safetensors"))["layers.3.feed_forward.w2.weight"])

    one = _resume_from_the_middle(pp_run, tmp_path / "one", 1, model=PP_MODEL)
    _assert_close(one, pp_run)
    assert _loader_state(_last(one)) == _loader_state(folder)


@pytest.mark.slow
def test_pp2_resumes_bitwise_on_pp2(pp_run, tmp_path):
    same = _resume_from_the_middle(pp_run, tmp_path / "same", 2, model=PP_MODEL, parallel={"pp": 2},
                               checkpoint={"every": EVERY})
    assert _step_losses(same) == _step_losses(pp_run)
    for name in ("model-00000.safetensors", "model-00001.safetensors", "optimizer-00001.safetensors"):
        assert (_last(same) / name).read_bytes() == (_last(pp_run) / name).read_bytes(), name


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_pp2(prepared, tmp_path_factory, tmp_path):
    single = _run(_fresh_out(prepared, tmp_path_factory, "single"), 1, model=PP_MODEL,
                  checkpoint={"every": EVERY, "format": "sharded"})
    two = _resume_from_the_middle(single, tmp_path / "two", 2, model=PP_MODEL, parallel={"pp": 2})
    _assert_close(two, single)
    _ranks_files(_last(two), 2)


@pytest.mark.slow  # ~16 s; like the other expert-parallel runs (four ranks, ep x fsdp2), in the slow suite
def test_ep2_experts_are_boxes_of_the_whole_tensor_and_resume_on_one_process(prepared, tmp_path_factory, tmp_path):
    """Expert parallel on 2 ranks: rank r writes experts [2r, 2r+2) of each (4, hidden, dim) tensor and their
    moments; the dense weights (DDP replicas) are written once, spread over the ranks. One process continues
    with micro-batches of 4 rows, each rank's share in the ep run: the same tokens meet the same capacity."""
    ep = _run(_fresh_out(prepared, tmp_path_factory, "ep"), 2, model=MOE_MODEL, parallel={"ep": 2},
              checkpoint={"every": EVERY})
    folder = _last(ep)
    _ranks_files(folder, 2)
    index = [json.loads((folder / f"index-{r:05d}.json").read_text())["pieces"] for r in (0, 1)]
    for rank in (0, 1):
        w1 = index[rank]["model"]["layers.0.feed_forward.experts.w1"]
        assert w1["offsets"][0] == 2 * rank and w1["shape"][0] == 2 and w1["global_shape"][0] == 4
        assert index[rank]["optimizer"]["layers.0.feed_forward.experts.w1/exp_avg"]["offsets"] == w1["offsets"]
    dense = [{k for k in index[r]["model"] if ".experts." not in k} for r in (0, 1)]
    assert dense[0] and dense[1] and not dense[0] & dense[1]
    assert load_checkpoint(folder)["model"]["layers.1.feed_forward.experts.w2"].shape[0] == 4
    assert kiln(["ckpt", "verify", str(folder)]) == 0

    one = _resume_from_the_middle(ep, tmp_path / "one", 1, model=MOE_MODEL, train={**STEPS, "micro_batch_size": 4})
    _assert_close(one, ep)
    assert _loader_state(_last(one)) == _loader_state(folder)


@pytest.mark.slow
def test_ep2_with_fsdp2_writes_expert_boxes_beside_fsdp_shards_and_resumes_on_one_process(prepared,
                                                                                          tmp_path_factory, tmp_path):
    """Expert parallel under FSDP2 (parallelize.ExpertFSDPModel): the experts stay out of FSDP2, so rank r writes
    experts [2r, 2r+2) as plain boxes of the whole tensor, while the dense weights are FSDP2's row shards; nothing
    is gathered. One process continues within 1e-3. A GPU run adds NCCL and bf16 parameters beside fp32 moments."""
    ep = _run(_fresh_out(prepared, tmp_path_factory, "ep-fsdp"), 2, model=MOE_MODEL,
              parallel={"mode": "fsdp", "ep": 2}, checkpoint={"every": EVERY})
    folder = _last(ep)
    _ranks_files(folder, 2)
    index = [json.loads((folder / f"index-{r:05d}.json").read_text())["pieces"] for r in (0, 1)]
    for rank in (0, 1):
        w1 = index[rank]["model"]["layers.0.feed_forward.experts.w1"]
        assert w1["offsets"][0] == 2 * rank and w1["shape"][0] == 2 and w1["global_shape"][0] == 4
        wq = index[rank]["model"]["layers.0.attention.wq.weight"]  # FSDP2's Shard(0): half the rows each
        assert wq["offsets"][0] == rank * wq["shape"][0] and 2 * wq["shape"][0] == wq["global_shape"][0]
    assert kiln(["ckpt", "verify", str(folder)]) == 0
    one = _resume_from_the_middle(ep, tmp_path / "one", 1, model=MOE_MODEL, train={**STEPS, "micro_batch_size": 4})
    _assert_close(one, ep)


STRIDED_SCRIPT = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from kiln.config import ParallelConfig
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.train.checkpoint import sharded
from kiln.checkpoint import load_checkpoint, rng_state
from kiln.train.checkpoint import Saver
from kiln.train.parallel import Dist
from kiln.train.parallel.mesh import Mesh, resolve_degrees
from kiln.train.parallel.parallelize import Precision, parallelize
from kiln.train.parallel.tensor import vocab_parallel_loss

dist.init_process_group("gloo")
d = Dist(rank=dist.get_rank(), world=dist.get_world_size())
cfg = ParallelConfig(tp=2, dp_shard=2)
args = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2)


def trained(seed):
    torch.manual_seed(seed)
    model = build_model(args, vocab_size=70, max_seq_len=8)  # 35 rows per tp rank: FSDP2 splits them 18 + 17
    parallelize(model, d, cfg, Precision(), None, Mesh(resolve_degrees(cfg, d.world), d.rank))
    opt = torch.optim.AdamW(model.parameters())
    vocab_parallel_loss(model, torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(3)),
                        None).backward()
    opt.step()
    return model, opt


def states(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    out = dict(get_model_state_dict(model))
    for fqn, entries in get_optimizer_state_dict(model, opt)["state"].items():
        out.update({f"{fqn}/{k}": v for k, v in entries.items() if k != "step"})
    return out


model, opt = trained(0)
mine, strided, full = states(model, opt), 0, {}
for key, t in mine.items():  # every rank's boxes hold exactly the global tensor's elements at those places
    full[key] = t.full_tensor()
    strided += any(type(p).__name__ == "_StridedShard" for p in t.placements)
    for offsets, shape, where in sharded._dtensor_boxes(t):
        box = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
        assert torch.equal(t.to_local()[where], full[key][box]), key
root = Path(sys.argv[1])
sharded.save(root, 1, model, opt, d, Saver(False), state={"step": 1}, rng=rng_state(), config_yaml="",
             tokenizer_file=root.parent / "tokenizer.json", manifest_fields={}, signing_key=None, timeout_s=60)
other, other_opt = trained(1)  # other weights and moments, overwritten by the load
sharded.load(root / "step-00000001", other, other_opt, d)
theirs = states(other, other_opt)
same = all(torch.equal(mine[k].to_local(), theirs[k].to_local()) for k in mine)
whole = load_checkpoint(root / "step-00000001")["model"] if d.rank == 0 else None
assembled = d.rank != 0 or all(torch.equal(whole[k], full[k]) for k in whole)
print(f"rank {d.rank} strided={strided} same={same} assembled={assembled}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_tp2_x_dp_shard2_strided_shares_are_the_right_boxes_and_round_trip(tmp_path):
    """FSDP2 over tensor parallel on 4 gloo ranks (column-parallel weights: _StridedShard then Shard on dim 0,
    uneven: 35 rows per tp rank): each rank's boxes hold exactly the elements of the gathered tensor there,
    a save -> load into another model restores every local shard bitwise, and the pieces assemble into the
    gathered weights. A GPU run would add NCCL and the 2-D mesh over NVLink (tp) and the fabric (dp_shard)."""
    import subprocess
    import sys

    from conftest import ROOT
    from test_resilience import ENV

    script = tmp_path / "strided.py"
    script.write_text(STRIDED_SCRIPT)
    (tmp_path / "tokenizer.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(script), str(tmp_path / "checkpoints")], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in range(4):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"rank {rank} "))
        assert "same=True assembled=True" in line and int(line.split("strided=")[1].split()[0]) > 0, line
    verify_checkpoint(tmp_path / "checkpoints" / "step-00000001")


@pytest.mark.slow
def test_ep2_over_four_ranks_writes_each_expert_box_once(prepared, tmp_path_factory):
    """ep=2 of 4 DDP ranks: ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3 (replicas). Each box is
    written by one of its two holders, the dense weights by one of four, and the pieces tile every tensor. A
    GPU run would add the all-to-all over NVLink within each expert group."""
    ep = _run(_fresh_out(prepared, tmp_path_factory, "ep4"), 4, model=MOE_MODEL, parallel={"ep": 2},
              checkpoint={"every": EVERY})
    folder = _last(ep)
    _ranks_files(folder, 4)
    verify_checkpoint(folder)  # with check_loads: every tensor's pieces cover it exactly once
    index = [json.loads((folder / f"index-{r:05d}.json").read_text())["pieces"] for r in range(4)]
    for kind in ("model", "optimizer"):
        for key in {k for i in index for k in i[kind] if ".experts." in k and not k.endswith("/step")}:
            holders = [(r, i[kind][key]["offsets"][0]) for r, i in enumerate(index) if key in i[kind]]
            assert sorted(o for _, o in holders) == [0, 2], (key, holders)  # two boxes, each once
            assert all(o == 2 * (r % 2) for r, o in holders)  # by a rank that holds those experts
    whole = load_checkpoint(folder)["model"]
    assert whole["layers.0.feed_forward.experts.w1"].shape[0] == 4


def test_a_model_holding_only_some_of_the_checkpoints_layers_is_refused_in_one_line(tmp_path):
    """One process, a pipeline part of layer 0 only (what a stage holds): the pieces of its tensors are there, but
    the param_groups of every rank together must be the checkpoint's, so the load is refused (as a model of
    another size is), naming the folder; the whole model loads the same checkpoint back bitwise."""
    from kiln.errors import KilnError
    from kiln.model.build import build_model
    from kiln.model.config import ModelConfig
    from kiln.train.checkpoint import sharded
    from kiln.checkpoint import rng_state
    from kiln.train.checkpoint import Saver
    from kiln.train.engine import param_groups
    from kiln.train.parallel import Dist
    from kiln.train.parallel.pipeline import ModelPart

    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=16, n_layers=2, n_heads=2), vocab_size=32, max_seq_len=8)
    opt = torch.optim.AdamW(param_groups(model, 0.1))
    model(torch.randint(0, 32, (1, 8))).sum().backward()
    opt.step()
    (tmp_path / "tokenizer.json").write_text("{}")
    sharded.save(tmp_path / "ckpt", 1, model, opt, Dist(), Saver(False), state={"step": 1}, rng=rng_state(),
                 config_yaml="", tokenizer_file=tmp_path / "tokenizer.json", manifest_fields={}, signing_key=None,
                 timeout_s=60)
    folder = tmp_path / "ckpt" / "step-00000001"
    part = ModelPart(build_model(ModelConfig(dim=16, n_layers=2, n_heads=2), vocab_size=32, max_seq_len=8), [0],
                     embeddings=True, head=False)
    with pytest.raises(KilnError, match="step-00000001: the optimizer's parameter groups differ"):
        sharded.load(folder, part, torch.optim.AdamW(param_groups(part, 0.1)), Dist())
    torch.manual_seed(1)
    other = build_model(ModelConfig(dim=16, n_layers=2, n_heads=2), vocab_size=32, max_seq_len=8)
    other_opt = torch.optim.AdamW(param_groups(other, 0.1))
    sharded.load(folder, other, other_opt, Dist())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert all(torch.equal(opt.state[a]["exp_avg"], other_opt.state[b]["exp_avg"])
               for a, b in zip(model.parameters(), other.parameters()))
