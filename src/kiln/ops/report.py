"""`kiln report RUN_DIR`: one self-contained report.html with the run's curves, the data stage's figures,
the checkpoints and the config.

Plots are matplotlib PNGs embedded as base64 data URIs; the page loads nothing else (no scripts, fonts or
stylesheets from anywhere), so it opens offline and can be mailed as one file. A metric the run did not
record is left out rather than drawn empty, so older runs and CPU runs still get a report.
"""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from kiln.errors import KilnError
from kiln.pages import (DPI, SMOOTHING, Records, check_replaceable_page, figure, figure_html, fmt, read_records, smooth,
                        table, page, write_page)
from kiln.run_layout import RunLayout, checkpoints_of



def _series(records: Records, event: str, key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get("event") == event and isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


# --- training curves: each returns a figure, or None when the run recorded nothing for it ----------

def plot_loss(records: Records):
    steps, loss = _series(records, "step", "loss")
    vsteps, vloss = _series(records, "eval", "val_loss")
    if not steps and not vsteps:
        return None
    fig, ax = figure()
    ax.plot(steps, loss, lw=0.8, alpha=0.35, color="tab:blue", label="train loss")
    if len(loss) > 2:
        ax.plot(steps, smooth(loss), lw=1.8, color="tab:blue", label=f"train loss, smoothed (EMA {SMOOTHING})")
    if vsteps:
        ax.plot(vsteps, vloss, "o-", ms=5, lw=1.5, color="tab:red", label="validation loss")
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


def plot_loss_by_tokens_and_time(records: Records):
    """The loss against tokens seen and against the training time (the sum of step times; evals excluded)."""
    steps = [r for r in records if r.get("event") == "step" and isinstance(r.get("loss"), (int, float))]
    if len(steps) < 2 or not all(isinstance(r.get("tokens_seen"), (int, float)) for r in steps):
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2), dpi=DPI, layout="constrained")
    by_tokens, by_time = fig.subplots(1, 2, sharey=True)
    loss = smooth([r["loss"] for r in steps])
    by_tokens.plot([r["tokens_seen"] for r in steps], loss, lw=1.5)
    by_tokens.set(xlabel="tokens seen", ylabel="train loss (smoothed)")
    clock, t = [], 0.0
    for r in steps:
        t += float(r.get("step_time_s") or 0.0)
        clock.append(t / 60)
    by_time.plot(clock, loss, lw=1.5, color="tab:purple")
    by_time.set(xlabel="training time (minutes)")
    return fig


def plot_tasks(records: Records):
    """Downstream tasks (eval.tasks): acc, acc_norm and acc_bytes per task against steps."""
    tasks = sorted({r["task"] for r in records if r.get("event") == "task" and "task" in r})
    if not tasks:
        return None
    fig, ax = figure()
    for name in tasks:
        rows = [r for r in records if r.get("event") == "task" and r.get("task") == name]
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["acc"] for r in rows], "o-", ms=4, label=f"{name} acc")
        ax.plot(steps, [r["acc_norm"] for r in rows], "s--", ms=4, label=f"{name} acc_norm")
        if all("acc_bytes" in r for r in rows):  # runs before acc_bytes was logged have none
            ax.plot(steps, [r["acc_bytes"] for r in rows], "^:", ms=4, label=f"{name} acc_bytes")
    ax.set(xlabel="step", ylabel="accuracy", ylim=(0, 1))
    ax.legend(fontsize=8)
    return fig


def _lines(records: Records, keys: list[str], ylabel: str, log: bool = False):
    drawn = [(k, *_series(records, "step", k)) for k in keys]
    drawn = [d for d in drawn if d[1]]
    if not drawn:
        return None
    fig, ax = figure()
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
    fig, ax = figure()
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
    fig, ax = figure()
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
    ("Cost so far", lambda r: _lines(r, ["cost_so_far"], "cost") if _any_nonzero(r, "cost_so_far") else None),
]


def _any_nonzero(records: Records, key: str) -> bool:
    return any(r.get(key) for r in records if r.get("event") == "step")


# Added after "Loss": loss against tokens and time, bits per byte, the update size and downstream tasks.
TRAINING_PLOTS[1:1] = [
    ("Loss against tokens seen and training time", plot_loss_by_tokens_and_time),
    ("Update-to-weight ratio ‖Δw‖/‖w‖ (every train.update_ratio_every steps)",
     lambda r: _lines(r, ["update_to_weight"], "‖Δw‖ / ‖w‖", log=True)),
    ("Downstream tasks (eval.tasks)", plot_tasks),
]


