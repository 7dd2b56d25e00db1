"""Nothing a user typed (paths, overrides, URLs, document ids) is read as rich markup, anywhere Kiln prints."""

from __future__ import annotations

import json
import re
import shlex
from io import StringIO
from pathlib import Path

from kiln.cli import main as kiln

MARKUP = "[bold]x[/bold] [/x] [ ] :smile:"  # rich would style, raise on, or turn into an emoji each of these


def _corpus(prepared, folder: Path, n: int = 60) -> Path:
    """A JSONL file of real kept documents, under a folder and a name full of markup, with markup ids and URLs."""
    from kiln.data.docs import read_docs

    path = folder / "[c] [/data/c1.jsonl].jsonl"  # (each '/' a folder: paths hold them too)
    path.parent.mkdir(parents=True)
    with open(path, "w") as f:
        for i, doc in zip(range(n), read_docs(prepared.out / "docs")):
            f.write(json.dumps({"id": f"[bold]doc{i}[/bold]", "url": f"https://ex.org/[/x]/{i}?q=[red]",
                                "text": doc["text"]}) + "\n")
    return path


def test_kiln_run_prints_paths_overrides_ids_and_urls_as_typed(prepared, tmp_path, capsys, monkeypatch):
    inputs = _corpus(prepared, tmp_path / MARKUP)
    out = tmp_path / "[bold]out[/x]"
    config = tmp_path / "c [red].yaml"
    config.write_text("data: {min_chars: 200, workers: 1}\ntokenizer: {vocab_size: 512}\npack: {seq_len: 64}\n")
    monkeypatch.chdir(tmp_path)
    words = ["run", str(config), f"data.inputs=['{inputs}']", f"out_dir={out}", "--until", "pack"]
    assert kiln(words) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "Traceback" not in err and "MarkupError" not in err
    assert f"{out}/docs" in err and f"{out}/shards" in err  # the stage lines, as typed
    again = shlex.join([str(config), f"data.inputs=['{inputs}']", f"out_dir={out}"])
    from kiln.install import kiln_command

    k = kiln_command()  # how next: lines call Kiln from here
    assert f"{k} run {again}" in err  # next: the same words, shell-quoted, markup and all
    assert [shlex.split(line.split("#")[0])[len(shlex.split(k)) + 1:] for line in err.splitlines()
            if line.strip().startswith(f"{k} run ")] == [shlex.split(again)]
    from kiln.data.docs import read_docs

    docs = list(read_docs(out / "docs"))
    assert docs and all(re.fullmatch(r"\[bold\]doc\d+\[/bold\]", d["id"]) for d in docs)
    assert all(d["source"] == str(inputs) for d in docs)  # the file with brackets is itself, not a glob
    # `kiln data explain` by id and by URL prints them as they are
    assert kiln(["data", "explain", docs[0]["id"], "--out", str(out / "docs")]) == 0
    explained = capsys.readouterr().out
    assert docs[0]["id"] in explained and docs[0]["url"] in explained


def test_the_summary_keeps_markup_and_long_paths_whole_in_a_file():
    from rich.console import Console

    from kiln.summary import print_summary

    data = {"documents": {"read": 10, "kept": 8, "rejected": 2}, "rejected_by_reason": {"quality/[bold]": 2},
            "kept_by_lang": {"en": 8}, "file_errors": [], "truncated": []}
    ckpt = "/r/" + "a-very-long-folder-name/" * 8 + f"{MARKUP}/run/checkpoints/step-00000020"
    train = {"steps": 20, "tokens_seen": 100, "skipped_steps": 0, "params": 5, "val_loss_start": 7.0,
             "val_loss_end": 6.0, "checkpoint": ckpt}
    out = StringIO()
    console = Console(file=out, width=80, markup=False)  # a file, 80 columns: what `kiln run 2> log` gets
    print_summary({"data": data, "train": train, "timings_s": {"data": 3.25}}, console, config="'c [/x].yaml'")
    text = out.getvalue()
    assert ckpt in text and "quality/[bold]" in text  # whole, on one line, not cut or folded at 80 columns
    run = str(Path(ckpt).parent.parent)
    assert f"kiln report {shlex.quote(run)}" in text and f"kiln export --hf {shlex.quote(run)} " in text
    assert "kiln run 'c [/x].yaml' train.max_steps=40" in text


def test_warnings_and_errors_print_markup_as_typed(tmp_path, capsys):
    missing = tmp_path / "[bold]nope[/x].warc.gz"
    assert kiln(["data", str(missing), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and len(err.strip().splitlines()) == 1
    from kiln.commands.args import console  # what `kiln run` and `kiln train` log through (stage lines, warnings)

    line = f"warning: {MARKUP} in {missing}" + " long" * 30
    console().print(line)
    assert capsys.readouterr().err == line + "\n"  # as typed, and not wrapped
