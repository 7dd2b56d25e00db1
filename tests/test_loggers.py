"""train.loggers: TensorBoard event files and an offline W&B run hold the run's config and the metrics that
metrics.jsonl holds; a logger that is not installed is a one-line error before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, tiny_config

from kiln.cli import main as kiln
from kiln.train.metrics import read_metrics


def train_cli(workdir: Path, tmp_path: Path, loggers: list[str], **env) -> list[dict]:
    cfg = tiny_config(workdir, train={"max_steps": 4, "eval_every": 2, "loggers": loggers}, checkpoint={"every": 4})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    proc = subprocess.run([sys.executable, "-m", "kiln", "train", str(path)], capture_output=True, text=True,
                          check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return read_metrics(workdir / "run" / "metrics.jsonl")


def train_here(workdir: Path, loggers: list[str]) -> list[dict]:
    from kiln.train.trainer import Trainer

    cfg = tiny_config(workdir, train={"max_steps": 4, "eval_every": 2, "loggers": loggers}, checkpoint={"every": 4})
    Trainer(cfg, log=lambda *_: None).run()
    return read_metrics(workdir / "run" / "metrics.jsonl")


def test_tensorboard_events_hold_the_metrics(workdir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = train_here(workdir, ["jsonl", "tensorboard"])
    events = EventAccumulator(str(workdir / "run" / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("step/loss")]
    assert losses == [(m["step"], pytest.approx(m["loss"], rel=1e-6)) for m in metrics if m["event"] == "step"]
    assert [e.step for e in events.Scalars("eval/val_loss")] == [0, 2, 4]


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: W&B's LevelDB-style log (a 7-byte header, 32 KiB blocks of
    crc32 u32, length u16, type u8 (1 full, 2 first, 3 middle, 4 last) + data), each a protobuf Record."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


@pytest.mark.slow  # a W&B service process starts and stops: ~20 s
def test_wandb_offline_run_holds_the_config_and_metrics(workdir, tmp_path):
    pytest.importorskip("wandb")
    metrics = train_cli(workdir, tmp_path, ["jsonl", "wandb"], WANDB_MODE="offline", WANDB_SILENT="true",
                        WANDB_CONSOLE="off", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
                        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"))
    [run] = list((workdir / "run" / "wandb").glob("offline-run-*"))
    [history_file] = list(run.glob("run-*.wandb"))  # what `wandb sync` uploads
    records = wandb_records(history_file)

    def key(item):
        return item.key or "/".join(item.nested_key)

    kinds = [r.WhichOneof("record_type") for r in records]
    config = {key(u): json.loads(u.value_json) for r in records if r.WhichOneof("record_type") in ("run", "config")
              for u in (r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update)}
    assert config["train"]["max_steps"] == 4 and config["model"]["dim"] == 64 and config["out_dir"] == str(workdir)
    history = [{key(i): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert kinds[-1] == "exit"  # the run was finished, not cut off
    losses = [(h["_step"], h["step/loss"]) for h in history if "step/loss" in h]
    assert losses == [(m["step"], pytest.approx(m["loss"], rel=1e-9)) for m in metrics if m["event"] == "step"]
    vals = [(h["_step"], h["eval/val_loss"]) for h in history if "eval/val_loss" in h]
    assert vals == [(m["step"], pytest.approx(m["val_loss"], rel=1e-9)) for m in metrics if m["event"] == "eval"]


def test_default_is_jsonl_alone(workdir):
    from kiln.config import TrainConfig

    assert TrainConfig().loggers == ["jsonl"]
    train_here(workdir, ["jsonl"])
    assert not (workdir / "run" / "tensorboard").exists() and not (workdir / "run" / "wandb").exists()


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_logger_that_is_not_installed_is_one_line(workdir, tmp_path, capsys, monkeypatch, name):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    path = tmp_path / "c.yaml"
    path.write_text(tiny_config(workdir, train={"loggers": ["jsonl", name]}).to_yaml())
    assert kiln(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"train.loggers asks for {name}, which is not installed: " in err and f"(Kiln's extra '{name}')" in err
    assert "Traceback" not in err and not (workdir / "run").exists()


def test_an_unknown_logger_names_the_choices(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  loggers: [jsonl, mlflow]\n")
    assert kiln(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.loggers" in err and "'jsonl', 'tensorboard' or 'wandb'" in err
