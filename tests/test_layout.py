"""The package's layout rules (DESIGN.md, "rules of the house"), checked on the source.

What the import tests count: every `import kiln...` / `from kiln... import ...` statement of every module under
src/kiln (relative ones resolved too), read with `ast`, as an edge to the kiln module it loads: `from kiln.a
import b` is an edge to kiln.a.b when that is a module, else to kiln.a; a package is its __init__.py (so a
submodule that imports its own package's face, `from kiln.a import name`, closes a loop through __init__.py).
Two graphs:
- module level: the statements Python runs when the module is imported (top level, and inside top-level
  if/try/with blocks; not in functions or classes; not under `if TYPE_CHECKING:`).
- every import: deferred ones inside functions and those under `if TYPE_CHECKING:` too. A deferred import does
  not fail at import time, but a module that needs another that needs it back is one tangled unit.
Neither graph may hold a cycle (a strongly connected component of more than one module).
The package rule, on the graph of every import: a module M inside a subpackage P (a package below a top-level
package: kiln.data.gates, kiln.data.dedup, kiln.train.checkpoint, kiln.train.parallel, ...) may import a module
X outside P whose own package encloses P (X in kiln.data, above kiln.data.gates; X in kiln.train, above
kiln.train.parallel) only if nothing X imports, directly or through other modules, lies inside P. So a gate
never imports the data stage (pipeline, steps, executor) that runs the gates; what both need moves down (into
P, or into a module of the package above that imports nothing of P).
Plus: kiln.model imports nothing of kiln outside kiln.model, and importing the config, the CLI or the data
pipeline loads no torch (a data worker or `kiln --help` must not pay for it).
And the shape of the code: no function in src/kiln over 80 lines (60 in src/kiln/train: issue 14), a short
loop, the parallel mode decided in one place, and a CLI that only parses and dispatches (cli.py under 300
lines), so a change that breaks the shape fails here, not in review.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src"


def module_files() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "kiln").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(name: str) -> str | None:
    """The kiln module that `import name` loads (the longest prefix that is a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _top_level(tree: ast.Module):
    """The statements that run at import time: the body, descending into if/try/with but not into
    functions, classes or `if TYPE_CHECKING:`."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(node, field, None) or [])


def imports_of(module: str, module_level_only: bool) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    nodes = _top_level(tree) if module_level_only else ast.walk(tree)
    package = module if _is_package(module) else module.rpartition(".")[0]
    targets = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "kiln"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "kiln":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in MODULES else _resolve(base))
    return {t for t in targets if t and t != module}


def import_graph(module_level_only: bool) -> dict[str, set[str]]:
    return {m: imports_of(m, module_level_only) for m in MODULES}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles as strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_of(module: str) -> str:
    """The package a module lies in: kiln.data.gates.c4 -> kiln.data.gates; a package is its own."""
    return module if _is_package(module) else module.rpartition(".")[0]


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """`start` and every module it imports, directly or through others."""
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def upward_imports_that_come_back(graph: dict[str, set[str]]) -> list[str]:
    """The package rule's breaches (module docstring): "M -> X -> ... -> Y", Y inside M's subpackage."""
    found = []
    for module in sorted(graph):
        package = package_of(module)
        if package.count(".") < 2:  # kiln.data, kiln.train: top-level packages have no package above but kiln
            continue
        for target in sorted(graph[module]):
            if inside(target, package) or not inside(package, package_of(target)):
                continue  # inside its own package, or not above it
            back = sorted(m for m in reaches(graph, target) if inside(m, package))
            if back:
                found.append(f"{module} -> {target} -> ... -> {back[0]}")
    return found


def test_the_graph_reader_sees_every_kind_of_import_and_finds_cycles():
    graph = import_graph(module_level_only=False)
    assert len(MODULES) > 80 and "kiln.data.gates.c4" in MODULES
    assert "kiln.data.docs" in graph["kiln.data.pipeline"]  # from kiln.data.docs import ...
    assert "kiln.train.checkpoint" in graph["kiln.train.trainer"]  # from kiln.train import checkpoint as ckpt
    assert "kiln.model.build" in graph["kiln.ops.doctor"]  # a deferred import, inside check_loader
    assert "kiln.model.build" not in import_graph(module_level_only=True)["kiln.ops.doctor"]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_package_rule_finds_a_gate_that_imports_the_stage_running_it():
    graph = {m: set(t) for m, t in import_graph(module_level_only=False).items()}
    assert upward_imports_that_come_back(graph) == []
    graph["kiln.data.gates.c4"].add("kiln.data.pipeline")  # pipeline -> steps -> gates (the package) -> gates.c4
    assert upward_imports_that_come_back(graph) == [
        "kiln.data.gates.c4 -> kiln.data.pipeline -> ... -> kiln.data.gates"]
    graph["kiln.data.gates.c4"] = {"kiln.data.document"}  # above kiln.data.gates, and imports nothing of it
    assert upward_imports_that_come_back(graph) == []


def test_no_import_cycle_at_module_level():
    assert strongly_connected(import_graph(module_level_only=True)) == []


def test_no_import_cycle_counting_deferred_imports():
    cycles = strongly_connected(import_graph(module_level_only=False))
    assert cycles == [], cycles


def test_no_module_imports_from_a_package_above_its_own_that_imports_it_back():
    breaches = upward_imports_that_come_back(import_graph(module_level_only=False))
    assert breaches == [], breaches


def test_model_imports_nothing_of_kiln_outside_model():
    graph = import_graph(module_level_only=False)
    model = [m for m in MODULES if m == "kiln.model" or m.startswith("kiln.model.")]
    assert {"kiln.model.config", "kiln.model.llama", "kiln.model.moe", "kiln.model.loss", "kiln.model.build"} <= set(
        model)
    outside = {m: sorted(t for t in graph[m] if not t.startswith("kiln.model")) for m in model}
    assert all(not targets for targets in outside.values()), outside


def test_every_module_imports_and_config_cli_and_data_load_no_torch():
    """In a fresh interpreter: the light entry points first (torch must stay out), then every module."""
    code = (
        "import importlib, sys\n"
        "import kiln.cli, kiln.config, kiln.data.pipeline, kiln.data.docs, kiln.model.config\n"
        "assert 'torch' not in sys.modules, 'torch loaded by the config, the CLI or the data pipeline'\n"
        f"for name in {sorted(set(MODULES) - {'kiln.__main__'})!r}:  # __main__ runs the CLI\n"
        "    importlib.import_module(name)\n"
        "print(len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(SRC)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


# --- the shape of src/kiln/train (issue 14): short functions, a short loop, the parallel mode in one place -------

TRAIN = SRC / "kiln" / "train"
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


MAX_FUNCTION_LINES_ANYWHERE = 80
MAX_CLI_LINES = 300


def test_no_function_in_src_kiln_is_longer_than_80_lines():
    long = [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for path in sorted((SRC / "kiln").rglob("*.py")) for fn in functions(path)
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES_ANYWHERE]
    assert not long, long


def test_the_cli_parses_and_dispatches_only():
    lines = (SRC / "kiln" / "cli.py").read_text().count("\n")
    assert lines <= MAX_CLI_LINES, f"cli.py has {lines} lines"
