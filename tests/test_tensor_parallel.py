"""Tensor parallel on real gloo ranks: the vocabulary-parallel loss and gradients equal one process's (with
document masking too), and
`kiln train` with parallel.tp=2 follows one process's losses; tp=2 x dp_shard=2 trains and resumes bitwise.

What a GPU run adds to these: NCCL instead of gloo for the all-gathers and reduce-scatters of sequence
parallelism, their overlap (or not) with compute, and the memory saving itself (1/tp of the block weights
and of the activations between blocks per device), which CPU tests cannot show.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_trained_alike, tiny_config, torchrun_script
from kiln.checkpoint import list_checkpoints, load_checkpoint
from kiln.train.metrics import read_metrics
from kiln.train.trainer import Trainer

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TP_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}


def steps(out: Path) -> list[dict]:
    return [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == "step"]


def torchrun(tmp_path: Path, out: Path, nproc: int, **sections) -> subprocess.CompletedProcess:
    cfg = tmp_path / f"{out.name}.yaml"
    cfg.write_text(tiny_config(out, **sections).to_yaml())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "-m", "kiln", "train", str(cfg)], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


_LOSS_AND_GRADS = r"""
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from kiln.model.loss import next_token_loss
from kiln.model.config import ModelConfig
from kiln.model.llama import Llama
from kiln.train.parallel.tensor import apply_tensor_parallel, vocab_parallel_loss

dist.init_process_group("gloo")
torch.manual_seed(0)
args = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
ref, model = Llama(args, 96, 16), Llama(args, 96, 16)
model.load_state_dict(ref.state_dict())
apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
batch = torch.randint(0, 96, (3, 17))
batch[0, 5:] = 7  # a pad id: those targets are not predicted
expected, got = next_token_loss(ref, batch, None, pad_id=7), vocab_parallel_loss(model, batch, None, pad_id=7)
expected.backward()
got.backward()
assert abs(float(got) - float(expected)) < 1e-5, (float(got), float(expected))
for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
    assert type(p).__name__ == "DTensor", name
    assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6), name
    if name.endswith(("wq.weight", "w1.weight", "output.weight")):  # column-wise: half the rows each
        assert p.to_local().shape[0] == q.shape[0] // 2, name
    if name.endswith(("wo.weight", "w2.weight")):  # row-wise: half the columns each
        assert p.to_local().shape[1] == q.shape[1] // 2, name
with torch.no_grad():  # outside the loss the model returns the full logits, gathered
    assert torch.allclose(model(batch[:, :-1]), ref(batch[:, :-1]), atol=1e-5)
# model.document_masking: the mask, read from the whole tokens, passes the sequence-parallel input untouched
args = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, document_masking=True, document_positions=True)
ref, model = Llama(args, 96, 16, eos_id=1), Llama(args, 96, 16, eos_id=1)
model.load_state_dict(ref.state_dict())
apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
batch[:, [4, 9]] = 1
expected, got = next_token_loss(ref, batch, None), vocab_parallel_loss(model, batch, None)
expected.backward()
got.backward()
assert abs(float(got) - float(expected)) < 1e-5, (float(got), float(expected))
for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
    assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6), name
print("ok", dist.get_rank())
dist.destroy_process_group()
"""


def test_vocab_parallel_loss_and_gradients_equal_one_process(tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(_LOSS_AND_GRADS)
    proc = torchrun_script(script, env={**ENV, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2


@pytest.mark.slow
def test_tp2_kiln_train_matches_one_process_over_40_steps(workdir, tmp_path):
    tp = tmp_path / "tp"
    shutil.copytree(workdir, tp)
    train = {"max_steps": 40, "eval_every": 20}
    Trainer(tiny_config(workdir, train=train, model=TP_MODEL), log=lambda *_: None).run()
    # checkpoint.format=full (a user's choice; sharded is the default under tp): rank 0 writes it gathered
    torchrun(tmp_path, tp, 2, train=train, model=TP_MODEL, parallel={"tp": 2}, checkpoint={"format": "full"})
    single, sharded = steps(workdir), steps(tp)
    assert len(sharded) == 40
    # Same global batch on both TP ranks; only the order of float sums differs.
    assert [r["loss"] for r in sharded] == pytest.approx([r["loss"] for r in single], rel=5e-3)
    assert [r["grad_norm"] for r in sharded] == pytest.approx([r["grad_norm"] for r in single], rel=5e-3)
    # The full-format checkpoint holds the gathered (unsharded) weights, as one process's does.
    a = load_checkpoint(list_checkpoints(workdir / "run" / "checkpoints")[-1])["model"]
    b = load_checkpoint(list_checkpoints(tp / "run" / "checkpoints")[-1])["model"]
    assert (list_checkpoints(tp / "run" / "checkpoints")[-1] / "model.safetensors").is_file()
    assert_trained_alike(a, b)


def resume_from_step_5(tmp_path: Path, full: Path, nproc: int, **sections) -> Path:
    """A copy of a finished 10-step run with its last checkpoint deleted, run again by the same command: it
    resumes from step 5, as after a crash, and must reproduce steps 6-10 bit for bit."""
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "run" / "checkpoints" / "step-00000010")
    proc = torchrun(tmp_path, resumed, nproc, **sections)
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = steps(full), steps(resumed)
    assert [r["step"] for r in b] == list(range(1, 11))
    assert [r["loss"] for r in b] == [r["loss"] for r in a]  # bitwise: the same floats
    assert [r["grad_norm"] for r in b] == [r["grad_norm"] for r in a]
    wa = load_checkpoint(list_checkpoints(full / "run" / "checkpoints")[-1])["model"]
    wb = load_checkpoint(list_checkpoints(resumed / "run" / "checkpoints")[-1])["model"]
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    return resumed


@pytest.mark.slow
def test_tp2_x_dp_shard2_on_four_ranks_trains_and_resumes_bitwise(workdir, tmp_path):
    full = tmp_path / "full"
    shutil.copytree(workdir, full)
    sections = {"train": {"max_steps": 10}, "model": TP_MODEL, "parallel": {"tp": 2, "dp_shard": 2}}
    torchrun(tmp_path, full, 4, **sections)
    a = steps(full)
    assert a[-1]["loss"] < a[0]["loss"]
    resume_from_step_5(tmp_path, full, 4, **sections)
