"""The table `kiln run` ends with: what was read, kept and dropped, what was trained, where it is."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kiln.terminal import console as plain_console


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    data = result["data"]
    docs = data["documents"]
    rows = [
        ("documents read", f"{docs['read']:,}"),
        ("documents kept", f"{docs['kept']:,}"),
        ("documents rejected", f"{docs['rejected']:,}"),
    ]
    rows += [(f"  rejected: {reason}", f"{n:,}") for reason, n in data["rejected_by_reason"].items()]
    rows.append(("languages kept", ", ".join(f"{k} {v}" for k, v in data["kept_by_lang"].items())))
    if data["file_errors"] or data["truncated"]:
        rows.append(
            ("input problems", f"{len(data['file_errors'])} unreadable file(s), {len(data['truncated'])} truncated")
        )
    if "tokenizer" in result:
        rows.append(("tokenizer vocabulary", f"{result['tokenizer']['vocab_size']:,}"))
    for split, info in result.get("pack", {}).get("splits", {}).items():
        rows.append((f"{split} tokens / samples", f"{info['tokens']:,} / {info['samples']:,}"))
    rows += [(f"wall time: {stage}", "skipped (up to date)" if stage in result.get("skipped", ()) else _duration(s))
             for stage, s in result.get("timings_s", {}).items()]
    if "train" not in result:
        return rows
    train = result["train"]
    rows += [
        ("training steps", f"{train['steps']:,} ({train['tokens_seen']:,} tokens, {train['skipped_steps']} skipped)"),
        ("model parameters", f"{train['params']:,}"),
        ("validation loss at start", _fmt(train["val_loss_start"])),
        ("validation loss at end", _last_eval(train)),
        ("checkpoint", str(train["checkpoint"])),
    ]
    return rows


def _last_eval(train: dict[str, Any]) -> str:
    """The last validation loss and, when it is not the last step's (a run stopped between evals), its step."""
    step = train.get("val_loss_end_step")
    if train["val_loss_end"] is None or step in (None, train["steps"]):
        return _fmt(train["val_loss_end"])
    return f"{_fmt(train['val_loss_end'])} (at step {step:,})"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _duration(seconds: float) -> str:
    m, s = divmod(seconds, 60)
    return f"{int(m)} min {s:.0f} s" if m else f"{s:.1f} s"


def next_commands(result: dict[str, Any], config: str | None = None, again: str | None = None,
                  kiln: str | None = None) -> list[str]:
    """What to try after a run, with the paths of this one, each shell-quoted.

    `config`: the config and overrides without train.max_steps, shell-quoted (for "train on"); `again`: the
    words of this very command, shell-quoted (to resume a run stopped by SIGTERM, or to run the remaining
    stages); `kiln`: how to call Kiln from here (default: kiln.install.kiln_command(), e.g. `.venv/bin/kiln`
    when kiln is not on the PATH)."""
    if kiln is None:
        from kiln.install import kiln_command

        kiln = kiln_command()
    config = config or "CONFIG"
    again = again or config
    train = result.get("train")
    if not train or not train.get("checkpoint"):
        stage = next((s for s in ("train", "pack", "tokenizer", "data") if s in result), None)
        return [f"{kiln} run {again}" + ("" if stage == "train" else "      # the remaining stages")]
    run_dir = Path(train["checkpoint"]).parent.parent
    run, hf = shlex.quote(str(run_dir)), shlex.quote(str(run_dir.parent / "hf"))
    follow = [f"{kiln} report {run}", f'{kiln} generate {run} --prompt "The" --max-new-tokens 40',
              f"{kiln} eval {run} --mc TASK.jsonl", f"{kiln} export --hf {run} {hf}"]
    if train.get("stopped") == "SIGTERM":  # the same command resumes it, on the same schedule
        return [f"{kiln} run {again}      # resumes from the last checkpoint", *follow]
    more = f"train.max_steps={train['steps'] * 2}"
    return [*follow, f"{kiln} run {config} {more}      # train on from the last checkpoint"]


def print_summary(result: dict[str, Any], console: Console | None = None, config: str | None = None,
                  again: str | None = None) -> None:
    table = Table(title="kiln run: summary", show_header=False)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")  # a long path wraps; it is never cut
    rows = summary_rows(result)
    for k, v in rows:
        table.add_row(k, v)
    console = console or plain_console(stderr=False)
    if not console.is_terminal:  # written to a file, nothing wraps: each value whole on its line (a terminal folds)
        wide = max(len(k) for k, _ in rows) + max(len(v) for _, v in rows) + 7  # the borders and padding
        console = plain_console(file=console.file, width=max(console.width, wide))
    console.print(table)
    console.print("next:\n" + "\n".join(f"  {c}" for c in next_commands(result, config, again)), soft_wrap=True)
