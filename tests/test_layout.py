"""The package's layout rules (docs/architecture.md, "Floors"), checked on the source.

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
The floors, on the graph of every import: each top-level module or package of src/kiln stands on exactly one
floor of FLOORS (below; a new one must be placed there), and a module imports only from its own floor and the
floors below it, not even inside a function (`upward_imports`). Packages at every level: the graph collapsed
to the children of each package (kiln.data, kiln.train, ... under kiln; kiln.data.gates, kiln.data.dedup,
kiln.data.pipeline, ... under kiln.data) holds no cycle among siblings (`package_cycles`); an import between a
package and its own ancestor is not a sibling edge (the package rule below covers those).
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

# The floors, bottom up: a top-level module or package of src/kiln (a package with all its submodules) may import
# from its own floor and those below, never from one above (docs/architecture.md, "Floors"). Names listed here
# that do not exist (yet) are allowed; a top-level module or package that is on no floor fails the test.
FLOORS: list[list[str]] = [
    # 0 ground: the package face, errors, the console, optional installs, the hardware probe, the model itself
    ["kiln", "kiln.errors", "kiln.terminal", "kiln.install", "kiln.hardware", "kiln.model"],
    # 1 house-wide: names, locks, manifests, the config and its doc, env, storage, summary, the task engine, a run's
    # folders, the shared report pages
    ["kiln.names", "kiln.lock", "kiln.manifest", "kiln.config", "kiln.config_doc", "kiln.env", "kiln.storage",
     "kiln.summary", "kiln.tasks", "kiln.run_layout", "kiln.pages"],
    # 2 the tokenizer
    ["kiln.tokenizer"],
    # 3 what reads a checkpoint and what scores a model (below both data's gates and train's validator)
    ["kiln.checkpoint", "kiln.scoring"],
    # 4 the data stage: crawls to documents
    ["kiln.data"],
    # 5 documents to packed token shards
    ["kiln.shards"],
    # 6 training, and evaluating a checkpoint
    ["kiln.train", "kiln.eval"],
    # 7 what runs and inspects the stages: ops, the end-to-end flow, the list of stages
    ["kiln.ops", "kiln.flow", "kiln.stages"],
    # 8 experiments made of whole runs
    ["kiln.ablate", "kiln.mix"],
    # 9 the command line
    ["kiln.commands", "kiln.cli", "kiln.__main__"],
]


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


def top_level(module: str) -> str:
    """The top-level module or package a module belongs to: kiln.data.gates.c4 -> kiln.data; kiln -> kiln."""
    return ".".join(module.split(".")[:2])


def off_the_floors(modules, floors: list[list[str]] = FLOORS) -> list[str]:
    """Each top-level module or package of `modules` that is not on exactly one floor, in words."""
    found = []
    for name in sorted({top_level(m) for m in modules}):
        on = [i for i, floor in enumerate(floors) if name in floor]
        if not on:
            found.append(f"put {name} on a floor in tests/test_layout.py FLOORS")
        elif len(on) > 1:
            found.append(f"{name} is on floors {', '.join(map(str, on))}: keep it on one in tests/test_layout.py "
                         "FLOORS")
    return found


def upward_imports(graph: dict[str, set[str]], floors: list[list[str]] = FLOORS) -> list[str]:
    """The floor rule's breaches: "kiln.a.b -> kiln.c.d (floor 4 imports floor 6)". Modules on no floor are
    `off_the_floors`'s to report."""
    floor = {name: i for i, names in enumerate(floors) for name in names}
    found = []
    for module in sorted(graph):
        here = floor.get(top_level(module))
        for target in sorted(graph[module]):
            there = floor.get(top_level(target))
            if here is not None and there is not None and there > here:
                found.append(f"{module} -> {target} (floor {here} imports floor {there})")
    return found