# --- data stage ----------------------------------------------------------------------------------

def _bars(counts: dict[str, float], xlabel: str, top: int = 25):
    if not counts:
        return None
    items = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    fig, ax = figure()
    fig.set_figheight(max(2.0, 0.28 * len(items) + 1))
    ax.barh([k for k, _ in items][::-1], [v for _, v in items][::-1], color="tab:blue")
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", labelsize=9)
    return fig


def plot_kept_rejected(stats: dict):
    docs = stats.get("documents") or {}
    counts = {
        "kept": docs.get("kept", 0),
        **{f"rejected: {k}": v for k, v in (stats.get("rejected_by_reason") or {}).items()},
    }
    return _bars({k: v for k, v in counts.items() if v}, "documents")


def plot_sources(stats: dict):
    by_source = stats.get("by_source") or {}
    if not by_source:
        return None
    items = list(by_source.items())[:25]
    fig, ax = figure()
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
    """Cluster sizes (size -> number of clusters) from stats.json's `dedup.cluster_sizes`, when the data
    stage wrote it."""
    sizes = (stats.get("dedup") or {}).get("cluster_sizes") if isinstance(stats.get("dedup"), dict) else None
    if not sizes:
        return None
    return _bars({f"{k} documents": v for k, v in sizes.items()}, "clusters")


STAGE_ORDER = ["read", "extract", "language", "quality", "dedup"]


def plot_funnel(stats: dict):
    """Documents left after each stage, in the order the stages run: read -> extract -> language -> quality -> dedup."""
    read = (stats.get("documents") or {}).get("read")
    by_stage = stats.get("rejected_by_stage") or {}
    if not read:
        return None
    stages = STAGE_ORDER[:-1] + [s for s in by_stage if s not in STAGE_ORDER] + ["dedup"]
    names, counts, left = ["documents read"], [read], read
    for stage in stages:
        if stage == "read" and not by_stage.get("read"):
            continue  # nothing unreadable: "after read" would repeat the first bar
        left -= by_stage.get(stage, 0)
        names.append(f"after {stage}")
        counts.append(left)
    fig, ax = figure()
    fig.set_figheight(2.8)
    bars = ax.barh(names[::-1], counts[::-1], color="tab:blue")
    ax.bar_label(bars, labels=[f"{c:,} ({c / read:.0%})" for c in counts[::-1]], fontsize=9, padding=3)
    ax.set_xlim(0, read * 1.25)
    ax.set_xlabel("documents")
    return fig


def plot_rejections_by_language(stats: dict, top_langs: int = 12, top_reasons: int = 7):
    """Stacked bars: per language (as language ID saw it; 'unknown' = dropped before it ran), the reasons."""
    by_lang = stats.get("rejected_by_lang") or {}
    if not by_lang:
        return None
    langs = list(by_lang)[:top_langs]
    totals: dict[str, int] = {}
    for lang in langs:
        for reason, n in by_lang[lang].items():
            totals[reason] = totals.get(reason, 0) + n
    reasons = sorted(totals, key=lambda r: -totals[r])[:top_reasons]
    fig, ax = figure()
    fig.set_figheight(max(2.2, 0.38 * len(langs) + 1.4))
    left = [0] * len(langs)
    for reason in reasons + ["other"]:
        vals = [sum(n for r, n in by_lang[lang].items() if r not in reasons) if reason == "other"
                else by_lang[lang].get(reason, 0) for lang in langs]
        if any(vals):
            ax.barh(langs[::-1], vals[::-1], left=left[::-1], label=reason)
            left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("rejected documents")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), title="reason", title_fontsize=8)
    return fig


def plot_lengths(stats: dict):
    """Document length histograms (characters, power-of-two bins), kept and rejected side by side."""
    hist = stats.get("length_histogram") or {}
    bins = sorted({int(b) for h in hist.values() for b in h})
    if not bins:
        return None
    import numpy as np

    fig, ax = figure()
    x = np.arange(len(bins))
    for i, (name, color) in enumerate([("kept", "tab:blue"), ("rejected", "tab:orange")]):
        counts = [hist.get(name, {}).get(str(b), 0) for b in bins]
        ax.bar(x + (i - 0.5) * 0.4, counts, width=0.4, label=name, color=color)
    ax.set_xticks(x, [_chars(b) for b in bins], fontsize=8, rotation=45)
    ax.set(xlabel="document length (characters, bins from the value shown)", ylabel="documents")
    ax.legend(fontsize=8)
    return fig


