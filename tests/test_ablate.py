"""`kiln ablate`: real runs of small ablations (Kiln's own stages, real training), what they write, how they
resume, and the one-line errors on bad input. The statistics alone: test_ablate_stats.py.

The data (tests/ablate_data.py) come from the bundled sample crawl: clean prose, junk without the reference
set's words, a reference set and a multiple-choice task from held-out pages.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ablate_data import GATES_OFF, junk, prose, questions, vocabulary, write_jsonl
from conftest import ROOT
from kiln.ablate.stats import BETTER, SAME
from kiln.cli import main as kiln

CHROMIUM = Path("/usr/bin/chromium")
TINY = {"seed": 7, "data": {"workers": 1}, "tokenizer": {"vocab_size": 300, "max_docs": 20},
        "pack": {"seq_len": 128, "val_fraction": 0.1},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
        "train": {"max_steps": 12, "batch_size": 1, "lr": 3e-3, "warmup_steps": 2, "eval_every": 0,
                  "eval_batches": 2, "log_every": 6, "threads": 1},
        "checkpoint": {"every": 4, "keep_last": 2}, "watchdog": {"enabled": False}}


def nested(flat: dict) -> dict:
    """{"data.min_chars": 0} -> {"data": {"min_chars": 0}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _merge(a: dict, b: dict) -> dict:
    return {**a, **{k: _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


TINY = _merge(TINY, nested(GATES_OFF))  # every gate off: each arm trains on exactly the text it names


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """clean.jsonl (40 documents, two of which are, or nearly are, reference documents), junk.jsonl (as many
    characters), eval/reference.jsonl (12), eval/mc.jsonl (12 questions), base.yaml (TINY, every gate off)."""
    folder = tmp_path_factory.mktemp("ablate-corpus")
    train, reference = prose()
    train, reference = train[:40], reference[:12]
    near = reference[1].replace(" the ", " a ", 1)
    write_jsonl(folder / "clean.jsonl", train[:38] + [reference[0], near])
    write_jsonl(folder / "junk.jsonl", junk(sum(map(len, train)), vocabulary(reference)))
    write_jsonl(folder / "eval" / "reference.jsonl", reference)
    (folder / "eval" / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions(reference, n=12)))
    (folder / "base.yaml").write_text(yaml.safe_dump({**TINY, "out_dir": "unused"}))
    return folder


DROP = object()  # write_ablation(key=DROP): the key left out


def write_ablation(folder: Path, name: str = "ablation.yaml", **changes) -> Path:
    spec = {"base": "base.yaml", "out_dir": f"out-{Path(name).stem}", "seeds": [1, 2], "baseline": "clean",
            "arms": [{"name": "clean", "set": {"data.inputs": ["clean.jsonl"]}},
                     {"name": "junk", "set": {"data.inputs": ["clean.jsonl", "junk.jsonl"]}}],
            "eval": {"text": {"reference": "eval/reference.jsonl"}, "tasks": [{"name": "mc", "path": "eval/mc.jsonl"}]}}
    spec = {k: v for k, v in {**spec, **changes}.items() if v is not DROP}
    path = folder / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def without_timings(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "timings_s"}


@pytest.fixture(scope="module")
def small(corpus) -> Path:
    """The out_dir of a finished 2-arm x 2-seed ablation (12 training steps a run)."""
    path = write_ablation(corpus)
    assert kiln(["ablate", str(path)]) == 0
    return corpus / "out-ablation"


# --- what an ablation writes --------------------------------------------------------------------------------------

def test_every_arm_and_seed_is_a_run_folder_with_one_tokenizer_and_one_budget(small):
    data = json.loads((small / "ablation.json").read_text())
    tokenizer = (small / "tokenizer" / "tokenizer.json").read_bytes()
    for arm in ("clean", "junk"):
        assert (small / arm / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer  # one tokenizer for all
        shards = json.loads((small / arm / "shards" / "manifest.json").read_text())
        for seed in (1, 2):
            run = small / arm / f"seed-{seed}"
            assert (run / "run" / "checkpoints" / "step-00000012" / "manifest.json").is_file()
            assert (run / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer
            config = yaml.safe_load((run / "run" / "config.yaml").read_text())
            assert config["seed"] == seed and config["loader"]["sources"][0]["path"] == str(small / arm / "shards")
            assert (run / "eval.json").is_file()
        assert shards["tokenizer_sha256"] == data["tokenizer"]["sha256"]
    # The tokenizer's sample is drawn evenly: tokenizer.max_docs 20 = 10 from each arm's kept documents.
    sampled = (small / "tokenizer" / "training_docs.txt").read_text().split()
    assert len(sampled) == 20 and all(s.startswith("clean-") for s in sampled[:10])
    assert sum(s.startswith("junk-") for s in sampled[10:]) >= 5
    budgets = {a["name"]: a["data"]["tokens_per_run"] for a in data["arms"]}
    assert budgets == {"clean": 12 * 1 * 128, "junk": 12 * 1 * 128}
    epochs = {a["name"]: a["data"]["epochs"] for a in data["arms"]}
    assert epochs["junk"] < epochs["clean"] and all(a["data"]["train_tokens"] > 0 for a in data["arms"])


def test_ablation_json_holds_every_number_and_a_comparison_per_metric(small):
    data = json.loads((small / "ablation.json").read_text())
    metrics = [m["name"] for m in data["metrics"]]
    assert metrics == ["reference/bits_per_byte", "val_loss", "mc/acc", "mc/acc_norm", "mc/acc_bytes"]
    assert [m["name"] for m in data["metrics"] if m["per_arm"]] == ["val_loss"]  # each arm's own split
    assert [(c["arm"], c["metric"]) for c in data["comparisons"]] == [("junk", m) for m in metrics if m != "val_loss"]
    for c in data["comparisons"]:
        assert {"arm", "baseline", "metric", "diff", "ci_low", "ci_high", "p", "p_holm", "verdict",
                "min_detectable"} <= set(c)
        assert c["baseline"] == "clean" and c["verdict"] in ("better", "worse", SAME) and c["pairs"] == 2
        assert c["ci_low"] <= c["diff"] <= c["ci_high"] and c["p"] <= c["p_holm"] <= 1
    for arm in data["arms"]:
        assert [r["seed"] for r in arm["runs"]] == [1, 2]
        for r in arm["runs"]:
            assert r["finished"] and r["folder"].endswith(f"{arm['name']}/seed-{r['seed']}")
            assert r["checkpoint"] == "step-00000012" and len(r["weights_sha256"]) == 64 and len(r["fingerprint"]) == 16
            assert set(r["metrics"]) == set(metrics) and 0 < r["metrics"]["reference/bits_per_byte"] < 16
        assert arm["mean"]["val_loss"] == pytest.approx(sum(r["metrics"]["val_loss"] for r in arm["runs"]) / 2)
        assert arm["data"]["documents"]["kept"] == arm["data"]["documents"]["read"] > 0  # every gate off
    # A run's bits per byte is its eval.json's bits over the kept documents' bytes.
    run = json.loads((small / "clean" / "seed-1" / "eval.json").read_text())
    rows = (small.parent / "eval" / "reference.jsonl").read_text().splitlines()
    kept = [json.loads(line)["text"] for line in rows][2:]
    assert len(run["text"]["reference"]["bits"]) == 10 and len(run["tasks"]["mc"]["acc"]) == 12
    assert sum(run["text"]["reference"]["bits"]) / sum(len(t.encode()) for t in kept) == pytest.approx(
        data["arms"][0]["runs"][0]["metrics"]["reference/bits_per_byte"])


def test_eval_documents_in_an_arms_training_data_are_dropped_and_reported(small):
    """clean.jsonl holds reference document 0 verbatim and document 1 with one word changed: both are dropped
    from every arm's evaluation, each reported with the arm(s) and the test that found it."""
    data = json.loads((small / "ablation.json").read_text())
    ref = data["eval"]["reference"]
    assert (ref["units"], ref["kept"]) == (12, 10)
    found = {(r["arm"], r["index"], r["kind"]) for r in ref["dropped"]}
    assert found == {(arm, 0, "exact") for arm in ("clean", "junk")} | {(arm, 1, "near_duplicate")
                                                                          for arm in ("clean", "junk")}
    assert all(r["similarity"] >= 0.8 and r["train_id"].startswith("clean-") for r in ref["dropped"])
    assert data["eval"]["mc"]["kept"] == 12


def test_the_same_command_again_skips_everything_and_writes_the_same_json(small, corpus, capsys):
    before = json.loads((small / "ablation.json").read_text())
    checkpoints = {p: p.stat().st_mtime_ns for p in small.glob("*/seed-*/run/checkpoints/step-*/manifest.json")}
    capsys.readouterr()
    assert kiln(["ablate", str(corpus / "ablation.yaml")]) == 0
    err = capsys.readouterr().err
    assert "data: skipping" in err and "tokenizer: skipping" in err and "pack: skipping" in err
    assert "measure:" not in err and "step 1/" not in err
    assert {p: p.stat().st_mtime_ns for p in checkpoints} == checkpoints
    assert without_timings(json.loads((small / "ablation.json").read_text())) == without_timings(before)


def test_report_compares_what_has_finished_and_a_run_trained_by_hand_counts(corpus, capsys):
    """`--until pack` prepares every arm and leaves each run's config; one run trained by hand with `kiln train`
    (as under torchrun); `--only` two of three arms, then `kiln ablate report DIR`: the run trained by hand is
    measured, not trained again; the arm that has not run is `not run`."""
    path = write_ablation(corpus, "partial.yaml", arms=[
        {"name": "clean", "set": {"data.inputs": ["clean.jsonl"]}},
        {"name": "junk", "set": {"data.inputs": ["clean.jsonl", "junk.jsonl"]}},
        {"name": "clean-again", "set": {"data.inputs": ["clean.jsonl"]}, "seeds": [3, 4]}])
    out = corpus / "out-partial"
    assert kiln(["ablate", str(path), "--until", "pack"]) == 0
    assert not list(out.glob("*/seed-*/run"))
    by_hand = out / "clean-again" / "seed-3"
    assert kiln(["train", str(by_hand / "config.yaml")]) == 0
    final = by_hand / "run" / "checkpoints" / "step-00000012" / "manifest.json"
    before = final.stat().st_mtime_ns
    capsys.readouterr()
    assert kiln(["ablate", str(path), "--only", "clean,clean-again"]) == 0
    err = capsys.readouterr().err
    assert final.stat().st_mtime_ns == before and "measure: seed-3 of clean-again" in err
    assert err.count("train: 12 steps") == 3  # clean's two runs and clean-again's seed 4
    assert not (out / "ablation.json").exists() and not (out / "junk" / "seed-1" / "run").exists()
    capsys.readouterr()
    assert kiln(["ablate", "report", str(out)]) == 0
    data = json.loads((out / "ablation.json").read_text())
    verdicts = {(c["arm"], c["verdict"]) for c in data["comparisons"]}
    assert {v for a, v in verdicts if a == "junk"} == {"not run"}
    assert {v for a, v in verdicts if a == "clean-again"} <= {"better", "worse", SAME}
    clean_again = next(a for a in data["arms"] if a["name"] == "clean-again")
    assert clean_again["data_shared_with"] == "clean" and not (out / "clean-again" / "docs").exists()
    assert [r["finished"] for r in clean_again["runs"]] == [True, True]


CHECK_SCRIPT = """<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const d = document.createElement('div');
  d.id = 'kiln-check';
  d.textContent = 'images=' + imgs.length + ' loaded=' + imgs.filter(i => i.complete && i.naturalWidth > 0).length
    + ' first=' + document.querySelector('h2').textContent;
  document.body.appendChild(d);
});
</script>"""


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (.ci/run installs it for CI)")
def test_ablation_html_is_self_contained_and_renders_in_headless_chromium(small, tmp_path):
    page = (small / "ablation.html").read_text()
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page and "<link" not in page
    for caption in ("reference/bits_per_byte against clean", "Training loss per arm", "Funnel: documents left"):
        assert caption in page
    assert page.index("<h2>Verdicts</h2>") < page.index("<h2>Metrics</h2>") < page.index("<h2>Data</h2>")
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("<head>", "<head>" + CHECK_SCRIPT, 1))
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    marker = re.search(r'<div id="kiln-check">images=(\d+) loaded=(\d+) first=(\w+)</div>', result.stdout)
    assert marker, result.stdout[-2000:]
    # One figure per compared metric (reference bits/byte, mc's three accuracies: val_loss is a per-arm fact, not
    # compared), the training curves and the funnel.
    assert int(marker[1]) == int(marker[2]) == page.count("<img ") == page.count("<figcaption>") == 6
    assert marker[3] == "Verdicts"


# --- resuming -----------------------------------------------------------------------------------------------------

def _rerun_until_the_junk_arm_trains(small, corpus):
    """The finished ablation's junk runs and outputs removed, the same command started in a subprocess (its own
    process group) and left to run until the junk arm's first run has checkpointed step 4: (the uninterrupted
    ablation.json, the process, that run's checkpoints folder)."""
    whole = json.loads((small / "ablation.json").read_text())
    for gone in ("junk/seed-1", "junk/seed-2", "ablation.json", "ablation.html"):
        (shutil.rmtree if (small / gone).is_dir() else os.remove)(small / gone)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "ablate", str(corpus / "ablation.yaml")], cwd=corpus,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    checkpoints = small / "junk" / "seed-1" / "run" / "checkpoints"
    deadline = time.time() + 300
    while not (checkpoints / "step-00000004").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    return whole, proc, checkpoints


def test_kill_9_mid_ablation_then_the_same_command_gives_the_uninterrupted_json(small, corpus):
    """The finished ablation's junk runs and outputs removed, the same command in a subprocess, killed (SIGKILL,
    its whole process group) while the junk arm's first run trains, then run again: ablation.json is the
    uninterrupted one's, timings aside (training resumes bitwise from the newest checkpoint)."""
    whole, proc, checkpoints = _rerun_until_the_junk_arm_trains(small, corpus)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (small / "ablation.json").exists() and not (small / "junk" / "seed-2" / "eval.json").exists()
    assert not (checkpoints / "step-00000012").exists()  # killed mid-run, not between runs
    assert kiln(["ablate", str(corpus / "ablation.yaml")]) == 0
    assert without_timings(json.loads((small / "ablation.json").read_text())) == without_timings(whole)


@pytest.mark.slow
def test_sigterm_mid_ablation_checkpoints_exits_0_and_the_same_command_finishes_it(small, corpus):
    """Issue #37 item 15, for real: SIGTERM while the junk arm's first run trains: the run checkpoints, the
    ablation says so and exits 0 (as `kiln train` does); the same command again gives the uninterrupted json."""
    whole, proc, checkpoints = _rerun_until_the_junk_arm_trains(small, corpus)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1].decode()
    assert proc.returncode == 0, err[-2000:]
    assert f"stopped by SIGTERM: {small / 'junk' / 'seed-1'} checkpointed at step " in err, err[-2000:]
    assert not (checkpoints / "step-00000012").exists() and not (small / "junk" / "seed-2" / "run").exists()
    assert kiln(["ablate", str(corpus / "ablation.yaml")]) == 0
    assert without_timings(json.loads((small / "ablation.json").read_text())) == without_timings(whole)


def test_runs_of_an_edited_arm_are_refused_not_measured(small, corpus, capsys):
    """The ablation file with the clean arm edited (its data, hence the shared tokenizer, change): the runs
    trained before are refused with the trainer's message, never measured as if they were the new arm's."""
    original = (corpus / "ablation.yaml").read_text()
    path = write_ablation(corpus, "ablation.yaml", arms=[
        {"name": "clean", "set": {"data.inputs": ["clean.jsonl"], "data.min_chars": 600}},
        {"name": "junk", "set": {"data.inputs": ["clean.jsonl", "junk.jsonl"]}}])
    capsys.readouterr()
    try:
        assert kiln(["ablate", str(path)]) == 2
    finally:
        path.write_text(original)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"kiln: error: arm 'clean': {small / 'clean' / 'seed-1' / 'run' / 'checkpoints'}") and \
        "was trained on other data: the shards changed" in err and "the tokenizer changed" in err, err