def package_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Cycles among sibling packages/modules at every level: each edge M -> T counts as an edge between the two
    children of M's and T's deepest common package that hold them (kiln.data.gates.c4 -> kiln.train.trainer is
    kiln.data -> kiln.train under kiln; kiln.data.gates.c4 -> kiln.data.dedup.index is kiln.data.gates ->
    kiln.data.dedup under kiln.data); an edge between a module and its own ancestor is none. Each cycle in words:
    its members, then one module edge for each sibling edge inside it."""
    by_parent: dict[str, dict[str, set[str]]] = {}
    example: dict[tuple[str, str], str] = {}
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if inside(module, target) or inside(target, module):
                continue
            a, b = module.split("."), target.split(".")
            common = 0
            while a[common] == b[common]:
                common += 1
            parent = ".".join(a[:common])
            child_a, child_b = ".".join(a[: common + 1]), ".".join(b[: common + 1])
            siblings = by_parent.setdefault(parent, {})
            siblings.setdefault(child_a, set()).add(child_b)
            siblings.setdefault(child_b, set())
            example.setdefault((child_a, child_b), f"{module} -> {target}")
    found = []
    for parent in sorted(by_parent):
        siblings = by_parent[parent]
        for component in strongly_connected(siblings):
            edges = [example[(a, b)] for a in component for b in sorted(siblings[a]) if b in component]
            found.append(f"cycle among {', '.join(component)} (under {parent}): {'; '.join(edges)}")
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


def test_every_top_level_module_and_package_is_on_exactly_one_floor():
    breaches = off_the_floors(MODULES)
    assert breaches == [], breaches


def test_no_module_imports_from_a_floor_above_its_own_counting_deferred_imports():
    breaches = upward_imports(import_graph(module_level_only=False))
    assert breaches == [], "\n".join(breaches)


def test_no_cycle_among_sibling_packages_at_any_level_counting_deferred_imports():
    breaches = package_cycles(import_graph(module_level_only=False))
    assert breaches == [], "\n".join(breaches)


def _planted(edges: list[tuple[str, str]]) -> dict[str, set[str]]:
    """A copy of the real graph (every import) with `edges` added."""
    graph = {m: set(t) for m, t in import_graph(module_level_only=False).items()}
    for module, target in edges:
        graph.setdefault(module, set()).add(target)
        graph.setdefault(target, set())
    return graph


def test_the_floor_check_reports_a_planted_upward_import():
    graph = _planted([("kiln.data.gates.perplexity", "kiln.train.checkpoint.checkpointer")])
    assert ("kiln.data.gates.perplexity -> kiln.train.checkpoint.checkpointer (floor 4 imports floor 6)"
            in upward_imports(graph))
    # the same import downward is allowed
    graph = _planted([("kiln.train.checkpoint.checkpointer", "kiln.data.gates.perplexity")])
    assert not [b for b in upward_imports(graph) if b.startswith("kiln.train.checkpoint.checkpointer ->")]


def _cycle_between(breaches: list[str], a: str, b: str, parent: str) -> list[str]:
    """The breaches that name the cycle a <-> b under parent with one module edge each way."""
    prefix = f"cycle among {a}, {b} (under {parent}): "
    found = []
    for breach in breaches:
        if breach.startswith(prefix):
            edges = [edge.split(" -> ") for edge in breach[len(prefix):].split("; ")]
            if sorted((top_of(m, a, b), top_of(t, a, b)) for m, t in edges) == [(a, b), (b, a)]:
                found.append(breach)
    return found


def top_of(module: str, *packages: str) -> str | None:
    return next((p for p in packages if inside(module, p)), None)


def test_the_cycle_check_reports_planted_cycles_among_siblings_at_depth_1_and_2():
    real = package_cycles(import_graph(module_level_only=False))
    # depth 2, inside kiln.data: gates <-> dedup (one floor, so only the cycle check sees it)
    assert not _cycle_between(real, "kiln.data.dedup", "kiln.data.gates", "kiln.data")
    depth_2 = package_cycles(_planted([("kiln.data.gates.c4", "kiln.data.dedup.minhash"),
                                       ("kiln.data.dedup.stages", "kiln.data.gates.basic")]))
    assert _cycle_between(depth_2, "kiln.data.dedup", "kiln.data.gates", "kiln.data"), depth_2
    # depth 1: train <-> eval, both on floor 6, through modules deep inside them
    assert not _cycle_between(real, "kiln.eval", "kiln.train", "kiln")
    depth_1 = package_cycles(_planted([("kiln.train.parts.validator", "kiln.eval.loss"),
                                       ("kiln.eval.mc", "kiln.train.trainer")]))
    assert _cycle_between(depth_1, "kiln.eval", "kiln.train", "kiln"), depth_1
    # a submodule importing its own package's face, and the face importing it, is no sibling cycle
    assert package_cycles({"kiln.data": {"kiln.data.gates.c4"}, "kiln.data.gates.c4": {"kiln.data"}}) == []
    # three siblings in a ring: one edge each
    assert package_cycles({"kiln.a.x": {"kiln.b.y"}, "kiln.b.y": {"kiln.c"}, "kiln.c": {"kiln.a"}, "kiln.a": set()}
                          ) == ["cycle among kiln.a, kiln.b, kiln.c (under kiln): kiln.a.x -> kiln.b.y; "
                                "kiln.b.y -> kiln.c; kiln.c -> kiln.a"]


def test_the_floor_list_reports_a_planted_module_on_no_floor_or_two():
    assert off_the_floors([*MODULES, "kiln.newroom", "kiln.newroom.thing"]) == [
        "put kiln.newroom on a floor in tests/test_layout.py FLOORS"]
    twice = [list(floor) for floor in FLOORS]
    twice[3].append("kiln.errors")
    assert off_the_floors(MODULES, twice) == ["kiln.errors is on floors 0, 3: keep it on one in "
                                              "tests/test_layout.py FLOORS"]


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


# --- the run folder's names (issue #38): spelled in kiln/run_layout.py only ---------------------------------------

NAMES = "docs|tokenizer|shards|run|checkpoints|cache"
RUN_FOLDER_NAMES = re.compile(  # path / "docs", "run" / x, f"{url}/shards" ({out_dir}/run in a message is prose)
    rf"""/ ["']({NAMES})["']|["']({NAMES})["'] /|\{{(?!\{{?out_dir\}}|dir\}})[\w.]+\}}/({NAMES})\b""")


