"""What a person watching training sees: one live line per step under a terminal, plain lines otherwise.

Under a TTY (stderr), a rich Live line is redrawn every step: step/max, elapsed, ETA, smoothed loss, lr,
tokens/s, peak memory and MFU where the device's peak is known. Whatever the output, a permanent line is
printed every `log_every` steps, at the last step and for a skipped step; `log_every` is capped at a tenth of
the run, so a 20-step run prints even with `log_every: 25`. `run_warnings` names settings that make a run
quietly useless (all warmup, repeated data, a vocabulary smaller than asked) before the first step.
Nothing here grows with the run: the console keeps one moving average and the last line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from kiln.terminal import stderr_is_terminal

# Weight of a new step in the smoothed loss: about the last 20 steps count.
SMOOTHING = 0.1


def effective_log_every(log_every: int, max_steps: int) -> int:
    """train.log_every, but at most a tenth of the run (at least 1), so every run prints some lines."""
    return max(1, min(log_every, math.ceil(max_steps / 10)))


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


class TrainConsole:
    """Fed each step's metrics record by the trainer (rank 0 only); `log` prints a permanent line."""

    def __init__(self, max_steps: int, log_every: int, start_step: int, log: Callable[[str], None],
                 live: bool | None = None) -> None:
        self.max_steps, self.every, self.log = max_steps, effective_log_every(log_every, max_steps), log
        self.start_step, self.t0 = start_step, time.perf_counter()
        self.smoothed: float | None = None
        self.live = None
        if stderr_is_terminal() if live is None else live:
            from rich.live import Live

            from kiln.terminal import stderr_console

            # The trainer's own lines (evals, saves, a stop) print above the live line when they go through the
            # same Console (kiln.terminal); redirect_stderr does it for plain writes to sys.stderr.
            self.live = Live(console=stderr_console(), auto_refresh=False, transient=True,
                             redirect_stderr=True, redirect_stdout=False)
            self.live.start()

    def line(self, record: dict[str, Any]) -> str:
        step = record["step"]
        elapsed = time.perf_counter() - self.t0
        done = step - self.start_step
        eta = elapsed / done * (self.max_steps - step) if done > 0 else float("nan")
        parts = [f"step {step}/{self.max_steps}", f"{_clock(elapsed)} elapsed",
                 f"ETA {_clock(eta)}" if math.isfinite(eta) else "ETA ?",
                 f"loss {record['loss']:.4f} (smoothed {self.smoothed:.4f})", f"lr {record['lr']:.2e}",
                 f"{record.get('tokens_per_s', 0):,.0f} tok/s"]
        if record.get("grad_norm") is not None:
            parts.append(f"grad_norm {record['grad_norm']:.3f}")
        if record.get("mem_peak_gb") is not None:
            parts.append(f"mem {record['mem_peak_gb']:.2f} GB")
        if record.get("mfu") is not None:
            parts.append(f"MFU {record['mfu']:.1%}")
        return "  ".join(parts)

    def step(self, record: dict[str, Any], skipped: str | None = None) -> None:
        loss = record["loss"]
        if math.isfinite(loss):
            self.smoothed = loss if self.smoothed is None else (1 - SMOOTHING) * self.smoothed + SMOOTHING * loss
        if self.smoothed is None:
            self.smoothed = float("nan")
        text = self.line(record) + (f"  SKIPPED ({skipped})" if skipped else "")
        if self.live is not None:
            from rich.text import Text

            # Wrapped at the terminal's width whatever the printing call asks (soft_wrap), so the live line's
            # height is what rich erases before the next draw.
            self.live.update(Text(text, no_wrap=False, overflow="fold"), refresh=True)
        step = record["step"]
        if step % self.every == 0 or step == self.max_steps or skipped:
            self.log(text)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def run_warnings(max_steps: int, warmup_steps: int, tokens_per_step: int, train_tokens: int,
                 vocab_asked: int | None, vocab_reached: int | None) -> list[str]:
    """Settings that make a run quietly wrong, each with its key and what to change."""
    out = []
    if warmup_steps >= max_steps:
        out.append(f"train.warmup_steps={warmup_steps} >= train.max_steps={max_steps}: the whole run is warmup "
                   "and the learning rate never reaches train.lr; lower warmup_steps")
    if train_tokens and max_steps * tokens_per_step > train_tokens:
        epochs = max_steps * tokens_per_step / train_tokens
        out.append(f"{max_steps} steps x {tokens_per_step:,} tokens = {epochs:.1f} epochs of the {train_tokens:,} "
                   "training tokens: the model sees the same data again (it may memorise it); "
                   "add data or lower train.max_steps")
    if vocab_asked and vocab_reached and vocab_reached < vocab_asked:
        out.append(f"the tokenizer reached a vocabulary of {vocab_reached:,} of the {vocab_asked:,} asked "
                   "(tokenizer.vocab_size): the corpus has too little text for more merges; add data or lower it")
    return out


def warnings_for(cfg, train_samples: int) -> list[str]:
    """run_warnings for a config and its training split (the tokenizer's reach read from its manifest)."""
    from kiln.manifest import read_manifest

    asked = reached = None
    tok_dir = cfg.layout.tokenizer
    if cfg.tokenizer.path is None and (tok_dir / "manifest.json").is_file():
        m = read_manifest(tok_dir)
        asked = cfg.tokenizer.vocab_size
        reached = int(m.get("vocab_size", 0)) - len(m.get("added_tokens") or []) or None
    t = cfg.train
    return run_warnings(t.max_steps, t.warmup_steps, t.batch_size * cfg.pack.seq_len,
                        train_samples * cfg.pack.seq_len, asked, reached)
