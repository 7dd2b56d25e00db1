"""The table `kiln run` ends with: what was read, kept and dropped, what was trained, where it is."""

from __future__ import annotations

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
        rows.append(("input problems", f"{len(data['file_errors'])} unreadable file(s), {len(data['truncated'])} truncated"))
    if "tokenizer" in result:
        rows.append(("tokenizer vocabulary", f"{result['tokenizer']['vocab_size']:,}"))
    for split, info in result.get("pack", {}).get("splits", {}).items():
        rows.append((f"{split} tokens / samples", f"{info['tokens']:,} / {info['samples']:,}"))
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


def print_summary(result: dict[str, Any], console: Console | None = None) -> None:
    table = Table(title="kiln run: summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for k, v in summary_rows(result):
        table.add_row(k, v)
    (console or Console()).print(table)
