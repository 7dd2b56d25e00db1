"""`kiln mix`: the swarm's draws, the fit's cross-validation and the proposal's constraints (fast units); a real
2-source mix end to end (Kiln's stages, real training, a handful of steps); resuming after kill -9; one-line
errors; and the known answers (slow: real proxy runs).

The data (tests/ablate_data.py) come from the bundled sample crawl: clean English prose, junk without the
reference set's words, another language's pages, a reference set from held-out pages.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ablate_data import GATES_OFF, example_builder, junk, prose, vocabulary, write_jsonl
from conftest import ROOT, SAMPLE_WARC, warc_pages
from kiln.ablate.stats import BETTER, SAME
from kiln.cli import main as kiln
from kiln.mix import fit as mixfit
from kiln.mix.propose import propose
from kiln.mix.swarm import Budget, draw, feasible

CHROMIUM = Path("/usr/bin/chromium")


def nested(flat: dict) -> dict:
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


TINY = _merge({"seed": 7, "data": {"workers": 1}, "tokenizer": {"vocab_size": 300, "max_docs": 20},
               "pack": {"seq_len": 64, "val_fraction": 0.1},
               "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
               "train": {"max_steps": 4, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0,
                         "eval_batches": 1, "log_every": 2, "threads": 1},
               "checkpoint": {"every": 2, "keep_last": 2}, "watchdog": {"enabled": False}}, nested(GATES_OFF))


def other_language(lang: str = "de") -> list[str]:
    """The sample crawl's pages in `lang`, cut as the English prose is."""
    from resiliparse.extract.html2text import extract_plain_text

    out = []
    for _, body in warc_pages(SAMPLE_WARC, lambda url: url.endswith(f".{lang}.html") and "index" not in url):
        out += example_builder().chunks(extract_plain_text(body.decode("utf-8", "replace"), main_content=True))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """prose.jsonl (40 documents), junk.jsonl (as many characters), eval/reference.jsonl (12), base.yaml."""
    folder = tmp_path_factory.mktemp("mix-corpus")
    train, reference = prose()
    train, reference = train[:40], reference[:12]
    write_jsonl(folder / "prose.jsonl", train)
    write_jsonl(folder / "junk.jsonl", junk(sum(map(len, train)), vocabulary(reference)))
    write_jsonl(folder / "eval" / "reference.jsonl", reference)
    (folder / "base.yaml").write_text(yaml.safe_dump({**TINY, "out_dir": "unused"}))
    return folder


DROP = object()


def write_mix(folder: Path, name: str = "mix.yaml", **changes) -> Path:
    spec = {"base": "base.yaml", "out_dir": f"out-{Path(name).stem}",
            "sources": {"prose": {"inputs": ["prose.jsonl"]}, "junk": {"inputs": ["junk.jsonl"]}},
            "swarm": 4, "seeds": [1, 2], "max_epochs": 4,
            "eval": {"text": {"reference": "eval/reference.jsonl"}}, "target": {"reference": 1.0}}
    spec = {k: v for k, v in {**spec, **changes}.items() if v is not DROP}
    path = folder / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def without_timings(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "timings_s"}


@pytest.fixture(scope="module")
def small(corpus) -> Path:
    """The out_dir of a finished 2-source mix: 4 swarm runs, 3 arms x 2 seeds, 4 training steps a run."""
    assert kiln(["mix", str(write_mix(corpus))]) == 0
    return corpus / "out-mix"


# --- the swarm, the fit, the proposal (units) ------------------------------------------------------------------

budgets = st.builds(
    lambda samples, run, epochs: Budget([f"s{i}" for i in range(len(samples))], np.asarray(samples, dtype=float),
                                        run, epochs),
    st.lists(st.integers(1, 5000), min_size=2, max_size=5), st.integers(1, 20000), st.floats(0.5, 8))


