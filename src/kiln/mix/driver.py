"""What `kiln mix` calls: `load` (read, plan and check a mix file), `mix` (run it, resumably, under the out_dir's
lock), `report_finished` (`kiln mix report DIR`: fit and compare what has finished).

The order, each step kiln.ablate's own machinery (kiln.ablate.runner) and skipped when done:
1. every source's data stage (out_dir/sources/NAME/docs), one tokenizer for all, the eval overlap check against
   every source, every source's shards (`runner.prepare` on the sources as arms);
2. the budget: each source's training samples, the run's, the caps of `max_epochs` (kiln.mix.swarm);
3. the swarm: `swarm` mixtures drawn (seeded), each an ordinary run folder out_dir/swarm/run-NNN (config.yaml
   with loader.sources weights), trained and measured (`runner.measure_run`: resumes after a kill);
4. the fit and the proposal (kiln.mix.fit, kiln.mix.propose), when the fit is trusted;
5. the proof: an ablation of arms natural (the baseline), proposed and best-swarm (the swarm run with the best
   measured target), each trained on every seed of `seeds` (out_dir/verify/ARM/seed-N) and compared by
   kiln.ablate.results.compare_arms (paired bootstrap, Holm); the proposal is an improvement only when its
   verdict on the target is `better`;
6. mix.json and mix.html.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from kiln.ablate.outdir import Owner
from kiln.ablate.plan import ArmPlan, Plan, RunPlan
from kiln.ablate.spec import PLAN_FILE
from kiln.config import build_config, merge
from kiln.errors import KilnError
from kiln.mix.spec import ARMS, PAGE, PAGE_MARKER, RESULTS, SWARM, VERIFY, MixSpec, min_swarm

OWNER = Owner("kiln mix", "a mix", RESULTS, "mix", PAGE, PAGE_MARKER, MixSpec)
Log = Callable[[str], None]


@dataclass
class MixPlan:
    file: Path
    spec: MixSpec
    base: dict[str, Any]
    sources: Plan  # kiln.ablate's plan of the sources: one arm each, no runs

    @property
    def out(self) -> Path:
        return Path(self.spec.out_dir)

    def run(self, name: str, folder: Path, weights: dict[str, float], seed: int) -> RunPlan:
        """A run of these weights: the first source's settings (every source shares the model, schedule, budget
        and tokenizer), this seed and folder, loader.sources = each source's shards with its weight (> 0)."""
        sources = [{"path": str(self.sources.arm(s).layout.shards), "weight": w} for s, w in weights.items() if w > 0]
        cfg = build_config(merge(self.sources.baseline.cfg.model_dump(mode="json"),
                                 {"seed": seed, "out_dir": str(folder), "loader": {"sources": sources}}))
        return RunPlan(name, seed, folder, cfg, name)


def load(path: str | Path) -> tuple[MixPlan, list]:
    """(plan, eval sets) of a mix file: every key, source, override and eval set checked, and the out_dir's
    ownership (kiln.ablate.outdir with kiln mix's files), before any work."""
    from kiln.ablate.evalsets import load_eval_sets
    from kiln.ablate.outdir import check_out_dir
    from kiln.mix.spec import read_spec

    from kiln.data.pipeline import expand_inputs

    spec, base = read_spec(path)
    plan = make_plan(spec, base, Path(path).resolve())
    for arm in plan.sources.data_arms():  # an input that matches nothing is said now, not after the other sources
        with source_context(arm.name):
            expand_inputs(arm.cfg.data.inputs, arm.cfg.data.storage_options)
    check_out_dir(plan.out, plan.file, OWNER)
    return plan, load_eval_sets(spec.eval.text, spec.eval.tasks)


def make_plan(spec: MixSpec, base: dict[str, Any], file: Path) -> MixPlan:
    from kiln.ablate.plan import make_plan as ablation_plan
    from kiln.mix.spec import as_ablation

    sources = ablation_plan(as_ablation(spec), base, file)
    for arm in sources.arms:
        arm.runs.clear()  # a source trains nothing of its own: the swarm and the verification mix them
    return MixPlan(file, spec, base, sources)


