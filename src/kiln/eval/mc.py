"""Multiple-choice downstream evaluation with lm-eval-harness's definitions (`kiln eval CKPT --mc FILE.jsonl`).

A task file holds one JSON object a line: `{"context": str, "choices": [str, ...], "answer": int}` (the index
of the right choice; the text of a choice is accepted too). A choice's score is the summed log-probability of
the tokens of `context + " " + choice` that come after those of `context` (lm-eval-harness's loglikelihood of
the continuation, its `target_delimiter` " "). `acc` counts rows where the right choice scores highest;
`acc_norm` divides each score by the UTF-8 byte length of `" " + choice` first. As in training, where every
document follows an <|eos|>, the tokens are preceded by <|eos|>; a row longer than the model's window keeps
its last `max_seq_len + 1` tokens (the context is cut from the left, as the harness does).

Memory: the rows of a task are held (a task file is a benchmark, thousands of rows, not a corpus); one row's
choices are scored in one batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.errors import KilnError

DELIMITER = " "
ROW = '{"context", "choices", "answer"}'


@dataclass
class Question:
    context: str
    choices: list[str]
    answer: int


def load_questions(path: str | Path) -> list[Question]:
    """The rows of a task file; a bad row is a one-line error naming FILE:LINE and what is wrong."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise KilnError(f"{path}: no such task file; give a JSONL of {ROW} rows") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KilnError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    questions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise KilnError(f"{where}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not {"context", "choices", "answer"} <= row.keys():
            raise KilnError(f"{where}: a row needs \"context\", \"choices\" and \"answer\" (the right choice's index)")
        context, choices, answer = row["context"], row["choices"], row["answer"]
        if not isinstance(context, str) or not isinstance(choices, list) or len(choices) < 2 \
                or not all(isinstance(c, str) and c for c in choices):
            raise KilnError(f"{where}: \"context\" must be text and \"choices\" a list of two or more non-empty texts")
        if isinstance(answer, str) and answer in choices:
            answer = choices.index(answer)
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
            raise KilnError(f"{where}: \"answer\" must be the index of the right choice (0 to {len(choices) - 1}), "
                            f"got {row['answer']!r}")
        questions.append(Question(context, choices, answer))
    if not questions:
        raise KilnError(f"{path}: no rows; give a JSONL of {ROW} rows")
    return questions


def choice_tokens(tok, eos: int, q: Question) -> tuple[list[list[int]], list[int]]:
    """Per choice: the token ids (<|eos|>, context, continuation) and how many of them are the continuation."""
    n_context = len(tok.encode(q.context, add_special_tokens=False).ids)
    rows, lengths = [], []
    for choice in q.choices:
        whole = tok.encode(q.context + DELIMITER + choice, add_special_tokens=False).ids
        continuation = max(len(whole) - n_context, 1)  # a merge across the boundary still scores >= 1 token
        rows.append([eos] + whole)
        lengths.append(continuation)
    return rows, lengths


@torch.no_grad()
def choice_scores(model: torch.nn.Module, rows: list[list[int]], lengths: list[int], window: int,
                  device: torch.device, autocast_dtype: torch.dtype | None = None) -> list[float]:
    """Summed log-probability of each row's last `lengths[i]` tokens, in fp32; rows padded on the right."""
    rows = [r[-(window + 1):] for r in rows]
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, :len(r)] = torch.tensor(r)
    batch = batch.to(device)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(batch[:, :-1])
    logp = F.log_softmax(logits.float(), dim=-1)
    scores = []
    for i, (r, n) in enumerate(zip(rows, lengths)):
        n = min(n, len(r) - 1)
        targets = batch[i, len(r) - n: len(r)]
        scores.append(float(logp[i, len(r) - n - 1: len(r) - 1].gather(1, targets[:, None]).sum()))
    return scores


def judge(q: Question, scores: list[float]) -> tuple[int, int]:
    """(acc, acc_norm) of one question: 1 when the right choice has the highest (normalised) score."""
    norm = [s / len((DELIMITER + c).encode("utf-8")) for s, c in zip(scores, q.choices)]
    best = max(range(len(scores)), key=scores.__getitem__)
    best_norm = max(range(len(norm)), key=norm.__getitem__)
    return int(best == q.answer), int(best_norm == q.answer)


def evaluate_questions(model: torch.nn.Module, tok, questions: list[Question], window: int, device: torch.device,
                       autocast_dtype: torch.dtype | None = None, rank: int = 0, world: int = 1,
                       eos_token: str | None = None) -> list[int]:
    """[acc hits, acc_norm hits, questions] over this rank's share (every world-th question). Every rank runs
    the same number of forwards (FSDP2 needs all ranks in each), a rank out of questions repeating its last."""
    from kiln.tokenizer import EOS, eos_id

    eos = eos_id(tok, eos_token or EOS)
    was_training = model.training
    model.eval()
    hits, hits_norm, count = 0, 0, 0
    mine = list(range(rank, len(questions), world))
    turns = -(-len(questions) // world)
    try:
        for turn in range(turns):
            index = mine[min(turn, len(mine) - 1)] if mine else 0
            rows, lengths = choice_tokens(tok, eos, questions[index])
            scores = choice_scores(model, rows, lengths, window, device, autocast_dtype)
            if turn < len(mine):
                acc, acc_norm = judge(questions[index], scores)
                hits, hits_norm, count = hits + acc, hits_norm + acc_norm, count + 1
    finally:
        model.train(was_training)
    return [hits, hits_norm, count]


def summarise(hits: float, hits_norm: float, count: float) -> dict[str, Any]:
    n = int(count)
    return {"acc": round(hits / max(n, 1), 6), "acc_norm": round(hits_norm / max(n, 1), 6), "n": n}


def evaluate_mc_checkpoint(folder: Path, task_file: Path) -> dict[str, Any]:
    """`kiln eval CKPT --mc FILE`: {"acc", "acc_norm", "n"} of a checkpoint on the CPU."""
    from kiln.eval import load_eval_model

    questions = load_questions(task_file)  # before the (slow) load
    model, tok, cfg = load_eval_model(folder)
    return summarise(*evaluate_questions(model, tok, questions, cfg.pack.seq_len, torch.device("cpu"),
                                         eos_token=cfg.tokenizer.eos_token))


class DownstreamTasks:
    """The in-loop tasks of `eval.tasks`, read once before training (a bad file stops the run before step 1);
    due every `eval.tasks_every` steps and at the last step."""

    def __init__(self, tasks: list, every: int, tokenizer_file: Path, eos_token: str | None = None) -> None:
        from kiln.tokenizer import load_tokenizer

        self.every, self.eos_token = every, eos_token
        self.tasks = [(t.name, load_questions(t.path)) for t in tasks]
        self.tok = load_tokenizer(tokenizer_file) if tasks else None

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def due(self, step: int, max_steps: int) -> bool:
        return bool(self.tasks) and ((self.every and step % self.every == 0) or step == max_steps)

    def run(self, model, window: int, device, autocast_dtype, rank: int, world: int, reduce) -> list[tuple[str, dict]]:
        """(name, {"acc", "acc_norm", "n"}) per task; `reduce` sums a list of numbers over the ranks."""
        out = []
        for name, questions in self.tasks:
            counts = evaluate_questions(model, self.tok, questions, window, device, autocast_dtype, rank, world,
                                        self.eos_token)
            out.append((name, summarise(*reduce([float(c) for c in counts]))))
        return out
