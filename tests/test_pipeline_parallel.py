"""Pipeline parallel on real gloo ranks: Kiln's Llama split by layers into stages, each schedule (gpipe,
1f1b, interleaved 1f1b) driven for 40 AdamW steps, follows one process's losses on the same batches.

What a GPU run adds: NCCL point-to-point sends between stages (here gloo over loopback), the real bubble and
its overlap with compute (on CPU every stage shares two cores, so no speed is measured), and the memory
saving per device (1/pp of the weights, gradients and optimizer state).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, assert_trained_alike, tiny_config, torchrun_script
from kiln.checkpoint import list_checkpoints, load_checkpoint
from kiln.train.metrics import read_metrics
from kiln.train.trainer import Trainer
from test_tensor_parallel import resume_from_step_5, torchrun

_DRIVE = r"""
import sys
import torch, torch.distributed as dist
from kiln.model.loss import next_token_loss
from kiln.model.config import ModelConfig
from kiln.model.llama import Llama
from kiln.train.clip import GROUPS, layer_groups
from kiln.train.parallel.dist import group_norms
from kiln.train.parallel.pipeline import Pipeline, pipeline_loss, split_model

schedule, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank, pp = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
args = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2)
ref = Llama(args, 96, 16)
model = Llama(args, 96, 16)
model.load_state_dict(ref.state_dict())
part, stages = split_model(model, rank, pp, schedule)
del model  # the other rank's blocks are freed: this rank holds only its part
n_layers_here = len(part.layers)
assert n_layers_here == args.n_layers // pp, n_layers_here
assert set(part.state_dict()) < set(ref.state_dict())  # the full model's names, a slice of them
pipe = Pipeline(stages, rank, pp, dist.group.WORLD, schedule, 4, torch.device("cpu"), pipeline_loss(None))
opt = torch.optim.AdamW(part.parameters(), lr=3e-3)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
data = torch.Generator().manual_seed(1)
batches = [torch.randint(0, 96, (8, 17), generator=data) for _ in range(4)]
for step in range(steps):
    batch = batches[step % 4]  # the same batch on both ranks; four of them, so the loss can fall
    loss = float(pipe.step(batch))
    norms = pipe.reduce_norms(group_norms(layer_groups(part, args.n_layers, 1)), GROUPS)
    opt.step()
    opt.zero_grad()
    expected = next_token_loss(ref, batch, None)
    expected.backward()
    ref_norms = group_norms(layer_groups(ref, args.n_layers, 1))
    ref_opt.step()
    ref_opt.zero_grad()
    assert abs(loss - float(expected)) <= 5e-3 * abs(float(expected)), (step, loss, float(expected))
    assert norms.keys() == ref_norms.keys(), (norms.keys(), ref_norms.keys())
    for g in norms:
        assert abs(float(norms[g]) - float(ref_norms[g])) <= 5e-3 * float(ref_norms[g]), (step, g)
    if step == 0:
        first = loss
assert loss < first  # it trains
for name, p in part.state_dict().items():
    assert torch.allclose(p, ref.state_dict()[name], atol=2e-3), name
print("ok", rank)
dist.destroy_process_group()
"""


@pytest.mark.slow  # ~35 s each on 2 cores
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pipeline_schedules_on_two_ranks_match_one_process_over_40_steps(tmp_path, schedule):
    script = tmp_path / "pp.py"
    script.write_text(_DRIVE)
    proc = torchrun_script(script, schedule, "40", env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2


# --- through `kiln train` -----------------------------------------------------------------------------------

def steps(out: Path) -> list[dict]:
    return [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == "step"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_pp2_kiln_train_matches_one_process_over_40_steps(workdir, tmp_path, schedule):
    pp = tmp_path / "pp"
    shutil.copytree(workdir, pp)
    train, model = {"max_steps": 40, "eval_every": 20}, {"n_layers": 4}
    Trainer(tiny_config(workdir, train=train, model=model), log=lambda *_: None).run()
    torchrun(tmp_path, pp, 2, train=train, model=model, parallel={"pp": 2, "pp_schedule": schedule},
             checkpoint={"format": "full"})  # a user's choice; sharded is the default under pp
    single, piped = steps(workdir), steps(pp)
    assert len(piped) == 40
    # Same global batch through two stages: the loss is the mean of the pipeline's micro-batch means.
    assert [r["loss"] for r in piped] == pytest.approx([r["loss"] for r in single], rel=5e-3)
    assert [r["grad_norm"] for r in piped] == pytest.approx([r["grad_norm"] for r in single], rel=5e-3)
    evals = lambda out: [m["val_loss"] for m in read_metrics(out / "run" / "metrics.jsonl")  # noqa: E731
                         if m["event"] == "eval"]
    assert evals(pp) == pytest.approx(evals(workdir), rel=5e-3)  # forward-only through the pipeline
    a = load_checkpoint(list_checkpoints(workdir / "run" / "checkpoints")[-1])["model"]
    b = load_checkpoint(list_checkpoints(pp / "run" / "checkpoints")[-1])["model"]
    assert (list_checkpoints(pp / "run" / "checkpoints")[-1] / "model.safetensors").is_file()
    assert_trained_alike(a, b)  # rank 0 wrote both stages' weights, under the whole model's names


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", [{}, {"dp_shard": 2}], ids=["replicas", "fsdp2"])
def test_pp2_x_dp2_on_four_ranks_trains_and_resumes_bitwise(workdir, tmp_path, data_parallel):
    full = tmp_path / "full"
    shutil.copytree(workdir, full)
    # dp=2: replicas averaging gradients (parallel.mode auto), or FSDP2 sharding each stage
    sections = {"train": {"max_steps": 10}, "model": {"n_layers": 4}, "parallel": {"pp": 2, **data_parallel}}
    torchrun(tmp_path, full, 4, **sections)
    a = steps(full)
    assert a[-1]["loss"] < a[0]["loss"]
    resume_from_step_5(tmp_path, full, 4, **sections)


@pytest.mark.slow  # two gloo ranks, 6-10 s: the default suite stays under 10 minutes on 2 cores
def test_pp2_summary_counts_every_stages_parameters(workdir, tmp_path):
    """The run's summary (`params`, what `kiln run` prints as model parameters) is the whole model's count, not the
    one stage rank 0 holds."""
    import json

    from kiln.model.build import build_model

    cfg = tiny_config(workdir, train={"max_steps": 1, "eval_every": 0}, checkpoint={"every": 100})
    proc = torchrun(tmp_path, workdir, 2, train={"max_steps": 1, "eval_every": 0}, checkpoint={"every": 100},
                    parallel={"pp": 2})
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    vocab = json.loads((workdir / "shards" / "manifest.json").read_text())["vocab_size"]
    whole = sum(p.numel() for p in build_model(cfg.model, vocab, cfg.pack.seq_len).parameters())
    assert summary["params"] == whole
