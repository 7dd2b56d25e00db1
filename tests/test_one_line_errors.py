"""Failures a user can meet, each one line naming what and the fix, never a traceback (issue 25's list):
an unreachable Ray address (bounded, SIGTERM works meanwhile), symlink loops and non-UTF-8 file names as
inputs, a read-only output filesystem, W&B without an API key, a full disk named where it is full."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, tiny_config
from kiln.cli import main as kiln

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def small_jsonl(prepared, tmp_path_factory) -> Path:
    from kiln.data.docs import read_docs

    path = tmp_path_factory.mktemp("small") / "small.jsonl"
    docs = [d for _, d in zip(range(25), read_docs(prepared.out / "docs"))]
    path.write_text("".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n" for d in docs))
    return path


# --- Ray: an address where no cluster answers --------------------------------------------------------------

def _kiln_data(args: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln", "data", *args], env=ENV, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


# a refused address is said at once: test_ray_engine
@pytest.mark.parametrize("address, why", [("bogus-host-xyz:6379", "the host name does not resolve")])
def test_an_unreachable_ray_address_gives_up_in_bounded_time_in_one_line(small_jsonl, tmp_path, address, why):
    start = time.monotonic()
    proc = _kiln_data([str(small_jsonl), "--out", str(tmp_path / "docs"), "--", "data.executor=ray",
                       f"data.ray_address={address}", "data.ray_connect_timeout_s=3"])
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2
    line = one_line(err)
    assert line.startswith(f"kiln: error: data.ray_address={address}: no Ray cluster answered there within 3 s")
    assert why in line and "data.ray_connect_timeout_s" in line
    assert took < 60  # imports, then 3 s of trying (Ray alone retried forever against the bogus host)
    assert not (tmp_path / "docs").exists()


def test_sigterm_ends_kiln_data_while_it_waits_for_a_ray_cluster(small_jsonl, tmp_path):
    proc = _kiln_data([str(small_jsonl), "--out", str(tmp_path / "docs"), "--", "data.executor=ray",
                       "data.ray_address=bogus-host-xyz:6379", "data.ray_connect_timeout_s=600"],
                      start_new_session=True)
    lock = tmp_path / ".docs.lock"
    deadline = time.monotonic() + 120
    while not lock.exists():  # the data stage holds its output's lock: it is past its imports, connecting
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 20 and proc.returncode != 0


# --- inputs whose names Kiln cannot use ---------------------------------------------------------------------

def test_a_symlink_loop_as_an_input_is_one_line(tmp_path, capsys):
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(tmp_path / "loop.jsonl")
    assert kiln(["data", str(loop), "--out", str(tmp_path / "docs")]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"kiln: error: input {loop} is a symlink loop")


def test_an_input_whose_name_is_not_utf8_is_one_line(small_jsonl, tmp_path, capsys):
    name = os.fsdecode(b"caf\xe9.jsonl")
    shutil.copyfile(small_jsonl, tmp_path / name)
    assert kiln(["data", str(tmp_path / name), "--out", str(tmp_path / "docs")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "its file name is not valid UTF-8 (byte e9)" in line and "rename the file" in line
    assert not (tmp_path / "docs").exists()


def test_relative_and_absolute_inputs_give_the_same_documents(small_jsonl, tmp_path, monkeypatch):
    """`kiln data in.jsonl` (relative) records the same `source`, so the same bytes, as `kiln run` (whose config
    paths are absolute)."""
    from kiln.data.docs import read_docs

    monkeypatch.chdir(small_jsonl.parent)
    assert kiln(["data", small_jsonl.name, "--out", str(tmp_path / "rel"), "--", "data.min_chars=50"]) == 0
    assert kiln(["data", str(small_jsonl), "--out", str(tmp_path / "abs"), "--", "data.min_chars=50"]) == 0
    rel, ab = list(read_docs(tmp_path / "rel")), list(read_docs(tmp_path / "abs"))
    assert rel and rel == ab and {d["source"] for d in rel} == {str(small_jsonl)}
    assert [p.read_bytes() for p in sorted((tmp_path / "rel").glob("part-*"))] == \
        [p.read_bytes() for p in sorted((tmp_path / "abs").glob("part-*"))]


# --- a read-only output filesystem --------------------------------------------------------------------------

def _can_mount_read_only() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_read_only(), reason="needs unshare -rm (user and mount namespaces) to mount a "
                    "folder read-only without root")
def test_an_output_on_a_read_only_filesystem_is_one_line(workdir, small_jsonl, tmp_path):
    """data, pack, train and export with their output on a read-only mount (a real EROFS from the kernel)."""
    from kiln.train.trainer import Trainer

    Trainer(tiny_config(workdir, train={"max_steps": 1, "eval_every": 0}, checkpoint={"every": 1}),
            log=lambda *_: None).run()
    ro = tmp_path / "ro"
    shutil.copytree(workdir, ro / "out")
    shutil.rmtree(ro / "out" / "run")
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(ro / "out").to_yaml())
    ckpt = next((workdir / "run" / "checkpoints").iterdir())
    commands = {
        "data": ["data", str(small_jsonl), "--out", str(ro / "docs")],
        "pack": ["pack", str(tmp_path / "docs-rw"), "--tokenizer", str(workdir / "tokenizer"), "--out",
                 str(ro / "shards2"), "--config", str(config)],
        "train": ["train", str(config)],
        "export": ["export", "--hf", str(ckpt), str(ro / "hf")],
    }
    assert kiln(["data", str(small_jsonl), "--out", str(tmp_path / "docs-rw"), "--", "data.min_chars=50"]) == 0
    script = "; ".join(f"echo '== {name}'; {sys.executable} -m kiln {' '.join(map(repr, argv))}; echo \"rc=$?\""
                       for name, argv in commands.items())
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind -o ro {ro} {ro} && {{ {script}; }} 2>&1"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    sections = dict(part.split("\n", 1) for part in proc.stdout.split("== ")[1:])
    assert set(sections) == set(commands), proc.stdout + proc.stderr
    for name, text in sections.items():
        body, rc = text.rstrip().rsplit("\n", 1)
        assert rc == "rc=2", (name, text)
        line = one_line(body)
        assert line.startswith(f"kiln: error: cannot write {ro}/") and "Read-only file system" in line, (name, line)


# --- W&B without an API key -----------------------------------------------------------------------------------

@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DISABLED", "NETRC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc


@pytest.mark.parametrize("command", ["train", "run"])
def test_wandb_without_an_api_key_stops_before_any_work(no_wandb_key, workdir, tmp_path, capsys, command):
    config = tmp_path / "c.yaml"
    out = workdir if command == "train" else tmp_path / "fresh"
    config.write_text(tiny_config(out, train={"loggers": ["wandb"]}).to_yaml())
    assert kiln([command, str(config)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "no W&B API key" in line and "wandb login" in line and "WANDB_MODE=offline" in line
    assert not (out / "run").exists() and not (out / "docs").exists()


def test_wandb_in_offline_mode_needs_no_key(no_wandb_key, monkeypatch):
    from kiln.train.loggers import check_loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    check_loggers(["wandb"])
    monkeypatch.delenv("WANDB_MODE")
    home = Path(os.environ["HOME"])
    home.mkdir()
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (home / ".netrc").chmod(0o600)
    check_loggers(["wandb"])  # what `wandb login` writes


# --- a full disk ---------------------------------------------------------------------------------------------

def test_a_full_disk_names_the_output_and_its_free_space_not_the_working_folder(small_jsonl, tmp_path, capsys,
                                                                                 monkeypatch):
    """An ENOSPC whose error names no file (a C library's, say), outside the staging folder (a task's outcome in
    the work folder beside the output), is reported at the output being written, not at the working folder."""
    import kiln.data.pipeline as pipeline

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")  # no file name, as zstd or a C writer gives

    monkeypatch.setattr(pipeline, "write_atomic", full)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "deep" / "docs"
    assert kiln(["data", str(small_jsonl), "--out", str(out), "--", "data.min_chars=50"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"kiln: error: no space left on the device writing {out} (")


def test_a_full_disk_inside_a_data_task_is_the_outputs_problem_said_at_once(small_jsonl, tmp_path, capsys,
                                                                            monkeypatch):
    """ENOSPC while a task writes its outcome is not a read error of the input: no retries, no "reading failed"."""
    import kiln.data.pipeline as pipeline

    tries = []

    def full(path):
        tries.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")  # as zstd's stream writer gives it: no file name

    monkeypatch.setattr(pipeline, "writing_atomic", full)
    out = tmp_path / "docs"
    t0 = time.monotonic()
    assert kiln(["data", str(small_jsonl), "--out", str(out), "--workers", "1", "--", "data.min_chars=50"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the progress bar's line
    assert "Traceback" not in err and "reading" not in err
    assert line.startswith(f"kiln: error: no space left on the device writing {out} (")
    assert len(tries) == 1 and time.monotonic() - t0 < 1.5  # once, not three times with 1 s and 2 s between


@pytest.mark.parametrize("argv, name", [
    (["ablate", "FILE.yaml", "--until", "data", "data.min_chars=5"], "ablate"),
    (["ablate", "FILE.yaml", "--plan", "train.lr=1"], "ablate"),
    (["eval", "RUN", "model.dim=64"], "eval"),
    (["generate", "RUN", "--prompt", "x", "train.lr=abc"], "generate"),
    (["ckpt", "verify", "DIR", "foo=bar"], "ckpt verify"),
    (["eval", "RUN", "--", "model.dim=64"], "eval"),
    (["shards", "inspect", "DIR", "--at", "0", "--set", "pack.seq_len=8"], "shards inspect"),
])
def test_overrides_on_a_command_that_takes_none_are_refused(argv, name, capsys):
    """Issue 37 item 10: KEY=VALUE words on a command that reads no config were ignored with exit 0."""
    assert kiln(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"kiln: error: `kiln {name}` takes no KEY=VALUE overrides, got {argv[-1]}; ")


# --- the last resort ------------------------------------------------------------------------------------------

def test_an_unexpected_error_is_one_line_with_its_traceback_in_a_log_in_the_output_folder(small_jsonl, tmp_path,
                                                                                          capsys, monkeypatch):
    import kiln.data.pipeline as pipeline

    def bug(*args, **kwargs):
        raise RuntimeError("a bug Kiln has no message for\nwith a second line")

    monkeypatch.setattr(pipeline, "_run_data", bug)
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    out = tmp_path / "out" / "docs"
    assert kiln(["data", str(small_jsonl), "--out", str(out)]) == 3
    line = one_line(capsys.readouterr().err)
    [log] = (tmp_path / "out").glob("kiln-error-*.log")
    assert line == (f"kiln: error: unexpected RuntimeError: a bug Kiln has no message for with a second line (the "
                    f"traceback is in {log}); run with KILN_DEBUG=1 for the traceback")
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "in bug" in text and "with a second line" in text
    monkeypatch.setenv("KILN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="a bug Kiln has no message for"):
        kiln(["data", str(small_jsonl), "--out", str(out)])


def test_the_last_resort_never_fails_on_arguments_that_are_not_utf8(tmp_path, capsys, monkeypatch):
    """Issue 45 item 10: argv holding bytes that are not UTF-8 (lone surrogates in Python) is written to the log
    escaped; and should the log itself fail, the one line still comes."""
    import kiln.cli as cli
    import kiln.commands.ops as ops

    def bug(args):
        raise TypeError("bad \udcff input")

    monkeypatch.setattr(ops, "cmd_report", bug)
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    argv = ["report", str(tmp_path / "run"), "--out", str(tmp_path / "out" / "r\udcff.html")]
    monkeypatch.setattr(sys, "argv", ["kiln", *argv])
    assert kiln(argv) == 3
    line = one_line(capsys.readouterr().err)
    [log] = (tmp_path / "out").glob("kiln-error-*.log")
    assert line.startswith("kiln: error: unexpected TypeError: bad ") and str(log) in line
    text = log.read_text()
    assert text.startswith("kiln report ") and "r\\udcff.html" in text and "TypeError: bad \\udcff input" in text

    monkeypatch.setattr(cli, "_output_folder", lambda args: 1 / 0)
    assert kiln(argv) == 3
    assert one_line(capsys.readouterr().err) == ("kiln: error: unexpected TypeError (the traceback could not be "
                                                 "written: ZeroDivisionError); run with KILN_DEBUG=1 for the "
                                                 "traceback")


def test_an_unexpected_error_of_a_run_logs_in_its_out_dir(workdir, tmp_path, capsys, monkeypatch):
    import kiln.flow as flow

    def bug(*args, **kwargs):
        raise KeyError("surprise")

    monkeypatch.setattr(flow, "run_all", bug)
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir).to_yaml())
    assert kiln(["run", str(config)]) == 3
    line = one_line(capsys.readouterr().err)
    [log] = workdir.glob("kiln-error-*.log")
    assert line.startswith("kiln: error: unexpected KeyError: 'surprise' (the traceback is in ") and str(log) in line


def test_the_ray_address_check_lets_a_real_cluster_through(monkeypatch):
    """The check before ray.init accepts a real Ray head: its GCS answers the gRPC hello (a real local Ray, started
    as `kiln data` starts one)."""
    ray = pytest.importorskip("ray")
    from kiln.tasks.executor import check_ray_address

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        start = time.monotonic()
        check_ray_address(ray.get_runtime_context().gcs_address, 10)
        assert time.monotonic() - start < 5
    finally:
        ray.shutdown()
