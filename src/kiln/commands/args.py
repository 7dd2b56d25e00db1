"""What several commands share: KEY=VALUE words among paths, the console, a checkpoint argument, an example."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_HELP = "a checkpoint folder, or a run folder or out_dir (its newest valid checkpoint, named on stderr)"


def is_override(word: str) -> bool:
    """KEY=VALUE, unless the word names an existing file (a Hive-style path such as lang=en/part-0.parquet)."""
    return "=" in word and not word.startswith("-") and not Path(word).exists()


def split_overrides(values: list[str]) -> tuple[list[str], list[str]]:
    """Positional words with '=' are KEY=VALUE overrides; the rest are paths (after `--`, see cli.main)."""
    return [v for v in values if not is_override(v)], [v for v in values if is_override(v)]


def console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def checkpoint_arg(path: str) -> Path:
    """A checkpoint folder, or the newest valid one of a run folder (named on stderr)."""
    from kiln.train.resolve import resolve_checkpoint

    return resolve_checkpoint(path, log=console().print)


def example(text: str) -> str:
    """A command's --help epilog: one example."""
    return f"example:\n  {text}"
