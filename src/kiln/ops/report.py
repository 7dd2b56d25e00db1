"""`kiln report RUN_DIR`: one self-contained report.html with the run's curves, the data stage's figures,
the checkpoints and the config.

Plots are matplotlib PNGs embedded as base64 data URIs; the page loads nothing else (no scripts, fonts or
stylesheets from anywhere), so it opens offline and can be mailed as one file. A metric the run did not
record is left out rather than drawn empty, so older runs and CPU runs still get a report.
"""

from __future__ import annotations

import base64
import html
import io
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from kiln.errors import KilnError
from kiln.manifest import write_atomic

Records = list[dict[str, Any]]


def read_records(path: Path) -> tuple[Records, int]:
    """metrics.jsonl as records, and how many lines were unreadable (a crash can cut the last one)."""
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records, bad


def _series(records: Records, event: str, key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get("event") == event and isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.4), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode()


# --- training curves: each returns a figure, or None when the run recorded nothing for it ----------

def plot_loss(records: Records):
    steps, loss = _series(records, "step", "loss")
    vsteps, vloss = _series(records, "eval", "val_loss")
    if not steps and not vsteps:
        return None
    fig, ax = _figure()
    ax.plot(steps, loss, lw=1, label="train loss")
    if vsteps:
        ax.plot(vsteps, vloss, "o-", ms=4, label="validation loss")
    skips = [r["step"] for r in records if r.get("event") == "skip"]
    for i, s in enumerate(skips):
        ax.axvline(s, color="tab:orange", ls=":", lw=1, label="skipped step" if i == 0 else None)
    for i, r in enumerate(r for r in records if r.get("event") == "rollback"):
        ax.axvline(r["step"], color="tab:red", lw=1.5, label="rollback" if i == 0 else None)
        if isinstance(r.get("to_step"), (int, float)):
            ax.annotate(f"→ {r['to_step']}", (r["step"], ax.get_ylim()[1]), fontsize=8, color="tab:red", va="top")
    ax.set(xlabel="step", ylabel="loss")
    ax.legend(fontsize=8)
    return fig


def _lines(records: Records, keys: list[str], ylabel: str, log: bool = False):
    drawn = [(k, *_series(records, "step", k)) for k in keys]
    drawn = [d for d in drawn if d[1]]
    if not drawn:
        return None
    fig, ax = _figure()
    for key, x, y in drawn:
        ax.plot(x, y, lw=1, label=key)
    if log and all(v > 0 for _, _, y in drawn for v in y):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel=ylabel)
    ax.legend(fontsize=8)
    return fig


def plot_grad_norm(records: Records):
    groups = sorted({k for r in records if r.get("event") == "step" for k in r if k.startswith("grad_norm/")})
    return _lines(records, ["grad_norm", *groups], "gradient norm", log=True)


