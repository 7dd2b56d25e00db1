"""The parallel degrees: derived and checked against the world size and the model before any work, and each
rank's place in the one mesh (which ranks share a batch)."""

from __future__ import annotations

import pytest

from conftest import tiny_config
from kiln.errors import ConfigError
from kiln.train.parallel.mesh import Degrees, Mesh, build_mesh, resolve_degrees
from kiln.train.parallel import Dist


def degrees(world: int, **parallel) -> Degrees:
    return resolve_degrees(tiny_config("/tmp/unused", parallel=parallel).parallel, world)


def test_defaults_keep_ddp_and_fsdp_as_before():
    assert degrees(1) == Degrees(1, 1, 1, 1, "none")
    assert degrees(4) == Degrees(1, 4, 1, 1, "ddp")  # auto = DDP over every rank
    assert degrees(4, mode="fsdp") == Degrees(1, 1, 4, 1, "fsdp")
    assert degrees(1, mode="fsdp") == Degrees(1, 1, 1, 1, "fsdp")  # FSDP2 on one device, as before


def test_mesh_under_mode_auto_is_fsdp2_as_readme_says():
    assert degrees(2, mesh=[1, 2]) == Degrees(1, 1, 2, 1, "fsdp")
    assert degrees(4, mesh=[2, 2]) == Degrees(1, 2, 2, 1, "fsdp")


def test_a_mesh_that_is_not_the_world_stops_kiln_train_before_any_work(workdir, tmp_path, capsys):
    from kiln.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir).to_yaml())
    assert main(["train", str(config), "parallel.mesh=[2,2]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kiln: error: parallel.mesh=[2, 2] multiplies to 4, not the 1 ranks; give a [replicate, shard] "
                   "whose product is that")
    assert not (workdir / "run" / "metrics.jsonl").exists() and not (workdir / "run" / "checkpoints").exists()


def test_mesh_is_the_hsdp_shorthand():
    assert degrees(4, mode="fsdp", mesh=[2, 2]) == degrees(4, mode="fsdp", dp_replicate=2, dp_shard=2)
    assert degrees(4, mode="fsdp", mesh=[2, 2]) == Degrees(1, 2, 2, 1, "fsdp")
    assert degrees(8, mode="fsdp", tp=2, mesh=[2, 2]) == Degrees(1, 2, 2, 2, "fsdp")  # mesh = the dp dims


def test_degrees_derive_the_rest_of_the_world():
    assert degrees(4, tp=2) == Degrees(1, 1, 2, 2, "fsdp")  # auto + tp: FSDP2 over the rest
    assert degrees(2, tp=2) == Degrees(1, 1, 1, 2, "none")
    assert degrees(8, tp=2, dp_replicate=2, dp_shard=2) == Degrees(1, 2, 2, 2, "fsdp")
    assert degrees(8, dp_shard=4) == Degrees(1, 2, 4, 1, "fsdp")  # the replicas fill the rest
    assert degrees(4, pp=2) == Degrees(2, 2, 1, 1, "ddp")
    assert degrees(8, pp=2, tp=2, dp_shard=2) == Degrees(2, 1, 2, 2, "fsdp")


@pytest.mark.parametrize("world, parallel, words", [
    (4, {"tp": 3}, "parallel.tp=3 x parallel.pp=1 = 3 does not divide the 4 ranks"),
    (8, {"tp": 2, "dp_shard": 2, "dp_replicate": 1}, "= 4, not the 8 ranks"),
    (4, {"dp_shard": 3}, "parallel.dp_shard=3 does not divide the 4 data-parallel ranks"),
    (4, {"mode": "ddp", "dp_shard": 2}, "parallel.mode=ddp; set parallel.mode=fsdp"),
    (4, {"mode": "ddp", "tp": 2}, "composes with FSDP2, not DDP"),
    (2, {"mode": "fsdp", "mesh": [2, 2]}, "parallel.mesh=[2, 2] multiplies to 4, not the 2 ranks"),
    (4, {"mode": "fsdp", "mesh": [2, 2], "dp_shard": 2}, "parallel.mesh and parallel.dp_replicate/dp_shard"),
    (2, {"mesh": [3, 5]}, "parallel.mesh=[3, 5] multiplies to 15, not the 2 ranks"),  # mode auto: honoured too
    (1, {"mesh": [2, 2]}, "parallel.mesh=[2, 2] multiplies to 4, not the 1 ranks"),
    (2, {"mode": "ddp", "mesh": [1, 2]}, "parallel.mesh=[1, 2] is FSDP2's [replicate, shard] mesh, but "
                                         "parallel.mode=ddp"),
])
def test_invalid_degrees_are_one_line_config_errors(world, parallel, words):
    with pytest.raises(ConfigError, match=None) as err:
        degrees(world, **parallel)
    assert words in str(err.value) and "\n" not in str(err.value)


def mesh_for(world: int, rank: int = 0, vocab: int = 1024, **sections) -> Mesh:
    cfg = tiny_config("/tmp/unused", **sections)
    return build_mesh(cfg, Dist(rank=rank, world=world), vocab)


@pytest.mark.parametrize("sections, words", [
    ({"parallel": {"tp": 8}, "model": {"n_heads": 4}}, "parallel.tp=8 does not divide model.n_heads = 4"),
    ({"parallel": {"tp": 4}, "model": {"n_heads": 4, "n_kv_heads": 2}}, "model.n_kv_heads = 2"),
    ({"parallel": {"tp": 2}, "model": {"tie_embeddings": True}}, "set model.tie_embeddings=false"),
    ({"parallel": {"tp": 2}, "model": {"moe": {"n_experts": 4}}}, "does not shard MoE experts"),
    ({"parallel": {"pp": 8}, "model": {"n_layers": 2}}, "model.n_layers=2 does not split into 8 pipeline stages"),
    ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b"}, "model": {"n_layers": 2}}, "into 4 pipeline stages"),
    ({"parallel": {"pp": 2, "pp_microbatches": 3}}, "parallel.pp_microbatches=3 does not divide the 2 sequences"),
    ({"parallel": {"pp": 2, "pp_microbatches": 1}}, "needs parallel.pp_microbatches >= parallel.pp=2"),
    ({"parallel": {"pp": 2}, "model": {"tie_embeddings": True}}, "does not combine with model.tie_embeddings"),
    ({"parallel": {"pp": 2, "tp": 2}}, "parallel.pp>1 does not combine with parallel.tp>1"),
    ({"parallel": {"pp": 2}, "train": {"dtype": "fp16"}}, "does not combine with train.dtype=fp16"),
    ({"parallel": {"pp": 2}, "train": {"micro_batch_size": 1}}, "unset train.micro_batch_size"),
    ({"parallel": {"ep": 2}}, "model.moe.n_experts=0; set parallel.ep=1"),
    ({"parallel": {"ep": 2, "compile": True}, "model": {"moe": {"n_experts": 4}}}, "combine with parallel.compile"),
    ({"parallel": {"ep": 3}, "model": {"moe": {"n_experts": 4}}}, "must divide model.moe.n_experts=4"),
])
def test_model_that_the_degrees_cannot_split_is_a_config_error(sections, words):
    with pytest.raises(ConfigError) as err:
        mesh_for(8, **sections)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_vocabulary_and_sequence_must_split_over_tp():
    with pytest.raises(ConfigError, match="vocabulary"):
        mesh_for(2, vocab=1001, parallel={"tp": 2})
    with pytest.raises(ConfigError, match="pack.seq_len"):
        mesh_for(4, parallel={"tp": 4}, pack={"seq_len": 66}, model={"n_heads": 4, "n_kv_heads": 4})


def test_ranks_of_one_tensor_parallel_group_share_a_data_rank():
    # world 8 = pp 2 x dp_shard 2 x tp 2: rank = (pp * 2 + shard) * 2 + tp
    # (the coordinates only: tp with pp is not trained yet, so build_mesh's model check would refuse it)
    ranks = [Mesh(degrees(8, pp=2, tp=2, dp_shard=2), r) for r in range(8)]
    assert [m.coords for m in ranks[:4]] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)]
    assert [m.dp_rank for m in ranks] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [m.pp_rank for m in ranks] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {m.dp_world for m in ranks} == {2}
    hsdp = [mesh_for(8, rank=r, parallel={"mode": "fsdp", "mesh": [2, 4]}) for r in range(8)]
    assert [m.dp_rank for m in hsdp] == list(range(8))  # no tp/pp: every rank its own slice, as before


