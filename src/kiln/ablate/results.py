"""ablation.json: every number of an ablation, and each arm compared with the baseline on every metric.

The metrics, per run (lower is better for the first two, higher for the accuracies):
- `SET/bits_per_byte` for every eval text set: the set's summed bits over its UTF-8 bytes;
- `val_loss`: the final validation loss, on the arm's own held-out split, drawn from its own data: the arms'
  numbers measure different text, so it is a per-arm fact (`metrics[].per_arm`), never compared;
- `TASK/acc`, `TASK/acc_norm`, `TASK/acc_bytes` for every task.
Only what every arm is measured on, the same text (the eval sets and tasks of the ablation's `eval:`), is
compared: an arm's i-th seed is paired with the baseline's i-th; pairs where either run has not finished are
left out (`kiln ablate report` compares whatever is done). Each comparison is `kiln.ablate.stats.compare`;
Holm's correction runs over all of them.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from kiln.ablate import stats
from kiln.ablate.evalsets import OVERLAP, EvalSet
from kiln.ablate.outdir import check_outputs
from kiln.ablate.plan import EVAL, ArmPlan, Plan
from kiln.ablate.spec import PAGE, RESULTS
from kiln.scoring.mc import METRICS as TASK_METRICS
from kiln.lock import OutputLock
from kiln.manifest import MANIFEST, read_manifest, sha256_file, write_atomic
from kiln.run_layout import RunLayout

PER_ARM = {"val_loss"}  # measured on each arm's own text: reported per arm, not compared


def metric_names(sets: list[EvalSet]) -> list[tuple[str, bool]]:
    """(metric, higher_is_better) in report order."""
    names = [(f"{s.name}/bits_per_byte", False) for s in sets if s.kind == "text"]
    names.append(("val_loss", False))
    names += [(f"{s.name}/{m}", True) for s in sets if s.kind == "task" for m in TASK_METRICS]
    return names


def unit_values(measured: dict[str, Any], metric: str) -> np.ndarray:
    """One run's per-unit values of a metric (bits per document, hits per question, the one val_loss)."""
    if metric == "val_loss":
        return np.array([measured["val_loss"]], dtype=np.float64)
    name, what = metric.rsplit("/", 1)
    if what == "bits_per_byte":
        return np.asarray(measured["text"][name]["bits"], dtype=np.float64)
    return np.asarray(measured["tasks"][name][what], dtype=np.float64)


def unit_weights(sets: list[EvalSet], keep: dict[str, list[int]], metric: str) -> np.ndarray | None:
    """The kept documents' UTF-8 bytes, for bits per byte; None (a mean over units) for the rest."""
    if not metric.endswith("/bits_per_byte"):
        return None
    s = next(s for s in sets if s.name == metric.rsplit("/", 1)[0])
    return np.array([len(s.texts[i].encode("utf-8")) for i in keep[s.name]], dtype=np.float64)


