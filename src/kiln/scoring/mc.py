"""Multiple-choice downstream evaluation with lm-eval-harness's definitions (`kiln eval CKPT --mc FILE.jsonl`,
the in-loop `eval.tasks`, `kiln ablate`).

A task file holds one JSON object a line: `{"context": str, "choices": [str, ...], "answer": int}` (the index
of the right choice; the text of a choice is accepted too). As lm-eval 0.4.13 does for a `multiple_choice`
task (`target_delimiter` " "), a choice's score is the summed log-probability of its continuation: the
tokens of `context + " " + choice` after those of `context`, where whitespace that ends the context moves to
the front of the continuation. Three metrics pick a choice per question (lm-eval's `process_results`):

- `acc`: the highest score;
- `acc_norm`: the highest score divided by the choice's length in characters (`len(choice)`, the delimiter
  not counted);
- `acc_bytes`: the highest score divided by the choice's UTF-8 bytes (`len(choice.encode())`).

A tie goes to the first choice (numpy's argmax). As in training, where every document follows an <|eos|>, the
tokens are preceded by <|eos|> (the exported tokenizer puts it first by default, so lm-eval on an export sees
the same tokens); a row longer than the model's window keeps its last `max_seq_len + 1` tokens (the context is
cut from the left, as the harness does).

`question_results` (and kiln.eval.mc's `checkpoint_question_results` for a checkpoint folder) return one
`QuestionResult` a question: the choice each metric picked and whether it is the right one, for statistics over
questions (`kiln ablate` bootstraps over them); `summarise` turns them into the three accuracies.

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

DELIMITER = " "  # lm-eval's target_delimiter
ROW = '{"context", "choices", "answer"}'
METRICS = ("acc", "acc_norm", "acc_bytes")


@dataclass
class Question:
    context: str
    choices: list[str]
    answer: int
    where: str = "question"  # FILE:LINE, for errors


@dataclass(frozen=True)
class QuestionResult:
    """One question: the index of the choice each metric picked (`chosen["acc"]`, ...), the right one's index,
    and each choice's summed log-likelihood in nats."""
    answer: int
    chosen: dict[str, int]
    scores: tuple[float, ...]

    def correct(self, metric: str) -> bool:
        return self.chosen[metric] == self.answer


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
        questions.append(Question(context, choices, answer, where))
    if not questions:
        raise KilnError(f"{path}: no rows; give a JSONL of {ROW} rows")
    return questions


def choice_tokens(tok, eos: int, q: Question, window: int) -> tuple[list[list[int]], list[int]]:
    """Per choice: the token ids (<|eos|>, context, continuation) and how many of them are the continuation.
    As lm-eval's `_encode_pair`: whitespace that ends the context is moved to the front of the continuation.
    A continuation longer than the model's window cannot be scored (lm-eval stops on it too): a one-line error."""
    context = q.context.rstrip()
    trailing = q.context[len(context):]
    n_context = len(tok.encode(context, add_special_tokens=False).ids)
    rows, lengths = [], []
    for choice in q.choices:
        whole = tok.encode(context + trailing + DELIMITER + choice, add_special_tokens=False).ids
        continuation = max(len(whole) - n_context, 1)  # a merge across the boundary still scores >= 1 token
        if continuation > window:
            raise KilnError(f"{q.where}: choice {len(rows)} is {continuation} tokens, more than the model's window "
                            f"of {window} (pack.seq_len); shorten it")
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


def judge(q: Question, scores: list[float]) -> QuestionResult:
    """The choice each metric picks from the choices' scores (lm-eval's argmax: a tie goes to the first)."""
    def best(divisors: list[int] | None = None) -> int:
        values = scores if divisors is None else [s / d for s, d in zip(scores, divisors)]
        return max(range(len(values)), key=values.__getitem__)

    chosen = {"acc": best(), "acc_norm": best([len(c) for c in q.choices]),
              "acc_bytes": best([len(c.encode("utf-8")) for c in q.choices])}
    return QuestionResult(q.answer, chosen, tuple(scores))


def question_results(model: torch.nn.Module, tok, questions: list[Question], window: int, device: torch.device,
                     autocast_dtype: torch.dtype | None = None, rank: int = 0, world: int = 1,
                     eos_token: str | None = None) -> list[QuestionResult]:
    """This rank's share of the questions (every world-th, from `rank`), each judged under the three metrics.

    Every rank runs the same number of forwards (FSDP2 needs all ranks in each), a rank out of questions
    repeating its last (and dropping that result)."""
    from kiln.tokenizer import EOS, eos_id

    eos = eos_id(tok, eos_token or EOS)
    was_training = model.training
    model.eval()
    mine = list(range(rank, len(questions), world))
    results = []
    try:
        for turn in range(-(-len(questions) // world)):
            index = mine[min(turn, len(mine) - 1)] if mine else 0
            rows, lengths = choice_tokens(tok, eos, questions[index], window)
            scores = choice_scores(model, rows, lengths, window, device, autocast_dtype)
            if turn < len(mine):
                results.append(judge(questions[index], scores))
    finally:
        model.train(was_training)
    return results


def counts(results: list[QuestionResult]) -> list[float]:
    """[right under acc, acc_norm, acc_bytes, questions]: sums that add up over ranks."""
    return [float(sum(r.correct(m) for r in results)) for m in METRICS] + [float(len(results))]


def summarise(totals: list[float]) -> dict[str, Any]:
    """{"acc", "acc_norm", "acc_bytes", "n"} from `counts` (summed over ranks)."""
    n = int(totals[-1])
    return {**{m: round(hits / max(n, 1), 6) for m, hits in zip(METRICS, totals)}, "n": n}


class DownstreamTasks:
    """The in-loop tasks of `eval.tasks`, read and tokenized once before training (a bad file, or a choice longer
    than `window`, stops the run before step 1); due every `eval.tasks_every` steps and at the last step."""

    def __init__(self, tasks: list, every: int, tokenizer_file: Path, eos_token: str | None = None,
                 window: int | None = None) -> None:
        from kiln.tokenizer import EOS, eos_id, load_tokenizer

        self.every, self.eos_token = every, eos_token
        self.tasks = [(t.name, load_questions(t.path)) for t in tasks]
        self.tok = load_tokenizer(tokenizer_file) if tasks else None
        for _, questions in self.tasks if window else []:
            for q in questions:
                choice_tokens(self.tok, eos_id(self.tok, eos_token or EOS), q, window)

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def due(self, step: int, max_steps: int) -> bool:
        return bool(self.tasks) and ((self.every and step % self.every == 0) or step == max_steps)

    def run(self, model, window: int, device, autocast_dtype, rank: int, world: int, reduce) -> list[tuple[str, dict]]:
        """(name, {"acc", "acc_norm", "acc_bytes", "n"}) per task; `reduce` sums a list of numbers over the ranks."""
        out = []
        for name, questions in self.tasks:
            results = question_results(model, self.tok, questions, window, device, autocast_dtype, rank, world,
                                       self.eos_token)
            out.append((name, summarise(reduce(counts(results)))))
        return out
