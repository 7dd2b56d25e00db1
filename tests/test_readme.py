"""README.md's commands, run: what the page tells a user to type is what works.

Each fenced block's info string says what happens to it (README.md, "Development"):
- `sh runnable`: every line runs (bash, `set -e`), in order, in a scratch folder with `examples/`, `.venv` (this
  environment) and a short run in `out/tiny` made by `examples/tiny.yaml` with a smaller model (the same docs,
  tokenizer and shards as `make run`'s);
- `sh runnable slow`: also run, by the slow test, in a fresh copy of the repository after a real `make run`;
- `sh runnable dev`: as `sh runnable`, but it needs the dev extras (pyarrow, datasets), which `make run` does not
  install: the fresh copy leaves it out;
- `console runnable`: each `$ COMMAND` runs and the lines after it must appear in its output, in order;
- `sh dry-run`: `make -n TARGET` (running the test suite from a test would recurse);
- `sh cluster`: needs GPUs, several nodes or a cluster service: every `kiln` subcommand and `KEY=VALUE` key
  in it must exist;
- `yaml`: a config snippet, validated against the config's types; `yaml ablation`: an ablation file's;
  `yaml mix`: a mix file's.
Any other sh or console block fails the test, so a new command cannot slip in unchecked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from conftest import ROOT
from kiln.ablate.spec import AblationSpec
from kiln.cli import build_parser
from kiln.config import Config, build_config, load_config
from kiln.mix.spec import MixSpec

README = ROOT / "README.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
KINDS = {"sh runnable", "sh runnable dev", "sh runnable slow", "console runnable", "sh dry-run", "sh cluster"}
# The stand-in for `make run` in the default suite: the same data, tokenizer and shards, a far smaller model.
STAND_IN = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "train.batch_size=2",
            "train.eval_batches=1", "train.threads=1"]


def blocks() -> list[tuple[str, str]]:
    """(info string, body) of every fenced block, in the page's order."""
    return [(info.strip(), body) for info, body in FENCE.findall(README.read_text(encoding="utf-8"))]


def run_block(body: str, cwd: Path, env: dict[str, str], timeout: float = 1800) -> None:
    done = subprocess.run(["bash", "-c", "set -eo pipefail\n" + body], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"README block failed:\n{body}\n--- stdout\n{done.stdout[-3000:]}\n" \
                                 f"--- stderr\n{done.stderr[-3000:]}"


def run_console(body: str, cwd: Path, env: dict[str, str]) -> None:
    """Each `$ COMMAND` and the lines it must print (in order, anywhere in stdout + stderr)."""
    for chunk in re.split(r"^\$ ", body, flags=re.MULTILINE)[1:]:
        command, *expected = chunk.rstrip("\n").split("\n")
        done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        lines = (done.stdout + done.stderr).splitlines()
        at = 0
        for want in expected:
            assert want in lines[at:], f"$ {command}\nwanted: {want}\ngot:\n" + "\n".join(lines)
            at = lines.index(want, at) + 1


def commands(body: str) -> list[list[str]]:
    """The shell words of each command line of a block (continuations joined, comments dropped)."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(shlex.split(line, comments=True))
    return out


def config_key_exists(dotted: str) -> bool:
    model: type[BaseModel] | None = Config
    for part in dotted.split("."):
        field = model.model_fields.get(part) if model else None
        if field is None:
            return False
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return True


def check_cluster(body: str) -> None:
    """The block's `kiln` subcommands exist, and so do its KEY=VALUE config keys."""
    subcommands = set(next(a for a in build_parser()._actions if a.dest == "command").choices)
    for words in commands(body):
        for i, word in enumerate(words):
            if word == "kiln" and (i == 0 or words[i - 1] == "-m"):
                assert words[i + 1] in subcommands, words
                for override in (w for w in words[i + 2:] if re.match(r"^[a-z_]+(\.[a-z_0-9]+)+=", w)):
                    assert config_key_exists(override.split("=")[0]), override


def sandbox_env(root: Path) -> dict[str, str]:
    home = root / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "PATH": f"{root / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
            "COLUMNS": "120", "PYTHONPATH": ""}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A scratch folder as the quick start leaves it: examples/, .venv (this environment), out/tiny (a short run)."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", root / "examples")
    (root / ".venv").symlink_to(Path(sys.prefix))
    run_block(f"kiln run examples/tiny.yaml {' '.join(STAND_IN)}", root, sandbox_env(root))
    return root


def test_every_command_block_says_how_it_is_checked():
    found = blocks()
    unmarked = [(info, body[:80]) for info, body in found
                if info.split(" ")[0] in ("sh", "bash", "console", "shell", "") and info not in KINDS]
    assert not unmarked, unmarked
    assert sum(info == "sh runnable" for info, _ in found) >= 5 and any(i == "sh runnable slow" for i, _ in found)


def test_the_demo_config_triggers_none_of_its_warnings(sandbox):
    from kiln.shards.reader import ShardSet
    from kiln.train.console import warnings_for

    cfg = load_config(str(sandbox / "examples" / "tiny.yaml"), [])
    assert cfg.out == sandbox / "out" / "tiny"
    assert warnings_for(cfg, len(ShardSet(cfg.out / "shards", "train"))) == []


def test_readme_commands_run_on_the_bundled_sample(sandbox):
    env = sandbox_env(sandbox)
    ran = 0
    for info, body in blocks():
        if info in ("sh runnable", "sh runnable dev"):
            run_block(body, sandbox, env)
            ran += 1
        elif info == "console runnable":
            run_console(body, sandbox, env)
        elif info == "sh cluster":
            check_cluster(body)
        elif info == "sh dry-run":
            for words in commands(body):
                assert words[0] == "make", words
                subprocess.run(["make", "-n", *words[1:], "VENV=/nonexistent/venv"], cwd=ROOT, check=True,
                               capture_output=True)
        elif info == "yaml":
            build_config(yaml.safe_load(body))
        elif info == "yaml ablation":
            AblationSpec(**yaml.safe_load(body))
        elif info == "yaml mix":
            MixSpec(**yaml.safe_load(body))
    assert ran >= 5
    assert (sandbox / "out" / "tiny" / "run" / "report.html").is_file()
    assert (sandbox / "out" / "tiny" / "hf" / "model.safetensors").is_file()


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a clone of this working tree would have them (tracked and new, not ignored)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
def test_readme_from_a_fresh_copy_every_runnable_block(tmp_path):
    """A newcomer's path: `make run` on a fresh copy (core dependencies only), then every runnable block."""
    root = fresh_copy(tmp_path / "kiln")
    fresh = {**sandbox_env(root), "PATH": "/usr/local/bin:/usr/bin:/bin"}  # a newcomer's shell: no .venv yet
    env = {**fresh, "PATH": f"{root / '.venv' / 'bin'}{os.pathsep}{fresh['PATH']}"}  # after `. .venv/bin/activate`
    first, *rest = [(info, body) for info, body in blocks()
                    if info in KINDS - {"sh dry-run", "sh cluster", "sh runnable dev"}]
    assert first == ("sh runnable slow", "make run\n")
    done = subprocess.run(["make", "run"], cwd=root, env=fresh, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning:" not in done.stderr  # the demo config triggers none of its own warnings
    assert "\n  .venv/bin/kiln report " in done.stderr.replace("\r", "")  # a next: line that works from here
    python = str(root / ".venv" / "bin" / "python")
    for module in ("pytest", "matplotlib", "transformers", "ray"):  # dev extras are not installed by make run
        assert subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode != 0, module
    for info, body in rest:
        if info == "console runnable":
            run_console(body, root, env)
        else:
            run_block(body, root, env)