def read_measurement(run_folder: Path, sets: list[EvalSet], keep: dict[str, list[int]]) -> dict | None:
    """A run's eval.json when it measured the run's final checkpoint on these eval units, else None."""
    path = run_folder / EVAL
    try:
        measured = json.loads(path.read_text())
        checkpoint = RunLayout(run_folder).checkpoints / measured["checkpoint"]
        same = sha256_file(checkpoint / MANIFEST) == measured["checkpoint_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    wanted = {s.name: len(keep[s.name]) for s in sets}
    have = {**{k: len(v["bits"]) for k, v in measured.get("text", {}).items()},
            **{k: len(v["acc"]) for k, v in measured.get("tasks", {}).items()}}
    return measured if same and have == wanted else None


def data_facts(arm: ArmPlan) -> dict[str, Any]:
    """The arm's data side: documents read, kept and rejected (by reason), languages, tokens and epochs."""
    stats_file, shards = arm.layout.docs / "stats.json", arm.layout.shards
    docs = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
    splits = read_manifest(shards).get("splits", {}) if (shards / MANIFEST).is_file() else {}
    t = arm.cfg.train
    budget = t.max_steps * t.batch_size * arm.cfg.pack.seq_len
    train_tokens = (splits.get("train") or {}).get("tokens")
    return {"folder": str(arm.data), "documents": docs.get("documents", {}),
            "rejected_by_reason": docs.get("rejected_by_reason", {}),
            "rejected_by_stage": docs.get("rejected_by_stage", {}), "kept_by_lang": docs.get("kept_by_lang", {}),
            "train_tokens": train_tokens, "val_tokens": (splits.get("val") or {}).get("tokens"),
            "tokens_per_run": budget, "epochs": round(budget / train_tokens, 4) if train_tokens else None}


def run_metrics(measured: dict[str, Any], sets: list[EvalSet], keep: dict[str, list[int]]) -> dict[str, float]:
    """One measured run's value of every metric (bits per byte of each set, val_loss, each task's accuracies)."""
    return {metric: float(stats.run_values(unit_values(measured, metric)[None, :],
                                           unit_weights(sets, keep, metric))[0]) for metric, _ in metric_names(sets)}


def comparison_rng(seed: int, arm: str, metric: str) -> np.random.Generator:
    """Each comparison's own stream: its numbers do not depend on which others ran or in what order."""
    return np.random.default_rng([seed, zlib.crc32(arm.encode()), zlib.crc32(metric.encode())])


def compare_arms(plan: Plan, sets: list[EvalSet], keep: dict[str, list[int]],
                 measured: dict[Path, dict | None]) -> list[dict[str, Any]]:
    settings = stats.Settings(**plan.spec.statistics.model_dump())
    base = plan.baseline
    others = [a for a in plan.arms if a.name != base.name]
    metrics = [(m, higher) for m, higher in metric_names(sets) if m not in PER_ARM]
    family = len(others) * len(metrics)
    rows = []
    for arm in others:
        pairs = [(measured[r.folder], measured[b.folder]) for r, b in zip(arm.runs, base.runs)
                 if measured[r.folder] is not None and measured[b.folder] is not None]
        for metric, higher in metrics:
            row = {"arm": arm.name, "baseline": base.name, "metric": metric, "pairs": len(pairs)}
            if not pairs:
                rows.append({**row, "diff": None, "ci_low": None, "ci_high": None, "p": None, "min_detectable": None,
                             "higher_is_better": higher})
                continue
            a = np.stack([unit_values(x, metric) for x, _ in pairs])
            b = np.stack([unit_values(y, metric) for _, y in pairs])
            result = stats.compare(a, b, unit_weights(sets, keep, metric), higher, settings,
                                   comparison_rng(settings.seed, arm.name, metric), family)
            rows.append({**row, **result})
    judged = stats.judge(rows, settings.confidence)
    for row in judged:  # a comparison with no finished pair has no verdict to give
        row["verdict"] = row["verdict"] if row["diff"] is not None else "not run"
    return judged


def arm_summary(plan: Plan, arm: ArmPlan, sets: list[EvalSet], keep: dict[str, list[int]],
                measured: dict[Path, dict | None]) -> dict[str, Any]:
    runs = []
    for run in arm.runs:
        m = measured[run.folder]
        values = run_metrics(m, sets, keep) if m else None
        runs.append({"seed": run.seed, "folder": str(run.folder), "shared_with": None if run.owner == arm.name
                     else run.owner, "finished": m is not None,
                     **({k: m[k] for k in ("checkpoint", "fingerprint", "weights_sha256")}
                        if m else {}), "metrics": values})
    means = {metric: float(np.mean([r["metrics"][metric] for r in runs if r["metrics"]]))
             for metric, _ in metric_names(sets) if any(r["metrics"] for r in runs)}
    return {"name": arm.name, "set": arm.overrides, "seeds": arm.seeds, "data": data_facts(plan.arm(arm.owner)),
            "data_shared_with": None if arm.owner == arm.name else arm.owner, "settings_key": arm.key,
            "mean": means, "runs": runs}


def eval_summary(plan: Plan, sets: list[EvalSet], keep: dict[str, list[int]]) -> dict[str, Any]:
    out = {}
    for s in sets:
        dropped = []
        for arm in plan.data_arms():
            rows = json.loads((arm.data / OVERLAP).read_text())["matches"]
            dropped += [{**r, "arm": arm.name} for r in rows if r["set"] == s.name]
        out[s.name] = {"kind": s.kind, "path": s.path, "units": len(s.ids), "kept": len(keep[s.name]),
                       "bytes": int(sum(len(s.texts[i].encode("utf-8")) for i in keep[s.name])),
                       "digest": s.digest(keep[s.name]), "dropped": dropped}
    return out


def warnings_of(arms: list[dict], plan: Plan) -> list[str]:
    out = []
    for arm in arms:
        epochs = arm["data"]["epochs"]
        if epochs and epochs > 1:
            out.append(f"arm {arm['name']!r} repeats its data: {epochs:.2f} epochs ({arm['data']['train_tokens']:,} "
                       f"training tokens for a budget of {arm['data']['tokens_per_run']:,} per run)")
    if len(plan.baseline.seeds) < 2:
        out.append("one seed per arm: seed-to-seed noise is not measured, so the intervals count only the eval "
                   "documents' (give 3 or more seeds)")
    return out


def results(plan: Plan, sets: list[EvalSet], keep: dict[str, list[int]], timings: dict[str, float]) -> dict:
    measured = {run.folder: read_measurement(run.folder, sets, keep) for run in plan.runs()}
    arms = [arm_summary(plan, a, sets, keep, measured) for a in plan.arms]
    return {"ablation": str(plan.file), "out_dir": str(plan.out), "baseline": plan.baseline.name,
            "proxy": plan.proxy and {k: v for k, v in plan.proxy.items() if k != "set"},
            "tokenizer": {"path": str(plan.tokenizer), "shared": plan.shared_tokenizer,
                          "sha256": sha256_file(plan.tokenizer) if plan.tokenizer.is_file() else None},
            "statistics": {**plan.spec.statistics.model_dump(), "method": stats.METHOD},
            "metrics": [{"name": m, "better": "higher" if h else "lower", "per_arm": m in PER_ARM}
                        for m, h in metric_names(sets)],
            "eval": eval_summary(plan, sets, keep), "arms": arms,
            "comparisons": compare_arms(plan, sets, keep, measured), "warnings": warnings_of(arms, plan),
            "timings_s": timings}


def write_results(plan: Plan, sets: list[EvalSet], keep: dict[str, list[int]], timings: dict[str, float]) -> dict:
    """ablation.json and ablation.html under out_dir (each replaced whole); returns ablation.json's content."""
    from kiln.ablate.report import write_page

    data = results(plan, sets, keep, timings)
    with OutputLock(plan.out / RESULTS, "`kiln ablate`"):  # one writer of the two files at a time
        check_outputs(plan.out, plan.file)  # both files kiln ablate's, before either is replaced
        write_atomic(plan.out / RESULTS, json.dumps(data, indent=1, ensure_ascii=False))
        write_page(plan, data, plan.out / PAGE)
    return data