# --- bad input: one line, before any work -------------------------------------------------------------------------

CLEAN = {"name": "clean", "set": {"data.inputs": ["clean.jsonl"]}}
BAD = {
    "unknown arm key": (dict(arms=[{"name": "clean", "sett": {}}, {"name": "junk"}]),
                        "unknown key 'arms.0.sett': did you mean arms.0.set?"),
    "unknown top-level key": (dict(baselin="clean"), "unknown key 'baselin': did you mean baseline?"),
    "two arms with one name": (dict(arms=[{"name": "clean"}, {"name": "clean", "set": {"data.min_chars": 5}}]),
                               "two arms are named 'clean'"),
    "a baseline that is not an arm": (dict(baseline="default"), "baseline 'default' is not an arm; the arms are "
                                                                "clean, junk"),
    "an empty seed list": (dict(seeds=[]), "the seed list is empty"),
    "an empty seed list of an arm": (dict(arms=[{"name": "clean"}, {"name": "junk", "seeds": []}]),
                                     "the seed list is empty"),
    "a typo in an arm's override": (dict(arms=[{"name": "clean"}, {"name": "junk",
                                                                   "set": {"data.quality.finweb.enabled": False}}]),
                                    "arm 'junk': unknown config key 'data.quality.finweb': did you mean "
                                    "data.quality.fineweb?"),
    "an arm that changes the model": (dict(arms=[{"name": "clean"}, {"name": "junk", "set": {"model.dim": 64}}]),
                                      "arm 'junk' sets 'model.dim': an arm may change only the data (data.*)"),
    # issue #37 item 3: guards and parallelism are the base config's, like the model
    "an arm that sets a guard": (dict(arms=[CLEAN, {"name": "junk", "set": {**CLEAN["set"],
                                                                           "guards.spike_zscore": 0.01}}]),
                                 "arm 'junk' sets 'guards.spike_zscore': an arm may change only the data (data.*)"),
    "an arm that sets parallelism": (dict(arms=[CLEAN, {"name": "junk", "set": {**CLEAN["set"],
                                                                               "parallel.compile": True}}]),
                                     "arm 'junk' sets 'parallel.compile': an arm may change only the data"),
    # item 5: equal settings and a shared seed are one run twice: an A/A "check" would show exactly 0
    "an A-A arm without seeds of its own": (
        dict(arms=[{"name": "clean", "set": {"data.inputs": ["clean.jsonl"]}},
                   {"name": "clean-again", "set": {"data.inputs": ["clean.jsonl"]}}]),
        "arms 'clean' and 'clean-again' have the same settings and seed(s) 1, 2 in common: those runs would be one "
        "run, and an A/A check would show a difference of exactly 0; give 'clean-again' seeds of its own (seeds: "
        "[3, 4])"),
    # item 8: names of the files kiln ablate writes in out_dir
    "an arm named plan.json": (dict(arms=[CLEAN, {**CLEAN, "name": "plan.json", "seeds": [3, 4]}]),
                               "arm name 'plan.json' must be a folder name"),
    "an arm named ablation.json": (dict(arms=[CLEAN, {**CLEAN, "name": "ablation.json", "seeds": [3, 4]}]),
                                   "and not ablation.html, ablation.json, plan.json, tokenizer"),
    # item 11: a misspelt required key gets the closest key, as an optional one does
    "a typo in a required key": (dict(baseline=DROP, basline="clean"),
                                 "unknown key 'basline': did you mean baseline?"),
    "a typo in the eval key": (dict(evals={"text": {"reference": "eval/reference.jsonl"}}, eval=DROP),
                               "unknown key 'evals': did you mean eval?"),
    "an arm that sets the seed": (dict(arms=[{"name": "clean"}, {"name": "junk", "set": {"seed": 3}}]),
                                  "arm 'junk' sets 'seed'"),
    "an empty eval set": (dict(eval={"text": {"empty": "eval/empty.jsonl"}}),
                          "eval set 'empty': {corpus}/eval/empty.jsonl holds no document with text"),
    "an eval set that is not JSON": (dict(eval={"text": {"broken": "eval/broken.jsonl"}}),
                                     "{corpus}/eval/broken.jsonl:2: not JSON"),
    "an eval set that does not exist": (dict(eval={"text": {"gone": "eval/gone.jsonl"}}),
                                        "eval set 'gone': {corpus}/eval/gone.jsonl does not exist"),
    "fewer seeds than the baseline": (dict(arms=[{"name": "clean"}, {"name": "junk", "seeds": [5]}]),
                                      "arm 'junk' has 1 seeds and the baseline 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_before_any_work(corpus, case, capsys):
    (corpus / "eval" / "empty.jsonl").write_text("\n")
    (corpus / "eval" / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    changes, message = BAD[case]
    path = write_ablation(corpus, f"bad-{case.replace(' ', '-')}.yaml", **changes)
    capsys.readouterr()
    assert kiln(["ablate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kiln: error: "), err
    assert message.format(corpus=corpus) in err, err
    assert not (corpus / f"out-{path.stem}").exists()


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=8), st.lists(st.integers(0, 9),
                                                                                          max_size=3))
KEYS = st.sampled_from(["base", "out_dir", "seeds", "baseline", "arms", "eval", "proxy", "proxy_tokens", "statistics",
                        "name", "set", "text", "tasks", "bogus"])
TREES = st.recursive(VALUES, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(KEYS, inner, max_size=5)), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(KEYS, TREES, max_size=8))
def test_any_ablation_file_is_read_or_refused_in_one_line(corpus, tree):
    """Hostile or broken ablation files (random keys, values and nesting): a ConfigError naming the file, or a
    valid spec; never a traceback."""
    from kiln.ablate.spec import read_spec
    from kiln.errors import ConfigError

    path = corpus / "random.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        read_spec(path)
    except ConfigError as exc:
        assert "\n" not in str(exc) and (str(path) in str(exc) or "config file" in str(exc)), str(exc)


def test_an_eval_set_inside_an_arms_training_data_is_one_line_after_the_data_stage(corpus, capsys):
    path = write_ablation(corpus, "inside.yaml", eval={"text": {"trained-on": "clean.jsonl"}})
    capsys.readouterr()
    assert kiln(["ablate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"kiln: error: eval set 'trained-on' ({corpus / 'clean.jsonl'}): all 40 of its documents are in "
                   "the training data of arms 'clean', 'junk' (exact or near duplicates); evaluate on text no arm "
                   "trains on")
    assert not list((corpus / "out-inside").glob("*/seed-*"))  # nothing trained


def test_a_choice_longer_than_the_window_is_one_line_before_training(corpus, capsys):
    long = " ".join(["package"] * 300)
    (corpus / "eval" / "long.jsonl").write_text(json.dumps({"context": "Debian", "choices": ["a b", long],
                                                            "answer": 0}) + "\n")
    path = write_ablation(corpus, "long.yaml", eval={"tasks": [{"name": "long", "path": "eval/long.jsonl"}]})
    capsys.readouterr()
    assert kiln(["ablate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"kiln: error: {corpus / 'eval' / 'long.jsonl'}:1: choice 1 is ") and \
        "more than the model's window of 128 (pack.seq_len)" in err
    assert not list((corpus / "out-long").glob("*/seed-*"))  # nothing trained


def test_an_out_dir_that_is_not_an_ablations_is_refused(corpus, capsys):
    (corpus / "someones").mkdir()
    (corpus / "someones" / "notes.txt").write_text("mine")
    path = write_ablation(corpus, "foreign.yaml", out_dir="someones")
    assert kiln(["ablate", str(path)]) == 2
    assert "is not an ablation's (no plan.json)" in capsys.readouterr().err
    assert sorted(p.name for p in (corpus / "someones").iterdir()) == ["notes.txt"]


def test_arms_with_equal_settings_share_data_not_runs(corpus):
    """Equal settings share the data folder; with seeds of their own, each arm's runs are its own (a shared
    seed is refused: BAD's A-A case)."""
    from kiln.ablate import load

    path = write_ablation(corpus, "shared.yaml", arms=[
        {"name": "clean", "set": {"data.inputs": ["clean.jsonl"]}},
        {"name": "same", "set": {"data.inputs": ["clean.jsonl"]}, "seeds": [5, 6]},
        {"name": "again", "set": {"data.inputs": ["clean.jsonl"]}, "seeds": [3, 4]}])
    plan, _, _ = load(path)
    out = plan.out
    assert [a.data for a in plan.arms] == [out / "clean"] * 3
    assert [r.folder for r in plan.arm("same").runs] == [out / "same" / "seed-5", out / "same" / "seed-6"]
    assert [r.folder for r in plan.arm("again").runs] == [out / "again" / "seed-3", out / "again" / "seed-4"]
    assert len(plan.runs()) == 6 and len(plan.data_arms()) == 1


def test_a_proxy_sets_the_model_and_about_20_tokens_per_parameter(corpus):
    from kiln.ablate import load
    from kiln.ablate.plan import count_parameters

    plan, _, _ = load(write_ablation(corpus, "proxy.yaml", proxy="cpu-tiny"))
    cfg = plan.runs()[0].cfg
    n = count_parameters(cfg)
    assert (cfg.model.dim, cfg.model.n_layers, cfg.pack.seq_len, cfg.train.batch_size, cfg.train.threads) == \
        (64, 2, 128, 8, 1)
    assert plan.proxy["params"] == n and 20 * n <= plan.proxy["tokens"] < 20 * n + 8 * 128
    assert cfg.train.max_steps == plan.proxy["steps"] == plan.proxy["tokens"] // (8 * 128)
    assert all(r.cfg.train.max_steps == cfg.train.max_steps for r in plan.runs())  # the same budget for all
    plan, _, _ = load(write_ablation(corpus, "proxy-tokens.yaml", proxy="cpu-tiny", proxy_tokens=10_000))
    assert plan.proxy["steps"] == 10 and plan.runs()[0].cfg.train.max_steps == 10


def test_plan_prints_each_scale_measured_here_extrapolated_and_on_gpus(corpus, monkeypatch, capsys):
    """--plan's arithmetic with the step measurement stubbed (the real one times 20m steps; the benchmark
    runs it): cpu-tiny and 20m measured, the larger scales from 20m's FLOP rate, GPUs from kiln plan."""
    from kiln.ablate import estimate

    monkeypatch.setattr(estimate, "step_seconds", lambda cfg: (1e-4 if cfg.model.dim == 64 else 1e-3,
                                                               estimate.flops_per_token(cfg)))
    rows = {r["scale"]: r for r in estimate.estimates(write_ablation(corpus, "plan.yaml"), 8, "H100")}
    assert list(rows) == ["base config (this file)", "cpu-tiny", "20m", "150m", "400m", "1b"]
    assert rows["20m"]["here"] == "measured" and rows["150m"]["here"] == "from 20m's FLOP/s"
    rate = estimate.flops_per_token(estimate.make_plan(*_spec_with_proxy(corpus, "20m")).runs()[0].cfg) / 1e-3
    big = estimate.make_plan(*_spec_with_proxy(corpus, "1b")).runs()[0].cfg
    assert rows["1b"]["here_hours"] == pytest.approx(
        estimate.flops_per_token(big) / rate * rows["1b"]["tokens_per_run"] * 4 / 3600)
    assert rows["1b"]["runs"] == 4 and rows["1b"]["gpu_hours"] > rows["400m"]["gpu_hours"] > rows["150m"]["gpu_hours"]
    assert kiln(["ablate", str(corpus / "plan.yaml"), "--plan"]) == 0 and "400m" in capsys.readouterr().out


@pytest.mark.parametrize("threads", ["auto", 1, None])
def test_plan_measures_a_real_step_whatever_train_threads_says(threads):
    """The step --plan times runs under every train.threads setting (README's `kiln ablate --plan` once stopped on
    `auto`, the default: torch.set_num_threads("auto")); under auto it keeps the faster of 1 and all threads."""
    import torch

    from kiln.ablate import estimate
    from kiln.config import load_config
    from kiln.train.parts.threads import available_threads

    cfg = load_config(ROOT / "examples" / "tiny.yaml", ["model.n_layers=1"])
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"threads": threads})})
    before = torch.get_num_threads()
    try:
        seconds, flops = estimate.step_seconds(cfg, steps=1)
        assert 0 < seconds < 1 and flops == estimate.flops_per_token(cfg)
        expected = {"auto": available_threads(), 1: 1, None: before}[threads]  # auto: 1, then N last
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def _spec_with_proxy(corpus, proxy):
    from kiln.ablate.spec import read_spec

    spec, base = read_spec(corpus / "plan.yaml")
    return spec.model_copy(update={"proxy": proxy}), base, corpus / "plan.yaml"


