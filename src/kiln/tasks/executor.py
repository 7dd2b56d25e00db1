"""Run independent tasks on a local process pool or on Ray, handing each result back as it finishes.

A task function is pure: it takes its arguments and returns its result; the caller
commits results (the driver owns the work folder's completion markers), so a killed worker
leaves nothing that counts. A task that writes files of its own (the data tasks: their outcome and
signatures, each atomically) writes them into the work folder before it returns; the dedup stage
tasks read the work folder. On a Ray cluster of several machines the work folder is therefore on
storage every node mounts."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from itertools import islice
from multiprocessing import get_context
from typing import Any, Callable, Iterator

from kiln.tasks import raywatch
from kiln.tasks.workers import POLL_S, ending_workers, worker_init
from kiln.errors import KilnError


def run_tasks(fn: Callable[[Any], Any], tasks: list[Any], workers: int, executor: str = "local",
              ray_address: str | None = None, spawn: bool = False) -> Iterator[Any]:
    """Yield fn(task) for every task, in completion order; at most `workers` run at once. `spawn`: the local
    pool's processes are spawned, not forked (pack's: a fork after the tokenizers library's threads ran in the
    driver, as `kiln run` trains the tokenizer there, would inherit them)."""
    if not tasks:
        return iter(())
    if executor == "ray":
        return _ray(fn, tasks, workers, ray_address)
    if workers <= 1:
        return (fn(t) for t in tasks)
    return _pool(fn, tasks, workers, spawn)


def _pool(fn, tasks, workers, spawn: bool = False) -> Iterator[Any]:
    # Submitting a bounded window (not pool.map over everything) keeps finished results
    # flowing back in completion order, so each is committed as soon as it exists.
    pending = iter(tasks)
    context = get_context("spawn") if spawn else None
    with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context, initializer=worker_init) as pool, \
            ending_workers(pool) as signals:
        running = {pool.submit(fn, t) for t in islice(pending, workers * 2)}
        while running:
            done, running = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
            signals.check()
            for future in done:
                yield future.result()
                running.update(pool.submit(fn, t) for t in islice(pending, 1))


@contextmanager
def engine(executor: str, workers: int, ray_address: str | None = None,
           connect_timeout_s: float = 30, section: str = "data") -> Iterator[None]:
    """Keep one Ray session for several rounds of `run_tasks` (the data tasks, then the dedup stages);
    the local pool needs nothing. `connect_timeout_s`: how long a cluster at `ray_address` may take to answer;
    `section`: the config section whose keys the user set (data, pack), named in errors. The caller makes its
    work folder inside, once Ray is there."""
    if executor != "ray":
        yield
        return
    ray = _import_ray(section)
    stop = _start_ray(ray, workers, ray_address, connect_timeout_s, section)
    try:
        yield
    finally:
        if stop:
            stop()


def _import_ray(section: str = "data"):
    try:
        import ray
    except ImportError:
        from kiln.install import install_hint

        raise KilnError(f"{section}.executor=ray needs Ray: {install_hint('ray')}, or use {section}.executor=local") \
            from None
    return ray


def _start_ray(ray, workers: int, address: str | None, connect_timeout_s: float = 30,
               section: str = "data") -> Callable[[], None] | None:
    """Start (or join) Ray unless this process already has; returns what ends it (None: nothing was started)."""
    if ray.is_initialized():
        return None
    if address:
        if address != "auto":  # `auto` reads the address a local `ray start` wrote: Ray says if there is none
            check_ray_address(address, connect_timeout_s, section)
        try:
            with _quiet_stderr():  # Ray's C++ client writes a warning a second while it retries
                ray.init(address=address, log_to_driver=False)
        except (ConnectionError, TimeoutError) as exc:
            raise KilnError(f"{section}.ray_address={address}: Ray could not join a cluster there "
                            f"({str(exc)[:200]}); start one (`ray start --head`) or fix the address") from None
        return ray.shutdown
    # A local Ray for this run: no dashboard, no token file (nothing leaves the machine), and a watchdog that
    # ends its processes when this one ends, even by SIGKILL (raywatch.py).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    watchdog = _watch_ray()
    try:
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    except BaseException:
        _end_local_ray(ray, watchdog)
        raise
    return lambda: _end_local_ray(ray, watchdog)


def _watch_ray() -> subprocess.Popen:
    """Start raywatch.py on a new session marker, set in this process's environment for Ray to inherit."""
    marker = f"{os.getpid()}-{secrets.token_hex(8)}"
    watchdog = subprocess.Popen([sys.executable, "-I", raywatch.__file__, marker], stdin=subprocess.PIPE,
                                start_new_session=True)
    os.environ[raywatch.VAR] = marker
    return watchdog


