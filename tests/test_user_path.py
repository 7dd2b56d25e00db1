"""The path a new user takes, mistake by mistake: each one is a one-line message and an exit code, never a
traceback. Run folders work wherever a checkpoint is expected; own JSONL data that the gates reject says why
and which keys decide it; config paths are relative to the config file; any path works after `--`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, tiny_config

from kiln.cli import main as kiln
from kiln.checkpoint import list_checkpoints
from kiln.train.trainer import Trainer


def QUIET(*_):
    return None


def fails(capsys, args: list[str], rc: int = 2) -> str:
    """Run the CLI, expect exit `rc` and a one-line `kiln: ...` message; return stderr."""
    assert kiln(args) == rc
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\nkiln: " in "\n" + err, err
    return err[err.index("kiln: ") if err.startswith("kiln: ") else err.index("\nkiln: ") + 1:]


@pytest.fixture(scope="module")
def run_out(prepared, tmp_path_factory) -> Path:
    """An out_dir after 4 steps with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("userpath") / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    Trainer(tiny_config(out, train={"max_steps": 4, "eval_every": 0}, checkpoint={"every": 2}), log=QUIET).run()
    assert [c.name for c in list_checkpoints(out / "run" / "checkpoints")] == ["step-00000002", "step-00000004"]
    return out


# --- a run folder wherever a checkpoint is expected ------------------------------------------------------------

