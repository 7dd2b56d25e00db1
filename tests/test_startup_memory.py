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


def test_plan_trace_against_two_real_fsdp_ranks(workdir, tmp_path, capsys):
    """#39.3: the traced rank's sharded parameters and optimizer state (2 fake ranks) equal what each of 2 real
    gloo ranks holds (its startup record's parameter bytes; AdamW's two moments are twice that) within 5%."""
    import json
    import os

    from kiln.cli import main as kiln

    cfg = tmp_path / "c.yaml"
    sections = {"train": {"max_steps": 1}, "parallel": {"dp_shard": 2}, "plan": {"devices": 2, "device": "H100"}}
    cfg.write_text(tiny_config(workdir, **sections).to_yaml())
    assert kiln(["plan", "--json", "--trace", str(cfg)]) == 0
    trace = json.loads(capsys.readouterr().out)["trace"]
    proc = torchrun_kiln("train", cfg, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    held = startups(workdir)[0]["param_bytes"]
    assert trace["world"] == 2 and trace["kind"] == "fsdp"
    assert abs(trace["tracker"]["Sharded Param"] - held) <= 0.05 * held
    assert abs(trace["optimizer"] - 2 * held) <= 0.05 * 2 * held