def _end_local_ray(ray, watchdog: subprocess.Popen) -> None:
    """ray.shutdown, then the watchdog's sweep of what it left (Ray's agents, deaf to SIGTERM)."""
    try:
        ray.shutdown()
    finally:
        os.environ.pop(raywatch.VAR, None)  # what this process starts next is not Ray's
        watchdog.stdin.close()
        try:
            watchdog.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 goes nowhere meanwhile: what Ray's C++ core writes there too, not only sys.stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


_GRPC_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # preface, empty SETTINGS


def check_ray_address(address: str, timeout_s: float, section: str = "data") -> None:
    """A Ray head (its GCS at HOST:PORT, or a Ray client server at ray://HOST:PORT) answers at `address` within
    `timeout_s` seconds (`section`.ray_connect_timeout_s), tried once a second meanwhile: else a one-line
    KilnError naming `section`.ray_address and what went wrong; a refused connection (nothing listens there) is
    said at once. `ray.init` itself retries without end when nothing answers, deaf to SIGTERM inside Ray's C++
    client; this check is plain sockets with short timeouts, so SIGTERM ends it at once. An answer counts when it
    is gRPC: a call answered with HTTP status 200 (any gRPC server does, with an unknown method too), where an
    HTTP/2 server or proxy that is not gRPC says 404."""
    import socket
    import time

    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    key = f"{section}.ray_address={address}"
    if not host or not port.isdigit():
        raise KilnError(f"{key!r}: not HOST:PORT (a head's GCS, e.g. head:6379), ray://HOST:PORT (a Ray client "
                        "server) or auto")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(5.0, left))) as sock:
                if _answers_grpc(sock, host):
                    return
                why = "something answers there, but not a Ray cluster (no gRPC)"
        except ConnectionRefusedError:
            raise KilnError(f"{key}: no Ray cluster answered there (connection refused: nothing listens at that "
                            "port); start one there (`ray start --head`) or fix the address") from None
        except socket.gaierror as exc:
            why = f"the host name does not resolve ({exc.strerror})"
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() + 1 > deadline:
            raise KilnError(f"{key}: no Ray cluster answered there within {timeout_s:g} s ({why}); start one there "
                            f"(`ray start --head`), fix the address, or raise {section}.ray_connect_timeout_s for a "
                            "cluster still starting")
        time.sleep(1)


def _answers_grpc(sock, host: str) -> bool:
    """HTTP/2's preface, then one gRPC call's headers (HPACK, no Huffman: POST, http, the path, the authority,
    content-type application/grpc, te: trailers); True when the first headers on stream 1 begin with `:status
    200` (HPACK static index 8). Frames before them (SETTINGS, WINDOW_UPDATE, PING) are skipped."""
    def literal(index: int, value: bytes) -> bytes:  # a header literal, not indexed, its name from the static table
        name = bytes([index]) if index < 15 else bytes([15, index - 15])
        return name + bytes([len(value)]) + value

    block = b"\x83\x86" + literal(4, b"/kiln.Probe/Hello") + literal(1, host.encode()[:100]) + \
        literal(31, b"application/grpc") + b"\x00\x02te\x08trailers"
    sock.sendall(_GRPC_HELLO + len(block).to_bytes(3, "big") + b"\x01\x05" + (1).to_bytes(4, "big") + block)
    data = b""
    while True:
        while len(data) < 9 or len(data) < 9 + int.from_bytes(data[:3], "big"):
            chunk = sock.recv(4096)
            if not chunk:
                return False
            data += chunk
        size, kind, stream = int.from_bytes(data[:3], "big"), data[3], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF
        if kind == 0x07:  # GOAWAY
            return False
        if kind == 0x01 and stream == 1:
            flags, payload = data[4], data[9:9 + size]
            if flags & 0x08:  # PADDED
                payload = payload[1:]
            if flags & 0x20:  # PRIORITY
                payload = payload[5:]
            while payload[:1] and payload[0] & 0xE0 == 0x20:  # dynamic table size updates, before any header
                payload = payload[1:] if payload[0] & 0x1F < 0x1F else payload[2:]
            return payload[:1] == b"\x88"
        data = data[9 + size:]


def _ray(fn, tasks, workers, address) -> Iterator[Any]:
    ray = _import_ray()
    stop = _start_ray(ray, workers, address)  # None inside `engine`, which started Ray (or joined it) already
    try:
        remote = ray.remote(num_cpus=1, max_retries=2)(fn)
        pending = iter(tasks)
        running = [remote.remote(t) for t in islice(pending, workers * 2)]
        while running:
            done, running = ray.wait(running, num_returns=1)
            try:
                result = ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, KilnError):  # the task's own message, not Ray's traceback around it
                    raise exc.cause from None
                raise
            yield result
            running += [remote.remote(t) for t in islice(pending, 1)]
    finally:
        if stop:
            stop()
