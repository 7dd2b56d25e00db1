"""`kiln report`: a self-contained report.html with every plot, rendered in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import tiny_config
from kiln.cli import main as kiln
from kiln.errors import KilnError
from kiln.ops.report import render
from kiln.train.trainer import Trainer

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def run_dir(prepared, tmp_path_factory):
    """A real 6-step run, its data stage's stats, and the events a long run adds (skips, a rollback)."""
    out = tmp_path_factory.mktemp("report") / "out"
    for name in ("docs", "tokenizer", "shards"):  # the docs folder: stats.json and its per-source tables
        shutil.copytree(prepared.out / name, out / name)
    stats = json.loads((prepared.out / "docs" / "stats.json").read_text())
    stats["dedup"] = {"cluster_sizes": {"2": 5, "3": 1}}  # the near-dedup stage's figure, when it reports one
    (out / "docs" / "stats.json").write_text(json.dumps(stats))
    Trainer(tiny_config(out, train={"max_steps": 6, "eval_every": 3, "update_ratio_every": 2}, checkpoint={"every": 3}),
            log=lambda *_: None).run()
    metrics = out / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    extra = [{"event": "skip", "step": 4, "reason": "loss_spike", "data_position": 32},
             {"event": "rollback", "step": 5, "to_step": 3, "reason": "3 skipped steps"}]
    steps = [json.loads(ln) for ln in lines if json.loads(ln).get("event") == "step"]
    for s in steps:  # per-group gradient norms, as the trainer writes them when enabled
        for g in ("embeddings", "lower", "middle", "upper"):
            s.setdefault(f"grad_norm/{g}", s["grad_norm"] / 2)
    others = [json.loads(ln) for ln in lines if json.loads(ln).get("event") != "step"]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in steps + others + extra) + '{"event": "step", "ste')
    return out / "run"


def test_report_has_every_plot_and_the_runs_tables(run_dir, tmp_path, capsys):
    out = tmp_path / "r" / "report.html"
    assert kiln(["report", str(run_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    for want in (
        "Loss",
        "Learning rate",
        "Gradient norm",
        "Throughput",
        "Peak memory",
        "Step time split",
        "Documents kept and rejected",
        "Kept documents by language",
        "Documents by source",
        "Near-duplicate clusters",
    ):
        assert any(c.startswith(want) for c in captions), (want, captions)
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', page)) == len(captions)
    # Self-contained: nothing refers to another file or the network.
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page and "<link" not in page
    assert "1 unreadable line(s)" in page  # the cut last line
    assert page.count("step-0000000") == 2 and "train:" in page and "max_steps: 6" in page  # checkpoints, config
    assert re.search(r"<td>skipped steps</td><td>1</td>", page) and re.search(r"<td>rollbacks</td><td>1</td>", page)


def test_report_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(KilnError, match="no metrics.jsonl"):
        render(tmp_path)


CHECK_SCRIPT = """<script>
window.kilnErrors = [];
window.addEventListener('error', e => kilnErrors.push(e.message || (e.target && e.target.tagName)), true);
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const loaded = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  const d = document.createElement('div');
  d.id = 'kiln-check';
  d.textContent = 'images=' + imgs.length + ' loaded=' + loaded + ' errors=' + kilnErrors.length;
  document.body.appendChild(d);
});
</script>"""


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (.ci/run installs it for CI)")
def test_report_renders_in_headless_chromium_with_every_image_loaded(run_dir, tmp_path):
    page = render(run_dir)
    n_images = page.count("<img ")
    # The check script goes into a copy: the report itself carries no script.
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("<head>", "<head>" + CHECK_SCRIPT, 1))
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    marker = re.search(r'<div id="kiln-check">images=(\d+) loaded=(\d+) errors=(\d+)</div>', result.stdout)
    assert marker, result.stdout[-2000:]
    assert (int(marker[1]), int(marker[2]), int(marker[3])) == (n_images, n_images, 0)
    assert n_images >= 10


def test_report_has_the_users_plots_rounded_numbers_and_the_config_changes(run_dir):
    page = render(run_dir)
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    for want in ("Loss against tokens seen and training time", "Update-to-weight ratio", "Validation bits per byte",
                 "Funnel: documents left after each stage", "Rejections per language", "Document lengths",
                 "Tokens per language"):
        assert any(c.startswith(want) for c in captions), (want, captions)
    assert not any(c.startswith("Cost so far") for c in captions)  # no price set: not a flat zero line
    assert "MFU is not plotted: the run's device has no peak FLOP/s" in page  # a CPU run says why
    assert re.search(r"<td>last train loss</td><td>\d\.\d{4}</td>", page)  # not 7.055826187133789
    assert re.search(r"<td>packing efficiency \(concat\)</td><td>\d+\.\d\d%</td>", page)
    assert re.search(r"<td>train bytes per token</td><td>\d\.\d{4}</td>", page)
    assert "<td>train.max_steps</td><td>6</td><td>100</td>" in page and "<details><summary>" in page


def test_data_stage_and_pack_count_what_the_report_shows(prepared):
    from kiln.data.docs import read_docs
    from kiln.shards.pack import split_of

    stats = json.loads((prepared.out / "docs" / "stats.json").read_text())
    docs = stats["documents"]
    assert sum(sum(r.values()) for r in stats["rejected_by_lang"].values()) == docs["rejected"]
    by_reason: dict[str, int] = {}
    for reasons in stats["rejected_by_lang"].values():
        for reason, n in reasons.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    assert by_reason == stats["rejected_by_reason"]
    assert sum(stats["length_histogram"]["kept"].values()) == docs["kept"]
    kept = list(read_docs(prepared.out / "docs"))
    for doc in kept[:50]:  # each kept document in the bin of its length
        assert (
            0 < int(max(b for b in stats["length_histogram"]["kept"] if int(b) <= len(doc["text"]))) <= len(doc["text"])
        )
    shards = json.loads((prepared.out / "shards" / "manifest.json").read_text())
    # every document token (EOS included) lands in a sample or the dropped tail; padding is no document's
    assert sum(shards["tokens_by_lang"].values()) == sum(s["tokens"] - s["pad_tokens"] + s["dropped_tail_tokens"]
                                                         for s in shards["splits"].values())
    val = prepared.pack.val_fraction
    assert shards["text_bytes"] == {s: sum(len(d["text"].encode()) for d in kept if split_of(d["id"], val) == s)
                                    for s in ("train", "val")}
