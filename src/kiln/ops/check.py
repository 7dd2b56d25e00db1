"""One verdict of `kiln doctor` or `kiln preflight`: a name, pass/fail/skip, what was seen, and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False

    @property
    def verdict(self) -> str:
        return "skip" if self.skipped else ("ok" if self.ok else "FAIL")

    def as_dict(self) -> dict:
        return {"name": self.name, "verdict": self.verdict, "ok": self.ok, "detail": self.detail, "fix": self.fix}


def skip(name: str, why: str) -> Check:
    return Check(name, True, why, skipped=True)


def guarded(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one check; an exception is that check's failure (with its message), never a traceback."""
    try:
        out = fn()
    except Exception as exc:  # a probe that crashes is exactly what the user needs to see, as a verdict
        return [
            Check(
                name,
                False,
                f"{type(exc).__name__}: {str(exc)[:300]}",
                "see the detail; rerun with --json for the full record",
            )
        ]
    return out if isinstance(out, list) else [out]


def print_checks(checks: list[Check], title: str = "") -> None:
    from rich.table import Table
    from rich.text import Text

    from kiln.terminal import console

    table = Table("check", "verdict", "detail", "fix", title=title or None)
    colour = {"ok": "green", "FAIL": "red", "skip": "yellow"}
    for c in checks:
        table.add_row(c.name, Text(c.verdict, style=colour[c.verdict]), c.detail, c.fix)
    console(stderr=False).print(table)
