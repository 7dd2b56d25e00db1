"""Installing Kiln: `make run` sets up the core only and `make test` the dev extras; a wheel installs into a fresh
venv with the core dependencies and gives a working `kiln`; the hints for an extra and the "next:" lines name
commands that work where Kiln actually is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import venv

import pytest

from conftest import ROOT
from kiln.cli import main as kiln
from kiln.install import extra_requirements, install_hint, kiln_command

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def make_dry_run(target: str) -> str:
    """The commands `make TARGET` would run on a fresh clone (no venv yet): `make -n` with VENV not made."""
    done = subprocess.run(["make", "-n", target, "VENV=/nonexistent/venv"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return done.stdout


def test_the_license_is_an_spdx_string_so_setuptools_builds_without_a_deprecation():
    """Issue 37 item 17: `license = {text = ...}` made setuptools print BuildBackendWarning three times per install
    (and such builds stop working after 2027-02-18); the SPDX string needs setuptools 77 or newer (PEP 639)."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    [setuptools] = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77"


def test_make_run_installs_the_core_and_make_test_the_dev_extras():
    run = make_dry_run("run")
    assert re.search(r"pip install -q -c constraints.txt -e \.$", run, re.MULTILINE), run
    assert "[dev]" not in run and "pytest" not in run
    assert "torch==2.13.0" in run  # pinned, before Kiln: an unpinned torch would pull a CUDA build
    test = make_dry_run("test")
    assert '-e ".[dev]"' in test and "-m pytest" in test and test.index("-e .\n") < test.index('-e ".[dev]"')


def test_every_extra_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"extra `([a-z0-9_-]+)`", readme)) | set(re.findall(r"\.\[([a-z0-9_-]+)\]", readme))
    assert named and named <= set(EXTRAS), named - set(EXTRAS)
    assert "pip install kiln-lm" not in readme and "'kiln-lm[" not in readme  # not on any package index


def test_an_extras_hint_names_its_packages_for_this_python():
    assert extra_requirements("report") == EXTRAS["report"] == ["matplotlib>=3.8"]
    hint = install_hint("trafilatura")
    python = os.path.relpath(sys.executable)
    assert hint.startswith(f"{sys.executable if python.startswith('..') else python} -m pip install ")
    assert "'trafilatura>=2.0' 'lxml_html_clean>=0.4'" in hint and "kiln-lm" not in hint


def test_a_missing_extra_is_one_line_naming_its_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"event": "step", "step": 1, "loss": 5.0, "lr": 1e-3}) + "\n")
    assert kiln(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: this needs matplotlib, which is not installed: ")
    assert "'matplotlib>=3.8' (Kiln's extra 'report')" in err and "Traceback" not in err


def test_next_lines_name_kiln_as_it_can_be_run_from_here(monkeypatch, tmp_path):
    script = tmp_path / "venv" / "bin" / "kiln"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "run", "c.yaml"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert kiln_command() == "venv/bin/kiln"  # not on the PATH: the path it was run by
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin")
    assert kiln_command() == "kiln"
    monkeypatch.setattr(sys, "argv", ["/x/kiln/__main__.py"])  # python -m kiln
    assert kiln_command().endswith(" -m kiln")


@pytest.mark.slow
def test_a_wheel_installs_a_working_kiln_with_the_core_dependencies_only(tmp_path):
    """`pip wheel` then, in a fresh venv, torch (pinned, as README says) and the wheel: `kiln` is a command of that
    venv, nothing of the extras came with it, and it runs the flow on the bundled sample."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True)
    [wheel] = (tmp_path / "dist").glob("kiln_lm-*.whl")
    venv.create(tmp_path / "venv", with_pip=True)
    pip = [str(tmp_path / "venv" / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "-c", str(ROOT / "constraints.txt"), str(wheel)], check=True)
    freeze = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                            capture_output=True, text=True, check=True).stdout
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(freeze)}
    extras_only = {re.split(r"[<>=\[;! ]", spec)[0].lower().replace("_", "-")
                   for name, specs in EXTRAS.items() for spec in specs if not spec.startswith("kiln-lm")}
    assert "kiln-lm" in installed and not installed & extras_only, installed & extras_only

    kiln_bin = tmp_path / "venv" / "bin" / "kiln"
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({
        "out_dir": str(tmp_path / "out"), "data": {"inputs": [str(ROOT / "examples/data/sample.warc.gz")]},
        "tokenizer": {"vocab_size": 512}, "pack": {"seq_len": 64},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
        "train": {"max_steps": 10, "batch_size": 8, "warmup_steps": 2, "eval_every": 0}}))
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # the venv is not activated
    done = subprocess.run([str(kiln_bin), "run", str(config)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "run" / "checkpoints" / "step-00000010").is_dir()
    assert "\n  venv/bin/kiln report " in done.stderr  # the "next:" lines name the command that works here
    done = subprocess.run([str(kiln_bin), "report", str(tmp_path / "out" / "run")], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "(Kiln's extra 'report')" in done.stderr  # an extra, named, not a traceback
