"""Run independent tasks on a local process pool or on Ray, handing each result back as it finishes.

A task function is pure: it takes its arguments and returns its result; the caller
commits results (the driver owns the work folder's completion markers), so a killed worker
leaves nothing that counts. A task that writes files of its own (the data tasks: their outcome and
signatures, each atomically) writes them into the work folder before it returns; the dedup stage
tasks read the work folder. On a Ray cluster of several machines the work folder is therefore on
storage every node mounts."""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from itertools import islice
from multiprocessing import get_context
from typing import Any, Callable, Iterator

from kiln.data.workers import POLL_S, ending_workers, worker_init
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
           connect_timeout_s: float = 30) -> Iterator[None]:
    """Keep one Ray session for several rounds of `run_tasks` (the data tasks, then the dedup stages);
    the local pool needs nothing. `connect_timeout_s`: how long a cluster at `ray_address` may take to answer."""
    if executor != "ray":
        yield
        return
    ray = _import_ray()
    started = _start_ray(ray, workers, ray_address, connect_timeout_s)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _import_ray():
    try:
        import ray
    except ImportError:
        from kiln.install import install_hint

        raise KilnError(f"data.executor=ray needs Ray: {install_hint('ray')}, or use data.executor=local") from None
    return ray


def _start_ray(ray, workers: int, address: str | None, connect_timeout_s: float = 30) -> bool:
    """Start (or join) Ray unless this process already has; True when it did."""
    started = not ray.is_initialized()
    if started:
        if address:
            if address != "auto":  # `auto` reads the address a local `ray start` wrote: Ray says if there is none
                check_ray_address(address, connect_timeout_s)
            try:
                ray.init(address=address, log_to_driver=False)
            except (ConnectionError, TimeoutError) as exc:
                raise KilnError(f"data.ray_address={address}: Ray could not join a cluster there ({str(exc)[:200]}); "
                                "start one (`ray start --head`) or fix the address") from None
        else:
            # A local Ray for this run: no dashboard, no token file (nothing leaves the machine).
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    return started


_GRPC_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # preface, empty SETTINGS


def check_ray_address(address: str, timeout_s: float) -> None:
    """A Ray head (its GCS at HOST:PORT, or a Ray client server at ray://HOST:PORT) answers at `address` within
    `timeout_s` seconds (data.ray_connect_timeout_s), tried once a second meanwhile: else a one-line KilnError
    naming the address and what went wrong. `ray.init` itself retries without end when nothing answers, deaf to
    SIGTERM inside Ray's C++ client; this check is plain sockets with short timeouts, so SIGTERM ends it at once.
    An answer counts when it is gRPC (an HTTP/2 SETTINGS frame answers HTTP/2's preface), as both Ray servers are."""
    import socket
    import time

    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise KilnError(f"data.ray_address={address!r}: not HOST:PORT (a head's GCS, e.g. head:6379), ray://HOST:PORT "
                        "(a Ray client server) or auto")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(5.0, left))) as sock:
                sock.sendall(_GRPC_HELLO)
                if sock.recv(9)[3:4] == b"\x04":
                    return
                why = "something answers there, but not a Ray cluster (no gRPC)"
        except socket.gaierror as exc:
            why = f"the host name does not resolve ({exc.strerror})"
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() + 1 > deadline:
            raise KilnError(f"data.ray_address={address}: no Ray cluster answered there within {timeout_s:g} s "
                            f"({why}); start one there (`ray start --head`), fix the address, or raise "
                            "data.ray_connect_timeout_s for a cluster still starting")
        time.sleep(1)


def _ray(fn, tasks, workers, address) -> Iterator[Any]:
    ray = _import_ray()
    started = _start_ray(ray, workers, address)
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
        if started:
            ray.shutdown()
