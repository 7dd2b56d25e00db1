"""How this Kiln runs and how to add to it: the command to write in "next:" lines and the command that installs
an optional extra into the running Python.

Kiln is installed from its source (`make run` makes .venv with `pip install -e .`; `pip install .` or the wheel
`make wheel` builds work anywhere): it is not on a package index, so a hint never says `pip install kiln-lm`.
An extra's packages come from the installed kiln-lm's metadata (pyproject.toml's optional-dependencies), so
the hint is true however Kiln was installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "kiln-lm"
# Top-level module -> the extra that installs it (the modules Kiln imports only when a feature asks for them).
MODULE_EXTRAS = {"matplotlib": "report", "pyarrow": "parquet", "s3fs": "s3", "trafilatura": "trafilatura",
                 "lxml_html_clean": "trafilatura", "ray": "ray", "transformers": "hf", "pynvml": "gpu",
                 "tensorboard": "tensorboard", "wandb": "wandb", "floret": "quality",
                 "torchft": "ft"}


def _shown(path: str) -> str:
    """`path` relative to the working folder when it is inside it (`.venv/bin/kiln`), else as it is."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    if relative.startswith(".."):
        return path
    return relative if "/" in relative else "./" + relative


def kiln_command() -> str:
    """`kiln` when that name on the PATH is this Kiln; else the script that is running (`.venv/bin/kiln`), or
    `PYTHON -m kiln`."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    on_path = shutil.which("kiln")
    if on_path and argv0 and Path(on_path).resolve() == Path(argv0).resolve():
        return "kiln"
    if Path(argv0).name == "kiln" and Path(argv0).is_file():
        return shlex.quote(_shown(argv0))
    return f"{shlex.quote(_shown(sys.executable))} -m kiln"


def extra_requirements(extra: str) -> list[str]:
    """The requirement specifiers of one of kiln-lm's extras, e.g. ["matplotlib>=3.8"]."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(r"""extra\s*==\s*["']""" + re.escape(extra) + r"""["']""")
    return [spec.split(";")[0].strip() for spec in requires if ";" in spec and marker.search(spec.split(";", 1)[1])]


def install_hint(extra: str) -> str:
    """The command that installs kiln-lm's extra `extra` into the running Python."""
    specs = extra_requirements(extra)
    pip = f"{shlex.quote(_shown(sys.executable))} -m pip install"
    if not specs:  # running from a source tree that is not installed
        return f"{pip} -e '.[{extra}]' (in Kiln's source folder)"
    return f"{pip} {' '.join(shlex.quote(s) for s in specs)} (Kiln's extra {extra!r})"


def missing_module_message(exc: ModuleNotFoundError) -> str | None:
    """A one-line error for an optional module Kiln imported and did not find; None for any other module."""
    module = (exc.name or "").split(".")[0]
    extra = MODULE_EXTRAS.get(module)
    if extra is None:
        return None
    return f"this needs {module}, which is not installed: {install_hint(extra)}"
