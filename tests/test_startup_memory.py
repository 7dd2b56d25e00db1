"""Item 4 of #39: host memory at start-up is planned (`kiln plan`), checked (`kiln doctor --config`, the
trainer before any work) and reported (one `startup` record per rank in metrics.jsonl, rank 0's on the console)."""

from __future__ import annotations

import pytest

from conftest import tiny_config, torchrun_kiln
from kiln.errors import KilnError
from kiln.train import cpu_memory
from kiln.train.metrics import read_metrics
from kiln.train.trainer import Trainer


def startups(out) -> list[dict]:
    return [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == "startup"]


def test_one_process_writes_its_startup_record_and_says_it(workdir):
    lines: list[str] = []
    Trainer(tiny_config(workdir, train={"max_steps": 2}), log=lines.append).run()
    [rec] = startups(workdir)
    assert rec["rank"] == 0 and rec["device_peak_bytes"] is None
    assert rec["param_bytes"] > 0 and rec["host_peak_bytes"] > 50e6
    assert any(line.startswith("start-up done: rank 0 of 1 holds") for line in lines), lines


def test_two_fsdp_ranks_each_write_a_record_of_half_the_parameters(workdir, tmp_path):
    import os

    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny_config(workdir, train={"max_steps": 1}, parallel={"dp_shard": 2}).to_yaml())
    proc = torchrun_kiln("train", cfg, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = startups(workdir)
    assert [r["rank"] for r in recs] == [0, 1]
    assert abs(recs[0]["param_bytes"] - recs[1]["param_bytes"]) <= 0.02 * recs[0]["param_bytes"]


def test_a_node_too_small_for_its_ranks_is_one_line_before_any_work(workdir, monkeypatch):
    monkeypatch.setattr(cpu_memory, "available_host_bytes", lambda: 10**6)
    with pytest.raises(KilnError, match=r"host memory: 1 rank\(s\) on this node need .* GB at start-up .* 0.0 GB "
                                        r"available; start fewer ranks per node"):
        Trainer(tiny_config(workdir, train={"max_steps": 2}))
    assert not (workdir / "run" / "metrics.jsonl").exists()


def test_startup_host_need_counts_the_largest_tensor_and_a_cpu_ranks_share():
    from kiln.config import build_config
    from kiln.model.build import build_model

    model = build_model(build_config({}).model, 1000, 64, device="meta")
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    assert cpu_memory.startup_host_bytes(model, "cuda", 4) == cpu_memory.HOST_BASE_BYTES["cuda"] + 4 * largest
    assert cpu_memory.startup_host_bytes(model, "cpu", 4) == pytest.approx(
        cpu_memory.HOST_BASE_BYTES["cpu"] + 4 * largest + 16 * n / 4)
    assert cpu_memory.check_host_memory(1e9, 8, 9e9) is None
    assert "8 rank(s) on this node need 10.4 GB" in cpu_memory.check_host_memory(1.3e9, 8, 9e9)


def test_doctor_judges_the_configured_ranks_start_up_against_the_node(tmp_path, monkeypatch):
    from kiln.config import build_config
    from kiln.ops.doctor import check_host_memory

    cfg = build_config({"out_dir": str(tmp_path), "plan": {"devices": 8}, "parallel": {"dp_shard": 8}})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    ok = check_host_memory(cfg, available=10**12)
    assert ok.ok and ok.detail.startswith("8 rank(s) x ") and "1,000.0 GB available" in ok.detail
    short = check_host_memory(cfg, available=10**9)
    assert not short.ok and short.fix.startswith("start fewer ranks per node")


def test_plan_reports_host_memory_per_rank_and_per_node(capsys):
    import json

    from kiln.cli import main as kiln

    assert kiln(["plan", "--json", "examples/llama-3.1-70b.yaml"]) == 0
    host = json.loads(capsys.readouterr().out)["memory"]["host"]
    assert host["ranks_per_node"] == 8 and host["device_type"] == "cuda"
    largest = 128256 * 8192 * 4  # the embedding in fp32: a rank never holds the 282 GB model on its host
    assert host["per_rank_bytes"] == cpu_memory.HOST_BASE_BYTES["cuda"] + largest
    assert host["per_node_bytes"] == 8 * host["per_rank_bytes"]


_HELD = r"""
import json, sys
import torch
from kiln.config import load_config
from kiln.model.build import build_model
from kiln.model.loss import next_token_loss
from kiln.ops.trace import optimizer_state_bytes
from kiln.train.engine import build_optimizer
from kiln.train.parallel.dist import init_distributed
from kiln.train.parallel.mesh import Mesh, resolve_degrees
from kiln.train.parallel.parallelize import Precision, parallelize

cfg, vocab, out = load_config(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
d = init_distributed(60)
model = build_model(cfg.model, vocab, cfg.pack.seq_len, 0, "meta")  # as the trainer: meta, split, each rank its part
parallel = parallelize(model, d, cfg.parallel, Precision.of(cfg.train), next_token_loss,
                       Mesh(resolve_degrees(cfg.parallel, d.world), d.rank), seed=cfg.seed)
optimizer = build_optimizer(parallel.model, cfg.train, d.device)
parallel.loss_fn(parallel.module, torch.randint(0, vocab, (1, cfg.pack.seq_len + 1)), parallel.autocast).backward()
parallel.after_backward()
optimizer.step()


def storage_bytes(tensors):  # each storage once: FSDP2's sharded gradients are views of one reduce-scatter output
    seen = {}
    for t in tensors:
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


params = list(parallel.model.parameters())
held = {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
        "optimizer": optimizer_state_bytes(optimizer)}
json.dump(held, open(f"{out}/held{d.rank}.json", "w"))
"""


@pytest.mark.parametrize("model", [
    pytest.param({}, id="tiny"),
    pytest.param({"dim": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8}, id="100M", marks=pytest.mark.slow)])
def test_plan_trace_against_two_real_fsdp_ranks(workdir, tmp_path, capsys, model):
    """#39.3: the parameters, gradients and optimizer state `kiln plan --trace` says a rank holds (2 fake ranks)
    equal the storage bytes each of 2 real FSDP2 gloo ranks holds after a step, within 5%; the plan's `fits` is
    the trace's, and its optimizer figure is the state AdamW holds (8 bytes a parameter), not the step's work."""
    import json
    import os

    from conftest import ROOT, torchrun_script
    from kiln.cli import main as kiln

    cfg = tmp_path / "c.yaml"
    sections = {"parallel": {"dp_shard": 2}, "plan": {"devices": 2, "device": "H100"}}
    cfg.write_text(tiny_config(workdir, model=model, **sections).to_yaml())
    assert kiln(["plan", "--json", "--trace", str(cfg)]) == 0
    plan = json.loads(capsys.readouterr().out)
    trace = plan["trace"]
    assert trace["world"] == 2 and trace["kind"] == "fsdp"
    assert plan["memory"]["fits_by"] == "trace" and plan["memory"]["fits"] is True
    assert trace["optimizer"] == trace["held"]["optimizer"] == trace["optimizer_state_bytes"]
    script = tmp_path / "held.py"
    script.write_text(_HELD)
    proc = torchrun_script(script, cfg, 1024, tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        held = json.loads((tmp_path / f"held{rank}.json").read_text())
        # AdamW: exp_avg and exp_avg_sq in fp32 (8 bytes a parameter) and a 4-byte step counter per tensor
        assert 0 < held["optimizer"] - 2 * held["parameters"] <= 1e-3 * held["optimizer"]
        for key in ("parameters", "gradients", "optimizer"):
            assert abs(trace["held"][key] - held[key]) <= 0.05 * held[key], (rank, key, trace["held"][key], held)


def test_traced_optimizer_state_is_adamws_eight_bytes_a_parameter_under_tp_and_fsdp(workdir):
    """#39.3: under tensor parallel x FSDP2 in bf16 (the 70B's layout), DTensor's sharding propagation ran every
    optimizer op once more on global-shape fake tensors and the tracker filed them as optimizer state (21.4 GB
    traced for the 70B's 8.8 GB); now the trace's optimizer state is the formula's 8 bytes a parameter."""
    from kiln.model.build import build_model
    from kiln.ops.memory import memory_plan
    from kiln.ops.trace import trace_memory
    from kiln.train.parallel.mesh import resolve_degrees

    cfg = tiny_config(workdir, model={"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4},
                      parallel={"tp": 2, "dp_shard": 2}, train={"dtype": "bf16", "micro_batch_size": 1})
    trace = trace_memory(cfg, 1024, 4)
    model = build_model(cfg.model, 1024, cfg.pack.seq_len, device="meta")
    formula = memory_plan(cfg, model, resolve_degrees(cfg.parallel, 4), None)
    assert trace["kind"] == "fsdp" and trace["world"] == 4
    assert trace["optimizer"] == trace["held"]["optimizer"] == trace["optimizer_state_bytes"]
    assert abs(trace["optimizer"] - formula["optimizer"]) <= 0.02 * formula["optimizer"]
    assert abs(trace["held"]["parameters"] - formula["parameters"]) <= 0.02 * formula["parameters"]
    # the propagation's global-shape tensors were 7x the state here, as temporaries of the fused AdamW step
    assert trace["temporaries"] < trace["optimizer"]
