"""The whole flow through the command line on the bundled sample: outputs exist and verify, a flipped
byte is caught, validation loss falls, eval prints JSON, and a second run skips finished stages."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import ROOT
from kiln.cli import main as kiln

SMALL = ["data.min_chars=200", "tokenizer.vocab_size=1024", "pack.seq_len=64", "model.dim=64", "model.n_layers=2",
         "train.max_steps=30", "train.batch_size=8", "train.eval_every=15", "train.eval_batches=4",
         "train.threads=1", "train.warmup_steps=3", "checkpoint.every=15", "data.workers=1"]


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "out"
    assert kiln(["run", str(ROOT / "examples" / "tiny.yaml"), f"out_dir={out}", *SMALL]) == 0
    return out


def flip_byte(path, at=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_outputs_exist_and_validation_loss_fell(flow):
    for name in (
        "docs/manifest.json",
        "docs/stats.json",
        "docs/part-00000.jsonl.zst",
        "docs/rejects/part-00000.jsonl.zst",
        "tokenizer/tokenizer.json",
        "shards/manifest.json",
        "shards/train/00000.bin",
        "shards/val/00000.idx",
        "run/metrics.jsonl",
        "run/checkpoints/step-00000030/manifest.json",
    ):
        assert (flow / name).is_file(), name
    stats = json.loads((flow / "docs" / "stats.json").read_text())
    assert stats["documents"]["read"] == stats["documents"]["kept"] + sum(stats["rejected_by_reason"].values())
    evals = [json.loads(line) for line in (flow / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {e["step"]: e["val_loss"] for e in evals if e["event"] == "eval"}
    assert set(val) == {0, 15, 30} and val[30] < val[0] - 0.5


def test_verify_commands_pass_then_catch_a_flipped_byte(flow, tmp_path, capsys):
    ckpt = flow / "run" / "checkpoints" / "step-00000030"
    assert kiln(["ckpt", "verify", str(ckpt)]) == 0
    assert kiln(["shards", "verify", str(flow / "shards")]) == 0
    bad_ckpt, bad_shards = tmp_path / "ckpt", tmp_path / "shards"
    shutil.copytree(ckpt, bad_ckpt)
    shutil.copytree(flow / "shards", bad_shards)
    flip_byte(bad_ckpt / "optimizer.pt")
    flip_byte(bad_shards / "train" / "00000.bin")
    capsys.readouterr()
    assert kiln(["ckpt", "verify", str(bad_ckpt)]) == 1
    assert "optimizer.pt" in capsys.readouterr().err
    assert kiln(["shards", "verify", str(bad_shards)]) == 1
    assert "train/00000.bin" in capsys.readouterr().err


def test_eval_prints_loss_perplexity_tokens(flow, tmp_path, capsys):
    ckpt = flow / "run" / "checkpoints" / "step-00000030"
    capsys.readouterr()
    assert kiln(["eval", str(ckpt)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"loss", "perplexity", "tokens"} and result["tokens"] > 0
    assert result["perplexity"] == pytest.approx(2.718281828 ** result["loss"], rel=1e-3)
    text = tmp_path / "sample.txt"
    text.write_text("Debian is a free operating system. The package manager installs software.\n" * 20)
    assert kiln(["eval", str(ckpt), "--text", str(text)]) == 0
    on_text = json.loads(capsys.readouterr().out)
    assert on_text["tokens"] > 100 and on_text["bits_per_byte"] > 0
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8")
    assert kiln(["eval", str(ckpt), "--text", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_second_run_skips_finished_stages(flow, capsys):
    capsys.readouterr()
    assert kiln(["run", str(ROOT / "examples" / "tiny.yaml"), f"out_dir={flow}", *SMALL]) == 0
    err = capsys.readouterr().err
    for stage in ("data:", "tokenizer:", "pack:", "train:"):
        line = next(ln for ln in err.splitlines() if ln.startswith(stage))
        assert "skipping" in line, line
    assert "validation loss at end" in err


def test_misspelt_key_stops_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    assert kiln(["run", str(ROOT / "examples" / "tiny.yaml"), f"out_dir={out}", "train.max_step=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.max_step" in err and "train.max_steps" in err
    assert not out.exists()


def test_docs_written_again_keep_the_tokenizer_shards_and_the_resume(flow, tmp_path, capsys):
    """Issue 45.2: the same inputs written into docs/ again (new timings and pids in stats.json) are the same
    data: the tokenizer and shards are kept byte for byte and training resumes from its checkpoint."""
    out = tmp_path / "out"
    shutil.copytree(flow, out)
    shutil.rmtree(out / "docs")
    capsys.readouterr()
    assert kiln(["run", str(ROOT / "examples" / "tiny.yaml"), f"out_dir={out}", *SMALL, "train.max_steps=35"]) == 0
    err = capsys.readouterr().err
    assert "data: reading" in err and "tokenizer: skipping" in err and "pack: skipping" in err, err
    assert "trained on other data" not in err
    for name in ("tokenizer", "shards"):
        files = sorted(p.relative_to(flow / name) for p in (flow / name).rglob("*") if p.is_file())
        assert files and all((out / name / f).read_bytes() == (flow / name / f).read_bytes() for f in files), name
    steps = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s.get("event") == "step"][-6:] == [30, 31, 32, 33, 34, 35]


def test_a_tokenizer_and_shards_an_older_kiln_fingerprinted_are_kept(prepared, tmp_path):
    """Before issue 45.2 the later stages' fingerprints hashed the docs manifest's bytes: such folders are still
    up to date while that manifest is unchanged (else each run's checkpoints would meet repacked shards)."""
    import hashlib

    from conftest import tiny_config
    from kiln.stages import run_pack_stage, run_tokenizer_stage
    from kiln.manifest import sha256_file

    out = tmp_path / "out"
    for name in ("docs", "tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    cfg, docs_sha = tiny_config(out), sha256_file(out / "docs" / "manifest.json")
    old = {"tokenizer": [docs_sha, cfg.section_hash("tokenizer")],
           "shards": [docs_sha, sha256_file(out / "tokenizer" / "tokenizer.json"), cfg.section_hash("pack")]}
    for name, parts in old.items():
        manifest = json.loads((out / name / "manifest.json").read_text())
        manifest["fingerprint"] = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        (out / name / "manifest.json").write_text(json.dumps(manifest))
    before = (out / "shards" / "manifest.json").read_bytes()
    log: list[str] = []
    run_tokenizer_stage(cfg, log.append)
    run_pack_stage(cfg, log.append)
    assert [line.split(",")[0] for line in log] == ["tokenizer: skipping", "pack: skipping"]
    assert (out / "shards" / "manifest.json").read_bytes() == before
