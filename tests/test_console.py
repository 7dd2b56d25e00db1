"""The training console: a live line per step under a pseudo-terminal, plain lines at log_every (capped for a
short run) in a file, and warnings for settings that make a run quietly wrong."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import time
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


def under_pty(args: list[str], columns: int = 200, sigterm_at: bytes | None = None,
              environ: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command with stdout and stderr on a pseudo-terminal `columns` wide; (exit code, everything it
    wrote). With `sigterm_at`, SIGTERM is sent once that text has appeared."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pty
        os.execvpe(args[0], args, {**(environ or env()), "COLUMNS": str(columns)})
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
        if sigterm_at is not None and sigterm_at in b"".join(chunks[-3:]):
            os.kill(pid, signal.SIGTERM)
            sigterm_at = None
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


def test_a_table_is_printed_whole_where_the_output_is_not_a_terminal(capsys):
    """Issue 37 item 12: `kiln ablate ... | tee log` cut the verdict table to 80 columns (`handboo…`, `no-fine…`)."""
    from kiln.ablate.report import print_verdicts
    from kiln.commands.args import console

    row = {"arm": "no-fineweb-quality-filter", "metric": "handbook_reference_bits_per_byte", "diff": -0.0123,
           "ci_low": -0.02, "ci_high": -0.004, "p_holm": 0.012, "verdict": "better", "min_detectable": 0.003}
    print_verdicts({"baseline": "default", "comparisons": [row], "warnings": [], "out_dir": "out/ablation"}, console())
    err = capsys.readouterr().err
    assert "…" not in err and "smallest detectable" in err
    [line] = [line for line in err.splitlines() if "no-fineweb-quality-filter" in line]
    assert "handbook_reference_bits_per_byte" in line and "better" in line and len(line) > 120


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


# --- kiln run's own lines and summary, under a terminal and in a file -------------------------------------------

def five_file_config(tmp_path: Path) -> tuple[Path, Path]:
    """A config reading a glob of 5 WARC files (40 pages of the sample) into an out_dir whose checkpoint paths
    are longer than any terminal line here; (config file, out_dir)."""
    from conftest import SAMPLE_WARC, warc_pages, write_warc

    pages = warc_pages(SAMPLE_WARC)[:40]
    crawl = tmp_path / "crawl"
    crawl.mkdir()
    for i in range(5):
        write_warc(crawl / f"part-{i}.warc.gz", [(url, body, "text/html") for url, body in pages[i * 8:(i + 1) * 8]])
    out = tmp_path / ("a-folder-with-a-long-name-" * 4) / "out"
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({
        "out_dir": str(out), "data": {"inputs": [str(crawl / "*.warc.gz")], "min_chars": 200, "workers": 1},
        "tokenizer": {"vocab_size": 512}, "pack": {"seq_len": 64, "val_fraction": 0.2},  # warcio ids: random
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
        "train": {"max_steps": 200, "batch_size": 8, "warmup_steps": 2, "eval_every": 0, "threads": 1,
                  "log_every": 100},  # a plain line every 20 steps (a tenth of the run); the live line each step
        "checkpoint": {"every": 100}}))
    return config, out


def kiln_script() -> tuple[list[str], str]:
    """(the argv that runs this environment's `kiln` script, how Kiln should name it in "next:" lines: the
    child's PATH leaves that folder out, so not as bare `kiln`)."""
    script = Path(sys.executable).parent / "kiln"
    if not script.is_file():
        pytest.skip("kiln is not installed as a script in this environment")
    shown = os.path.relpath(script)
    return [str(script)], shown if not shown.startswith("..") else str(script)


def path_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**env(), "PATH": os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != bin_dir)}


def summary_value(text: str, what: str) -> str:
    """The value cell of the summary row `what`, with the lines it folded onto joined back."""
    value, inside = [], False
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) != 4:
            inside = False
            continue
        if cells[1] == what:
            inside = True
        elif cells[1]:
            inside = False
        if inside:
            value.append(cells[2])
    return "".join(value)


def assert_summary_whole(text: str, out: Path, kiln: str, step: int) -> None:
    ckpt = out / "run" / "checkpoints" / f"step-{step:08d}"
    assert len(str(ckpt)) > 110 and "…" not in text
    assert summary_value(text, "checkpoint") == str(ckpt)  # folded in its cell, never cut
    for command in (f"{kiln} report {out / 'run'}", f"{kiln} export --hf {out / 'run'} {out / 'hf'}"):
        assert f"\n  {command}\n" in text.replace("\r\n", "\n") + "\n", command  # one line each, however long


def lines_of(text: str) -> list[str]:
    """What a terminal or a file shows line by line (escape codes dropped; \\r starts a line, as a redraw does)."""
    return ANSI.sub("", text).splitlines()