@settings(max_examples=60, deadline=None)
@given(budget=budgets, concentration=st.floats(0.2, 20), seed=st.integers(0, 2**31))
def test_every_swarm_draw_is_a_mixture_inside_the_repetition_limit(budget, concentration, seed):
    if budget.run_samples > budget.max_epochs * budget.samples.sum():
        return  # no mixture can meet it: check_feasible's one line (tested below)
    try:
        draws = draw(budget, concentration, seed, 5)
    except Exception as exc:  # a limit the Dirichlet rarely meets: one line saying so, never a draw over it
        assert "raise max_epochs or concentration" in str(exc)
        return
    for w in draws:
        assert abs(w.sum() - 1) < 1e-5 and (w >= 0).all()
        assert (budget.epochs(w) <= budget.max_epochs + 1e-5).all(), (w, budget.epochs(w))
    # Draw i is its own seeded stream: a larger swarm keeps the earlier draws.
    assert all((a == b).all() for a, b in zip(draws, draw(budget, concentration, seed, 3)))


def test_draws_center_on_the_natural_shares_and_concentration_tightens_them():
    budget = Budget(["a", "b", "c"], np.array([600.0, 300.0, 100.0]), 100, 4.0)
    loose = np.array(draw(budget, 1.0, 0, 400))
    tight = np.array(draw(budget, 50.0, 0, 400))
    assert np.allclose(loose.mean(0), [0.6, 0.3, 0.1], atol=0.05)
    assert np.allclose(tight.mean(0), [0.6, 0.3, 0.1], atol=0.02)
    assert (tight.std(0) < loose.std(0) / 3).all()


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(-1, 5), min_size=2, max_size=6), caps=st.lists(st.floats(0.05, 1), min_size=6,
                                                                                     max_size=6))
def test_feasible_makes_any_vector_a_mixture_under_the_caps(weights, caps):
    caps = np.asarray(caps[:len(weights)])
    if caps.sum() < 1:
        return
    w = feasible(np.asarray(weights), caps)
    assert abs(w.sum() - 1) < 1e-9 and (w >= -1e-12).all() and (w <= caps + 1e-9).all()


def test_the_fit_recovers_a_log_linear_law_and_cross_validates_it():
    rng = np.random.default_rng(0)
    w = rng.dirichlet([1, 1, 1], 20)
    y = np.exp(w @ np.array([0.5, 1.5, 2.5])) * np.exp(rng.normal(0, 0.01, 20))
    result = mixfit.fit_metric(w, y)
    assert result["cv"]["model"] in mixfit.MODELS
    assert result["cv"]["spearman"] > 0.95 and result["cv"]["rmse"] < result["cv"]["mean_rmse"] / 5
    linear = mixfit.fit(w, y, "log-linear")
    assert np.allclose(linear.coef, [0.5, 1.5, 2.5], atol=0.05)
    # Held-out predictions never saw their run: a run's own value moved far off moves no other prediction
    # of itself.
    moved = y.copy()
    moved[3] *= 10
    pred, _ = mixfit.held_out(w, moved, "log-linear")
    base, _ = mixfit.held_out(w, y, "log-linear")
    assert pred[3] == pytest.approx(base[3])


def test_a_fit_to_noise_is_no_better_than_the_mean_and_not_trusted():
    rng = np.random.default_rng(1)
    w = rng.dirichlet([1, 1, 1], 12)
    y = 2 + rng.normal(0, 0.05, 12)
    result = mixfit.fit_all(w, {"a/bits_per_byte": y}, {"a/bits_per_byte": 1.0}, 5)
    assert not result["trusted"] and "no better than their mean" in result["why"]
    few = mixfit.fit_all(w[:4], {"a/bits_per_byte": y[:4]}, {"a/bits_per_byte": 1.0}, 5)
    assert not few["trusted"] and "needs at least 5" in few["why"]


@settings(max_examples=25, deadline=None)
@given(coef=st.lists(st.floats(-2, 2), min_size=3, max_size=3), samples=st.lists(st.integers(50, 1000), min_size=3,
                                                                                   max_size=3))
