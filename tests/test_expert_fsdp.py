"""Expert parallel composed with FSDP2 (parallel.ep with dp_shard) through `kiln train` on 2 real gloo ranks:
FSDP2 shards the dense weights, each rank holds half the experts outside FSDP2 (parallelize.ExpertFSDPModel).

What a GPU run adds: NCCL's all-to-all beside FSDP2's all-gathers and reduce-scatters (here gloo over loopback),
bf16 parameters gathered by FSDP2 while the experts cast themselves, and the memory saved on both sides.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kiln.checkpoint import list_checkpoints, load_checkpoint
from test_tensor_parallel import resume_from_step_5, steps, torchrun

# No token dropped (capacity_factor None: every token reaches its experts), so each rank's routing is one
# process's on the same rows; the router's balance loss is the only per-rank statistic.
MOE = {"moe": {"n_experts": 4, "top_k": 2, "capacity_factor": None}}


@pytest.mark.slow
def test_ep2_with_fsdp2_matches_one_process_and_fsdp2_with_whole_experts(workdir, tmp_path):
    one, fsdp, ep = tmp_path / "one", tmp_path / "fsdp", tmp_path / "ep"
    for out in (one, fsdp, ep):
        shutil.copytree(workdir, out)
    train = {"max_steps": 20, "eval_every": 10}
    torchrun(tmp_path, one, 1, train=train, model=MOE)
    torchrun(tmp_path, fsdp, 2, train=train, model=MOE, parallel={"mode": "fsdp"})
    proc = torchrun(tmp_path, ep, 2, train=train, model=MOE, parallel={"mode": "fsdp", "ep": 2})
    assert "Traceback" not in proc.stderr
    a, b, c = steps(one), steps(fsdp), steps(ep)
    assert len(c) == 20 and c[-1]["loss"] < c[0]["loss"]
    assert [r["loss"] for r in c] == pytest.approx([r["loss"] for r in b], rel=5e-3)
    assert [r["grad_norm"] for r in c] == pytest.approx([r["grad_norm"] for r in b], rel=5e-3)
    assert [r["loss"] for r in c] == pytest.approx([r["loss"] for r in a], rel=5e-3)
    # The weights: FSDP2's with whole experts (one process's drift further apart, ~2e-2 after 20 steps, from the
    # ranks' own balance statistics, with or without ep), gathered whole: dense shards and experts alike.
    wb = load_checkpoint(list_checkpoints(fsdp / "run" / "checkpoints")[-1])["model"]
    wc = load_checkpoint(list_checkpoints(ep / "run" / "checkpoints")[-1])["model"]
    assert wb.keys() == wc.keys()
    for k in wb:
        assert wb[k].shape == wc[k].shape and torch.allclose(wb[k], wc[k], rtol=1e-3, atol=1e-3), k


@pytest.mark.slow
def test_ep2_with_fsdp2_resumes_bitwise(workdir, tmp_path):
    full = tmp_path / "full"
    shutil.copytree(workdir, full)
    sections = {"train": {"max_steps": 10}, "model": MOE, "parallel": {"mode": "fsdp", "ep": 2}}
    torchrun(tmp_path, full, 2, **sections)
    resume_from_step_5(tmp_path, full, 2, **sections)