# --- fairness and ownership (issue #37): refused in one line before any work, stages stubbed ------------------------

@pytest.fixture
def stages(monkeypatch) -> list:
    """Every stage the runner calls, stubbed and recorded as (stage, folder): the ablation's own checks run, no
    data, tokenizer, pack or training work does."""
    from kiln.ablate import runner

    calls: list = []
    for name in ("run_data_stage", "run_tokenizer_stage", "run_pack_stage", "run_train_stage"):
        monkeypatch.setattr(runner, name, lambda cfg, log, name=name: calls.append((name, cfg.out)) or {})
    monkeypatch.setattr(runner, "shared_tokenizer", lambda plan, log: calls.append(("shared_tokenizer", plan.out)))
    return calls


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kiln: error: "), err
    return err


def test_an_out_dir_holding_a_users_plan_json_is_refused_before_any_work(corpus, stages, capsys):
    """Item 2: a plan.json kiln ablate did not write (no `written_by` mark) is the user's: never replaced."""
    out = corpus / "users-plan"
    out.mkdir()
    (out / "plan.json").write_text('{"my": "plan"}\n')
    path = write_ablation(corpus, "users-plan.yaml", out_dir="users-plan")
    capsys.readouterr()
    assert kiln(["ablate", str(path)]) == 2
    assert f'{out / "plan.json"}: no "written_by": "kiln ablate", so it is not a plan kiln ablate wrote' in \
        one_line(capsys)
    assert (out / "plan.json").read_text() == '{"my": "plan"}\n' and stages == []