def mix(path: str | Path, log: Log, only: list[str] | None = None) -> dict[str, Any] | None:
    """Run (or resume) a mix; returns mix.json's content when it has run to the end. The out_dir is checked and
    locked before plan.json, its first write; `--only` jobs hold the lock only to write plan.json."""
    from kiln.ablate.outdir import check_out_dir, is_written, plan_json
    from kiln.lock import OutputLock
    from kiln.manifest import write_atomic

    plan, sets = load(path)
    known = [f"run-{i:03d}" for i in range(plan.spec.runs_in_swarm)] + list(ARMS)
    unknown = [name for name in only or [] if name not in known]
    if unknown:
        last = plan.spec.runs_in_swarm - 1
        raise KilnError(f"--only {unknown[0]!r} is neither a swarm run (run-000 .. run-{last:03d}) nor a "
                        f"verification arm ({', '.join(ARMS)}) of {path}")
    content = plan_json(plan, plan.base, OWNER)
    if only and is_written(plan.out, content):
        return run_mix(plan, sets, log, only)
    with OutputLock(plan.out, "`kiln mix`") as lock:
        check_out_dir(plan.out, plan.file, OWNER)
        if not is_written(plan.out, content):
            plan.out.mkdir(parents=True, exist_ok=True)
            write_atomic(plan.out / PLAN_FILE, content)
        if only:
            lock.release()
        return run_mix(plan, sets, log, only)


@contextmanager
def source_context(name: str) -> Iterator[None]:
    try:
        yield
    except KilnError as exc:
        raise type(exc)(f"source {name!r}: {exc}") from None


