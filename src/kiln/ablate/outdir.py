"""The ablation's out_dir: Kiln writes only into a folder it owns, checked and locked before the first write.

An out_dir is the ablation's when it is absent or empty (`manifest.check_replaceable`'s rule: not a file, not
the current folder), or holds the plan.json kiln ablate wrote (its `written_by` mark) for the same ablation
file: one out_dir, one ablation file. Its ablation.json and ablation.html, where they exist, must be the ones
kiln ablate wrote for that file (ablation.json's `ablation`, the page's first-line marker). `kiln ablate`
holds the out_dir's lock (`kiln.lock`) from this check through the run (`--only` jobs, which run side by side,
only while they write plan.json); the stages inside hold their own folders' locks as always.

The same rule serves `kiln mix` (kiln.mix: mix.json, mix.html): an `Owner` names the command, its files and
its spec; every function takes one (default: kiln ablate's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.ablate.spec import PAGE, PLAN_FILE, RESULTS, AblationSpec
from kiln.config import explain_error
from kiln.errors import KilnError
from kiln.manifest import check_replaceable
from kiln.pages import check_replaceable_page

PAGE_MARKER = "<!-- written by kiln ablate -->\n"  # ablation.html's first line: what lets a later run replace it
WRITTEN_BY = "kiln ablate"  # plan.json's `written_by`: what makes out_dir an ablation's


@dataclass(frozen=True)
class Owner:
    """A command that owns an out_dir by its plan.json: its name (plan.json's `written_by`), what its out_dir
    is called in messages, its results file (and the key naming the file it ran), its page and marker, its spec."""
    command: str
    noun: str
    results: str
    results_key: str
    page: str
    page_marker: str
    spec: type


ABLATE = Owner(WRITTEN_BY, "an ablation", RESULTS, "ablation", PAGE, PAGE_MARKER, AblationSpec)


def _not_ours(path: Path, why: str, owner: Owner = ABLATE) -> KilnError:
    return KilnError(f"{path}: {why}, so it is not a plan {owner.command} wrote; move it away (`{owner.command} FILE` "
                     "then writes it again), or give another out_dir")


def read_plan(out: Path, owner: Owner = ABLATE) -> tuple[dict[str, Any], Any]:
    """plan.json of the ablation (or mix) in `out` and its spec, checked: one line on anything else."""
    path = out / PLAN_FILE
    if not path.is_file():
        raise KilnError(f"{out}: no {PLAN_FILE}; give the out_dir of {owner.noun} (`{owner.command} FILE` writes it)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _not_ours(path, f"not JSON ({exc})", owner) from None
    if not isinstance(saved, dict) or saved.get("written_by") != owner.command:
        raise _not_ours(path, f"no \"written_by\": \"{owner.command}\"", owner)
    if not isinstance(saved.get("file"), str) or not isinstance(saved.get("spec"), dict) or \
            not isinstance(saved.get("base"), dict):
        raise _not_ours(path, "\"file\" (a path), \"spec\" or \"base\" (mappings) is missing or damaged", owner)
    try:
        spec = owner.spec(**saved["spec"])
    except ValidationError as err:
        raise _not_ours(path, f"its spec does not validate ({explain_error(err, owner.spec, 'key')})", owner) \
            from None
    return saved, spec


def check_out_dir(out: Path, file: Path, owner: Owner = ABLATE) -> None:
    """Refuse, in one line, an out_dir this ablation (or mix) file may not write (see the module's rule)."""
    if not out.is_dir() or not any(out.iterdir()):
        check_replaceable(out, None)  # absent or empty: not a file, not the current folder
        return
    what = owner.noun.split(" ", 1)[1]
    if not (out / PLAN_FILE).exists():
        raise KilnError(f"out_dir {out} exists and is not {owner.noun}'s (no {PLAN_FILE}); {owner.command} writes "
                        "into a new or empty folder, or into its own: choose another out_dir")
    saved, _ = read_plan(out, owner)
    if Path(saved["file"]) != file:
        raise KilnError(f"out_dir {out} holds the {what} of {saved['file']} (its {PLAN_FILE}), not of {file}: an "
                        f"out_dir holds one {what}; run that file, or give {file.name} an out_dir of its own")
    check_outputs(out, file, owner)


def check_outputs(out: Path, file: Path, owner: Owner = ABLATE) -> None:
    """The results file and the page, where they exist, are the owner's for `file`: else one line."""
    page = out / owner.page
    check_replaceable_page(page, owner.page_marker, owner.command)
    results = out / owner.results
    if results.exists():
        try:
            ours = json.loads(results.read_text(encoding="utf-8")).get(owner.results_key) == str(file)
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise KilnError(f"{results} exists and is not the results {owner.command} wrote for {file}; move it away")


def is_written(out: Path, content: str) -> bool:
    """plan.json is already `content` (plan_json's): nothing to write."""
    path = out / PLAN_FILE
    return path.is_file() and path.read_text(encoding="utf-8", errors="replace") == content


def plan_json(plan, base: dict[str, Any], owner: Owner = ABLATE) -> str:
    """plan.json's content: `plan` has the file it was read from (.file) and its spec (.spec)."""
    return json.dumps({"written_by": owner.command, "file": str(plan.file),
                       "spec": plan.spec.model_dump(mode="json"), "base": base}, indent=1)