def test_the_proposal_is_a_mixture_under_the_caps_and_no_worse_than_any_start(coef, samples):
    budget = Budget(["a", "b", "c"], np.asarray(samples, dtype=float), 1000, 2.0)
    if budget.caps.sum() < 1.05:  # no room, or only the caps themselves: draw's one line (tested above) instead
        return
    fits = {"m": {"model": mixfit.Model("log-linear", True, np.asarray(coef))}}
    swarm = np.array(draw(budget, 1.0, 0, 4))
    w = propose(fits, {"m": 1.0}, False, budget, swarm)
    assert abs(w.sum() - 1) < 1e-5 and (w >= 0).all() and (w <= budget.caps + 1e-5).all()
    predicted = mixfit.predict_target(fits, {"m": 1.0}, w[None, :])[0]
    for start in [budget.natural, *swarm]:  # a draw rounded to DIGITS may sum to 1 - 1e-6: compared as a mixture
        start = feasible(start, budget.caps)
        assert predicted <= mixfit.predict_target(fits, {"m": 1.0}, start[None, :])[0] + 1e-6
    # With the best source's cap at 1, a log-linear law puts every weight on it.
    if budget.caps[int(np.argmin(coef))] >= 1 and sorted(coef)[1] - min(coef) > 0.01:
        assert w[int(np.argmin(coef))] == pytest.approx(1.0, abs=1e-4)


# --- a real mix, end to end --------------------------------------------------------------------------------------

def test_a_two_source_mix_writes_its_swarm_fit_proposal_and_verification(small):
    data = json.loads((small / "mix.json").read_text())
    assert list(data["sources"]) == ["prose", "junk"]
    assert [r["name"] for r in data["runs"]] == ["run-000", "run-001", "run-002", "run-003"]
    tokenizer = (small / "sources" / "tokenizer" / "tokenizer.json").read_bytes()
    for r in data["runs"]:
        assert r["finished"] and abs(sum(r["weights"].values()) - 1) < 1e-5
        assert all(e <= 4 + 1e-6 for e in r["epochs"].values())
        config = yaml.safe_load((Path(r["folder"]) / "config.yaml").read_text())
        sources = {Path(s["path"]).parent.name: s["weight"] for s in config["loader"]["sources"]}
        assert sources == {k: v for k, v in r["weights"].items() if v > 0}
        assert (Path(r["folder"]) / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer
        assert (Path(r["folder"]) / "run" / "checkpoints" / "step-00000004" / "manifest.json").is_file()
        assert r["target"] == pytest.approx(r["metrics"]["reference/bits_per_byte"])
    assert data["fit"]["runs"] == 4 and len(data["fit"]["held_out"]) == 4
    assert set(data["fit"]) >= {"spearman", "rmse", "mean_rmse", "trusted", "metrics"}
    natural = {n: s["natural"] for n, s in data["sources"].items()}
    arms = data["verification"]["arms"]
    assert arms["natural"]["weights"] == pytest.approx(natural, abs=1e-6)
    assert arms["best-swarm"]["weights"] == data["best_swarm"]["weights"]
    best = min(data["runs"], key=lambda r: r["target"])
    assert data["best_swarm"]["run"] == best["name"]
    if data["fit"]["trusted"]:
        assert set(data["proposal"]["weights"]) == {"prose", "junk"} and "loader:" in data["loader_sources"]
        assert data["improvement"]["verdict"] in (BETTER, SAME, "worse")
    else:
        assert data["proposal"] is None and data["warnings"][0].startswith("no proposal")
    compared = {c["arm"] for c in data["comparisons"]}
    assert compared == set(arms) - {"natural"}
    for c in data["comparisons"]:
        assert c["baseline"] == "natural" and c["pairs"] == 2 and c["verdict"] in (BETTER, SAME, "worse")
        assert {"diff", "ci_low", "ci_high", "p", "p_holm", "min_detectable"} <= set(c)
    for arm in arms:
        for seed in (1, 2):
            assert (small / "verify" / arm / f"seed-{seed}" / "eval.json").is_file()


def test_the_same_command_again_skips_everything_and_writes_the_same_json(small, corpus, capsys):
    before = json.loads((small / "mix.json").read_text())
    capsys.readouterr()
    assert kiln(["mix", str(corpus / "mix.yaml")]) == 0
    err = capsys.readouterr().err
    assert "data: skipping" in err and "pack: skipping" in err and "measure:" not in err and "train: 4 steps" not in err
    assert without_timings(json.loads((small / "mix.json").read_text())) == without_timings(before)


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


def test_mix_html_is_self_contained(small, tmp_path):
    page = (small / "mix.html").read_text()
    assert page.startswith("<!-- written by kiln mix -->")
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page and "<link" not in page
    assert page.index("<h2>Proposal</h2>") < page.index("<h2>Verification</h2>") < page.index("<h2>Weights</h2>")
    assert "Weights per source" in page and "Predicted against measured target" in page
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (.ci/run installs it for CI)")
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("<head>", "<head>" + CHECK_SCRIPT, 1))
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    marker = re.search(r'<div id="kiln-check">images=(\d+) loaded=(\d+) first=(\w+)</div>', result.stdout)
    assert marker, result.stdout[-2000:]
    assert int(marker[1]) == int(marker[2]) == page.count("<img ") == 2 and marker[3] == "Proposal"


