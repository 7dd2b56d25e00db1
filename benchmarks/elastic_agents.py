"""torchrun agents on this machine standing for the nodes of an elastic job, and the means to lose one: the harness
of tests/test_elastic.py and benchmarks/bench_elastic.py.

Each `Agent` is one `python -m torch.distributed.run --nnodes=1:2 --nproc_per_node=1 --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:PORT --rdzv-id=ID -m kiln train CONFIG`, in a session of its own, its output in a log
file, with KILN_HOST naming its node (two agents on one machine are two hosts to Kiln) and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch 2.13's c10d rendezvous cannot grow back without it: NOTES.md).
The first agent started serves the rendezvous store (the c10d backend's agent on the endpoint's host does):
`start` waits until it listens before the next may start, and the first agent is never the one lost.

torchrun starts its workers in sessions of their own, so losing a node is `lose`: SIGKILL of the agent and of
every process descended from it, collected (and stopped, so none can start another) before any is killed.
Waits are on files and log lines, with generous deadlines, never on fixed sleeps. The agents' TMPDIR is the
job's own folder, so torchrun's /tmp/torchelastic_* folders are made there and removed with it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

# Shorter than torch's defaults so a lost node is noticed in seconds: keep-alive every second, a node silent for
# three is dead; a round closes one second after it has its minimum of nodes.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], bool], what: str, timeout: float = 180, alive: list | None = None) -> None:
    """Poll `pred` every 50 ms until it holds; an AssertionError naming `what` after `timeout` seconds, or at once
    when an agent in `alive` has exited (with the end of its log)."""
    deadline = time.monotonic() + timeout
    while not pred():
        for agent in alive or []:
            if agent.proc.poll() is not None:
                raise AssertionError(f"waiting for {what}: agent {agent.name} exited ({agent.proc.returncode}):\n"
                                     f"{agent.log()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def records(out: Path, kind: str) -> list[dict]:
    """The `kind` records of a run's metrics.jsonl while it is being written (a line being written is skipped)."""
    path = Path(out) / "run" / "metrics.jsonl"
    found = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        if f'"event": "{kind}"' in line:
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found


def children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        pid, ppid = int(text.split()[0]), int(text.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(pid)
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Agent:
    """One torchrun agent: a node of the job."""

    def __init__(self, name: str, config: Path, endpoint: str, run_id: str, log_dir: Path, max_restarts: int = 3,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.config, self.endpoint, self.run_id = name, config, endpoint, run_id
        self.log_path = Path(log_dir) / f"agent-{name}.log"
        self.max_restarts = max_restarts
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "KILN_HOST": name,
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5",
                    "TMPDIR": str(Path(log_dir) / "tmp"), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.runs = 0

    def start(self) -> "Agent":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
               f"--rdzv-conf={RDZV_CONF}", f"--max-restarts={self.max_restarts}", "--monitor-interval=0.2",
               "-m", "kiln", "train", str(self.config)]
        self.runs += 1
        log = open(self.log_path, "a")
        log.write(f"\n=== start {self.runs}: {' '.join(cmd)}\n")
        log.flush()
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def workers(self) -> list[int]:
        """The pids of this agent's kiln workers (its descendants running `-m kiln`)."""
        out = []
        for pid in descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"kiln" in cmdline and b"torch.distributed.run" not in cmdline:
                out.append(pid)
        return out

    def lose(self) -> float:
        """The node is lost: SIGKILL of the agent and all its descendants. Returns the time (time.time())."""
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        signal_all(pids, signal.SIGSTOP)  # none of them moves (or starts another) while the rest are found
        pids += [p for p in descendants(self.proc.pid) if p not in pids]
        when = time.time()
        signal_all(pids, signal.SIGKILL)
        self.proc.wait()
        return when

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Whatever is left of the agent and its descendants, killed (cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            signal_all([self.proc.pid, *descendants(self.proc.pid)], signal.SIGKILL)
            self.proc.wait()


def listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


class Job:
    """Agents of one elastic job (one rendezvous id and endpoint); `close` kills what is left of them and removes
    their temporary folder (torchrun's torchelastic_* folders)."""

    def __init__(self, config: Path, log_dir: Path, max_restarts: int = 3, env: dict[str, str] | None = None) -> None:
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.run_id = f"kiln-{os.getpid()}-{time.monotonic_ns()}"
        self.config, self.log_dir, self.max_restarts, self.env = config, Path(log_dir), max_restarts, env
        self.agents: dict[str, Agent] = {}
        (self.log_dir / "tmp").mkdir(parents=True, exist_ok=True)

    def start(self, name: str) -> Agent:
        """Start (or start again) the agent of node `name`; the first waits until it serves the rendezvous store."""
        agent = self.agents.get(name) or Agent(name, self.config, self.endpoint, self.run_id, self.log_dir,
                                               self.max_restarts, self.env)
        self.agents[name] = agent
        first = len(self.agents) == 1 and agent.runs == 0
        agent.start()
        if first:
            wait_until(lambda: listening(self.endpoint), f"agent {name} to serve the rendezvous store", 120, [agent])
        return agent

    def close(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        shutil.rmtree(self.log_dir / "tmp", ignore_errors=True)


class Lighthouse:
    """`torchft_lighthouse` (torchft's own) on 127.0.0.1, a free port, its log in `tmp`, with short heartbeat and
    join timeouts (a lost replica group is noticed in about 1.5 s): tests/test_torchft.py, bench_diloco.py."""

    def __init__(self, tmp: Path, min_replicas: int) -> None:
        self.port = free_port()
        exe = Path(sys.executable).with_name("torchft_lighthouse")
        self.log = tmp / f"lighthouse-{self.port}.log"
        self.proc = subprocess.Popen([str(exe), "--bind", f"127.0.0.1:{self.port}", "--min_replicas",
                                      str(min_replicas), "--join_timeout_ms", "2000", "--heartbeat_timeout_ms",
                                      "1500", "--quorum_tick_ms", "50"], stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
