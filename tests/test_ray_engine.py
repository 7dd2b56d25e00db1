"""The Ray engine's failures (issue 37, items 13 and 14): a bad address is one line naming the key the user set,
said at once when refused, with none of Ray's own log lines and no work folder left behind; a local Ray that
Kiln started does not outlive a killed kiln."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLE_WARC
from kiln.tasks import executor, raywatch
from kiln.errors import KilnError

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def _kiln(args: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln", *map(str, args)], env=popen.pop("env", ENV), cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


# --- 13: a bad address ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["pack", "data"])
def test_a_refused_ray_address_is_one_line_at_once_naming_the_key_set_and_leaves_no_work_folder(prepared, tmp_path,
                                                                                              stage):
    out, address = tmp_path / "out", "127.0.0.1:1" if stage == "pack" else "ray://127.0.0.1:1"  # GCS; client server
    if stage == "pack":
        args = ["pack", prepared.out / "docs", "--tokenizer", prepared.out / "tokenizer", "--out", out]
    else:
        args = ["data", SAMPLE_WARC, "--out", out]
    start = time.monotonic()  # the timeout stays at its 30 s default: refused is said without waiting for it
    proc = _kiln([*args, "--", f"{stage}.executor=ray", f"{stage}.ray_address={address}"])
    _, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"kiln: error: {stage}.ray_address={address}: no Ray cluster answered there "
                               "(connection refused")
    assert ("data." if stage == "pack" else "pack.") not in lines[0]
    assert time.monotonic() - start < 20  # imports (Ray's too), not 30 s of retries
    assert list(tmp_path.iterdir()) == []  # no output, no .out-work-* folder, no lock


def _http2_server(answer: bytes) -> tuple[socket.socket, int]:
    """A server on 127.0.0.1 that reads what comes and sends `answer` back to every connection."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(answer)
                time.sleep(0.2)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_an_http2_server_that_is_not_ray_fails_the_check_naming_the_sections_keys():
    """What answered 10.255.255.1:6379 in the issue (an HTTP/2 proxy: 404 to any call) passed the old check, and
    ray.init then printed a warning a second for 20 s. A real Ray head passes (test_one_line_errors)."""
    settings = bytes.fromhex("000000040000000000")
    not_found = bytes.fromhex("000001010500000001") + b"\x8d"  # HEADERS, stream 1, END_STREAM: `:status 404`
    srv, port = _http2_server(settings + not_found)
    try:
        with pytest.raises(KilnError) as caught:
            executor.check_ray_address(f"127.0.0.1:{port}", 1.5, "pack")
    finally:
        srv.close()
    line = str(caught.value)
    assert line.startswith(f"pack.ray_address=127.0.0.1:{port}: no Ray cluster answered there within 1.5 s "
                           "(something answers there, but not a Ray cluster (no gRPC))")
    assert "pack.ray_connect_timeout_s" in line and "data." not in line


def test_ray_s_own_lines_while_joining_are_silenced(monkeypatch, capfd):
    """Ray's C++ client writes its retries to file descriptor 2, its Python logger to the process's stderr:
    neither shows; the error is Kiln's one line, naming the section's key."""
    class Ray:
        @staticmethod
        def is_initialized():
            return False

        @staticmethod
        def init(**_):
            os.write(2, b"[2026-01-01 W 1 1] gcs_client.cc:210: Failed to get cluster ID from GCS server\n" * 20)
            print("INFO worker.py:1841 -- Connecting to existing Ray cluster at address: head:6379...",
                  file=sys.__stderr__, flush=True)  # the process's stderr, as Ray's log handler holds it
            raise ConnectionError("Failed to connect to Ray cluster at head:6379")

    monkeypatch.setattr(executor, "_import_ray", lambda section: Ray)
    monkeypatch.setattr(executor, "check_ray_address", lambda *a: None)
    with pytest.raises(KilnError) as caught:
        with executor.engine("ray", 2, "head:6379", 5, section="pack"):
            pass
    assert str(caught.value).startswith("pack.ray_address=head:6379: Ray could not join a cluster there (Failed to")
    assert capfd.readouterr().err == ""
    os.write(2, b"after\n")  # descriptor 2 is back
    assert capfd.readouterr().err == "after\n"


# --- 14: a local Ray does not outlive kiln --------------------------------------------------------------------

def _alive(pid: int, started: str | None = None) -> bool:
    """The process runs (not a zombie) and, given its start time (/proc stat field 22), is the same one."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and (started is None or fields[19] == started)


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    """{pid: (start time, command line)} of every descendant of `root`, read from /proc."""
    table = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), fields[19], cmd)
    found, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, (ppid, *_) in table.items() if ppid in frontier and pid not in found}
        found |= {pid: table[pid][1:] for pid in frontier}
    return found


def _wait_gone(procs: dict[int, tuple[str, str]], within_s: float) -> dict[int, tuple[str, str]]:
    deadline = time.monotonic() + within_s
    while (left := {p: v for p, v in procs.items() if _alive(p, v[0])}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the watchdog reads /proc (Linux)")
def test_the_watchdog_ends_the_marked_processes_when_its_kiln_is_killed(tmp_path):
    """The mechanism, without Ray: a driver starts the watchdog as the engine does, then a child (with the
    session's marker, SIGTERM ignored as Ray's agents do) and is killed by SIGKILL; the child goes, a process with
    another marker stays."""
    script = ("import subprocess, sys, time\n"
              "from kiln.tasks.executor import _watch_ray\n"
              "watchdog = _watch_ray()\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
              "print(watchdog.pid, child.pid, flush=True)\n"
              "time.sleep(120)\n")
    other = subprocess.Popen(["sleep", "120"], env={**ENV, raywatch.VAR: "another-session"})
    driver = subprocess.Popen([sys.executable, "-c", script], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        watchdog, child = map(int, driver.stdout.readline().split())
        assert _alive(child) and _alive(watchdog)
        driver.kill()
        driver.wait()
        assert _wait_gone({child: (None, ""), watchdog: (None, "")}, 10) == {}
        assert other.poll() is None
    finally:
        other.kill()
        driver.kill()


@pytest.mark.slow  # 7 s: kiln and a local Ray start, then the kill (the fast test above: the mechanism)
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the watchdog reads /proc (Linux)")
def test_kill_9_of_kiln_pack_leaves_no_process_of_its_local_ray(prepared, tmp_path):
    pytest.importorskip("ray")
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")  # short: Ray's socket paths must fit in 107 bytes
    proc = _kiln(["pack", prepared.out / "docs", "--tokenizer", prepared.out / "tokenizer", "--out",
                  tmp_path / "shards", "--", "pack.executor=ray", "pack.workers=2"], env={**ENV, "RAY_TMPDIR": ray_tmp},
                 start_new_session=True)
    ray: dict[int, tuple[str, str]] = {}
    try:
        deadline = time.monotonic() + 120
        while sum("agent" in cmd for _, cmd in _descendants(proc.pid).values()) < 2:  # dashboard, runtime env
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        ray = _descendants(proc.pid)
        assert proc.poll() is None, "kiln pack ended before the kill: the test needs more work for it"
        proc.kill()
        proc.wait()
        left = _wait_gone(ray, 20)
        assert left == {}, f"still running after kiln was killed: {[cmd[:80] for _, cmd in left.values()]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, (started, _) in ray.items():  # nothing left when the test passes
            if _alive(pid, started):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