@pytest.mark.parametrize("name, content, message", [
    ("ablation.html", "<p>my notes</p>", "ablation.html exists and is not a page kiln ablate wrote; move it away"),
    ("ablation.json", '{"mine": 1}', "ablation.json exists and is not the results kiln ablate wrote for ")])
def test_a_users_results_in_an_ablations_out_dir_are_refused_before_any_work(corpus, stages, capsys, name, content,
                                                                             message):
    """Item 2: ablation.html / ablation.json that kiln ablate did not write stop the ablation before its first
    stage, not after all the training."""
    path = write_ablation(corpus, f"users-{name}.yaml")
    assert kiln(["ablate", str(path), "--until", "data"]) == 0  # an ablation's out_dir: plan.json, data stubbed
    out = corpus / f"out-users-{name}"
    (out / name).write_text(content)
    stages.clear()
    capsys.readouterr()
    assert kiln(["ablate", str(path)]) == 2
    assert message in one_line(capsys) and stages == [] and (out / name).read_text() == content


def test_a_second_ablation_file_into_an_out_dir_is_refused_before_any_write(corpus, stages, capsys):
    """Item 7: an out_dir holds one ablation file; another file (with --only too) stops before it replaces
    plan.json or runs a stage (which retrained the shared tokenizer and repacked the arms)."""
    first = write_ablation(corpus, "first.yaml", out_dir="out-one")
    assert kiln(["ablate", str(first), "--until", "data"]) == 0
    plan = (corpus / "out-one" / "plan.json").read_bytes()
    second = write_ablation(corpus, "second.yaml", out_dir="out-one", seeds=[7, 8])
    for extra in ([], ["--only", "junk"]):
        stages.clear()
        capsys.readouterr()
        assert kiln(["ablate", str(second), *extra]) == 2
        assert f"out_dir {corpus / 'out-one'} holds the ablation of {first.resolve()} (its plan.json), not of " \
               f"{second.resolve()}" in one_line(capsys)
        assert (corpus / "out-one" / "plan.json").read_bytes() == plan and stages == []