def assert_own_lines(lines: list[str]) -> int:
    """The trainer's lines each start a line (none glued to the end of the live line); the step it stopped at."""
    for line in lines:
        if "/200 " in line:
            assert line.startswith("step "), line
    stop = next(ln for ln in lines if "stopping cleanly (SIGTERM)" in ln)
    assert re.fullmatch(r"step \d+: stopping cleanly \(SIGTERM\); the same command resumes", stop), stop
    return int(stop.split(":")[0].split()[1])


@pytest.mark.slow  # a whole kiln run three times under a pty and to a file: ~16 s
def test_kiln_run_lines_and_summary_under_a_terminal_and_in_a_file(tmp_path):
    config, out = five_file_config(tmp_path)
    argv, kiln = kiln_script()

    # 1. Under a terminal 100 columns wide, SIGTERM during training.
    rc, raw = under_pty([*argv, "run", str(config)], 100, b"step 23/200", path_env())
    assert rc == 0, raw
    lines = lines_of(raw)
    assert f"data: reading 5 input files -> {out / 'docs'}" in lines
    stopped = assert_own_lines(lines)
    assert stopped % 20 and any(ln.startswith("step 20/200 ") for ln in lines)  # stopped between plain lines
    assert_summary_whole("\n".join(lines), out, kiln, stopped)

    # 2. Into a file: the finished stages are skipped (and say so), the run resumes; SIGTERM again.
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([*argv, "run", str(config)], stdout=f, stderr=subprocess.STDOUT, env=path_env())
        deadline = time.monotonic() + 300
        while f"step {stopped // 20 * 20 + 40}/200" not in log.read_text() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0
    text = log.read_text()
    assert "\x1b[" not in text
    for stage in ("data", "tokenizer", "pack"):
        assert summary_value(text, f"wall time: {stage}") == "skipped (up to date)"
    assert_summary_whole(text, out, kiln, assert_own_lines(text.splitlines()))

    # 3. Under a terminal again, to the end: skipped stages there too.
    rc, raw = under_pty([*argv, "run", str(config)], 100, environ=path_env())
    assert rc == 0, raw
    text = "\n".join(lines_of(raw))
    assert summary_value(text, "wall time: data") == "skipped (up to date)" and "0.0 s" not in text
    assert_summary_whole(text, out, kiln, 200)


def test_after_sigterm_the_summary_suggests_the_same_command_and_its_last_eval(prepared, tmp_path, capsys):
    """`kiln run` stopped by SIGTERM between evals: "next:" resumes with the very command typed (shell-quoted,
    train.max_steps unchanged: the schedule stays), and the last validation loss is shown with its step."""
    import shlex
    import shutil
    import signal
    import threading
    import time

    from kiln.cli import main
    from kiln.install import kiln_command

    out = tmp_path / "my out"
    shutil.copytree(prepared.out, out)  # docs, tokenizer and shards as `kiln run` left them: only training runs
    config = tmp_path / "c.yaml"
    config.write_text(prepared.to_yaml())
    words = [str(config), f"out_dir={out}", "train.max_steps=40", "train.eval_every=10", "train.log_every=1"]
    metrics, done = out / "run" / "metrics.jsonl", threading.Event()

    def stop_after_step_13():
        while not done.is_set():
            lines = metrics.read_text().splitlines() if metrics.is_file() else []
            if any('"event": "step"' in ln and json.loads(ln)["step"] >= 13 for ln in lines):
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler (installed while it trains) takes it
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=stop_after_step_13, daemon=True)
    watcher.start()
    try:
        assert main(["run", *words]) == 0
    finally:
        done.set()
        watcher.join()
    err = capsys.readouterr().err
    stop = next(json.loads(ln) for ln in metrics.read_text().splitlines() if '"event": "stop"' in ln)
    assert 13 <= stop["step"] < 20
    val10 = next(json.loads(ln)["val_loss"] for ln in metrics.read_text().splitlines()
                 if '"event": "eval"' in ln and json.loads(ln)["step"] == 10)
    assert re.search(rf"validation loss at end\s+│\s+{val10:.4f} \(at step 10\)", err), err
    nexts = [line.strip() for line in err[err.index("next:"):].splitlines()[1:]]
    assert nexts[0] == f"{kiln_command()} run {shlex.join(words)}      # resumes from the last checkpoint"
    prefix = len(shlex.split(kiln_command())) + 1  # the words before the config
    assert shlex.split(nexts[0].split("#")[0])[prefix:] == words  # pastes back into a shell as the same words
    assert not any("train.max_steps=" in n and "train.max_steps=40" not in n for n in nexts)
    run = shlex.quote(str(out / "run"))
    assert f"{kiln_command()} report {run}" in nexts and "'" in run
