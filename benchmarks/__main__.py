"""`make bench`: run every benchmarks/bench_*.py (or those named: python -m benchmarks loader data)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main(names: list[str]) -> int:
    found = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("bench_"))
    chosen = [m for m in found if not names or m.removeprefix("bench_") in names]
    if not chosen:
        print(f"no benchmark matches {names}; available: {[m.removeprefix('bench_') for m in found]}")
        return 1
    for name in chosen:
        print(f"== {name}")
        importlib.import_module(f"benchmarks.{name}").main()
    return 0


raise SystemExit(main(sys.argv[1:]))