def test_an_out_dir_being_written_is_refused_before_plan_json(corpus, stages, capsys):
    """Item 7: the out_dir's lock comes before the first write: a second `kiln ablate` into it stops at once."""
    from kiln.lock import OutputLock

    path = write_ablation(corpus, "locked.yaml")
    out = corpus / "out-locked"
    with OutputLock(out, "`kiln ablate`"):
        capsys.readouterr()
        assert kiln(["ablate", str(path), "--until", "data"]) == 2
        assert f"{out} is being written by `kiln ablate`" in one_line(capsys)
    assert not out.exists() and stages == []
    assert kiln(["ablate", str(path), "--until", "data"]) == 0 and (out / "plan.json").is_file()  # once it is free


@pytest.mark.parametrize("content, message", [
    ('{"file": ', "plan.json: not JSON"),
    (json.dumps({"written_by": "kiln ablate", "file": "a.yaml", "base": {}}), '"spec" or "base" (mappings) is missing'),
    (json.dumps({"written_by": "kiln ablate", "file": "a.yaml", "spec": {"seeds": "x"}, "base": {}}),
     "its spec does not validate")])
def test_report_on_a_damaged_plan_json_is_one_line(tmp_path, capsys, content, message):
    """Item 8: `kiln ablate report` on a damaged plan.json (JSONDecodeError, KeyError, ValidationError)."""
    (tmp_path / "plan.json").write_text(content)
    assert kiln(["ablate", "report", str(tmp_path)]) == 2
    err = one_line(capsys)
    assert f"{tmp_path / 'plan.json'}: " in err and message in err and "move it away" in err


