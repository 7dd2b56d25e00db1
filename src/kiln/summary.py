"""The table `kiln run` ends with: what was read, kept and dropped, what was trained, where it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


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
        ("validation loss at end", _fmt(train["val_loss_end"])),
        ("checkpoint", str(train["checkpoint"])),
    ]
    return rows


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _duration(seconds: float) -> str:
    m, s = divmod(seconds, 60)
    return f"{int(m)} min {s:.0f} s" if m else f"{s:.1f} s"


def next_commands(result: dict[str, Any], config: str | None = None, kiln: str | None = None) -> list[str]:
    """What to try after a run, with the paths of this one; `kiln` is how to call Kiln from here (default:
    kiln.install.kiln_command(), e.g. `.venv/bin/kiln` when kiln is not on the PATH)."""
    if kiln is None:
        from kiln.install import kiln_command

        kiln = kiln_command()
    config = config or "CONFIG"
    train = result.get("train")
    if not train or not train.get("checkpoint"):
        stage = next((s for s in ("train", "pack", "tokenizer", "data") if s in result), None)
        return [f"{kiln} run {config}" + ("" if stage == "train" else "      # the remaining stages")]
    run = str(Path(train["checkpoint"]).parent.parent)
    return [f"{kiln} report {run}", f'{kiln} generate {run} --prompt "The" --max-new-tokens 40',
            f"{kiln} eval {run} --mc TASK.jsonl", f"{kiln} export --hf {run} {Path(run).parent / 'hf'}",
            f"{kiln} run {config} train.max_steps={train['steps'] * 2}      # train on from the last checkpoint"]


def print_summary(result: dict[str, Any], console: Console | None = None, config: str | None = None) -> None:
    table = Table(title="kiln run: summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")  # a long path wraps in its cell, never cut to "…"
    for k, v in summary_rows(result):
        table.add_row(k, v)
    console = console or Console()
    console.print(table)
    # soft_wrap: a command is one line however narrow the terminal or file, so it copies whole.
    console.print("next:\n" + "\n".join(f"  {c}" for c in next_commands(result, config)), soft_wrap=True)
