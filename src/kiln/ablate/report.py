"""ablation.html: one self-contained page, in `kiln report`'s style (kiln.pages: its CSS, tables and
base64 PNG figures; no script, font or stylesheet from anywhere).

In order: the verdict table (every arm against the baseline on every metric, Holm-corrected), each metric with
every arm's difference and its interval, the training loss per arm (the mean over seeds, a band from the lowest
to the highest seed), the data funnel of every arm side by side with its kept documents, tokens and epochs, the
eval sets (and what the overlap check dropped), then the warnings and the statistics' settings.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from kiln.ablate.outdir import PAGE_MARKER
from kiln.ablate.plan import Plan
from kiln.ops.report import STAGE_ORDER
from kiln import pages
from kiln.pages import figure, figure_html, fmt, page, read_records, smooth, table
from kiln.run_layout import RunLayout

VERDICT_STYLE = ".better{color:#070;font-weight:600}.worse{color:#b00;font-weight:600}"


def verdict_table(comparisons: list[dict]) -> str:
    """The comparisons as an HTML table (ablation.html's, and mix.html's verification)."""
    head = "".join(f"<th>{c}</th>" for c in ("arm", "metric", "difference", "95% interval", "p", "p (Holm)",
                                             "verdict", "smallest detectable"))
    rows = []
    for c in comparisons:
        ci = f"[{fmt(c['ci_low'])}, {fmt(c['ci_high'])}]" if c["ci_low"] is not None else ""
        cells = [c["arm"], c["metric"], fmt(c["diff"]), ci, fmt(c["p"]), fmt(c["p_holm"])]
        verdict = c["verdict"]
        css = {"better": "better", "worse": "worse"}.get(verdict, "")
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in cells)
                    + f'<td class="{css}">{html.escape(verdict)}</td><td>{html.escape(fmt(c["min_detectable"]))}</td>'
                    + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def plot_metric(metric: dict, comparisons: list[dict], baseline: str):
    rows = [c for c in comparisons if c["metric"] == metric["name"] and c["diff"] is not None]
    if not rows:
        return None
    fig, ax = figure()
    fig.set_figheight(max(1.8, 0.45 * len(rows) + 1.2))
    y = np.arange(len(rows))[::-1]
    colors = ["tab:green" if c["verdict"] == "better" else "tab:red" if c["verdict"] == "worse" else "tab:gray"
              for c in rows]
    for yi, c, color in zip(y, rows, colors):
        ax.errorbar(c["diff"], yi, xerr=[[c["diff"] - c["ci_low"]], [c["ci_high"] - c["diff"]]], fmt="o",
                    color=color, capsize=4)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, [c["arm"] for c in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"{metric['name']}: arm minus {baseline} ({metric['better']} is better), 95% interval")
    return fig


def _curve(run_folder: Path) -> tuple[list[int], list[float]] | None:
    path = RunLayout(run_folder).run / "metrics.jsonl"
    if not path.is_file():
        return None
    steps = [r for r in read_records(path)[0] if r.get("event") == "step" and isinstance(r.get("loss"), (int, float))]
    return ([r["step"] for r in steps], smooth([r["loss"] for r in steps])) if steps else None


def plot_loss_bands(data: dict):
    fig, ax = figure()
    drawn = False
    for arm in data["arms"]:
        curves = [c for r in arm["runs"] if (c := _curve(Path(r["folder"]))) is not None]
        if not curves:
            continue
        n = min(len(c[0]) for c in curves)
        steps, losses = curves[0][0][:n], np.array([c[1][:n] for c in curves])
        line, = ax.plot(steps, losses.mean(0), lw=1.5, label=f"{arm['name']} ({len(curves)} seeds)")
        ax.fill_between(steps, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.2)
        drawn = True
    if not drawn:
        return None
    ax.set(xlabel="step", ylabel="train loss (smoothed)")
    ax.legend(fontsize=8)
    return fig


def funnel(facts: dict) -> list[tuple[str, int]]:
    """Documents left after each stage, in kiln report's order."""
    read = int((facts["documents"] or {}).get("read") or 0)
    by_stage = facts.get("rejected_by_stage") or {}
    stages = STAGE_ORDER[1:-1] + [s for s in by_stage if s not in STAGE_ORDER] + ["dedup"]
    left = read - by_stage.get("read", 0)
    out = [("read", read)]
    for stage in stages:
        left -= by_stage.get(stage, 0)
        out.append((f"after {stage}", left))
    return out


