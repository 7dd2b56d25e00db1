"""train.threads: auto. The choice follows the step times it sees (fed here from a table of step times per thread
count: the scheduler's load cannot be set in a test; benchmarks/bench_busy_run.py runs real busy loops), and
the thread count does not change the losses, which is what lets it change mid-run."""

from __future__ import annotations

import shutil

import torch

from conftest import tiny_config
from kiln.train.metrics import read_metrics
from kiln.train.parts.outcome import Outcome
from kiln.train.parts.threads import FIRST_INTERVAL, TRIAL_STEPS, ThreadTuner
from kiln.train.trainer import Trainer

QUIET = lambda *_: None  # noqa: E731


def drive(tuner: ThreadTuner, steps: range, step_s) -> None:
    """The loop's calls for `steps`, each step taking step_s(threads now) seconds."""
    for step in steps:
        tuner.pre_step(step)
        tuner.post_step(Outcome(step, 1e-3, step_s(torch.get_num_threads()), 0, 0, {"time_data_s": 0.0}, {}))


def test_auto_takes_the_faster_count_and_follows_the_load():
    before = torch.get_num_threads()
    lines, events = [], []
    tuner = ThreadTuner("auto", torch.device("cpu"), lines.append, events.append, most=2)
    busy = lambda n: 0.08 if n == 1 else 1.9  # noqa: E731  (NOTES.md: 2 busy cores)
    idle = lambda n: 0.10 if n == 1 else 0.06  # noqa: E731
    try:
        tuner.pre_train()
        assert torch.get_num_threads() == 1  # the first step at 1 thread: safe on a busy machine
        trial_end = 3  # the first step, then one at 2 threads and one at 1: 1.9 s > 2 x 0.08 s decides at once
        drive(tuner, range(1, trial_end + 1), busy)
        assert torch.get_num_threads() == 1 and tuner.chosen == 1
        assert lines == ["train.threads auto: 1 thread (the cores are busy with other work); "
                         "a step took 0.080 s on 1, 1.900 s on 2"]
        assert events == [{"event": "threads", "step": trial_end, "threads": 1, "step_s": {"1": 0.08, "2": 1.9}}]

        # The load goes: 1 thread is no slower than before, so only the next scheduled trial finds 2 faster
        # (three steps at each count: 0.10 against 0.06 s is no clear winner).
        drive(tuner, range(trial_end + 1, trial_end + FIRST_INTERVAL + 2 * TRIAL_STEPS + 1), idle)
        assert tuner.chosen == 2 and torch.get_num_threads() == 2
        assert lines[-1] == "train.threads auto: 2 threads; a step took 0.100 s on 1, 0.060 s on 2"

        # The load comes back: 2 threads get 30x slower, which starts a trial within a few steps.
        start = tuner.next_trial - FIRST_INTERVAL + 1
        drive(tuner, range(start, start + TRIAL_STEPS + 2), busy)
        assert tuner.chosen == 1 and torch.get_num_threads() == 1
        assert [e["threads"] for e in events] == [1, 2, 1]
    finally:
        torch.set_num_threads(before)


def test_a_choice_that_stands_is_checked_less_often():
    before = torch.get_num_threads()
    events = []
    tuner = ThreadTuner("auto", torch.device("cpu"), QUIET, events.append, most=2)
    try:
        tuner.pre_train()
        drive(tuner, range(1, 1001), lambda n: 0.05 if n == 1 else 0.5)
    finally:
        torch.set_num_threads(before)
    # Trials (two steps each: 0.5 s > 2 x 0.05 s) end at steps 3, 3+50+2, +100+2, +200+2, +400+2: each interval
    # twice the last.
    assert [e["step"] for e in events] == [3, 55, 157, 359, 761]
    assert {e["threads"] for e in events} == {1} and tuner.interval == 16 * FIRST_INTERVAL


def test_nothing_is_timed_on_a_gpu_on_one_core_or_for_a_number():
    for setting, device, most in (("auto", "cuda", 2), ("auto", "cpu", 1), (2, "cpu", 2), (None, "cpu", 2)):
        assert not ThreadTuner(setting, torch.device(device), QUIET, QUIET, most=most).tuning


def test_the_losses_do_not_depend_on_the_thread_count(workdir, tmp_path):
    """What lets `auto` change the count mid-run (and a resume choose another) with bitwise-equal losses."""
    before = torch.get_num_threads()
    losses = {}
    try:
        for threads in (1, 2):
            out = tmp_path / str(threads)
            shutil.copytree(workdir, out)
            Trainer(tiny_config(out, train={"max_steps": 6, "eval_every": 3, "threads": threads}), log=QUIET).run()
            records = read_metrics(out / "run" / "metrics.jsonl")
            losses[threads] = [(r["step"], r.get("loss"), r.get("val_loss")) for r in records
                               if r.get("event") in ("step", "eval")]
    finally:
        torch.set_num_threads(before)
    assert len(losses[1]) >= 8 and losses[1] == losses[2]
