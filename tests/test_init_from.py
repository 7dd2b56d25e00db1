"""train.init_from: a run B starts from run A's weights on other data with its own schedule (a WSD decay to zero,
the annealing phase), through the verified checkpoint path.

B's first-step loss is A's model's loss on B's first batch; B records where it started (run folder, checkpoint,
sha256 of its manifest) in metrics.jsonl, in every checkpoint's state and in `kiln report`; once B has
checkpoints of its own it resumes those. A model of another shape, a missing or corrupt checkpoint and another
tokenizer are one-line errors. Run A trains on the prepared sample crawl; run B's data is another corpus (JSONL
of English paragraphs) packed with A's tokenizer (tokenizer.path)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_config
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import sha256_file
from kiln.model.loss import next_token_loss
from kiln.checkpoint import list_checkpoints, load_checkpoint
from kiln.train.loader import BatchPlan, LoaderState
from kiln.train.metrics import read_metrics
from kiln.train.trainer import Trainer
from test_data import english

QUIET = lambda *_: None  # noqa: E731
ANNEAL = {"max_steps": 6, "schedule": "wsd", "decay_fraction": 1.0, "min_lr_ratio": 0.0, "warmup_steps": 0,
          "lr": 1e-3, "eval_every": 0, "log_every": 1}


@pytest.fixture(scope="module")
def run_a(prepared, tmp_path_factory) -> Path:
    """Run A: 10 steps on the sample crawl, checkpoints at 5 and 10; returns its out_dir."""
    out = tmp_path_factory.mktemp("a") / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    Trainer(tiny_config(out, train={"max_steps": 10, "eval_every": 0}), log=QUIET).run()
    return out


@pytest.fixture(scope="module")
def b_data(run_a, tmp_path_factory) -> Path:
    """Run B's prepared out_dir: other documents (JSONL), packed with A's tokenizer."""
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage

    root = tmp_path_factory.mktemp("b")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"b{i}", "text": english(1000 + i, sentences=12)}) + "\n"
                              for i in range(160)))
    cfg = b_config(root / "out", corpus=corpus, tokenizer=run_a / "tokenizer" / "tokenizer.json")
    for stage in (run_data_stage, run_tokenizer_stage, run_pack_stage):
        stage(cfg, QUIET)
    return root / "out"


def b_config(out: Path, corpus: Path | None = None, tokenizer: Path | None = None, **train):
    sections = {"train": {**ANNEAL, **train}}
    if corpus is not None:
        sections["data"] = {"inputs": [str(corpus)], "min_chars": 200}
        sections["tokenizer"] = {"path": str(tokenizer)}
    return tiny_config(out, **sections)


def fresh_b(b_data: Path, root: Path) -> Path:
    out = root / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(b_data / name, out / name)
    return out


def steps(out: Path) -> list[dict]:
    return [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == "step"]


def test_b_starts_from_as_last_checkpoint_on_other_data_and_anneals(run_a, b_data, tmp_path, capsys):
    from kiln.checkpoint.model import load_model
    from kiln.shards.reader import ShardSet
    from kiln.train.data import Mixture

    out = fresh_b(b_data, tmp_path)
    a_last = list_checkpoints(run_a / "run" / "checkpoints")[-1]
    assert a_last.name == "step-00000010"
    lines = []
    cfg = b_config(out, init_from=str(run_a / "run"))  # a run folder: its newest valid checkpoint
    Trainer(cfg, log=lines.append).run()

    # B's first step: A's model on B's first batch (B's own seeded order over its own shards).
    train = Mixture([ShardSet(out / "shards", "train")])
    assert train.manifest["tokenizer_sha256"] == sha256_file(run_a / "tokenizer" / "tokenizer.json")  # A's
    plan = BatchPlan(train, cfg.train.batch_size, cfg.train.batch_size, 0, 1)
    [batch] = plan.assemble(plan.advance(LoaderState(cfg.seed))[0])
    a_model, _, _ = load_model(a_last)
    with torch.no_grad():
        expected = float(next_token_loss(a_model.train(), batch, None, train.manifest.get("pad_id")))
    rows = steps(out)
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-6)
    # The WSD decay: from lr down to zero at the last step.
    lrs = [r["lr"] for r in rows]
    assert len(lrs) == 6 and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] == pytest.approx(0.0, abs=1e-12)

    record = {"run": str(run_a / "run"), "checkpoint": str(a_last), "sha256": sha256_file(a_last / "manifest.json"),
              "checkpoint_step": 10, "optimizer": False}
    [event] = [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == "init_from"]
    assert {k: event[k] for k in record} == record and event["step"] == 0  # this run's step, as every event's
    assert any(line.startswith(f"starting from {a_last} (step 10; its weights;") for line in lines)
    for folder in list_checkpoints(out / "run" / "checkpoints"):
        assert load_checkpoint(folder)["state"]["init_from"] == record

    # Once B has checkpoints of its own it resumes those, and still knows where it began.
    again = Trainer(b_config(out, init_from=str(run_a / "run"), max_steps=8), log=QUIET)
    assert again.resume() == list_checkpoints(out / "run" / "checkpoints")[-1]
    assert again.step == 6 and again.warm_start.record == record

    from kiln.cli import main as kiln

    assert kiln(["report", str(out / "run"), "--out", str(tmp_path / "report.html")]) == 0
    html = (tmp_path / "report.html").read_text()
    assert "started from" in html and str(a_last) in html and record["sha256"] in html


def test_init_optimizer_brings_the_moments_and_keeps_this_runs_settings(run_a, b_data, tmp_path):
    out = fresh_b(b_data, tmp_path)
    a_last = list_checkpoints(run_a / "run" / "checkpoints")[-1]
    trainer = Trainer(b_config(out, init_from=str(a_last), init_optimizer=True, weight_decay=0.05, beta2=0.99),
                      log=QUIET)
    trainer.resume()
    saved = load_checkpoint(a_last)["optimizer"]
    opt = trainer.engine.optimizer
    first = opt.param_groups[0]["params"][0]
    first_name = saved["param_groups"][0]["params"][0]  # the optimizer state is keyed by parameter name
    assert torch.equal(opt.state[first]["exp_avg"], saved["state"][first_name]["exp_avg"])
    assert opt.param_groups[0]["weight_decay"] == 0.05 and opt.param_groups[0]["betas"] == (0.9, 0.99)
    assert trainer.step == 0 and trainer.warm_start.record["optimizer"] is True

    plain = Trainer(b_config(fresh_b(b_data, tmp_path / "plain"), init_from=str(a_last)), log=QUIET)
    plain.resume()
    assert not plain.engine.optimizer.state  # weights only: AdamW starts afresh
    for k, v in load_checkpoint(a_last)["model"].items():
        assert torch.equal(plain.model.state_dict()[k], v), k


def test_another_shape_is_refused_in_one_line(run_a, b_data, tmp_path):
    out = fresh_b(b_data, tmp_path)
    for model, said in (({"dim": 32}, "model.dim 64 there, 32 here"), ({"n_layers": 3}, "model.n_layers 2 there, "
                                                                                       "3 here")):
        cfg = b_config(out, init_from=str(run_a))  # an out_dir works too
        cfg.model = cfg.model.model_copy(update=model)
        with pytest.raises(KilnError) as err:
            Trainer(cfg, log=QUIET).resume()
        message = str(err.value)
        assert "\n" not in message and message.startswith("train.init_from: ") and said in message
        assert "holds a model of another shape" in message


def test_missing_and_corrupt_checkpoints_and_another_tokenizer_are_refused(run_a, b_data, tmp_path):
    out = fresh_b(b_data, tmp_path)
    config = tmp_path / "b.yaml"
    config.write_text(b_config(out, init_from=str(tmp_path / "nowhere")).to_yaml())
    r = subprocess.run([sys.executable, "-m", "kiln", "train", str(config)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"kiln: error: train.init_from: {tmp_path / 'nowhere'} does not exist; pass a checkpoint folder "
        "(run/checkpoints/step-NNNNNNNN) or a run folder ({out_dir}/run)")
    assert not (out / "run" / "checkpoints").exists()

    broken = tmp_path / "a-copy"
    shutil.copytree(run_a / "run", broken)
    weights = broken / "checkpoints" / "step-00000010" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"^train.init_from: .*step-00000010 cannot be started from \(.*sha256"):
        Trainer(b_config(out, init_from=str(broken / "checkpoints" / "step-00000010")), log=QUIET).resume()
    lines = []
    trainer = Trainer(b_config(out, init_from=str(broken)), log=lines.append)  # the run folder: newest valid
    trainer.resume()
    assert trainer.warm_start.record["checkpoint"] == str(broken / "checkpoints" / "step-00000005")

    from kiln.train.checkpoint.init_from import check_fits

    with pytest.raises(KilnError, match=r"was trained with another tokenizer .* set tokenizer.path to"):
        check_fits(broken / "checkpoints" / "step-00000005", trainer.cfg, trainer.model.vocab_size, "0" * 64)


@pytest.mark.slow  # two torchrun ranks: about a minute on 2 free cores
def test_fsdp_on_two_gloo_ranks_starts_from_a_one_process_checkpoint(run_a, b_data, tmp_path):
    """Every rank verifies its share of A's full checkpoint and FSDP2 loads it sharded: B's first loss is still
    A's model's on B's first global batch, and B's sharded checkpoints carry the record."""
    import os

    from conftest import torchrun_kiln
    from kiln.checkpoint.model import load_model
    from kiln.shards.reader import ShardSet
    from kiln.train.data import Mixture

    out = fresh_b(b_data, tmp_path)
    a_last = list_checkpoints(run_a / "run" / "checkpoints")[-1]
    cfg = b_config(out, init_from=str(a_last), max_steps=2)
    cfg.parallel.mode = "fsdp"
    config = tmp_path / "b.yaml"
    config.write_text(cfg.to_yaml())
    proc = torchrun_kiln("train", config, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = Mixture([ShardSet(out / "shards", "train")])
    plan = BatchPlan(train, cfg.train.batch_size, cfg.train.batch_size, 0, 1)
    [batch] = plan.assemble(plan.advance(LoaderState(cfg.seed))[0])
    a_model, _, _ = load_model(a_last)
    with torch.no_grad():
        expected = float(next_token_loss(a_model.train(), batch, None, train.manifest.get("pad_id")))
    assert steps(out)[0]["loss"] == pytest.approx(expected, rel=1e-5)  # two ranks' means, summed in another order
    [last] = list_checkpoints(out / "run" / "checkpoints")[-1:]
    assert (last / "index.json").is_file()  # sharded, as FSDP2 writes by default
    assert load_checkpoint(last)["state"]["init_from"]["checkpoint"] == str(a_last)