def test_arms_never_share_a_dedup_index(corpus, capsys):
    """Item 4: a base config's data.dedup.index would make the second arm deduplicate against the first's
    documents: refused; each arm with an index of its own is fine."""
    from kiln.ablate import load

    base = yaml.safe_load((corpus / "base.yaml").read_text())
    base["data"]["dedup"]["index"] = "dedup-index"
    (corpus / "base-index.yaml").write_text(yaml.safe_dump(base))
    path = write_ablation(corpus, "index.yaml", base="base-index.yaml")
    capsys.readouterr()
    assert kiln(["ablate", str(path)]) == 2
    assert f"arms 'clean' and 'junk' share data.dedup.index {corpus / 'dedup-index'}: each arm's data stage adds " \
           "its documents to it, so 'junk' would be deduplicated against the documents of 'clean'" in one_line(capsys)
    assert not (corpus / "out-index").exists()
    plan, _, _ = load(write_ablation(corpus, "own-index.yaml", base="base-index.yaml", arms=[
        {"name": "clean", "set": {"data.inputs": ["clean.jsonl"], "data.dedup.index": "index-clean"}},
        {"name": "junk", "set": {"data.inputs": ["clean.jsonl", "junk.jsonl"], "data.dedup.index": "index-junk"}}]))
    assert [a.cfg.data.dedup.index for a in plan.arms] == [str(corpus / "index-clean"), str(corpus / "index-junk")]


