"""Item 1 of #39: a model built on the meta device, split, then materialised (each rank draws only its part,
kiln.model.init) has, gathered, bitwise the initial weights of one process, for every layout: FSDP2, tensor
parallel, pipeline parallel and expert parallel (MoE, under DDP and FSDP2) on two gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import ROOT, torchrun_script

DENSE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
MOE = {**DENSE, "moe": {"n_experts": 4, "top_k": 2}}
CHUNK = 256  # elements per draw in these tests: chunks of 4 rows cross every shard's edge

_LAYOUTS = r"""
import sys
import torch
import kiln.model.init
from kiln.config import ParallelConfig
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.model.loss import next_token_loss
from kiln.train.parallel.dist import init_distributed
from kiln.train.parallel.mesh import Mesh, resolve_degrees
from kiln.train.parallel.parallelize import Precision, parallelize

out, chunk = sys.argv[1], int(sys.argv[2])
kiln.model.init.CHUNK = chunk
d = init_distributed(60)
LAYOUTS = {"fsdp2": ({}, {"dp_shard": 2}), "tp2": ({}, {"tp": 2}), "pp2": ({}, {"pp": 2}),
           "ep2": ("moe", {"ep": 2, "mode": "ddp"}), "ep2_fsdp2": ("moe", {"ep": 2, "dp_shard": 2})}
for name, (moe, degrees) in LAYOUTS.items():
    model = ModelConfig(**%s, **({"moe": {"n_experts": 4, "top_k": 2}} if moe else {}))
    meta = build_model(model, 96, 16, device="meta")
    cfg = ParallelConfig(**degrees)
    parallel = parallelize(meta, d, cfg, Precision(), next_token_loss, Mesh(resolve_degrees(cfg, d.world), d.rank),
                           seed=1234)
    held = [p for p in parallel.model.parameters()]
    assert not any(p.is_meta for p in held), name
    whole, _ = parallel.full_states(torch.optim.AdamW(parallel.model.parameters()))
    if d.rank == 0:
        torch.save(whole, f"{out}/{name}.pt")
print("ok", d.rank)
""" % DENSE


def one_process(model: dict, seed: int = 1234) -> dict[str, torch.Tensor]:
    from kiln.model.build import build_model
    from kiln.model.config import ModelConfig

    m = build_model(ModelConfig(**model), 96, 16)
    m.reset_parameters(seed)
    return m.state_dict()


def test_initial_weights_do_not_depend_on_the_layout(tmp_path, monkeypatch):
    import kiln.model.init

    script = tmp_path / "layouts.py"
    script.write_text(_LAYOUTS)
    proc = torchrun_script(script, tmp_path, CHUNK, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setattr(kiln.model.init, "CHUNK", CHUNK)
    dense, moe = one_process(DENSE), one_process(MOE)
    assert one_process(DENSE, seed=5)["layers.0.attention.wq.weight"].ne(dense["layers.0.attention.wq.weight"]).all()
    for layout, ref in [("fsdp2", dense), ("tp2", dense), ("pp2", dense), ("ep2", moe), ("ep2_fsdp2", moe)]:
        got = torch.load(tmp_path / f"{layout}.pt")
        assert got.keys() == ref.keys(), layout
        for name, want in ref.items():
            assert torch.equal(got[name], want), (layout, name)


def test_the_draw_is_by_place_not_by_chunking_or_order(monkeypatch):
    """A box of a parameter drawn alone equals that box of the whole; norms start at one; the residual
    projections are scaled by 1/sqrt(2·n_layers)."""
    import kiln.model.init as init
    from kiln.model.config import ModelConfig

    monkeypatch.setattr(init, "CHUNK", 100)
    config = ModelConfig(**DENSE)
    whole = torch.empty(96, 64)
    init.fill_box(whole, "tok_embeddings.weight", (96, 64), (0, 0), config, 3)
    box = torch.empty(37, 20)
    init.fill_box(box, "tok_embeddings.weight", (96, 64), (41, 30), config, 3)
    assert torch.equal(box, whole[41:78, 30:50])
    big = torch.empty(2000, 64)
    init.fill_box(big, "layers.1.attention.wo.weight", (2000, 64), (0, 0), config, 3)
    assert big.std().item() == pytest.approx(0.02 / 2, rel=0.02)
    ones = torch.zeros(64)
    init.fill_box(ones, "layers.0.ffn_norm.weight", (64,), (0,), config, 3)
    assert ones.eq(1).all()