def check_kept(plan: MixPlan) -> None:
    """Every source kept enough documents to be trained on: else one line naming it (before the tokenizer)."""
    from kiln.data.rejections import FEW_DOCUMENTS, docs_stats

    for arm in plan.sources.data_arms():
        docs = docs_stats(arm.layout.docs)["documents"]
        if docs["kept"] < FEW_DOCUMENTS:
            reasons = docs_stats(arm.layout.docs).get("rejected_by_reason") or {}
            top = ", ".join(f"{r} {n:,}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
            raise KilnError(f"{plan.file}: source {arm.name!r} kept {docs['kept']:,} of {docs['read']:,} documents "
                            f"(at least {FEW_DOCUMENTS} are needed){f'; rejected: {top}' if top else ''}; check its "
                            f"inputs and set: (details in {arm.layout.docs / 'stats.json'})")


def prepare_sources(plan: MixPlan, sets: list, log: Log, timer) -> dict[str, list[int]]:
    """Step 1: the sources' data, the shared tokenizer, the overlap check, the shards; the eval units kept."""
    from kiln.ablate.runner import prepare
    from kiln.stages import run_data_stage

    with timer("data"):
        for arm in plan.sources.data_arms():
            with source_context(arm.name):
                run_data_stage(arm.cfg, log)
    check_kept(plan)
    return prepare(plan.sources, sets, log, timer, "train", None)


def budget_of(plan: MixPlan):
    """Step 2: each source's training samples (its shards' manifest) and the run's, under max_epochs."""
    from kiln.manifest import read_manifest
    from kiln.mix.swarm import Budget, check_feasible

    samples = [read_manifest(plan.sources.arm(name).layout.shards)["splits"]["train"]["samples"]
               for name in plan.spec.sources]
    t = plan.sources.baseline.cfg.train
    budget = Budget(list(plan.spec.sources), np.asarray(samples, dtype=np.float64), t.max_steps * t.batch_size,
                    plan.spec.max_epochs)
    check_feasible(budget, plan.file)
    return budget


def swarm_runs(plan: MixPlan, budget) -> list[RunPlan]:
    from kiln.mix.swarm import draw

    spec = plan.spec
    draws = draw(budget, spec.concentration, spec.swarm_seed, spec.runs_in_swarm)
    return [plan.run(f"run-{i:03d}", plan.out / SWARM / f"run-{i:03d}", budget.as_dict(w), spec.swarm_seed)
            for i, w in enumerate(draws)]


def train_runs(runs: list[RunPlan], sets: list, keep: dict[str, list[int]], log: Log) -> bool:
    """Train and measure each run (resuming); False when SIGTERM stopped one (it checkpointed)."""
    from kiln.ablate.runner import StoppedBySignal, arm_context, measure_run, ready_run

    try:
        for run in runs:
            with arm_context(run.arm):
                ready_run(run, log)
                measure_run(run, sets, keep, log)
    except StoppedBySignal as stop:
        log(f"stopped by SIGTERM: {stop}; run the same command again to resume the mix")
        return False
    return True


def run_mix(plan: MixPlan, sets: list, log: Log, only: list[str] | None = None) -> dict[str, Any] | None:
    from kiln.ablate.runner import Timer

    timer = Timer()
    keep = prepare_sources(plan, sets, log, timer)
    budget = budget_of(plan)
    runs = swarm_runs(plan, budget)
    wanted = [r for r in runs if only is None or r.arm in only]
    with timer("swarm"):
        if not train_runs(wanted, sets, keep, log):
            return None
    arms = [a for a in ARMS if only is None or a in only]
    if not arms:
        log(f"done: {', '.join(only or [])}; `kiln mix report {plan.out}` fits and compares the runs finished so far")
        return None
    return finish(plan, sets, keep, budget, runs, log, timer, train=arms, only=only is not None)


def measured_runs(runs: list[RunPlan], sets: list, keep: dict[str, list[int]]) -> dict[Path, dict | None]:
    from kiln.ablate.results import read_measurement

    return {r.folder: read_measurement(r.folder, sets, keep) for r in runs}


def target_value(metrics: dict[str, float], target: dict[str, float]) -> float:
    total = sum(target.values())
    return sum(w / total * metrics[target_metric(name)] for name, w in target.items())


def target_metric(name: str) -> str:
    """The metric a target entry names: a text set's bits per byte, or the TASK/METRIC itself."""
    return name if "/" in name else f"{name}/bits_per_byte"


def swarm_table(plan: MixPlan, budget, runs: list[RunPlan], measured: dict, sets: list,
                keep: dict[str, list[int]]) -> list[dict[str, Any]]:
    from kiln.ablate.results import run_metrics

    rows = []
    for run in runs:
        weights = {s.path: s.weight for s in run.cfg.loader.sources}
        w = [weights.get(str(plan.sources.arm(n).layout.shards), 0.0) for n in budget.names]
        m = measured[run.folder]
        metrics = run_metrics(m, sets, keep) if m else None
        rows.append({"name": run.arm, "folder": str(run.folder), "weights": budget.as_dict(np.asarray(w)),
                     "epochs": budget.as_dict(budget.epochs(np.asarray(w))), "finished": m is not None,
                     "metrics": metrics,
                     "target": target_value(metrics, plan.spec.target) if metrics else None,
                     **({k: m[k] for k in ("checkpoint", "fingerprint", "weights_sha256")} if m else {})})
    return rows


def fit_swarm(plan: MixPlan, budget, rows: list[dict], sets: list) -> tuple[dict, dict | None, list[str]]:
    """(mix.json's `fit`, its `proposal` or None, warnings) from the finished swarm runs."""
    from kiln.ablate.results import PER_ARM, metric_names
    from kiln.mix.fit import fit_all
    from kiln.mix.propose import proposal

    done = [r for r in rows if r["finished"]]
    spec = plan.spec
    names = [m for m, _ in metric_names(sets) if m not in PER_ARM]
    weights = np.asarray([[r["weights"][n] for n in budget.names] for r in done], dtype=np.float64).reshape(
        len(done), len(budget.names))
    metrics = {m: np.asarray([r["metrics"][m] for r in done]) for m in names}
    target = {target_metric(n): w for n, w in spec.target.items()}
    result = fit_all(weights, metrics, target, min_swarm(len(budget.names)))
    fit = {"runs": len(done), "target": target, "trusted": result["trusted"],
           **({k: result["target"][k] for k in ("spearman", "rmse", "mean_rmse")} if result["target"] else
              {"spearman": None, "rmse": None, "mean_rmse": None}),
           "metrics": {m: f["cv"] for m, f in result["metrics"].items() if f},
           "held_out": [{"run": r["name"], "actual": r["target"], "predicted": float(p)}
                        for r, p in zip(done, result.get("held_out", []))],
           "coefficients": {m: {"model": f["model"].name, "log": f["model"].log,
                                "coef": [round(float(c), 8) for c in f["model"].coef]}
                            for m, f in result["metrics"].items() if f}}
    if not result["trusted"]:
        return fit, None, [f"no proposal: {result['why']}"]
    higher = any(h for m, h in metric_names(sets) if m in target)
    return fit, proposal(result["metrics"], metrics, target, higher, budget, weights, result["target"]["rmse"],
                         spec.swarm_seed), []


def best_swarm(rows: list[dict], higher: bool) -> dict | None:
    done = [r for r in rows if r["finished"]]
    if not done:
        return None
    pick = (max if higher else min)(done, key=lambda r: r["target"])
    return {"run": pick["name"], "weights": pick["weights"], "target": pick["target"]}


def verification_plan(plan: MixPlan, arms: dict[str, dict[str, float]]) -> Plan:
    """The proof as kiln.ablate plans it: arms natural (the baseline), proposed, best-swarm, each one run per
    seed of `seeds` under out_dir/verify/ARM/seed-N with its loader.sources weights."""
    from kiln.ablate.spec import AblationSpec, ArmSpec

    spec = plan.spec
    out = plan.out / VERIFY
    aspec = AblationSpec(base=spec.base, out_dir=str(out), seeds=spec.seeds, baseline=ARMS[0],
                         arms=[ArmSpec(name=name) for name in arms], eval=spec.eval, proxy=spec.proxy,
                         proxy_tokens=spec.proxy_tokens, statistics=spec.statistics)
    planned = []
    for name, weights in arms.items():
        runs = [plan.run(name, out / name / f"seed-{seed}", weights, seed) for seed in spec.seeds]
        planned.append(ArmPlan(name, {"loader.sources": weights}, runs[0].cfg, name, name, list(spec.seeds), runs))
    src = plan.sources
    return Plan(plan.file, aspec, out, planned, src.tokenizer, src.shared_tokenizer, src.proxy)


def target_comparisons(vplan: Plan, sets: list, keep: dict[str, list[int]], measured: dict,
                       target: dict[str, float]) -> list[dict]:
    """For a target of several text sets, each arm against the baseline on the target itself: every kept
    document of the target's sets one unit, valued so that a run's mean over units is its target."""
    from kiln.ablate import stats
    from kiln.ablate.results import comparison_rng, unit_values, unit_weights

    if len(target) < 2:
        return []
    total = sum(target.values())
    units = sum(len(keep[m.split("/")[0]]) for m in target)

    def values(m: dict) -> np.ndarray:
        return np.concatenate([unit_values(m, name) * (w / total) * units / unit_weights(sets, keep, name).sum()
                               for name, w in target.items()])

    settings = stats.Settings(**vplan.spec.statistics.model_dump())
    base, rows = vplan.baseline, []
    for arm in [a for a in vplan.arms if a.name != base.name]:
        pairs = [(measured[r.folder], measured[b.folder]) for r, b in zip(arm.runs, base.runs)
                 if measured[r.folder] is not None and measured[b.folder] is not None]
        row = {"arm": arm.name, "baseline": base.name, "metric": "target", "pairs": len(pairs)}
        if not pairs:
            rows.append({**row, "diff": None, "ci_low": None, "ci_high": None, "p": None, "min_detectable": None,
                         "higher_is_better": False})
            continue
        a, b = np.stack([values(x) for x, _ in pairs]), np.stack([values(y) for _, y in pairs])
        rows.append({**row, **stats.compare(a, b, None, False, settings,
                                            comparison_rng(settings.seed, arm.name, "target"))})
    return rows


def compare(vplan: Plan, sets: list, keep: dict[str, list[int]], measured: dict,
            target: dict[str, float]) -> list[dict]:
    """ablation.json's comparisons of the verification, the target's own (several sets) judged with them."""
    from kiln.ablate import stats
    from kiln.ablate.results import compare_arms

    rows = compare_arms(vplan, sets, keep, measured)
    extra = target_comparisons(vplan, sets, keep, measured, target)
    if not extra:
        return rows
    judged = stats.judge([{k: v for k, v in r.items() if k not in ("p_holm", "verdict")} for r in rows + extra],
                         vplan.spec.statistics.confidence)
    for row in judged:
        row["verdict"] = row["verdict"] if row["diff"] is not None else "not run"
    return judged


def finish(plan: MixPlan, sets: list, keep: dict[str, list[int]], budget, runs: list[RunPlan], log: Log, timer,
           train: list[str] | None, only: bool = False) -> dict[str, Any] | None:
    """Steps 4-6: the fit and proposal on the finished swarm; the verification's runs (those of `train`,
    trained here) and comparisons; mix.json and mix.html. Verification arms are trained only once every swarm
    run has finished (the proposal depends on all of them)."""
    from kiln.ablate.results import metric_names

    measured = measured_runs(runs, sets, keep)
    rows = swarm_table(plan, budget, runs, measured, sets, keep)
    with timer("fit"):
        fit, proposal, warnings = fit_swarm(plan, budget, rows, sets)
    target = {target_metric(n): w for n, w in plan.spec.target.items()}
    higher = any(h for m, h in metric_names(sets) if m in target)
    best = best_swarm(rows, higher)
    arms = {ARMS[0]: budget.as_dict(budget.natural)}
    if proposal:
        arms[ARMS[1]] = proposal["weights"]
    if best:
        arms[ARMS[2]] = best["weights"]
    vplan = verification_plan(plan, arms) if len(arms) > 1 else None
    if train and vplan is not None:
        missing = [r["name"] for r in rows if not r["finished"]]
        if missing:
            raise KilnError(f"the swarm has {len(rows) - len(missing)} of {len(rows)} runs finished (not "
                            f"{missing[0]}): the proposal needs them all; train them first (`kiln mix {plan.file}`, "
                            f"or --only {missing[0]}), then the verification")
        with timer("verify"):
            if not train_runs([r for a in vplan.arms if a.name in train for r in a.runs], sets, keep, log):
                return None
        if only:
            log(f"done: {', '.join(train)}; `kiln mix report {plan.out}` fits and compares the runs finished so far")
            return None
    comparisons = []
    if vplan is not None:
        comparisons = compare(vplan, sets, keep, measured_runs(vplan.runs(), sets, keep), target)
    with timer("report"):
        return write_results(plan, budget, rows, fit, proposal, best, vplan, comparisons, warnings, sets, keep,
                             timer.seconds)


def improvement(comparisons: list[dict], target: dict[str, float]) -> dict[str, Any] | None:
    """The proposal's verdict on the target (its own comparison for several sets, else the one metric's)."""
    metric = "target" if len(target) > 1 else next(iter(target))
    row = next((c for c in comparisons if c["arm"] == ARMS[1] and c["metric"] == metric), None)
    return None if row is None else {"metric": metric, "verdict": row["verdict"], "diff": row["diff"],
                                     "ci_low": row["ci_low"], "ci_high": row["ci_high"], "p_holm": row["p_holm"],
                                     "better": row["verdict"] == "better"}


def loader_block(plan: MixPlan, weights: dict[str, float]) -> str:
    """The loader.sources block to paste into the full-size config (each source's shards, its weight)."""
    lines = ["loader:", "  sources:"]
    for name, w in weights.items():
        if w > 0:
            lines.append(f"    - {{path: {plan.sources.arm(name).layout.shards}, weight: {w:g}}}  # {name}")
    return "\n".join(lines) + "\n"


def write_results(plan: MixPlan, budget, rows, fit, proposal, best, vplan, comparisons, warnings, sets, keep,
                  timings) -> dict[str, Any]:
    from kiln.ablate.outdir import check_outputs
    from kiln.ablate.results import eval_summary
    from kiln.lock import OutputLock
    from kiln.manifest import write_atomic
    from kiln.mix.report import write_page

    spec = plan.spec
    target = {target_metric(n): w for n, w in spec.target.items()}
    verification = None
    if vplan is not None:
        verification = {"baseline": ARMS[0], "seeds": spec.seeds,
                        "arms": {a.name: {"weights": a.overrides["loader.sources"], "runs": [
                            {"seed": r.seed, "folder": str(r.folder)} for r in a.runs]} for a in vplan.arms}}
    data = {"mix": str(plan.file), "out_dir": str(plan.out),
            "proxy": plan.sources.proxy and {k: v for k, v in plan.sources.proxy.items() if k != "set"},
            "sources": {n: {"folder": str(plan.sources.arm(n).data), "train_samples": int(s), "natural": float(w),
                            "cap": float(c)} for n, s, w, c in zip(budget.names, budget.samples, budget.natural,
                                                                     budget.caps)},
            "budget": {"samples": budget.run_samples, "max_epochs": spec.max_epochs,
                       "tokens": budget.run_samples * plan.sources.baseline.cfg.pack.seq_len},
            "swarm": {"size": len(rows), "concentration": spec.concentration, "seed": spec.swarm_seed},
            "target": target, "eval": eval_summary(plan.sources, sets, keep), "runs": rows, "fit": fit,
            "proposal": proposal, "best_swarm": best, "verification": verification, "comparisons": comparisons,
            "improvement": improvement(comparisons, target) if proposal else None,
            "loader_sources": loader_block(plan, proposal["weights"]) if proposal else None,
            "statistics": spec.statistics.model_dump(), "warnings": warnings, "timings_s": timings}
    with OutputLock(plan.out / RESULTS, "`kiln mix`"):
        check_outputs(plan.out, plan.file, OWNER)
        write_atomic(plan.out / RESULTS, json.dumps(data, indent=1, ensure_ascii=False))
        write_page(data, plan.out / PAGE)
    return data


def report_finished(out_dir: str | Path, log: Log) -> dict[str, Any]:
    """`kiln mix report DIR`: fit the finished swarm runs and compare the finished verification runs."""
    from kiln.ablate.evalsets import OVERLAP, find_overlap, kept_units, load_eval_sets
    from kiln.ablate.outdir import check_outputs, read_plan
    from kiln.ablate.runner import Timer

    out = Path(out_dir)
    saved, spec = read_plan(out, OWNER)
    plan = make_plan(spec, saved["base"], Path(saved["file"]))
    check_outputs(out, plan.file, OWNER)
    sets = load_eval_sets(spec.eval.text, spec.eval.tasks)
    missing = [a.name for a in plan.sources.data_arms() if not (a.data / OVERLAP).is_file() or
               not (a.layout.shards / "manifest.json").is_file()]
    if missing:
        raise KilnError(f"source {missing[0]!r} has not been prepared yet; run `kiln mix {saved['file']}` first")
    dedup = plan.sources.baseline.cfg.data.dedup
    keep = kept_units(sets, {a.name: find_overlap(a.layout.docs, sets, dedup, a.data / OVERLAP, log)
                             for a in plan.sources.data_arms()})
    budget = budget_of(plan)
    return finish(plan, sets, keep, budget, swarm_runs(plan, budget), log, Timer(), train=None)


def print_plan(path: str | Path, gpus: int, gpu: str) -> None:
    """`kiln mix FILE --plan`: kiln ablate's table of what each proxy scale costs, for the swarm's runs and the
    verification's (3 arms x seeds)."""
    from kiln.ablate.estimate import print_estimates, scale_rows
    from kiln.mix.spec import as_ablation, read_spec

    spec, base = read_spec(path)
    runs = spec.runs_in_swarm + len(ARMS) * len(spec.seeds)
    rows = scale_rows(as_ablation(spec), base, Path(path).resolve(), gpus, gpu, runs=runs)
    print_estimates(path, gpus, gpu, rows, "kiln mix")
