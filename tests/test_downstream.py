"""Downstream multiple-choice evaluation: `kiln eval CKPT --mc FILE` against an independent computation on the
exported model in transformers, the same tasks inside the training loop (`eval.tasks`), and bad task files."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_config

from kiln.cli import main as kiln
from kiln.train.checkpoint import list_checkpoints
from kiln.train.trainer import Trainer

transformers = pytest.importorskip("transformers")


def QUIET(*_):
    return None


def make_task(path: Path, rows: int = 24, seed: int = 0) -> Path:
    """Sentences of the README cut in two: the true ending and three endings of other sentences."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    sentences = [s for s in re.split(r"(?<=[.!?]) ", text) if 40 < len(s) < 200]
    rng = random.Random(seed)
    out = []
    for sentence in sentences[:rows]:
        words = sentence.split(" ")
        cut = len(words) // 2
        right = " ".join(words[cut:])
        others = [" ".join(s.split(" ")[len(s.split(" ")) // 2:]) for s in rng.sample(sentences, 3) if s != sentence]
        choices = [right, *others][:4]
        rng.shuffle(choices)
        out.append({"context": " ".join(words[:cut]), "choices": choices, "answer": choices.index(right)})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    task = make_task(root / "readme.jsonl")
    out = root / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    cfg = tiny_config(out, train={"max_steps": 6, "eval_every": 0}, checkpoint={"every": 6},
                      eval={"tasks": [{"name": "readme", "path": str(task)}], "tasks_every": 3})
    Trainer(cfg, log=QUIET).run()
    return out, task, list_checkpoints(out / "run" / "checkpoints")[-1]


def hf_accuracy(model_dir: Path, task: Path) -> tuple[float, float, int]:
    """lm-eval-harness's loglikelihood, written against transformers: the continuation's tokens are those of
    context + " " + choice after the context's; acc_norm divides by the bytes of " " + choice."""
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    acc = acc_norm = n = 0
    for line in task.read_text().splitlines():
        row = json.loads(line)
        n_ctx = len(tok(row["context"], add_special_tokens=False)["input_ids"])
        scores = []
        for choice in row["choices"]:
            whole = tok(row["context"] + " " + choice, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([[tok.eos_token_id] + whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            cont = len(whole) - n_ctx
            positions = range(ids.shape[1] - cont, ids.shape[1])
            scores.append(sum(float(logp[p - 1, ids[0, p]]) for p in positions))
        norm = [s / len((" " + c).encode()) for s, c in zip(scores, row["choices"])]
        acc += int(max(range(len(scores)), key=scores.__getitem__) == row["answer"])
        acc_norm += int(max(range(len(norm)), key=norm.__getitem__) == row["answer"])
        n += 1
    return acc / n, acc_norm / n, n


def test_mc_agrees_with_transformers_on_the_exported_model(trained, tmp_path, capsys):
    out, task, ckpt = trained
    assert kiln(["eval", str(out / "run"), "--mc", str(task)]) == 0
    mc = json.loads(capsys.readouterr().out)["mc"]
    assert set(mc) == {"acc", "acc_norm", "n"} and mc["n"] == len(task.read_text().splitlines()) >= 10
    assert kiln(["export", "--hf", str(ckpt), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    acc, acc_norm, n = hf_accuracy(tmp_path / "hf", task)
    assert n == mc["n"]
    # Within one question: a near tie may fall either way under another float order.
    assert (
        abs(acc - mc["acc"]) * n <= 1 + 1e-4 and abs(acc_norm - mc["acc_norm"]) * n <= 1 + 1e-4
    )  # kiln rounds to 6 places


def test_tasks_run_in_the_loop_and_match_the_command(trained, capsys):
    out, task, ckpt = trained
    events = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    tasks = [e for e in events if e["event"] == "task"]
    assert [(e["step"], e["task"]) for e in tasks] == [(3, "readme"), (6, "readme")]
    assert kiln(["eval", str(ckpt), "--mc", str(task)]) == 0
    mc = json.loads(capsys.readouterr().out)["mc"]
    assert {k: tasks[-1][k] for k in ("acc", "acc_norm", "n")} == mc


@pytest.mark.parametrize("content, message", [
    (None, "no such task file"),
    ('{"context": "a", "choices": ["b", "c"]}\n', ':1: a row needs "context", "choices" and "answer"'),
    ('{"context": "a", "choices": ["b", "c"], "answer": 0}\nnot json\n', ":2: not JSON"),
    ('{"context": "a", "choices": ["b", "c"], "answer": 2}\n',
     ':1: "answer" must be the index of the right choice (0 to 1)'),
    ('{"context": "a", "choices": ["b"], "answer": 0}\n', "two or more non-empty texts"),
])
def test_a_bad_task_file_is_one_line(trained, tmp_path, capsys, content, message):
    out, _, _ = trained
    task = tmp_path / "t.jsonl"
    if content is not None:
        task.write_text(content)
    assert kiln(["eval", str(out / "run"), "--mc", str(task)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and str(task) in err and message in err and "Traceback" not in err


def test_a_missing_task_file_stops_training_before_step_one(workdir, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    cfg = tiny_config(workdir, eval={"tasks": [{"name": "x", "path": str(tmp_path / "nope.jsonl")}]})
    config.write_text(cfg.to_yaml())
    assert kiln(["train", str(config)]) == 2
    assert "nope.jsonl: no such task file" in capsys.readouterr().err
    assert not (workdir / "run" / "metrics.jsonl").exists()