def test_gpu_parallel_benchmark_layouts():
    from benchmarks.gpu_parallel import default_layouts, overrides_for

    assert default_layouts(8) == ["dp_shard=8", "tp=2,dp_shard=4", "pp=2,dp_shard=4", "tp=4,dp_shard=2", "tp=8"]
    assert default_layouts(2) == ["dp_shard=2", "tp=2", "pp=2"]
    assert overrides_for("tp=2,dp_shard=4") == ["parallel.tp=2", "parallel.dp_shard=4"]
    assert "parallel.compile=false" in overrides_for("pp=2,pp_schedule=gpipe")


@pytest.mark.slow
def test_gpu_parallel_benchmark_smoke_runs_three_layouts_on_cpu(tmp_path):
    # On a GPU node the same script compares NCCL layouts' tokens/s and memory; here it checks the plumbing.
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_parallel.py"), "--smoke", "--steps", "5",
                           "--report", str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["layout"] for r in report["layouts"]] == ["dp_shard=2", "tp=2", "pp=2"]
    assert all(r["losses_match_first"] for r in report["layouts"]) and not report["failures"]


def test_one_parallelized_kind_per_combination_of_degrees():
    """parallelize's kind_for: the one place the degrees pick how the model is wrapped, gathered and loaded."""
    from kiln.train.parallel.parallelize import (DDPModel, ExpertFSDPModel, ExpertParallelModel, FSDPModel,
                                                 Parallelized, PipelineModel, TensorParallelModel, kind_for)

    cases = [(Degrees(), Parallelized), (Degrees(dp_replicate=4, mode="ddp"), DDPModel),
             (Degrees(dp_shard=4, mode="fsdp"), FSDPModel), (Degrees(tp=2), TensorParallelModel),
             (Degrees(dp_shard=2, tp=2, mode="fsdp"), FSDPModel),
             (Degrees(pp=2, dp_shard=2, mode="fsdp"), PipelineModel),
             (Degrees(pp=2, dp_replicate=2, mode="ddp"), PipelineModel),
             (Degrees(dp_replicate=4, mode="ddp", ep=2), ExpertParallelModel),
             (Degrees(dp_shard=4, mode="fsdp", ep=2), ExpertFSDPModel)]
    for degrees, kind in cases:
        assert kind_for(Mesh(degrees, 0)) is kind, degrees
    assert PipelineModel.every_rank_reads and ExpertParallelModel.every_rank_reads and ExpertFSDPModel.every_rank_reads
    assert not (Parallelized.every_rank_reads or FSDPModel.every_rank_reads)


