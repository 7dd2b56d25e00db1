"""BENCHMARKS.md's summary table: every row's command names a benchmark that exists and settings it reads.

A row's command is `[VAR=VALUE ...] python -m benchmarks NAME` or `python benchmarks/SCRIPT.py [ARGS]`. Checked
without running anything (most benchmarks take minutes to an hour): NAME is a `benchmarks/bench_NAME.py` with a
`main`, and every VAR is read by that module or by a benchmarks module it imports (`os.environ`)."""

from __future__ import annotations

import ast
import re
import shlex

from conftest import ROOT

BENCH = ROOT / "benchmarks"


def summary_commands() -> list[str]:
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    table = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| [")]
    commands = [re.findall(r"`([^`]*)`", row.rsplit("|", 2)[-2])[-1] for row in rows]
    assert len(commands) == len(rows) > 10, rows
    return commands


def module_source(path) -> str:
    """The module's text and that of the benchmarks modules it imports (`from benchmarks[.X] import ...`)."""
    text = path.read_text(encoding="utf-8")
    for name in re.findall(r"from benchmarks\.(\w+) import|from benchmarks import (\w+)", text):
        name = "".join(name)
        text += (BENCH / f"{name}.py").read_text(encoding="utf-8")
    return text


def test_every_summary_command_names_a_benchmark_and_settings_it_reads():
    for command in summary_commands():
        words = shlex.split(command)
        settings = [w.split("=", 1)[0] for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]
        rest = words[len(settings):]
        if rest[:3] == ["python", "-m", "benchmarks"]:
            path = BENCH / f"bench_{rest[3]}.py"
        else:
            assert rest[0] == "python" and rest[1].startswith("benchmarks/"), command
            path = ROOT / rest[1]
        assert path.is_file(), f"{command}: no {path.relative_to(ROOT)}"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), f"{path.name}: no main"
        source = module_source(path)
        unread = [s for s in settings if not re.search(rf"""["']{s}["']""", source)]
        assert not unread, f"{command}: {path.name} does not read {unread}"