def plot_throughput(records: Records):
    steps, tps = _series(records, "step", "tokens_per_s")
    msteps, mfu = _series(records, "step", "mfu")
    if not steps:
        return None
    fig, ax = _figure()
    ax.plot(steps, tps, lw=1, label="tokens/s")
    ax.set(xlabel="step", ylabel="tokens/s")
    if msteps:
        twin = ax.twinx()
        twin.plot(msteps, [100 * m for m in mfu], lw=1, color="tab:green", label="MFU %")
        twin.set_ylabel("MFU %")
        twin.legend(loc="lower right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    return fig


def plot_step_time(records: Records):
    parts = ["time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_comm_s"]
    series = [(k, *_series(records, "step", k)) for k in parts]
    series = [s for s in series if s[1]]
    if not series:
        return None
    fig, ax = _figure()
    steps = series[0][1]
    ax.stackplot(steps, *[s[2] if len(s[2]) == len(steps) else [0] * len(steps) for s in series],
                 labels=[s[0].removeprefix("time_").removesuffix("_s") for s in series])
    ax.set(xlabel="step", ylabel="seconds per step")
    ax.legend(fontsize=8, loc="upper right")
    return fig


TRAINING_PLOTS: list[tuple[str, Callable[[Records], Any]]] = [
    ("Loss (training and validation; skipped steps and rollbacks marked)", plot_loss),
    ("Learning rate", lambda r: _lines(r, ["lr"], "learning rate")),
    ("Gradient norm (global and per layer group)", plot_grad_norm),
    ("Throughput and MFU", plot_throughput),
    ("Peak memory", lambda r: _lines(r, ["mem_peak_gb"], "GiB")),
    ("Step time split", plot_step_time),
    ("Cost so far", lambda r: _lines(r, ["cost_so_far"], "cost")),
]


# --- data stage ----------------------------------------------------------------------------------

def _bars(counts: dict[str, float], xlabel: str, top: int = 25):
    if not counts:
        return None
    items = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    fig, ax = _figure()
    fig.set_figheight(max(2.0, 0.28 * len(items) + 1))
    ax.barh([k for k, _ in items][::-1], [v for _, v in items][::-1], color="tab:blue")
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", labelsize=8)
    return fig


def plot_kept_rejected(stats: dict):
    docs = stats.get("documents") or {}
    counts = {"kept": docs.get("kept", 0), **{f"rejected: {k}": v for k, v in (stats.get("rejected_by_reason") or {}).items()}}
    return _bars({k: v for k, v in counts.items() if v}, "documents")


def plot_sources(stats: dict):
    by_source = stats.get("by_source") or {}
    if not by_source:
        return None
    items = list(by_source.items())[:25]
    fig, ax = _figure()
    fig.set_figheight(max(2.0, 0.35 * len(items) + 1))
    names = [Path(s).name or s for s, _ in items]
    kept = [c.get("kept", 0) for _, c in items]
    rejected = [c.get("rejected", 0) for _, c in items]
    ax.barh(names, kept, label="kept")
    ax.barh(names, rejected, left=kept, label="rejected")
    ax.set_xlabel("documents")
    ax.legend(fontsize=8)
    return fig


def plot_dedup_clusters(stats: dict):
    """Cluster sizes (size -> number of clusters) from stats.json's `dedup.cluster_sizes`, when the data stage wrote it."""
    sizes = (stats.get("dedup") or {}).get("cluster_sizes") if isinstance(stats.get("dedup"), dict) else None
    if not sizes:
        return None
    return _bars({f"{k} documents": v for k, v in sizes.items()}, "clusters")


DATA_PLOTS: list[tuple[str, Callable[[dict], Any]]] = [
    ("Documents kept and rejected by reason", plot_kept_rejected),
    ("Kept documents by language", lambda s: _bars(s.get("kept_by_lang") or {}, "documents")),
    ("Documents by source", plot_sources),
    ("Near-duplicate clusters", plot_dedup_clusters),
]


# --- the page ------------------------------------------------------------------------------------

CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:62em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;margin-top:2em}figure{margin:1em 0}
figcaption{font-weight:600;margin-bottom:.3em}img{max-width:100%}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}.bad{color:#b00}"""


def _figure_html(title: str, fig) -> str:
    return (f'<figure><figcaption>{html.escape(title)}</figcaption>'
            f'<img alt="{html.escape(title)}" src="data:image/png;base64,{_png(fig)}"></figure>')


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape('' if r.get(c) is None else str(r.get(c)))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def composition_table(stats: dict, top: int = 20) -> str:
    """The corpus by source (data.distribution.source_key) and by language, with each source's sampling
    weight: stats.json's `composition` and `source_weights`; "" when the data stage wrote no composition."""
    comp, weights = stats.get("composition") or {}, stats.get("source_weights") or {}
    out = []
    for axis, label in (("by_source", "source"), ("by_lang", "language")):
        rows = [{label: name, "documents": r["documents"], "chars": r["chars"], "doc share": r["doc_share"],
                 "char share": r["char_share"], **({"weight": weights.get(name, {}).get("weight")}
                                                    if axis == "by_source" else {})}
                for name, r in list((comp.get(axis) or {}).items())[:top]]
        if rows:
            columns = [label, "documents", "chars", "doc share", "char share"]
            columns += ["weight"] if axis == "by_source" else []
            out.append(f"<h3>Corpus by {label}</h3>" + _table(rows, columns))
    return "".join(out)


def _summary(records: Records) -> list[dict]:
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    rows = [{"what": "optimizer steps", "value": steps[-1]["step"] if steps else 0},
            {"what": "tokens seen", "value": steps[-1].get("tokens_seen") if steps else None},
            {"what": "last train loss", "value": steps[-1].get("loss") if steps else None},
            {"what": "last validation loss", "value": evals[-1].get("val_loss") if evals else None},
            {"what": "skipped steps", "value": sum(r.get("event") == "skip" for r in records)},
            {"what": "rollbacks", "value": sum(r.get("event") == "rollback" for r in records)}]
    return [r for r in rows if r["value"] is not None]


def _checkpoints(run_dir: Path) -> str:
    from kiln.train.checkpoint import checkpoint_table

    rows = checkpoint_table(run_dir / "checkpoints")
    if not rows:
        return "<p>No checkpoints.</p>"
    for r in rows:
        r["path"] = Path(r["path"]).name
        r["valid"] = "yes" if r["valid"] else "NO"
    return _table(rows, ["path", "step", "valid", "tokens_seen", "val_loss", "problem"])


def render(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise KilnError(f"{run_dir}: no metrics.jsonl; give the run folder `kiln train` wrote ({{out_dir}}/run)")
    records, bad = read_records(metrics)
    parts = [f"<h1>Kiln run report</h1><p>{html.escape(str(run_dir.resolve()))}<br>written "
             f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</p>"]
    if bad:
        parts.append(f'<p class="bad">{bad} unreadable line(s) in metrics.jsonl were left out.</p>')
    parts.append("<h2>Summary</h2>" + _table(_summary(records), ["what", "value"]))
    parts.append("<h2>Training</h2>")
    for title, plot in TRAINING_PLOTS:
        if (fig := plot(records)) is not None:
            parts.append(_figure_html(title, fig))
    stats_file = run_dir.parent / "docs" / "stats.json"
    parts.append("<h2>Data</h2>")
    if stats_file.is_file():
        stats = json.loads(stats_file.read_text())
        docs = stats.get("documents") or {}
        parts.append(f"<p>{html.escape(str(stats_file))}: read {docs.get('read')}, kept {docs.get('kept')}, "
                     f"rejected {docs.get('rejected')}.</p>")
        parts.append(composition_table(stats))
        for title, plot in DATA_PLOTS:
            if (fig := plot(stats)) is not None:
                parts.append(_figure_html(title, fig))
    else:
        parts.append(f"<p>No data-stage statistics at {html.escape(str(stats_file))}.</p>")
    parts.append("<h2>Checkpoints</h2>" + _checkpoints(run_dir))
    config = run_dir / "config.yaml"
    parts.append("<h2>Config</h2>" + (f"<pre>{html.escape(config.read_text())}</pre>" if config.is_file()
                                      else "<p>No config.yaml in the run folder.</p>"))
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Kiln report</title>"
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    out = Path(out) if out is not None else Path(run_dir) / "report.html"
    page = render(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, page)
    return out
