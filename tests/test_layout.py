"""The shape of src/kiln/train (issue 14): short functions, a short loop, and the parallel mode decided in one
place. Checked with `ast` on the source, so a change that breaks the shape fails here, not in review."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "src" / "kiln" / "train"
MAX_FUNCTION_LINES = 60
MAX_TRAINER_LINES = 300


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_in_train_is_longer_than_60_lines():
    long = [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for path in sorted(TRAIN.rglob("*.py")) for fn in functions(path)
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_the_trainer_is_the_loop_only():
    lines = (TRAIN / "trainer.py").read_text().count("\n")
    assert lines <= MAX_TRAINER_LINES, f"train/trainer.py has {lines} lines"


def test_the_parallel_mode_is_tested_only_in_parallelize():
    mode = re.compile(r"""["'](fsdp|ddp)["']|\.mode\b""")
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sorted(TRAIN.rglob("*.py")) if path.parent.name != "parallel"
             for i, line in enumerate(path.read_text().splitlines(), 1) if mode.search(line)]
    assert not found, found