def test_kill_9_during_the_swarm_then_the_same_command_gives_the_same_json(small, corpus):
    """The finished mix's last two swarm runs, verification and outputs removed; the same command in a
    subprocess (its own process group), killed (SIGKILL) once run-002 has checkpointed step 2 (mid-run); then
    the same command again: mix.json is the uninterrupted one's, timings aside."""
    whole = json.loads((small / "mix.json").read_text())
    for gone in ("swarm/run-002", "swarm/run-003", "verify", "mix.json", "mix.html"):
        (shutil.rmtree if (small / gone).is_dir() else os.remove)(small / gone)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "mix", str(corpus / "mix.yaml")], cwd=corpus, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    checkpoints = small / "swarm" / "run-002" / "run" / "checkpoints"
    deadline = time.time() + 300
    while not (checkpoints / "step-00000002").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (small / "mix.json").exists() and not (checkpoints / "step-00000004").exists()
    assert kiln(["mix", str(corpus / "mix.yaml")]) == 0
    assert without_timings(json.loads((small / "mix.json").read_text())) == without_timings(whole)


def test_report_fits_what_has_finished(small, corpus, capsys):
    assert kiln(["mix", "report", str(small)]) == 0
    data = json.loads((small / "mix.json").read_text())
    assert data["fit"]["runs"] == 4 and data["comparisons"]