def spelled_run_folders(files: dict[Path, str]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{i}" for path, text in sorted(files.items())
            for i, line in enumerate(text.splitlines(), 1) if RUN_FOLDER_NAMES.search(line)]


def test_run_folder_names_are_spelled_only_in_the_run_layout():
    files = {p: p.read_text() for p in sorted((SRC / "kiln").rglob("*.py")) if p.name != "run_layout.py"}
    assert spelled_run_folders(files) == []
    planted = {ROOT / "src/kiln/x.py": 'docs = cfg.out / "docs"\nurl = f"{out}/shards"\n'}
    assert spelled_run_folders(planted) == ["src/kiln/x.py:1", "src/kiln/x.py:2"]


def test_a_run_layout_names_local_folders_and_urls_alike():
    from kiln.run_layout import RunLayout, checkpoints_of

    local = RunLayout(Path("/data/out"))
    assert (local.docs, local.tokenizer, local.shards, local.run, local.checkpoints, local.shard_cache) == (
        Path("/data/out/docs"), Path("/data/out/tokenizer"), Path("/data/out/shards"), Path("/data/out/run"),
        Path("/data/out/run/checkpoints"), Path("/data/out/cache/shards"))
    url = RunLayout("s3://bucket/out/")
    assert (url.tokenizer, url.checkpoints) == ("s3://bucket/out/tokenizer", "s3://bucket/out/run/checkpoints")
    assert RunLayout.of_run(local.run) == local and RunLayout.of_run("s3://bucket/out/run").shards == "s3://bucket/out/shards"
    assert checkpoints_of(local.run) == local.checkpoints
