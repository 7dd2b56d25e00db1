"""Where metrics go besides metrics.jsonl: `train.loggers: [jsonl, tensorboard, wandb]` (default [jsonl]).

metrics.jsonl is always written (the report and resume read it); `tensorboard` writes run/tensorboard/
(Kiln's extra `tensorboard`), `wandb` a Weights & Biases run under run/wandb/
(the extra `wandb`; `WANDB_MODE=offline` keeps it on disk, `wandb sync` uploads it later).
A logger that is asked for and not installed stops the run before any work, naming the extra to install.
Each sink sees every record the trainer writes; it keeps nothing of its own (W&B buffers in its own process).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.install import install_hint

MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_loggers(loggers: list[str]) -> None:
    """Before any work (`kiln train`, and `kiln run` before its first stage): each logger asked for is installed,
    and W&B has what it needs to start (an API key, or a mode that keeps the run on disk)."""
    for name in loggers:
        module = MODULES.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"train.loggers asks for {name}, which is not installed: {install_hint(name)}, "
                              f"or remove {name} from train.loggers")
    if "wandb" in loggers and not _wandb_can_start():
        raise ConfigError("train.loggers asks for wandb, but no W&B API key is set (WANDB_API_KEY or ~/.netrc): "
                          "run `wandb login`, or set WANDB_MODE=offline to keep the run on disk (`wandb sync` "
                          "uploads it later), or remove wandb from train.loggers")


def _wandb_can_start() -> bool:
    """What `wandb.init` needs without a prompt, read as W&B reads it: a mode that needs no account
    (WANDB_MODE offline/disabled), an API key or identity token in the environment, or ~/.netrc's entry for
    the W&B host (what `wandb login` writes). No network."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or \
            os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return True
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields as `event/key` (what the step-indexed loggers plot)."""
    event = record.get("event", "step")
    prefix = f"{event}/{record['task']}" if event == "task" and "task" in record else event
    return {f"{prefix}/{k}": float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "event")}


class WandbSink:
    """One W&B run per Kiln run folder: its id is derived from the folder, so a resumed run continues it."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str) -> None:
        import wandb

        run_id = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=project, name=Path(run_dir).resolve().parent.name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config, reinit="finish_previous")
        self.last_step = -1

    def write(self, record: dict[str, Any]) -> None:
        values = numbers(record)
        if not values:
            return
        step = int(record.get("step", 0))
        if step < self.last_step:  # lines for steps that run again after a resume: W&B wants steps in order
            return
        self.last_step = step
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(loggers: list[str], run_dir: Path, config: dict[str, Any], wandb_project: str) -> list:
    """The extra sinks beyond metrics.jsonl and TensorBoard (which MetricsLog writes itself)."""
    return [WandbSink(run_dir, config, wandb_project)] if "wandb" in loggers else []
