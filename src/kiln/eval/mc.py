"""`kiln eval CKPT --mc FILE.jsonl`: a checkpoint's multiple-choice accuracy on the CPU (the scoring, with
lm-eval-harness's definitions, is kiln.scoring.mc)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint.model import load_model
from kiln.scoring.mc import QuestionResult, counts, load_questions, question_results, summarise


def checkpoint_question_results(folder: Path, task_file: Path) -> list[QuestionResult]:
    """Every question of `task_file` judged by a checkpoint on the CPU, in the file's order."""
    questions = load_questions(task_file)  # before the (slow) load
    model, tok, cfg = load_model(folder)
    return question_results(model, tok, questions, cfg.pack.seq_len, torch.device("cpu"),
                            eos_token=cfg.tokenizer.eos_token)


def evaluate_mc_checkpoint(folder: Path, task_file: Path) -> dict[str, Any]:
    """`kiln eval CKPT --mc FILE`: {"acc", "acc_norm", "acc_bytes", "n"} of a checkpoint on the CPU."""
    return summarise(counts(checkpoint_question_results(folder, task_file)))