def _chars(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k" if n >= 1000 else str(n)


DATA_PLOTS: list[tuple[str, Callable[[dict], Any]]] = [
    ("Funnel: documents left after each stage", plot_funnel),
    ("Documents kept and rejected by reason", plot_kept_rejected),
    ("Rejections per language", plot_rejections_by_language),
    ("Document lengths", plot_lengths),
    ("Kept documents by language", lambda s: _bars(s.get("kept_by_lang") or {}, "documents")),
    ("Documents by source", plot_sources),
    ("Near-duplicate clusters", plot_dedup_clusters),
]


# --- the page ------------------------------------------------------------------------------------

def with_tables(stats: dict, docs_dir: Path, inputs: int = 25, sources: int = 20) -> dict:
    """stats.json with the rows the data section shows taken from its per-source tables (kiln.data.tables): the
    first `inputs` inputs, the `sources` largest sources by characters and their weights, each table streamed
    (and verified) once, holding those rows only. A stats.json that holds the tables itself (older) as it is."""
    if "tables" not in stats:
        return stats
    from kiln.data.tables import largest, rows

    try:
        first: list[dict] = []
        for row in rows(docs_dir, "by_source"):
            if len(first) < inputs:
                first.append(row)
        top = largest(docs_dir, "composition_by_source", "chars", sources)
        wanted = {r["source"] for r in top}
        weights = {r.pop("source"): r for r in rows(docs_dir, "source_weights") if r["source"] in wanted}
    except KilnError as exc:
        return stats | {"tables_error": str(exc)}
    return stats | {"by_source": {r.pop("source"): r for r in first}, "source_weights": weights,
                    "composition": (stats.get("composition") or {}) | {"by_source": {r.pop("source"): r for r in top}}}


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
            out.append(f"<h3>Corpus by {label}</h3>" + table(rows, columns))
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
    for r in records:  # train.init_from: where the run's weights came from
        if r.get("event") == "init_from":
            what = "weights and optimizer state" if r.get("optimizer") else "weights only"
            rows.insert(0, {"what": "started from", "value": f"{r['checkpoint']} (step {r['checkpoint_step']} of the "
                            f"run {r['run']}; its manifest.json sha256 {r['sha256']}; {what})"})
    if steps:
        times = sorted(float(r.get("step_time_s") or 0) for r in steps)
        rates = sorted(float(r.get("tokens_per_s") or 0) for r in steps)
        rows += [{"what": "training time (sum of step times)", "value": f"{sum(times) / 60:.1f} min"},
                 {"what": "tokens/s (median)", "value": rates[len(rates) // 2]}]
        mfus = [r["mfu"] for r in steps if isinstance(r.get("mfu"), (int, float))]
        rows.append({"what": "MFU (median)", "value": f"{sorted(mfus)[len(mfus) // 2]:.1%}" if mfus else
                     "not reported: the device's peak FLOP/s is unknown (set train.peak_tflops)"})
    for r in records:
        if r.get("event") == "task":
            rows.append({"what": f"task {r['task']} at step {r['step']}",
                         "value": f"acc {r['acc']:.3f}, acc_norm {r['acc_norm']:.3f}"
                                  + (f", acc_bytes {r['acc_bytes']:.3f}" if "acc_bytes" in r else "")
                                  + f" (n {r['n']})"})
    return [r for r in rows if r["value"] is not None]


def _read_yaml(path: Path) -> dict | None:
    from kiln.config import parse_yaml

    import yaml

    try:
        data = parse_yaml(path.read_bytes())
    except (OSError, ValueError, yaml.YAMLError):  # a missing or damaged file: the report says so instead of failing
        return None
    return data if isinstance(data, dict) else None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tokenizer_rows(out_dir: Path, config: dict | None) -> list[dict]:
    """Vocabulary asked and reached, bytes per token, packing efficiency and tokens per split (when recorded)."""
    rows: list[dict] = []
    tok = _read_json(RunLayout(out_dir).tokenizer / "manifest.json")
    asked = ((config or {}).get("tokenizer") or {}).get("vocab_size")
    if tok:
        reached = tok.get("vocab_size")
        own = ((config or {}).get("tokenizer") or {}).get("path")
        rows.append({"what": "vocabulary", "value": f"{fmt(reached)} (your own: {own})" if own else
                     f"{fmt(reached)} reached of {fmt(asked)} asked" if asked else fmt(reached)})
    shards = _read_json(RunLayout(out_dir).shards / "manifest.json")
    if shards:
        text_bytes = shards.get("text_bytes") or {}
        for split, info in (shards.get("splits") or {}).items():
            rows.append({"what": f"{split} tokens / samples / documents",
                         "value": " / ".join(fmt(info.get(k)) for k in ("tokens", "samples", "documents"))})
            if text_bytes.get(split) and info.get("tokens"):
                rows.append({"what": f"{split} bytes per token", "value": text_bytes[split] / info["tokens"]})
        if shards.get("packing_efficiency") is not None:
            rows.append({"what": f"packing efficiency ({shards.get('mode', 'concat')})",
                         "value": f"{shards['packing_efficiency']:.2%}"})
    return rows


def plot_bits_per_byte(records: Records, bytes_per_token: float | None):
    """Validation loss in bits per byte: comparable across tokenizers (nats/token / ln 2 / bytes per token)."""
    vsteps, vloss = _series(records, "eval", "val_loss")
    if not vsteps or not bytes_per_token:
        return None
    fig, ax = figure()
    ax.plot(vsteps, [v / math.log(2) / bytes_per_token for v in vloss], "o-", ms=4, color="tab:green")
    ax.set(xlabel="step", ylabel="bits per byte")
    return fig


def config_changes(config: dict) -> list[dict]:
    """The keys of a run's config.yaml that differ from Kiln's defaults, dotted, with the default."""
    from kiln.config import Config

    defaults = Config().model_dump(mode="json")
    rows = []

    def walk(value, default, key):
        if isinstance(value, dict) and isinstance(default, dict):
            for k, v in value.items():
                walk(v, default.get(k), f"{key}.{k}" if key else k)
        elif value != default:
            rows.append({"key": key, "value": json.dumps(value), "default": json.dumps(default)})

    walk(config, defaults, "")
    return rows


def _checkpoints(run_dir: Path) -> str:
    from kiln.checkpoint import checkpoint_table

    rows = checkpoint_table(checkpoints_of(run_dir))
    if not rows:
        return "<p>No checkpoints.</p>"
    for r in rows:
        r["path"] = Path(r["path"]).name
        r["valid"] = "yes" if r["valid"] else "NO"
    return table(rows, ["path", "step", "valid", "tokens_seen", "val_loss", "problem"])


def run_folder(path: Path) -> Path:
    """The run folder itself, or an out_dir's run/."""
    path = Path(path)
    if not (path / "metrics.jsonl").is_file() and (RunLayout(path).run / "metrics.jsonl").is_file():
        return RunLayout(path).run
    return path
def hardware_section(records: Records) -> str:
    """Telemetry (kiln.train.telemetry): the GPU's figures, the allocator's memory, the ranks' spread, and the
    alerts; empty when the run recorded none (telemetry off)."""
    plots = [("GPU utilisation, temperature and power", ["gpu_util_pct", "gpu_temp_c", "gpu_power_w"], "", False),
             ("GPU clocks (MHz)", ["gpu_sm_clock_mhz", "gpu_mem_clock_mhz"], "MHz", False),
             ("GPU memory (GiB): allocated, reserved, fragmentation (reserved - allocated)",
              ["mem_allocated_gb", "mem_reserved_gb", "mem_fragmentation_gb", "gpu_mem_used_gb"], "GiB", False),
             ("CUDA allocation retries", ["mem_alloc_retries"], "retries", False),
             ("PCIe throughput (MB/s)", ["pcie_tx_mb_s", "pcie_rx_mb_s"], "MB/s", False),
             ("Compute time per step across ranks (s): median rank and slowest",
              ["rank_compute_median_s", "rank_compute_max_s"], "seconds", False)]
    parts = [figure_html(title, fig) for title, keys, ylabel, log in plots
             if (fig := _lines(records, keys, ylabel, log)) is not None]
    alerts = [r for r in records if r.get("event") == "alert"]
    if alerts:
        parts.append(f"<p>{len(alerts)} alert(s):</p>" + table(alerts, ["step", "kind", "rank", "host", "message"]))
    return "<h2>Hardware</h2>" + "".join(parts) if parts else ""


def render(run_dir: Path) -> str:
    run_dir = run_folder(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise KilnError(f"{run_dir}: no metrics.jsonl; give the run folder `kiln train` wrote ({{out_dir}}/run)")
    records, bad = read_records(metrics)
    parts = [f"<h1>Kiln run report</h1><p>{html.escape(str(run_dir.resolve()))}<br>written "
             f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</p>"]
    if bad:
        parts.append(f'<p class="bad">{bad} unreadable line(s) in metrics.jsonl were left out.</p>')
    parts.append("<h2>Summary</h2>" + table(_summary(records), ["what", "value"]))
    parts.append("<h2>Training</h2>")
    for title, plot in TRAINING_PLOTS:
        if (fig := plot(records)) is not None:
            parts.append(figure_html(title, fig))
    config_file = run_dir / "config.yaml"
    config = _read_yaml(config_file)
    shards = _read_json(RunLayout.of_run(run_dir).shards / "manifest.json") or {}
    val = (shards.get("splits") or {}).get("val") or {}
    val_bytes = (shards.get("text_bytes") or {}).get("val")
    if (fig := plot_bits_per_byte(records, val_bytes / val["tokens"] if val_bytes and val.get("tokens") else None)):
        parts.append(figure_html("Validation bits per byte (validation loss / ln 2 / the split's bytes per token)",
                                  fig))
    if not any(isinstance(r.get("mfu"), (int, float)) for r in records if r.get("event") == "step"):
        parts.append("<p>MFU is not plotted: the run's device has no peak FLOP/s in Kiln's table (a CPU, or an "
                     "unlisted GPU); set <code>train.peak_tflops</code> to report it.</p>")
    parts.append(hardware_section(records))
    stats_file = RunLayout.of_run(run_dir).docs / "stats.json"
    parts.append("<h2>Data</h2>")
    if stats_file.is_file():
        stats = with_tables(json.loads(stats_file.read_text()), stats_file.parent)
        docs = stats.get("documents") or {}
        parts.append(f"<p>{html.escape(str(stats_file))}: read {docs.get('read')}, kept {docs.get('kept')}, "
                     f"rejected {docs.get('rejected')}.</p>")
        if "tables_error" in stats:
            parts.append(f"<p>Per-source tables not shown: {html.escape(stats['tables_error'])}</p>")
        parts.append(composition_table(stats))
        for title, plot in DATA_PLOTS:
            if (fig := plot(stats)) is not None:
                parts.append(figure_html(title, fig))
    else:
        parts.append(f"<p>No data-stage statistics at {html.escape(str(stats_file))}.</p>")
    if rows := tokenizer_rows(run_dir.parent, config):
        parts.append("<h3>Tokenizer and packing</h3>" + table(rows, ["what", "value"]))
    if (fig := _bars(shards.get("tokens_by_lang") or {}, "tokens")) is not None:
        parts.append(figure_html("Tokens per language (both splits)", fig))
    parts.append("<h2>Checkpoints</h2>" + _checkpoints(run_dir))
    if config is None:
        parts.append("<h2>Config</h2><p>No config.yaml in the run folder.</p>")
    else:
        changes = config_changes(config)
        parts.append("<h2>Config</h2><p>Keys that differ from Kiln's defaults "
                     f"(<code>kiln config show {html.escape(str(config_file))}</code> explains every key):</p>"
                     + (table(changes, ["key", "value", "default"]) if changes else "<p>none</p>")
                     + f"<details><summary>the whole config.yaml</summary><pre>{html.escape(config_file.read_text())}"
                     "</pre></details>")
    return page("Kiln report", parts)


REPORT_MARKER = "<!-- written by kiln report -->\n"  # what lets a later `kiln report` replace this file


def check_replaceable_report(out: Path) -> None:
    """`out` is free or a report Kiln wrote (its marker, or the title reports had before it); else refuse."""
    check_replaceable_page(out, REPORT_MARKER, "kiln report", legacy_title="Kiln report")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    out = Path(out) if out is not None else run_folder(run_dir) / "report.html"
    return write_page(out, REPORT_MARKER, render(run_dir), "kiln report", legacy_title="Kiln report")