def plot_funnels(data: dict):
    arms = [a for a in data["arms"] if a["data_shared_with"] is None and (a["data"]["documents"] or {}).get("read")]
    if not arms:
        return None
    fig, ax = figure()
    names = [name for name, _ in funnel(arms[0]["data"])]
    fig.set_figheight(max(2.5, 0.25 * len(names) * len(arms) + 1))
    height = 0.8 / len(arms)
    y = np.arange(len(names))[::-1]
    for k, arm in enumerate(arms):
        counts = dict(funnel(arm["data"]))
        bars = ax.barh(y - k * height, [counts.get(n, 0) for n in names], height=height, label=arm["name"])
        ax.bar_label(bars, fontsize=7, padding=2)
    ax.set_yticks(y - height * (len(arms) - 1) / 2, names)
    ax.set_xlabel("documents")
    ax.legend(fontsize=8)
    return fig


def _data_rows(data: dict) -> list[dict]:
    rows = []
    for arm in data["arms"]:
        d, docs = arm["data"], arm["data"]["documents"] or {}
        reasons = sorted((d["rejected_by_reason"] or {}).items(), key=lambda kv: -kv[1])[:3]
        langs = sorted((d["kept_by_lang"] or {}).items(), key=lambda kv: -kv[1])[:3]
        rows.append({"arm": arm["name"] + (f" (= {arm['data_shared_with']})" if arm["data_shared_with"] else ""),
                     "read": docs.get("read"), "kept": docs.get("kept"), "train tokens": d["train_tokens"],
                     "epochs": d["epochs"], "top rejections": ", ".join(f"{r} {n:,}" for r, n in reasons),
                     "languages": ", ".join(f"{lang} {n:,}" for lang, n in langs)})
    return rows


def _eval_rows(data: dict) -> list[dict]:
    return [{"set": name, "kind": e["kind"], "path": e["path"], "units": e["units"], "kept": e["kept"],
             "dropped (in an arm's data)": len({r["index"] for r in e["dropped"]})}
            for name, e in data["eval"].items()]


def render(plan: Plan, data: dict[str, Any]) -> str:
    parts = [f"<h1>Kiln ablation</h1><p>{html.escape(data['ablation'])} &rarr; {html.escape(data['out_dir'])}<br>"
             f"baseline <b>{html.escape(data['baseline'])}</b>; {len(data['arms'])} arms</p>"]
    parts += [f'<p class="bad">{html.escape(w)}</p>' for w in data["warnings"]]
    parts.append("<h2>Verdicts</h2>" + verdict_table(data["comparisons"]))
    parts.append("<h2>Metrics</h2>")
    means = [{"arm": a["name"], **a["mean"]} for a in data["arms"]]
    parts.append(table(means, ["arm"] + [m["name"] for m in data["metrics"]]))
    for metric in data["metrics"]:
        if (fig := plot_metric(metric, data["comparisons"], data["baseline"])) is not None:
            parts.append(figure_html(f"{metric['name']} against {data['baseline']}", fig))
    parts.append("<h2>Training</h2>")
    if (fig := plot_loss_bands(data)) is not None:
        parts.append(figure_html("Training loss per arm: mean over seeds, band from the lowest to the highest", fig))
    parts.append("<h2>Data</h2>" + table(_data_rows(data), ["arm", "read", "kept", "train tokens", "epochs",
                                                              "top rejections", "languages"]))
    if (fig := plot_funnels(data)) is not None:
        parts.append(figure_html("Funnel: documents left after each stage, per arm", fig))
    parts.append("<h2>Eval sets</h2>" + table(_eval_rows(data), ["set", "kind", "path", "units", "kept",
                                                                   "dropped (in an arm's data)"]))
    parts.append(f"<h2>Settings</h2><pre>{html.escape(json.dumps(data['statistics'], indent=1))}</pre>")
    return page("Kiln ablation", parts, VERDICT_STYLE)


def write_page(plan: Plan, data: dict[str, Any], out: Path) -> Path:
    """Write ablation.html, replacing only a page an ablation wrote (its first-line marker)."""
    return pages.write_page(out, PAGE_MARKER, render(plan, data), "kiln ablate")


def print_verdicts(data: dict[str, Any], console) -> None:
    """The verdict table on the console (rich; every cell plain text, so no name is read as markup)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"kiln ablate: every arm against {data['baseline']}")
    for column in ("arm", "metric", "difference", "95% interval", "p (Holm)", "verdict", "smallest detectable"):
        table.add_column(column)
    style = {"better": "green", "worse": "red"}
    for c in data["comparisons"]:
        ci = f"[{fmt(c['ci_low'])}, {fmt(c['ci_high'])}]" if c["ci_low"] is not None else ""
        table.add_row(*(Text(v) for v in (c["arm"], c["metric"], fmt(c["diff"]), ci, fmt(c["p_holm"]))),
                      Text(c["verdict"], style=style.get(c["verdict"], "")), Text(fmt(c["min_detectable"])))
    console.print(table)
    for warning in data["warnings"]:
        console.print(Text(f"warning: {warning}"))
    console.print(Text(f"details: {Path(data['out_dir']) / data.get('page', 'ablation.html')}"))
