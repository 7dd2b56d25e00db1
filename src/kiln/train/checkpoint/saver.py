"""Saving without stopping the loop: the CPU snapshot a background writer owns, the finiteness check every save
makes first, and `Saver`, which runs one write at a time, synchronously or in a thread (both formats use it)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

import torch

from kiln.errors import KilnError


def snapshot(obj):
    """A CPU copy of every tensor in a (nested) state: what a background writer owns while training goes on.

    GPU tensors are copied into pinned host buffers with non-blocking copies and one synchronize at the end,
    so the snapshot costs no GPU memory (a clone on the device would add 8 bytes per parameter for Adam's
    moments for the whole write) and overlaps the copies. A GPU run confirms the stall it measures.
    """
    copies = _snapshot(obj)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return copies


def _snapshot(obj):
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            host = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=True)
            return host.copy_(obj.detach(), non_blocking=True)
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    return obj


def all_finite(*states: dict) -> bool:
    """Never commit a checkpoint whose weights or optimizer state hold NaN/inf."""
    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)
    return all(bool(torch.isfinite(t).all()) for s in states for t in tensors(s) if t.is_floating_point())


class Saver:
    """Writes checkpoints on rank 0, synchronously or in a background thread; never two at once.

    Async: the caller hands over CPU copies (the snapshot, taken at the step boundary),
    training continues while the thread writes. The time the loop waited is the stall.
    `busy`: a context the loop waits in (a synchronous write, or the wait for a background one): the
    trainer's `Watchdog.saving`, so a long save is not reported as a stalled rank.
    """

    def __init__(self, async_save: bool, log: Callable[[str], None] = print) -> None:
        self.async_save, self.log = async_save, log
        self.busy: Callable[[], Any] = contextlib.nullcontext
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_write_s: float | None = None

    def wait(self) -> float:
        """Block until the previous save is committed; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            with self.busy():
                self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise KilnError(f"background checkpoint save failed: {err}") from err
        return time.perf_counter() - t0

    def save(self, write: Callable[[], Any]) -> float:
        """Run `write` (which commits one checkpoint); returns the stall in seconds."""
        stall = self.wait()
        if not self.async_save:
            t0 = time.perf_counter()
            with self.busy():
                write()
            self.last_write_s = time.perf_counter() - t0
            return stall + self.last_write_s

        def run():
            t0 = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # reported on the next wait()
                self.error = exc
            self.last_write_s = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="kiln-checkpoint", daemon=False)
        self._thread.start()
        return stall