def test_plan_counts_the_swarm_and_the_verification_at_each_scale(corpus, monkeypatch, capsys):
    """--plan is kiln ablate's table for the mix's runs: the swarm (4) and 3 arms x 2 seeds, 10 at every scale
    (the step measurement stubbed: the real one times 20m steps; the benchmark runs it)."""
    from kiln.ablate import estimate

    monkeypatch.setattr(estimate, "step_seconds", lambda cfg: (1e-4 if cfg.model.dim == 64 else 1e-3,
                                                               estimate.flops_per_token(cfg)))
    path = write_mix(corpus, "plan.yaml")
    assert kiln(["mix", str(path), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "kiln mix --plan: training time of every run of plan.yaml" in out
    rows = [line for line in out.splitlines() if re.match(r"\W*(base config|cpu-tiny|20m|150m|400m|1b)", line)]
    assert len(rows) == 6 and all(" 10 " in re.sub(r"[│|]", " ", line) for line in rows), out
    assert not (corpus / "out-plan").exists()


def test_only_one_swarm_run_then_report_warns_and_proposes_nothing(corpus, capsys):
    """`--only run-001` trains that run alone (the sources first) and writes no mix.json; `kiln mix report`
    then fits what finished: one run is fewer than the fit needs, so a warning and no proposal; the
    verification's arms are `not run`; `--only natural` before the swarm has finished is one line."""
    path = write_mix(corpus, "partial.yaml")
    out = corpus / "out-partial"
    assert kiln(["mix", str(path), "--only", "run-001"]) == 0
    assert [p.name for p in sorted((out / "swarm").iterdir())] == ["run-001"] and not (out / "mix.json").exists()
    assert kiln(["mix", "report", str(out)]) == 0
    data = json.loads((out / "mix.json").read_text())
    assert [r["finished"] for r in data["runs"]] == [False, True, False, False]
    assert data["proposal"] is None and data["fit"]["runs"] == 1
    assert data["warnings"] == ["no proposal: 1 finished swarm run(s): the fit needs at least 4"]
    assert data["best_swarm"]["run"] == "run-001" and {c["verdict"] for c in data["comparisons"]} == {"not run"}
    capsys.readouterr()
    assert kiln(["mix", str(path), "--only", "natural"]) == 2
    assert "the swarm has 1 of 4 runs finished (not run-000)" in one_error(capsys.readouterr().err)


# --- bad input: one line ------------------------------------------------------------------------------------------

def one_error(err: str) -> str:
    """The one error line among the stages' progress lines (each line of its own: no traceback)."""
    errors = [line for line in err.splitlines() if line.startswith("kiln:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("change, message", [
    ({"target": {"nowhere": 1.0}}, "target 'nowhere' names no eval set"),
    ({"swarm": 3}, "swarm 3 is smaller than the fit needs: 2 sources need at least 4 runs"),
    ({"sources": {"prose": {"inputs": ["prose.jsonl"]}}}, "give at least two sources to mix, got 1"),
    ({"sources": {"prose": {"inputs": ["prose.jsonl"], "set": {"train.lr": 1.0}}, "junk": {"inputs": ["junk.jsonl"]}}},
     "'train.lr' is not a data.* key"),
    ({"swarm_seed": 1}, "swarm_seed 1 is also a verification seed"),
    ({"sourcs": {}}, "sourcs"),
])
def test_bad_mix_files_are_one_line_before_any_work(corpus, capsys, change, message):
    path = write_mix(corpus, "bad.yaml", **change)
    assert kiln(["mix", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (corpus / "out-bad").exists()


def test_a_source_whose_inputs_match_nothing_is_one_line_before_any_work(corpus, capsys):
    path = write_mix(corpus, "missing.yaml", sources={"prose": {"inputs": ["prose.jsonl"]},
                                                      "web": {"inputs": ["crawl/*.warc.gz"]}})
    assert kiln(["mix", str(path)]) == 2
    err = one_error(capsys.readouterr().err)
    assert "source 'web': input" in err and "crawl/*.warc.gz' matches no file" in err, err
    assert not (corpus / "out-missing").exists()


def test_an_unknown_source_in_only_is_one_line(corpus, capsys):
    assert kiln(["mix", str(write_mix(corpus, "only.yaml")), "--only", "web"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--only 'web' is neither a swarm run (run-000 .. run-003)" in err
    assert not (corpus / "out-only").exists()


def test_a_source_with_no_kept_documents_is_one_line(corpus, capsys):
    path = write_mix(corpus, "empty.yaml", sources={"prose": {"inputs": ["prose.jsonl"]},
                                                    "junk": {"inputs": ["junk.jsonl"],
                                                             "set": {"data.min_chars": 10**6}}})
    assert kiln(["mix", str(path)]) == 2
    err = one_error(capsys.readouterr().err)
    assert "source 'junk' kept 0 of 30 documents" in err and "quality/too_short 30" in err, err
    assert not (corpus / "out-empty" / "swarm").exists()


def test_a_repetition_limit_no_mixture_can_meet_is_one_line_before_training(corpus, capsys):
    path = write_mix(corpus, "tight.yaml", max_epochs=0.001)
    assert kiln(["mix", str(path)]) == 2
    err = one_error(capsys.readouterr().err)
    assert "max_epochs 0.001 is a limit no mixture can meet" in err, err
    assert not (corpus / "out-tight" / "swarm").exists()


# --- known answers (real runs: slow) ------------------------------------------------------------------------------

KNOWN = _merge(TINY, {"tokenizer": {"vocab_size": 512, "max_docs": 100_000}, "pack": {"seq_len": 64},
                      "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
                      "train": {"max_steps": 150, "batch_size": 8, "warmup_steps": 10, "log_every": 50},
                      "checkpoint": {"every": 50}})


def summary(data: dict) -> str:
    fit = {k: data["fit"][k] for k in ("runs", "spearman", "rmse", "mean_rmse", "trusted")}
    rows = [f"{c['arm']} {c['metric']}: diff {c['diff']:.4f} [{c['ci_low']:.4f}, {c['ci_high']:.4f}] p_holm "
            f"{c['p_holm']:.3g} {c['verdict']}" for c in data["comparisons"]]
    return "\n".join([f"fit {fit}", f"proposal {data['proposal']}", *rows])


@pytest.mark.slow
def test_known_answer_in_domain_over_another_language_over_junk(tmp_path):
    """Three sources: English prose (the eval's domain), German pages, junk (made-up words, base64): the proposal
    puts >= 0.6 on the prose and <= 0.05 on the junk, its held-out Spearman >= 0.7, and the verification says
    `better` than the natural mixture on the target."""
    train, reference = prose()
    german = other_language("de")
    write_jsonl(tmp_path / "prose.jsonl", train)
    write_jsonl(tmp_path / "german.jsonl", german)
    write_jsonl(tmp_path / "junk.jsonl", junk(sum(map(len, train)), vocabulary(reference)))
    write_jsonl(tmp_path / "eval" / "reference.jsonl", reference)
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**KNOWN, "out_dir": "unused"}))
    path = write_mix(tmp_path, swarm=12, seeds=[1, 2, 3], sources={
        "prose": {"inputs": ["prose.jsonl"]}, "german": {"inputs": ["german.jsonl"]},
        "junk": {"inputs": ["junk.jsonl"]}})
    assert kiln(["mix", str(path)]) == 0
    data = json.loads((tmp_path / "out-mix" / "mix.json").read_text())
    print(summary(data))  # the figures behind the verdict, with -s
    assert data["fit"]["trusted"] and data["fit"]["spearman"] >= 0.7, data["fit"]
    weights = data["proposal"]["weights"]
    assert weights["prose"] >= 0.6 and weights["junk"] <= 0.05, weights
    assert data["improvement"]["verdict"] == BETTER and data["improvement"]["better"], data["improvement"]


@pytest.mark.slow
def test_no_false_discovery_on_one_corpus_split_in_three(tmp_path):
    """Three sources that are one corpus (the English prose) split in three at random: the verification says
    `no detectable difference` against the natural mixture for every arm it compares. max_epochs 1 and a budget
    of 320 samples (40 steps of 8): no mixture repeats any text, so no mixture is better in expectation (a
    mixture that repeated a third of the corpus would be worse for a real reason)."""
    train, reference = prose()
    random.Random(0).shuffle(train)
    for k in range(3):
        write_jsonl(tmp_path / f"part{k}.jsonl", train[k::3])
    write_jsonl(tmp_path / "eval" / "reference.jsonl", reference)
    base = _merge(KNOWN, {"train": {"max_steps": 40, "warmup_steps": 4, "log_every": 20}, "checkpoint": {"every": 20}})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**base, "out_dir": "unused"}))
    path = write_mix(tmp_path, swarm=12, seeds=[1, 2, 3], max_epochs=1, sources={
        f"part{k}": {"inputs": [f"part{k}.jsonl"]} for k in range(3)})
    assert kiln(["mix", str(path)]) == 0
    data = json.loads((tmp_path / "out-mix" / "mix.json").read_text())
    print(summary(data))
    assert data["comparisons"] and all(c["verdict"] == SAME for c in data["comparisons"]), data["comparisons"]
    assert not (data["improvement"] or {}).get("better")