@pytest.mark.parametrize("where", ["run", "out", "checkpoints"])
def test_generate_takes_a_run_folder_and_names_the_checkpoint_it_used(run_out, capsys, where):
    folder = {"run": run_out / "run", "out": run_out, "checkpoints": run_out / "run" / "checkpoints"}[where]
    assert kiln(["generate", str(folder), "--prompt", "The", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "step-00000004" in captured.err and "newest valid checkpoint" in captured.err
    assert captured.out.startswith("The")
    # The same text as naming the checkpoint itself.
    assert kiln(["generate", str(run_out / "run/checkpoints/step-00000004"), "--prompt", "The",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == captured.out


def test_eval_and_export_take_a_run_folder(run_out, tmp_path, capsys):
    assert kiln(["eval", str(run_out / "run")]) == 0
    captured = capsys.readouterr()
    assert "step-00000004" in captured.err and json.loads(captured.out)["tokens"] > 0
    assert kiln(["export", "--hf", str(run_out / "run"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "hf" / "manifest.json").read_text())["step"] == 4


def test_a_corrupt_newest_checkpoint_is_named_and_the_one_before_used(run_out, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_out / "run", run)
    weights = run / "checkpoints" / "step-00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    assert kiln(["eval", str(run)]) == 0
    err = capsys.readouterr().err
    assert "skipping corrupt checkpoint" in err and "model.safetensors" in err and "step-00000002" in err


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist; pass a checkpoint folder"),
    ("empty", "no checkpoints here or under checkpoints/ or run/checkpoints/; train first"),
    ("hf", "is a Hugging Face model folder, not a Kiln checkpoint; bring it in with `kiln import --hf"),
])
@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_what_is_not_a_checkpoint_is_one_line(tmp_path, capsys, case, expected, command):
    folder = tmp_path / case
    if case != "missing":
        folder.mkdir()
    if case == "hf":
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
    args = {"generate": ["generate", str(folder), "--prompt", "x"], "eval": ["eval", str(folder)],
            "export": ["export", "--hf", str(folder), str(tmp_path / "exported")]}[command]
    err = fails(capsys, args)
    assert expected in err and str(folder) in err and len(err.strip().splitlines()) == 1


def test_train_on_an_empty_out_dir_says_to_prepare_the_data(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(f"out_dir: {tmp_path / 'empty'}\n")
    err = fails(capsys, ["train", str(config)])
    assert "tokenizer.json" in err and "kiln run CONFIG --until pack" in err and "Traceback" not in err


# --- own data ---------------------------------------------------------------------------------------------------

def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_one_sentence_per_line_prints_the_rejection_table_and_the_keys(tmp_path, capsys):
    rows = [{"text": f"This is sentence number {i} of a small file."} for i in range(60)]
    data = _jsonl(tmp_path / "one.jsonl", rows)
    config = tmp_path / "own.yaml"
    config.write_text(f"out_dir: out\ndata:\n  inputs: [{data.name}]\n")
    err = fails(capsys, ["run", str(config), "--until", "tokenizer"])
    assert "only 0 of 60 documents survived the data stage" in err
    assert "60  100.0%  quality/gopher_short_doc  <- data.quality.gopher_quality.min_words" in err
    # And the key it names is the fix: with the gate relaxed, documents survive it.
    assert kiln(["run", str(config), "--until", "data", "--", "data.quality.gopher_quality.min_words=3",
                 "data.min_chars=10"]) == 0
    stats = json.loads((tmp_path / "out" / "docs" / "stats.json").read_text())  # out_dir: beside the config
    assert "quality/gopher_short_doc" not in stats["rejected_by_reason"]


def test_a_text_field_by_another_name_points_at_data_text_field(tmp_path, capsys):
    data = _jsonl(tmp_path / "c.jsonl", [{"id": f"r{i}", "content": "word " * 80} for i in range(30)])
    config = tmp_path / "own.yaml"
    config.write_text(f"out_dir: {tmp_path / 'out'}\ndata:\n  inputs: [{data}]\n")
    err = fails(capsys, ["run", str(config), "--until", "pack"])
    assert "30  100.0%  read/missing_text  <- data.text_field" in err
    assert "the records have the fields content, id: set data.text_field to the one holding the text" in err


def test_relative_paths_in_a_config_are_relative_to_its_folder(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    _jsonl(project / "data" / "a.jsonl", [{"text": "word " * 80}])
    (project / "cfg.yaml").write_text("out_dir: out\ndata:\n  inputs: [data/a.jsonl]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert kiln(["run", str(project / "cfg.yaml"), "--until", "data"]) == 0
    capsys.readouterr()
    assert (project / "out" / "docs" / "stats.json").is_file() and not (elsewhere / "out").exists()
    # An override typed on the command line is relative to the working directory.
    assert kiln(["run", str(project / "cfg.yaml"), "--until", "data", "out_dir=mine"]) == 0
    assert (elsewhere / "mine" / "docs" / "stats.json").is_file()


def test_a_hive_style_path_is_an_input_not_an_override(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "lang=en" / "part-0.jsonl", [{"text": "word " * 80}])
    assert kiln(["data", "lang=en/part-0.jsonl", "--out", "docs"]) == 0  # an existing file
    assert json.loads(capsys.readouterr().out)["documents"]["read"] == 1
    # A glob is not a file: after `--` the words before are inputs whatever they hold.
    assert kiln(["data", "lang=en/*.jsonl", "--out", "docs2", "--", "data.min_chars=5"]) == 0
    assert json.loads(capsys.readouterr().out)["documents"]["read"] == 1
    assert kiln(["data", "lang=en/*.jsonl", "--out", "docs3", "--set", "data.min_chars=5"]) == 0
    assert json.loads(capsys.readouterr().out)["documents"]["read"] == 1


def test_explain_accepts_the_path_and_line_a_user_types(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "in" / "mine.jsonl", [{"id": f"doc-{i}", "text": f"Short line {i}."} for i in range(5)])
    assert kiln(["data", "in/mine.jsonl", "--out", "docs"]) == 0
    capsys.readouterr()
    assert kiln(["data", "explain", "in/mine.jsonl:3", "--out", "docs"]) == 0
    out = capsys.readouterr().out
    assert "document doc-2" in out and "offset:       82" in out and "dropped by" in out and "doc-1" not in out
    err = fails(capsys, ["data", "explain", "in/mine.jsonl:9", "--out", "docs"])
    assert "give FILE:LINE of an input" in err


def test_tiny_example_runs_from_any_folder(tmp_path, monkeypatch):
    from kiln.config import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "examples" / "tiny.yaml")
    assert Path(cfg.data.inputs[0]) == ROOT / "examples" / "data" / "sample.warc.gz"
    assert Path(cfg.out_dir) == ROOT / "out" / "tiny"


# --- config show and --help ----------------------------------------------------------------------------------------

def test_config_show_prints_the_resolved_config_with_descriptions_and_defaults(tmp_path, capsys):
    import yaml

    from kiln.config import load_config

    tiny = ROOT / "examples" / "tiny.yaml"
    assert kiln(["config", "show", str(tiny), "train.max_steps=20"]) == 0
    out = capsys.readouterr().out
    assert "  max_steps: 20  # * default 100" in out
    assert '  text_field: "text"  # JSONL/Parquet: the field holding the document text; default "text"' in out
    assert "  warmup_steps: 20  # * default 10" in out and "  eos_token: \"<|eos|>\"  # the end-of-document" in out
    # It is YAML that loads back into the same config.
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert load_config(shown) == load_config(tiny, ["train.max_steps=20"])
    assert yaml.safe_load(out)["data"]["inputs"] == [str(ROOT / "examples" / "data" / "sample.warc.gz")]


def test_config_show_names_a_misspelt_override(capsys):
    err = fails(capsys, ["config", "show", str(ROOT / "examples" / "tiny.yaml"), "train.max_step=3"])
    assert "unknown config key 'train.max_step': did you mean train.max_steps?" in err


@pytest.mark.parametrize("command", [["run"], ["data"], ["tokenizer", "train"], ["pack"], ["train"], ["eval"],
                                     ["generate"], ["ckpt", "list"], ["export"], ["import"], ["config", "show"],
                                     ["report"], ["doctor"], ["plan"]])
def test_help_shows_defaults_and_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        kiln([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "\nexample:\n  kiln " in out or "\nexample:\n  torchrun " in out
    if command == ["generate"]:
        assert "--max-new-tokens N  default: 100" in out and "--seed S            default: 0" in out
    if command == ["run"]:
        assert "(default: train)" in out and "--set KEY=VALUE" in " ".join(out.split())
