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
from kiln.checkpoint import list_checkpoints
from kiln.train.trainer import Trainer

transformers = pytest.importorskip("transformers")


def QUIET(*_):
    return None


def make_task(path: Path, rows: int = 24, seed: int = 0) -> Path:
    """Sentences of the README cut in two: the true ending and three endings of other sentences."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    sentences = [s for s in re.split(r"(?<=[.!?]) ", text) if 40 < len(s) < 100]  # endings fit 64 tokens
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


def hf_accuracy(model_dir: Path, task: Path) -> dict[str, float]:
    """lm-eval-harness's loglikelihood, written against transformers with the exported tokenizer's defaults
    (which put <|eos|> first): the continuation's tokens are those of context + " " + choice after the
    context's; acc_norm divides by the choice's characters, acc_bytes by its UTF-8 bytes. (The slow
    test_lm_eval.py runs lm-eval itself.)"""
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hits = {"acc": 0, "acc_norm": 0, "acc_bytes": 0}
    rows = [json.loads(line) for line in task.read_text().splitlines()]
    for row in rows:
        n_ctx = len(tok(row["context"])["input_ids"])
        scores = []
        for choice in row["choices"]:
            ids = torch.tensor([tok(row["context"] + " " + choice)["input_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            scores.append(sum(float(logp[p - 1, ids[0, p]]) for p in range(n_ctx, ids.shape[1])))
        for metric, divide in (("acc", lambda c: 1), ("acc_norm", len), ("acc_bytes", lambda c: len(c.encode()))):
            norm = [s / divide(c) for s, c in zip(scores, row["choices"])]
            hits[metric] += int(max(range(len(norm)), key=norm.__getitem__) == row["answer"])
    return {k: v / len(rows) for k, v in hits.items()} | {"n": len(rows)}


def test_mc_agrees_with_transformers_on_the_exported_model(trained, tmp_path, capsys):
    out, task, ckpt = trained
    assert kiln(["eval", str(out / "run"), "--mc", str(task)]) == 0
    mc = json.loads(capsys.readouterr().out)["mc"]
    assert set(mc) == {"acc", "acc_norm", "acc_bytes", "n"} and mc["n"] == len(task.read_text().splitlines()) >= 10
    assert kiln(["export", "--hf", str(ckpt), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    theirs = hf_accuracy(tmp_path / "hf", task)
    assert theirs["n"] == mc["n"]
    for metric in ("acc", "acc_norm", "acc_bytes"):  # within one question: a near tie may fall either way
        assert abs(theirs[metric] - mc[metric]) * mc["n"] <= 1 + 1e-4, metric  # kiln rounds to 6 places


def test_tasks_run_in_the_loop_and_match_the_command(trained, capsys):
    out, task, ckpt = trained
    events = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    tasks = [e for e in events if e["event"] == "task"]
    assert [(e["step"], e["task"]) for e in tasks] == [(3, "readme"), (6, "readme")]
    assert kiln(["eval", str(ckpt), "--mc", str(task)]) == 0
    mc = json.loads(capsys.readouterr().out)["mc"]
    assert {k: tasks[-1][k] for k in ("acc", "acc_norm", "acc_bytes", "n")} == mc


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


def test_each_metric_divides_as_lm_eval_does():
    from kiln.scoring.mc import Question, judge

    # "日本語" is 3 characters, 9 bytes; "abcdef" 6 and 6. Summed log-likelihoods -6 and -7.2:
    # acc takes the higher (0); per character -2 vs -1.2 (1); per byte -0.667 vs -1.2 (0).
    q = Question("ctx", ["日本語", "abcdef"], answer=1)
    r = judge(q, [-6.0, -7.2])
    assert r.chosen == {"acc": 0, "acc_norm": 1, "acc_bytes": 0}
    assert [r.correct(m) for m in ("acc", "acc_norm", "acc_bytes")] == [False, True, False]
    assert judge(q, [-3.0, -3.0]).chosen["acc"] == 0  # a tie goes to the first, as numpy's argmax


def test_context_whitespace_moves_into_the_continuation(prepared):
    from kiln.scoring.mc import Question, choice_tokens
    from kiln.tokenizer import load_tokenizer

    tok = load_tokenizer(prepared.out / "tokenizer")
    rows, lengths = choice_tokens(tok, 1, Question("The answer is\n", ["yes", "no"], 0), window=64)
    for row, n, choice in zip(rows, lengths, ["yes", "no"]):
        assert row[0] == 1 and tok.decode(row[1:]) == "The answer is\n " + choice
        assert row[1:-n] == tok.encode("The answer is", add_special_tokens=False).ids  # the context without "\n"
        assert tok.decode(row[-n:]) == "\n " + choice


def test_per_question_results_add_up_to_the_command(trained, capsys):
    from kiln.scoring.mc import counts, load_questions, summarise
    from kiln.eval.mc import checkpoint_question_results

    out, task, ckpt = trained
    results, questions = checkpoint_question_results(ckpt, task), load_questions(task)
    assert [(r.answer, len(r.scores)) for r in results] == [(q.answer, len(q.choices)) for q in questions]
    assert all(set(r.chosen) == {"acc", "acc_norm", "acc_bytes"} for r in results)
    assert kiln(["eval", str(ckpt), "--mc", str(task)]) == 0
    assert summarise(counts(results)) == json.loads(capsys.readouterr().out)["mc"]


def test_a_choice_longer_than_the_window_is_named_before_training(workdir, tmp_path, capsys):
    task = tmp_path / "long.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": ["b", "word " * 100], "answer": 0}) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir, eval={"tasks": [{"name": "x", "path": str(task)}]}).to_yaml())
    assert kiln(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{task}:1: choice 1 is " in err and "more than the model's window of 64" in err
    assert not (workdir / "run" / "metrics.jsonl").exists()
