"""Self-contained HTML pages (`kiln report`'s report.html, `kiln ablate`'s ablation.html, `kiln mix`'s mix.html):
matplotlib figures embedded as base64 PNGs, tables, one stylesheet inline; a page loads nothing else (no scripts,
fonts or stylesheets from anywhere), so it opens offline and can be mailed as one file.

A page's first line is the marker of the command that wrote it: that command replaces only a page with its
marker (`write_page`), never a file a person put there.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.manifest import write_atomic

Records = list[dict[str, Any]]
DPI = 110  # 880 px wide figures: sharp at the page's width, text readable without zooming

CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:62em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;margin-top:2em}figure{margin:1em 0}
figcaption{font-weight:600;margin-bottom:.3em}img{max-width:100%}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}.bad{color:#b00}"""

SMOOTHING = 0.9  # EMA weight of the past: about the last 10 steps


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


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased at the start (as TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def figure():
    """(figure, axes) of the pages' one size."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.4), dpi=DPI, layout="constrained")
    return fig, fig.add_subplot()


def png(fig) -> str:
    """The figure as a base64 PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode()


def figure_html(title: str, fig) -> str:
    return (f'<figure><figcaption>{html.escape(title)}</figcaption>'
            f'<img alt="{html.escape(title)}" src="data:image/png;base64,{png(fig)}"></figure>')


def fmt(value: Any) -> str:
    """A number as a person reads it: 7.0558 not 7.055826187133789, 1,234,567 not 1234567."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}" if abs(value) < 0.01 and value else f"{value:.4f}"


def table(rows: list[dict], columns: list[str]) -> str:
    """An HTML table of `rows` under `columns`, every cell escaped (numbers through `fmt`)."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def page(title: str, parts: list[str], css: str = "") -> str:
    """The whole document: `parts` (already HTML) under the pages' stylesheet plus `css`."""
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}{css}</style></head><body>{''.join(parts)}</body></html>\n")


def written_by(path: Path, marker: str, legacy_title: str | None = None) -> bool:
    """`path` is a page `marker`'s command wrote (or, for pages from before markers, one titled `legacy_title`)."""
    head = path.read_bytes()[:512] if path.is_file() else b""
    return head.startswith(marker.encode()) or bool(legacy_title and f"<title>{legacy_title}</title>".encode() in head)


def check_replaceable_page(out: Path, marker: str, command: str, legacy_title: str | None = None) -> None:
    """`out` is free or a page `command` wrote; else one line, and nothing is replaced."""
    if out.exists() and not written_by(out, marker, legacy_title):
        raise KilnError(f"{out} exists and is not a page {command} wrote; move it away or choose another output "
                        f"({command} replaces only its own page)")


def write_page(out: Path, marker: str, document: str, command: str, legacy_title: str | None = None) -> Path:
    """Write `document` to `out` atomically after `marker`, replacing only a page `command` wrote."""
    check_replaceable_page(out, marker, command, legacy_title)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, marker + document)
    return out
