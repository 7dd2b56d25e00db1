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
def engine(executor: str, workers: int, ray_address: str | None = None) -> Iterator[None]:
    """Keep one Ray session for several rounds of `run_tasks` (the data tasks, then the dedup stages);
    the local pool needs nothing."""
    if executor != "ray":
        yield
        return
    ray = _import_ray()
    started = _start_ray(ray, workers, ray_address)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise KilnError("data.executor=ray needs Ray; pip install 'kiln-lm[ray]' or use data.executor=local") from None
    return ray


def _start_ray(ray, workers: int, address: str | None) -> bool:
    """Start (or join) Ray unless this process already has; True when it did."""
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # A local Ray for this run: no dashboard, no token file (nothing leaves the machine).
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    return started


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
