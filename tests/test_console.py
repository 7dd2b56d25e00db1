"""The training console: a live line per step under a pseudo-terminal, plain lines at log_every (capped for a
short run) in a file, and warnings for settings that make a run quietly wrong."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, tiny_config

from kiln.train.console import effective_log_every, run_warnings

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def config_file(workdir: Path, tmp_path: Path, **train) -> Path:
    cfg = tiny_config(workdir, train={"max_steps": 20, "log_every": 25, "eval_every": 0, **train},
                      checkpoint={"every": 20})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    return path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "TERM": "xterm-256color"}


def under_pty(args: list[str]) -> tuple[int, str]:
    """Run a command with stdout and stderr on a pseudo-terminal; (exit code, everything it wrote)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pty
        os.execvpe(args[0], args, env())
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode("utf-8", "replace")


def test_live_line_every_step_under_a_terminal(workdir, tmp_path):
    rc, out = under_pty([sys.executable, "-m", "kiln", "train", str(config_file(workdir, tmp_path))])
    assert rc == 0, out
    assert ANSI.search(out)  # rich redraws the line in place
    plain = ANSI.sub("", out)
    # Every step is drawn, not only every log_every: the live line is redrawn each step.
    for step in range(1, 21):
        assert f"step {step}/20" in plain, step
    line = next(ln for ln in plain.splitlines() if "step 13/20" in ln)
    for part in ("elapsed", "ETA", "loss", "(smoothed", "lr ", "tok/s", "mem "):
        assert part in line, (part, line)


def test_plain_lines_at_a_capped_log_every_in_a_file(workdir, tmp_path):
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "kiln", "train", str(config_file(workdir, tmp_path))], check=False,
                              stdout=subprocess.PIPE, stderr=f, env=env(), timeout=300)
    assert proc.returncode == 0
    text = log.read_text()
    assert "\x1b[" not in text  # no escape codes in a log file
    steps = [int(m) for m in re.findall(r"^step (\d+)/20 ", text, re.MULTILINE)]
    # log_every 25 > 20 steps: capped at a tenth of the run, so it prints every 2 steps.
    assert steps == list(range(2, 21, 2))
    last = r"^step 20/20  0:00:\d\d elapsed  ETA 0:00:00  loss \d+\.\d{4} \(smoothed \d+\.\d{4}\)"
    assert re.search(last, text, re.MULTILINE)


def test_warnings_for_settings_that_make_a_run_quietly_wrong(workdir):
    from kiln.train.trainer import Trainer

    lines: list[str] = []
    cfg = tiny_config(workdir, train={"max_steps": 2, "warmup_steps": 30, "eval_every": 0}, checkpoint={"every": 2})
    Trainer(cfg, log=lines.append).run()
    assert "warning: train.warmup_steps=30 >= train.max_steps=2: the whole run is warmup and the learning rate " \
           "never reaches train.lr; lower warmup_steps" in lines
    assert lines.index(next(ln for ln in lines if ln.startswith("warning:"))) < \
        lines.index(next(ln for ln in lines if ln.startswith("step 1/2")))  # before the first step


def test_repeated_data_and_a_short_vocabulary_are_named(prepared):
    from kiln.shards.reader import ShardSet
    from kiln.train.console import warnings_for

    samples = len(ShardSet(prepared.out / "shards", "train"))
    cfg = prepared.model_copy(update={"train": prepared.train.model_copy(update={"max_steps": 2 * samples // 8})})
    text = "\n".join(warnings_for(cfg, samples))
    assert f"{cfg.train.max_steps} steps x 512 tokens = 2.0 epochs of the {samples * 64:,} training tokens" in text
    # The sample corpus is too small for 1,024 merges? Then it says so; the number is the tokenizer's own.
    reached = json.loads((prepared.out / "tokenizer" / "manifest.json").read_text())["vocab_size"]
    assert (f"vocabulary of {reached:,} of the 1,024 asked" in text) == (reached < 1024)
    big = cfg.model_copy(update={"tokenizer": cfg.tokenizer.model_copy(update={"vocab_size": reached + 1000})})
    assert f"vocabulary of {reached:,} of the {reached + 1000:,} asked (tokenizer.vocab_size)" in \
        "\n".join(warnings_for(big, samples))


def test_warning_rules():
    assert run_warnings(100, 10, 1000, 10**9, 4096, 4096) == []
    [w] = run_warnings(10, 10, 1000, 10**9, None, None)
    assert w.startswith("train.warmup_steps=10 >= train.max_steps=10")
    [w] = run_warnings(100, 10, 1000, 25_000, None, None)
    assert "4.0 epochs of the 25,000 training tokens" in w
    [w] = run_warnings(100, 10, 1000, 10**9, 2048, 1240)
    assert "vocabulary of 1,240 of the 2,048 asked (tokenizer.vocab_size)" in w


@pytest.mark.parametrize("log_every, max_steps, expected", [(25, 20, 2), (10, 1000, 10), (5, 3, 1), (1, 1, 1)])
def test_log_every_is_capped_at_a_tenth_of_the_run(log_every, max_steps, expected):
    assert effective_log_every(log_every, max_steps) == expected


def test_run_summary_has_wall_time_per_stage_and_next_commands():
    from io import StringIO

    from rich.console import Console

    from kiln.summary import print_summary

    data = {"documents": {"read": 10, "kept": 8, "rejected": 2}, "rejected_by_reason": {"quality/too_short": 2},
            "kept_by_lang": {"en": 8}, "file_errors": [], "truncated": []}
    train = {"steps": 20, "tokens_seen": 100, "skipped_steps": 0, "params": 5, "val_loss_start": 7.0,
             "val_loss_end": 6.0, "checkpoint": "/r/out/run/checkpoints/step-00000020"}
    out = StringIO()
    print_summary({"data": data, "train": train, "timings_s": {"data": 3.25, "train": 125.0}},
                  Console(file=out, width=140), config="my.yaml")
    text = out.getvalue()
    assert re.search(r"wall time: data\s+│\s+3\.2 s", text) and re.search(r"wall time: train\s+│\s+2 min 5 s", text)
    assert "kiln report /r/out/run" in text and "kiln export --hf /r/out/run /r/out/hf" in text
    assert "kiln run my.yaml train.max_steps=40" in text and "kiln eval /r/out/run --mc TASK.jsonl" in text


@pytest.mark.slow
def test_kiln_run_shows_a_progress_line_per_stage_under_a_terminal(tmp_path):
    from conftest import SAMPLE_WARC

    config = tmp_path / "c.yaml"
    config.write_text(f"out_dir: out\ndata:\n  inputs: [{SAMPLE_WARC}]\n  min_chars: 200\n"
                      "tokenizer:\n  vocab_size: 512\npack:\n  seq_len: 64\n")
    rc, out = under_pty([sys.executable, "-m", "kiln", "run", str(config), "--until", "pack"])
    assert rc == 0, out
    plain = ANSI.sub("", out)
    assert re.search(r"data .*\d+/1 tasks .*records/s", plain)  # the data stage's bar
    assert re.search(r"✓ tokenizer: sampling up to [\d,]+ documents and training", plain)  # ends ticked
    assert re.search(r"✓ pack: \d+ documents", plain)  # not a frozen spinner glyph
    assert re.search(r"wall time: pack\s+│", plain) and "next:" in plain and "kiln run " in plain