def test_val_loss_is_a_per_arm_fact_not_a_verdict(corpus):
    """Item 6: each arm's validation split is drawn from its own data, so val_loss (here a whole nat apart, every
    seed) is never compared; the eval set's bits per byte (the same text for every arm) is."""
    import numpy as np

    from kiln.ablate import load
    from kiln.ablate.results import compare_arms

    plan, sets, _ = load(write_ablation(corpus, "facts.yaml"))
    keep = {s.name: list(range(len(s.ids))) for s in sets}
    rng = np.random.default_rng(0)

    def measured(arm: str, seed: int) -> dict:
        shift = 1.0 if arm == "junk" else 0.0
        return {"val_loss": 2.0 + shift + 0.01 * seed,
                "text": {"reference": {"bits": (1000 + 50 * shift + rng.normal(0, 1, 12)).tolist()}},
                "tasks": {"mc": {m: [1.0] * 12 for m in ("acc", "acc_norm", "acc_bytes")}}}

    rows = compare_arms(plan, sets, keep, {r.folder: measured(r.arm, r.seed) for r in plan.runs()})
    assert [r["metric"] for r in rows] == ["reference/bits_per_byte", "mc/acc", "mc/acc_norm", "mc/acc_bytes"]
    assert rows[0]["verdict"] == "worse"


