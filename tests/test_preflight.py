"""`kiln preflight` runs real steps on a slice of the data and judges five signals; `kiln plan` turns the
measured step time (or a peak and an MFU) into compute, time and cost with its assumptions."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import tiny_config
from kiln.cli import main as kiln
from kiln.errors import KilnError
from kiln.manifest import sha256_file
from kiln.ops.plan import make_plan
from kiln.ops.preflight import preflight


@pytest.fixture
def out(prepared, tmp_path):
    out = tmp_path / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    return out


def config_file(out, path, **sections):
    path.write_text(tiny_config(out, **sections).to_yaml())
    return str(path)


def test_preflight_passes_and_leaves_only_its_record(out, tmp_path, capsys):
    cfg_file = config_file(out, tmp_path / "c.yaml", preflight={"steps": 3})
    assert kiln(["preflight", cfg_file, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in result["checks"]] == ["loader", "utilisation", "memory", "grad_norm", "checkpoint"]
    assert all(c["verdict"] == "ok" for c in result["checks"])
    assert result["steps"] == 3 and result["tokens_per_s"] > 0
    assert json.loads((out / "preflight.json").read_text())["step_time_s"] == result["step_time_s"]
    assert sorted(p.name for p in out.iterdir()) == ["preflight.json", "shards", "tokenizer"]  # no run/, no temp folder


def test_preflight_fails_usefully_on_an_exploding_gradient(out):
    # A threshold no real gradient meets stands in for an exploding one: the verdict and the fix must name it.
    # The timing checks are switched off (a loaded machine makes the tiny model wait for data): only the
    # gradient is judged bad here, so any other failing check still fails the test.
    cfg = tiny_config(out, preflight={"steps": 2, "max_grad_norm": 1e-6, "min_utilisation": 0,
                                      "min_loader_ratio": 1e-9})
    result, checks = preflight(cfg)
    bad = {c.name: c for c in checks if not c.ok}
    assert list(bad) == ["grad_norm"] and not result["ok"]
    assert "outside [1e-08, 1e-06]" in bad["grad_norm"].fix


def test_preflight_needs_packed_shards(tmp_path):
    with pytest.raises(KilnError, match="run `kiln run CONFIG --until pack` first"):
        preflight(tiny_config(tmp_path / "nothing"))


def test_preflight_names_an_empty_validation_split(out):
    # pack.val_fraction: 0 leaves the val split without files; this was a bare IndexError
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    manifest["splits"]["val"] = {"files": [], "tokens": 0, "samples": 0}
    table = out / "shards" / manifest["file_table"]["name"]  # and no row of the table goes in the val list
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    table.write_text("".join(json.dumps({k: v for k, v in row.items() if not row["name"].startswith("val/")
                                         or k != "in"}) + "\n" for row in rows))
    manifest["files"][table.name] = {"size": table.stat().st_size, "sha256": sha256_file(table)}
    (out / "shards" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KilnError, match="the val split has no samples.*raise pack.val_fraction"):
        preflight(tiny_config(out, preflight={"steps": 2}))
    assert sorted(p.name for p in out.iterdir()) == ["shards", "tokenizer"]  # the temporary folder is gone


def test_plan_is_6ND_over_measured_or_assumed_throughput(out, tmp_path, capsys):
    cfg = tiny_config(out, plan={"device": "H100", "devices": 8, "mfu": 0.5}, budget={"price_per_device_hour": 2.0})
    plan = make_plan(cfg)
    n, d = plan["params_non_embedding"], 20 * 8 * 64  # TINY: 20 steps × 8 sequences × 64 tokens
    assert plan["tokens"] == d and plan["compute_6ND"] == 6 * n * d
    # TINY trains in fp32: the table's H100 fp32 (TF32) peak is 494 TFLOP/s.
    assert plan["tokens_per_s"] == pytest.approx(8 * 494e12 * 0.5 / (plan["compute_flops"] / d))
    assert plan["cost"] == pytest.approx(plan["hours"] * 8 * 2.0)
    assert any("H100 peak 494" in a and "50%" in a for a in plan["assumptions"])

    # On this CPU the peak is unknown: plan asks for a measurement, then uses it.
    with pytest.raises(KilnError, match="run `kiln preflight` first"):
        make_plan(tiny_config(out))
    (out / "preflight.json").write_text(
        json.dumps(
            {
                "device": "cpu",
                "world": 1,
                "tokens_per_s": 1000.0,
                "dtype": "fp32",
                "batch_size": 8,
                "model_hash": cfg.section_hash("model", "pack"),
            }
        )
    )
    assert kiln(["plan", config_file(out, tmp_path / "p.yaml", plan={"devices": 2}), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["time_source"] == "preflight" and measured["hours"] == pytest.approx(d / 2000 / 3600)