# --- FSDP2/HSDP take their device mesh from the one Mesh ---------------------------------------------------

_FSDP_MESH = r"""
import json, sys
import torch
import torch.distributed as dist
from kiln.config import ParallelConfig
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.train.parallel import Dist
from kiln.train.parallel.parallelize import Precision, parallelize

dist.init_process_group("gloo")
d = Dist(rank=dist.get_rank(), world=dist.get_world_size())
out = {}
for name, section in json.loads(sys.argv[1]).items():
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4), vocab_size=128, max_seq_len=64)
    whole = model.layers[0].attention.wq.weight.detach().clone()
    parallelize(model, d, ParallelConfig(**section), Precision(), None)
    w = model.layers[0].attention.wq.weight
    local = w.to_local()
    rows = [r for r in range(whole.shape[0]) if any(torch.equal(whole[r], x) for x in local)]
    seen = [None] * d.world
    dist.all_gather_object(seen, {"dims": list(w.device_mesh.mesh_dim_names), "ranks": w.device_mesh.mesh.tolist(),
                                  "placements": [type(p).__name__ for p in w.placements], "rows": rows})
    out[name] = seen
if d.rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""


def _fsdp_meshes(tmp_path, nproc: int, layouts: dict) -> dict:
    import json

    from conftest import torchrun_script

    script = tmp_path / "fsdp_mesh.py"
    script.write_text(_FSDP_MESH)
    proc = torchrun_script(script, json.dumps(layouts), nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_plain_fsdp_and_hsdp_shard_over_the_one_meshs_data_parallel_dims(tmp_path):
    """Plain FSDP2 and HSDP (no tp/pp) shard over the data-parallel dimensions of mesh.py's DeviceMesh, named as
    there: parallel.mesh [2, 1] is two replicas of the whole weight (swapping replicate and shard would make it
    FSDP2 over 2 ranks, each holding half the rows), [1, 2] and plain fsdp shard the rows over both ranks."""
    seen = _fsdp_meshes(tmp_path, 2, {"fsdp": {"mode": "fsdp"}, "hsdp-2x1": {"mode": "fsdp", "mesh": [2, 1]},
                                      "hsdp-1x2": {"mode": "fsdp", "mesh": [1, 2]},
                                      "auto-1x2": {"mode": "auto", "mesh": [1, 2]},  # README: mesh means FSDP2
                                      "replicate-2": {"mode": "fsdp", "dp_replicate": 2}})
    half = [list(range(0, 32)), list(range(32, 64))]
    for name in ("fsdp", "hsdp-1x2", "auto-1x2"):
        assert [r["dims"] for r in seen[name]] == [["dp_shard"]] * 2, name
        assert [r["ranks"] for r in seen[name]] == [[0, 1]] * 2
        assert [r["placements"] for r in seen[name]] == [["Shard"]] * 2
        assert [r["rows"] for r in seen[name]] == half, name
    for name in ("hsdp-2x1", "replicate-2"):
        assert [r["dims"] for r in seen[name]] == [["dp_replicate", "dp_shard"]] * 2, name
        assert [r["ranks"] for r in seen[name]] == [[[0], [1]]] * 2
        assert [r["placements"] for r in seen[name]] == [["Replicate", "Shard"]] * 2
        assert [r["rows"] for r in seen[name]] == [list(range(64))] * 2, name  # each replica holds it whole


@pytest.mark.slow
def test_hsdp_2x2_shards_within_a_replica_and_replicates_across(tmp_path):
    """4 ranks, parallel.mesh [2, 2]: ranks (0, 1) and (2, 3) are the two replicas, each sharding the weight in two;
    ranks 0 and 2 hold the same rows (rank = replicate x 2 + shard, mesh.py's order). Swapped dimensions would
    pair 0 with 2 in a shard group instead."""
    seen = _fsdp_meshes(tmp_path, 4, {"hsdp": {"mode": "fsdp", "mesh": [2, 2]}})["hsdp"]
    assert {tuple(r["dims"]) for r in seen} == {("dp_replicate", "dp_shard")}
    assert seen[0]["ranks"] == [[0, 1], [2, 3]]
    assert [r["rows"] for r in seen] == [list(range(0, 32)), list(range(32, 64))] * 2
