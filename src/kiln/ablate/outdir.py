"""The ablation's out_dir: Kiln writes only into a folder it owns, checked and locked before the first write.

An out_dir is the ablation's when it is absent or empty (`manifest.check_replaceable`'s rule: not a file, not
the current folder), or holds the plan.json kiln ablate wrote (its `written_by` mark) for the same ablation
file: one out_dir, one ablation file. Its ablation.json and ablation.html, where they exist, must be the ones
kiln ablate wrote for that file (ablation.json's `ablation`, the page's first-line marker). `kiln ablate`
holds the out_dir's lock (`kiln.lock`) from this check through the run (`--only` jobs, which run side by side,
only while they write plan.json); the stages inside hold their own folders' locks as always.
"""

from __future__ import annotations

import json
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


def _not_ours(path: Path, why: str) -> KilnError:
    return KilnError(f"{path}: {why}, so it is not a plan kiln ablate wrote; move it away (`kiln ablate FILE` then "
                     "writes it again), or give another out_dir")


def read_plan(out: Path) -> tuple[dict[str, Any], AblationSpec]:
    """plan.json of the ablation in `out` and its spec, checked: one line on anything else."""
    path = out / PLAN_FILE
    if not path.is_file():
        raise KilnError(f"{out}: no {PLAN_FILE}; give the out_dir of an ablation (`kiln ablate FILE` writes it)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _not_ours(path, f"not JSON ({exc})") from None
    if not isinstance(saved, dict) or saved.get("written_by") != WRITTEN_BY:
        raise _not_ours(path, f"no \"written_by\": \"{WRITTEN_BY}\"")
    if not isinstance(saved.get("file"), str) or not isinstance(saved.get("spec"), dict) or \
            not isinstance(saved.get("base"), dict):
        raise _not_ours(path, "\"file\" (a path), \"spec\" or \"base\" (mappings) is missing or damaged")
    try:
        spec = AblationSpec(**saved["spec"])
    except ValidationError as err:
        raise _not_ours(path, f"its spec does not validate ({explain_error(err, AblationSpec, 'key')})") from None
    return saved, spec


def check_out_dir(out: Path, file: Path) -> None:
    """Refuse, in one line, an out_dir this ablation file may not write (see the module's rule)."""
    if not out.is_dir() or not any(out.iterdir()):
        check_replaceable(out, None)  # absent or empty: not a file, not the current folder
        return
    if not (out / PLAN_FILE).exists():
        raise KilnError(f"out_dir {out} exists and is not an ablation's (no {PLAN_FILE}); kiln ablate writes into a "
                        "new or empty folder, or into its own: choose another out_dir")
    saved, _ = read_plan(out)
    if Path(saved["file"]) != file:
        raise KilnError(f"out_dir {out} holds the ablation of {saved['file']} (its {PLAN_FILE}), not of {file}: an "
                        f"out_dir holds one ablation; run that file, or give {file.name} an out_dir of its own")
    check_outputs(out, file)


def check_outputs(out: Path, file: Path) -> None:
    """ablation.json and ablation.html, where they exist, are kiln ablate's for `file`: else one line."""
    page = out / PAGE
    check_replaceable_page(page, PAGE_MARKER, "kiln ablate")
    results = out / RESULTS
    if results.exists():
        try:
            ours = json.loads(results.read_text(encoding="utf-8")).get("ablation") == str(file)
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise KilnError(f"{results} exists and is not the results kiln ablate wrote for {file}; move it away")


def is_written(out: Path, content: str) -> bool:
    """plan.json is already `content` (plan_json's): nothing to write."""
    path = out / PLAN_FILE
    return path.is_file() and path.read_text(encoding="utf-8", errors="replace") == content


def plan_json(plan, base: dict[str, Any]) -> str:
    return json.dumps({"written_by": WRITTEN_BY, "file": str(plan.file), "spec": plan.spec.model_dump(mode="json"),
                       "base": base}, indent=1)
