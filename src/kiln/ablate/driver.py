"""What `kiln ablate` calls: `load` (read, plan and check an ablation file), `ablate` (run it, resumably, under
the out_dir's lock), `report_finished` (`kiln ablate report DIR`: compare what has finished)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from kiln.ablate.spec import PLAN_FILE
from kiln.errors import KilnError


def load(path: str | Path):
    """(plan, eval sets, base config mapping) of an ablation file: every key, arm, override and eval set
    checked, and the out_dir's ownership (outdir.py), before any work."""
    from kiln.ablate.evalsets import load_eval_sets
    from kiln.ablate.outdir import check_out_dir
    from kiln.ablate.plan import make_plan
    from kiln.ablate.spec import read_spec

    spec, base = read_spec(path)
    plan = make_plan(spec, base, Path(path).resolve())
    check_out_dir(plan.out, plan.file)
    sets = load_eval_sets(spec.eval.text, spec.eval.tasks)
    return plan, sets, base


def ablate(path: str | Path, log: Callable[[str], None], until: str = "train",
           only: list[str] | None = None) -> dict[str, Any] | None:
    """Run (or resume) an ablation; returns ablation.json's content when every arm has run. The out_dir is
    checked and locked before plan.json, its first write; the lock is held through the run, except by `--only`
    jobs (one per arm, side by side), which need it only to write plan.json, and not at all when it is written."""
    from kiln.ablate.outdir import check_out_dir, is_written, plan_json
    from kiln.ablate.runner import run_ablation
    from kiln.lock import OutputLock
    from kiln.manifest import write_atomic

    plan, sets, base = load(path)
    unknown = [name for name in only or [] if name not in {a.name for a in plan.arms}]
    if unknown:
        raise KilnError(f"--only {unknown[0]!r} is not an arm of {path}; the arms are "
                        f"{', '.join(a.name for a in plan.arms)}")
    content = plan_json(plan, base)
    if only and is_written(plan.out, content):
        return run_ablation(plan, sets, log, until=until, only=only)
    with OutputLock(plan.out, "`kiln ablate`") as lock:
        check_out_dir(plan.out, plan.file)  # again, holding the lock: what another writer did meanwhile
        if not is_written(plan.out, content):
            plan.out.mkdir(parents=True, exist_ok=True)
            write_atomic(plan.out / PLAN_FILE, content)
        if only:
            lock.release()
        return run_ablation(plan, sets, log, until=until, only=only)


def report_finished(out_dir: str | Path, log: Callable[[str], None]) -> dict[str, Any]:
    """`kiln ablate report DIR`: compare whatever runs of the ablation in DIR have finished."""
    from kiln.ablate.evalsets import OVERLAP, find_overlap, kept_units, load_eval_sets
    from kiln.ablate.outdir import check_outputs, read_plan
    from kiln.ablate.plan import make_plan
    from kiln.ablate.results import write_results

    out = Path(out_dir)
    saved, spec = read_plan(out)
    plan = make_plan(spec, saved["base"], Path(saved["file"]))
    check_outputs(out, plan.file)
    sets = load_eval_sets(plan.spec.eval.text, plan.spec.eval.tasks)
    missing = [a.name for a in plan.data_arms() if not (a.data / OVERLAP).is_file()]
    if missing:
        raise KilnError(f"arm {missing[0]!r} has not been prepared yet (no {OVERLAP}); run `kiln ablate "
                        f"{saved['file']} --until tokenizer` first")
    dedup = plan.baseline.cfg.data.dedup
    keep = kept_units(sets, {a.name: find_overlap(a.layout.docs, sets, dedup, a.data / OVERLAP, log)
                             for a in plan.data_arms()})
    return write_results(plan, sets, keep, {})