def test_sigterm_while_a_run_trains_stops_the_ablation_with_exit_0(corpus, stages, monkeypatch, capsys):
    """Item 15: a run stopped by SIGTERM (checkpointed, `stopped: SIGTERM` in its summary) stops the ablation
    there, exit 0 and one line saying the same command resumes; no later run starts."""
    from kiln.ablate import runner

    monkeypatch.setattr(runner, "prepare", lambda plan, sets, *_: {s.name: list(range(len(s.ids))) for s in sets})
    monkeypatch.setattr(runner, "run_train_stage",
                        lambda cfg, log: stages.append(("train", cfg.out)) or {"stopped": "SIGTERM", "steps": 5})
    path = write_ablation(corpus, "sigterm.yaml")
    out = corpus / "out-sigterm"
    capsys.readouterr()
    assert kiln(["ablate", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM: {out / 'clean' / 'seed-1'} checkpointed at step 5; run the same command again to " \
           "resume the ablation" in err
    assert [s for s in stages if s[0] == "train"] == [("train", out / "clean" / "seed-1")]
    assert not (out / "ablation.json").exists()


# --- known answers (real runs: slow) ------------------------------------------------------------------------------

@pytest.mark.slow
def test_known_answers_clean_beats_junk_and_identical_arms_show_no_difference(tmp_path):
    """Clean prose against the same prose diluted with as many characters of junk (menus, base64, shuffled
    made-up words: none of the reference set's words), every gate off in both arms so each trains on exactly
    what it names, the same token budget: the clean arm is `better` on the reference set's bits per byte. An
    A/A arm (the junk arm's settings, five other seeds) shows `no detectable difference` on every metric.
    5 seeds a arm, 150 steps of a 2-layer, 64-wide model a run: about 2 minutes on 2 idle cores."""
    train, reference = prose()
    write_jsonl(tmp_path / "clean.jsonl", train)
    write_jsonl(tmp_path / "junk.jsonl", junk(sum(map(len, train)), vocabulary(reference)))
    write_jsonl(tmp_path / "eval" / "reference.jsonl", reference)
    (tmp_path / "eval" / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions(reference)))
    base = _merge(TINY, {"tokenizer": {"vocab_size": 512, "max_docs": 100_000}, "pack": {"seq_len": 64},
                         "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
                         "train": {"max_steps": 150, "batch_size": 8, "warmup_steps": 10, "log_every": 50},
                         "checkpoint": {"every": 50}})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**base, "out_dir": "unused"}))
    mixed = {"data.inputs": ["clean.jsonl", "junk.jsonl"]}
    path = write_ablation(tmp_path, seeds=[1, 2, 3, 4, 5], baseline="junk", arms=[
        {"name": "junk", "set": mixed}, {"name": "clean", "set": {"data.inputs": ["clean.jsonl"]}},
        {"name": "junk-again", "set": mixed, "seeds": [6, 7, 8, 9, 10]}])
    assert kiln(["ablate", str(path)]) == 0
    data = json.loads((tmp_path / "out-ablation" / "ablation.json").read_text())
    verdicts = {(c["arm"], c["metric"]): c for c in data["comparisons"]}
    clean = verdicts["clean", "reference/bits_per_byte"]
    assert clean["verdict"] == BETTER and clean["ci_high"] < 0, clean
    same = [c for c in data["comparisons"] if c["arm"] == "junk-again"]
    assert len(same) == 4 and all(c["verdict"] == SAME for c in same), same  # val_loss: a per-arm fact
