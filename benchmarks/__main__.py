"""`make bench`: run every benchmarks/bench_*.py (or those named: python -m benchmarks loader encode).

`python -m benchmarks NAME --help` prints what NAME measures and its settings (its module docstring) and runs
nothing; `python -m benchmarks --help` lists every benchmark with its first line."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

HERE = Path(__file__).parent


def describe(module: str) -> str:
    """A benchmark's docstring, read without importing it (its imports may need a peer's environment)."""
    return ast.get_docstring(ast.parse((HERE / f"{module}.py").read_text(encoding="utf-8"))) or ""


def main(args: list[str]) -> int:
    names = [a for a in args if a not in ("-h", "--help")]
    found = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))
    chosen = [m for m in found if not names or m.removeprefix("bench_") in names]
    unknown = [n for n in names if f"bench_{n}" not in found]
    if not chosen or unknown:
        print(f"no benchmark matches {unknown or names}; available: {[m.removeprefix('bench_') for m in found]}")
        return 1
    if len(names) < len(args):  # --help
        for name in chosen:
            text = describe(name)
            print(f"{name.removeprefix('bench_')}: {text.splitlines()[0] if text else ''}" if not names else
                  f"== {name.removeprefix('bench_')}\n{text}\n")
        return 0
    for name in chosen:
        print(f"== {name}")
        importlib.import_module(f"benchmarks.{name}").main()
    return 0


raise SystemExit(main(sys.argv[1:]))
