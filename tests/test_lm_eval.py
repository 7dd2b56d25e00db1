"""`kiln eval --mc` against lm-eval-harness itself: lm-eval 0.4.13 (`lm_eval --model hf`), installed from the
package index, runs a local multiple_choice task on a model Kiln exported, and its acc, acc_norm and acc_bytes
(and each question's log-likelihoods and verdicts) are Kiln's.

lm-eval is not one of Kiln's extras (with its dependencies it adds ~400 MB and several minutes of install): the
test installs it once into a venv of its own layered on this one (`.cache/lm-eval-0.4.13/`: its packages, plus
this venv's through a .pth file, pinned to their installed versions so nothing here changes), or uses
`$KILN_LM_EVAL_PYTHON` if set. It needs the package index (a slow test; CI runs it with `make test-all`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT, tiny_config

from kiln.cli import main as kiln
from kiln.data.docs import read_docs
from kiln.scoring.mc import METRICS, load_questions
from kiln.eval.mc import checkpoint_question_results
from kiln.tokenizer import load_tokenizer
from kiln.checkpoint import list_checkpoints
from kiln.train.trainer import Trainer

pytestmark = pytest.mark.slow
LM_EVAL = "lm-eval[hf]==0.4.13"
QUIET = lambda *_: None  # noqa: E731


def lm_eval_python() -> Path:
    """A Python with lm-eval 0.4.13 importable: $KILN_LM_EVAL_PYTHON, or a venv layered on this one."""
    if os.environ.get("KILN_LM_EVAL_PYTHON"):
        return Path(os.environ["KILN_LM_EVAL_PYTHON"])
    venv = ROOT / ".cache" / "lm-eval-0.4.13"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    if stamp.is_file():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    layered = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # addsitedir (not a bare path): this venv's own .pth files (editable installs) work there too.
    Path(layered, "kiln-base.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    pins = venv / "pins.txt"
    pins.write_text(subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                                   capture_output=True, text=True, check=True).stdout)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(pins), LM_EVAL], check=True)
    stamp.touch()
    return python


def multilingual_task(docs: Path, tokenizer: Path, path: Path, rows: int = 50, seed: int = 0) -> Path:
    """Sentences of the sample's documents (8 languages) cut in two: the true ending and three endings of
    sentences in other documents, so a question's choices differ in characters per byte (acc_norm and
    acc_bytes then pick differently); some contexts end in whitespace (lm-eval moves it into the choice).
    Endings fit the 64-token window (longer ones are an error in both tools); contexts may not (both cut them
    from the left)."""
    tok = load_tokenizer(tokenizer)

    def fits(sentence: str) -> bool:
        return len(tok.encode(" " + sentence[len(sentence) // 2:].lstrip()).ids) <= 40

    sentences = []
    for doc in read_docs(docs):
        sentences += [s for s in re.split(r"(?<=[.!?。])\s+", " ".join(doc["text"].split()))
                      if 30 < len(s) < 400 and fits(s)]
    rng = random.Random(seed)
    rng.shuffle(sentences)
    out = []
    for i, sentence in enumerate(sentences[:rows]):
        cut = len(sentence) // 2
        context, right = sentence[:cut].rstrip(), sentence[cut:].lstrip()
        others = [s[len(s) // 2:].lstrip() for s in rng.sample(sentences, 3)]
        choices = [right, *others]
        rng.shuffle(choices)
        out.append({"context": context + ("\n" if i % 5 == 0 else " " if i % 5 == 1 else ""), "choices": choices,
                    "answer": choices.index(right)})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    return path


def task_yaml(folder: Path, data: Path) -> None:
    """A local lm-eval task over Kiln's task file: the fields by name, target_delimiter " " (the default)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kiln_mc.yaml").write_text(f"""task: kiln_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_bytes
""")


def run_lm_eval(python: Path, model: Path, tasks: Path, out: Path) -> tuple[dict, list[dict]]:
    """(the task's results, its logged samples in doc order) of `lm_eval --model hf` on the CPU, offline."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf-home"),
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(python), "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
           "--tasks", "kiln_mc", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "1",
           "--output_path", str(out / "results"), "--log_samples"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(next((out / "results").rglob("results_*.json")).read_text())["results"]["kiln_mc"]
    samples = [json.loads(line) for line in next((out / "results").rglob("samples_kiln_mc_*.jsonl")).open()]
    return results, sorted(samples, key=lambda s: s["doc_id"])


def test_mc_metrics_equal_lm_eval_on_an_exported_model(prepared, tmp_path, capsys):
    python = lm_eval_python()
    out = tmp_path / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    Trainer(tiny_config(out, train={"max_steps": 30, "eval_every": 0}, checkpoint={"every": 30}), log=QUIET).run()
    ckpt = list_checkpoints(out / "run" / "checkpoints")[-1]
    task = multilingual_task(prepared.out / "docs", prepared.out / "tokenizer", tmp_path / "task.jsonl")
    assert kiln(["export", "--hf", str(ckpt), str(tmp_path / "hf")]) == 0
    assert kiln(["eval", str(ckpt), "--mc", str(task)]) == 0
    ours = json.loads(capsys.readouterr().out.splitlines()[-1])["mc"]

    task_yaml(tmp_path / "tasks", task)
    theirs, samples = run_lm_eval(python, tmp_path / "hf", tmp_path / "tasks", tmp_path / "lm-eval")
    print("kiln:", ours, "lm-eval:", {m: theirs[f"{m},none"] for m in METRICS})
    assert ours["n"] == len(samples) == len(load_questions(task)) == 50
    assert {m: ours[m] for m in METRICS} == {m: pytest.approx(theirs[f"{m},none"], abs=1e-6) for m in METRICS}

    # Question by question: the same log-likelihoods and the same verdict under each metric.
    per_question = checkpoint_question_results(ckpt, task)
    for result, sample in zip(per_question, samples):
        lls = [float(r[0]) for r in sample["filtered_resps"]]
        assert list(result.scores) == pytest.approx(lls, rel=1e-4, abs=1e-4), sample["doc_id"]
        assert {m: float(result.correct(m)) for m in METRICS} == {m: sample[m] for m in METRICS}, sample["doc_id"]
    # The task tells the three definitions apart (a test where they agree could not catch a swap).
    assert any(r.chosen["acc_norm"] != r.chosen["acc_bytes"] for r in per_question)
    assert any(r.chosen["acc"] != r.chosen["acc_norm"] for r in per_question)
