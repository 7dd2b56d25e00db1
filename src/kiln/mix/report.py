"""mix.html: one self-contained page in `kiln report`'s style (kiln.pages: its CSS, tables, base64 PNG figures;
no script, font or stylesheet from anywhere).

In order: the proposal (its weights, predicted target and uncertainty, whether the verification calls it an
improvement, the loader.sources block to paste), the verification (kiln.ablate's verdict table), the weights per
source (natural, proposal, best swarm run, every swarm run), the fit's held-out predictions against what the
runs measured, the fit's quality per metric, the warnings.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from kiln import pages
from kiln.ablate.report import VERDICT_STYLE, verdict_table
from kiln.pages import figure, figure_html, fmt, page, table


def plot_weights(data: dict):
    names = list(data["sources"])
    rows = [("natural", {n: s["natural"] for n, s in data["sources"].items()})]
    if data["proposal"]:
        rows.append(("proposed", data["proposal"]["weights"]))
    if data["best_swarm"]:
        rows.append((f"best swarm ({data['best_swarm']['run']})", data["best_swarm"]["weights"]))
    rows += [(r["name"], r["weights"]) for r in data["runs"]]
    fig, ax = figure()
    fig.set_figheight(max(2.5, 0.22 * len(rows) + 1.2))
    y = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    for name in names:
        share = np.array([w.get(name, 0.0) for _, w in rows])
        ax.barh(y, share, left=left, label=name)
        left += share
    ax.set_yticks(y, [label for label, _ in rows], fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_xlabel("weight (share of training tokens)")
    ax.legend(fontsize=8, ncols=min(4, len(names)), loc="lower right")
    return fig


def plot_predicted(data: dict):
    points = [p for p in data["fit"].get("held_out", []) if p["actual"] is not None]
    if not points:
        return None
    fig, ax = figure()
    actual = [p["actual"] for p in points]
    predicted = [p["predicted"] for p in points]
    ax.scatter(actual, predicted, s=18)
    lo, hi = min(actual + predicted), max(actual + predicted)
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.set(xlabel="target measured", ylabel="target predicted (run held out)")
    return fig


def _proposal(data: dict) -> str:
    p = data["proposal"]
    if not p:
        return "<p class=\"bad\">no proposal (see the warnings)</p>"
    verdict = data["improvement"]
    said = ("not verified yet" if verdict is None else
            f"verification on {verdict['metric']}: <b>{html.escape(verdict['verdict'])}</b> than natural")
    rows = [{"source": n, "weight": w, "epochs": p["epochs"][n], "natural": data["sources"][n]["natural"]}
            for n, w in p["weights"].items()]
    return (f"<p>predicted target {fmt(p['predicted_target'])} &plusmn; {fmt(p['uncertainty'])}; {said}</p>"
            + table(rows, ["source", "weight", "natural", "epochs"])
            + f"<pre>{html.escape(data['loader_sources'] or '')}</pre>")


def _fit_rows(data: dict) -> list[dict]:
    fit = data["fit"]
    rows = [{"metric": "target", "model": "", "spearman": fit["spearman"], "rmse": fit["rmse"],
             "mean_rmse": fit["mean_rmse"]}]
    rows += [{"metric": m, "model": q["model"], "spearman": q["spearman"], "rmse": q["rmse"],
              "mean_rmse": q["mean_rmse"]} for m, q in fit["metrics"].items()]
    return rows


def render(data: dict[str, Any]) -> str:
    parts = [f"<h1>Kiln mix</h1><p>{html.escape(data['mix'])} &rarr; {html.escape(data['out_dir'])}<br>"
             f"{len(data['sources'])} sources, {data['swarm']['size']} swarm runs, target "
             f"{html.escape(', '.join(f'{k} x {v:g}' for k, v in data['target'].items()))}</p>"]
    parts += [f'<p class="bad">{html.escape(w)}</p>' for w in data["warnings"]]
    parts.append("<h2>Proposal</h2>" + _proposal(data))
    parts.append("<h2>Verification</h2>" + (verdict_table(data["comparisons"]) if data["comparisons"] else
                                            "<p>no verification runs</p>"))
    parts.append("<h2>Weights</h2>")
    parts.append(figure_html("Weights per source: natural, proposed, best swarm run, every swarm run",
                             plot_weights(data)))
    parts.append("<h2>Fit</h2>")
    if (fig := plot_predicted(data)) is not None:
        parts.append(figure_html("Predicted against measured target, each swarm run held out", fig))
    parts.append(table(_fit_rows(data), ["metric", "model", "spearman", "rmse", "mean_rmse"]))
    return page("Kiln mix", parts, VERDICT_STYLE)


def write_page(data: dict[str, Any], out: Path) -> Path:
    """Write mix.html, replacing only a page kiln mix wrote (its first-line marker)."""
    from kiln.mix.spec import PAGE_MARKER

    return pages.write_page(out, PAGE_MARKER, render(data), "kiln mix")


def print_summary(data: dict[str, Any], console) -> None:
    """The fit, the proposal and its verdict on the console (every cell plain text)."""
    from rich.text import Text

    from kiln.ablate.report import print_verdicts

    fit = data["fit"]
    console.print(Text(f"fit: {fit['runs']} swarm runs, held-out Spearman {fmt(fit['spearman'])}, error "
                       f"{fmt(fit['rmse'])} (the mean's {fmt(fit['mean_rmse'])})"))
    if data["proposal"]:
        p = data["proposal"]
        console.print(Text(f"proposal: {p['weights']}, predicted target {fmt(p['predicted_target'])} +- "
                           f"{fmt(p['uncertainty'])}"))
    if data["comparisons"]:
        print_verdicts({"baseline": "natural", "comparisons": data["comparisons"], "warnings": data["warnings"],
                        "out_dir": data["out_dir"], "page": "mix.html"}, console)
    else:
        for warning in data["warnings"]:
            console.print(Text(f"warning: {warning}"))
    if data["loader_sources"]:
        console.print(Text("paste into the full-size config:\n" + data["loader_sources"]))
