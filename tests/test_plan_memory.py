"""`kiln plan`'s per-device memory: parameters, gradients and optimizer state divided the way each degree
divides them, activations at the micro-batch and activation checkpointing, and the fit against a device."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from kiln.cli import main as kiln
from kiln.errors import ConfigError
from kiln.ops.memory import memory_plan
from kiln.ops.plan import make_plan
from kiln.train.parallel.mesh import Degrees
from kiln.model.build import build_model

SHARDED = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight",
           "tok_embeddings.weight", "output.weight")


def cfg_and_model(**sections):
    cfg = tiny_config("/tmp/unused", **sections)
    with torch.device("meta"):
        model = build_model(cfg.model, 1024, cfg.pack.seq_len)
    return cfg, model


def counts(model) -> tuple[int, int]:
    """(elements of the weights tensor parallel shards, of the replicated ones)."""
    sharded = sum(p.numel() for n, p in model.named_parameters() if n.endswith(SHARDED))
    return sharded, sum(p.numel() for p in model.parameters()) - sharded


def test_tp2_halves_the_sharded_weights_and_fsdp_divides_param_grad_optimizer():
    cfg, model = cfg_and_model()
    sharded, replicated = counts(model)
    one = memory_plan(cfg, model, Degrees(), None)
    assert one["parameters"] == 4 * (sharded + replicated) and one["gradients"] == one["parameters"]
    assert one["optimizer"] == 8 * (sharded + replicated)  # AdamW: two fp32 moments
    tp2 = memory_plan(cfg, model, Degrees(tp=2), None)
    assert tp2["parameters"] == 4 * (sharded / 2 + replicated)  # the norms stay whole
    for n in (2, 4):
        fsdp = memory_plan(cfg, model, Degrees(dp_shard=n, mode="fsdp"), None)
        for key in ("parameters", "gradients", "optimizer"):
            assert fsdp[key] == pytest.approx(one[key] / n)
        assert fsdp["fsdp_buffers"] > 0  # the gathered blocks
    ddp = memory_plan(cfg, model, Degrees(dp_replicate=4, mode="ddp"), None)
    assert ddp["parameters"] == one["parameters"]  # replicas keep a whole copy


def test_pipeline_stages_hold_their_blocks_and_the_heaviest_is_reported():
    cfg, model = cfg_and_model(model={"n_layers": 4})
    block = sum(p.numel() for p in model.layers[0].parameters())
    embed, head = model.tok_embeddings.weight.numel(), model.output.weight.numel() + model.norm.weight.numel()
    pp2 = memory_plan(cfg, model, Degrees(pp=2), None)
    # stage 0: embeddings + 2 blocks; stage 1: 2 blocks + norm + head (and the logits): the heavier one
    assert pp2["pp_rank"] == 1 and pp2["parameters"] == 4 * (2 * block + head)
    assert embed == head - model.norm.weight.numel()


def test_activations_follow_micro_batch_checkpointing_and_tp():
    cfg, model = cfg_and_model(train={"micro_batch_size": 4})
    base = memory_plan(cfg, model, Degrees(), None)["activations"]
    cfg8, _ = cfg_and_model(train={"micro_batch_size": 8})
    assert memory_plan(cfg8, model, Degrees(), None)["activations"] == pytest.approx(2 * base)
    ac, _ = cfg_and_model(train={"micro_batch_size": 4}, parallel={"activation_checkpointing": True})
    assert memory_plan(ac, model, Degrees(), None)["activations"] < base
    assert memory_plan(cfg, model, Degrees(tp=2), None)["activations"] < base
    bf16, _ = cfg_and_model(train={"micro_batch_size": 4, "dtype": "bf16"})
    assert memory_plan(bf16, model, Degrees(), None)["activations"] < base


def test_plan_says_what_does_not_fit_a_device(capsys, tmp_path):
    cfg, model = cfg_and_model(plan={"device": "H100", "devices": 4, "device_memory_gb": 0.001},
                               parallel={"mode": "fsdp"})
    plan = make_plan(cfg)
    m = plan["memory"]
    assert m["degrees"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1, "mode": "fsdp"}
    assert m["device_bytes"] == 1e6 and m["fits"] is False
    # tp=4 cannot split 2 kv heads; (1, 2) is pp=2 x dp_shard=2
    assert {(a["tp"], a["dp_shard"]) for a in m["alternatives"]} == {(1, 4), (2, 2), (1, 2)}
    assert all(a["fits"] is False for a in m["alternatives"])
    roomy = make_plan(tiny_config("/tmp/unused", plan={"device": "H100", "devices": 4}))["memory"]
    assert roomy["device_bytes"] == 80e9 and roomy["fits"] is True  # the H100's 80 GB from the table
    path = tmp_path / "p.yaml"
    path.write_text(cfg.to_yaml())
    assert kiln(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "memory per device: pp 1 x dp_replicate 1 x dp_shard 4 x tp 1 (fsdp)" in out and "NO" in out
    assert kiln(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["fits"] is False


def test_plan_refuses_degrees_that_do_not_match_the_devices():
    with pytest.raises(ConfigError, match="parallel.tp=3 x parallel.pp=1 = 3 does not divide the 4 ranks"):
        make_plan(tiny_config("/tmp/unused", plan={"device": "H100", "devices": 4}, parallel={"tp": 3}))


def test_expert_parallel_divides_the_experts():
    cfg, model = cfg_and_model(model={"moe": {"n_experts": 4}})
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    one = memory_plan(cfg, model, Degrees(dp_replicate=2, mode="ddp"), None)
    ep_cfg, _ = cfg_and_model(model={"moe": {"n_experts": 4}}, parallel={"ep": 2})
    ep2 = memory_plan(ep_cfg, model, Degrees(dp_replicate=2, mode="ddp"), None)
    assert one["parameters"] - ep2["parameters"] == 4 * experts / 2


def test_expert_parallel_with_fsdp2_divides_the_experts_by_ep_and_the_rest_by_dp_shard():
    from kiln.ops.memory import stage_params

    _, model = cfg_and_model(model={"moe": {"n_experts": 4, "top_k": 2}})
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    fsdp4 = Degrees(dp_shard=4, mode="fsdp")
    assert stage_params(model, fsdp4, "gpipe", ep=2) == [pytest.approx(experts / 2 + rest / 4)]  # experts: ep
    assert stage_params(model, fsdp4, "gpipe") == [pytest.approx((experts + rest) / 4)]  # no ep: FSDP2 shards all
