"""Every file a reader of a checkpoint opens is listed in its manifest.json and hashed (issue 37, item 1).

A checkpoint (full or sharded) whose file is dropped from manifest.json and then altered must be refused, in one
line naming the file, by every reader: `ckpt verify`, `ckpt list`, `eval`, `generate`, `export --hf`, a resume
(which skips it like a corrupt one) and the library's loaders. The cases are every file the manifest lists, not
a list of names, so a file a later format adds is covered too; the issue's two (tokenizer.json with its EOS and
BOS ids swapped, config.yaml with another layer count) run against every reader in the default suite.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from kiln.cli import main as kiln
from kiln.errors import IntegrityError

CKPT = "run/checkpoints/step-00000002"
FORMATS = ("full", "sharded")


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> Path:
    """One trained run per format (never changed: each case works on a copy)."""
    from kiln.train.trainer import Trainer

    root = tmp_path_factory.mktemp("ckpt-files")
    for fmt in FORMATS:
        for name in ("tokenizer", "shards"):
            shutil.copytree(prepared.out / name, root / fmt / name)
        cfg = tiny_config(root / fmt, train={"max_steps": 2, "eval_every": 0}, checkpoint={"every": 2, "format": fmt})
        Trainer(cfg, log=lambda *_: None).run()
        (root / f"{fmt}.yaml").write_text(tiny_config(root / fmt, train={"max_steps": 1, "eval_every": 0},
                                                      checkpoint={"every": 2, "format": fmt}).to_yaml())
    return root


def _listed(runs: Path, fmt: str) -> list[str]:
    return sorted(json.loads((runs / fmt / CKPT / "manifest.json").read_text())["files"])


def _alter(path: Path) -> None:
    """New bytes a reader still takes: the issue's changes for the tokenizer and the config, else a byte of a
    tensor's data flipped, or JSON/pickle contents rewritten."""
    data = path.read_bytes()
    path.unlink()  # the workspace is hard links to the run: replace, never write through
    if path.name == "tokenizer.json":  # the issue's: bos and eos ids swapped
        tok = json.loads(data)
        ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
        swap = {"<|eos|>": "<|bos|>", "<|bos|>": "<|eos|>"} if "<|bos|>" in ids else {}
        for t in tok["added_tokens"]:
            t["id"] = ids[swap.get(t["content"], t["content"])]
        data = json.dumps(tok, indent=1).encode()
    elif path.name == "config.yaml":  # the issue's: another model shape
        cfg = yaml.safe_load(data)
        cfg["model"]["n_layers"] += 1
        data = yaml.safe_dump(cfg).encode()
    elif path.suffix == ".json":
        data = json.dumps(json.loads(data), indent=3).encode()
    elif path.suffix == ".safetensors":
        data = data[:-1] + bytes([data[-1] ^ 0x40])
    else:  # a torch zip: one more byte after its end, which the loaders skip
        data += b"\0"
    path.write_bytes(data)


def tampered(runs: Path, w: Path, fmt: str, name: str) -> Path:
    """A copy of the run whose checkpoint has `name` dropped from manifest.json and then altered."""
    shutil.copytree(runs / fmt, w / fmt, copy_function=os.link)
    shutil.copyfile(runs / f"{fmt}.yaml", w / f"{fmt}.yaml")
    text = (runs / f"{fmt}.yaml").read_text().replace(str(runs / fmt), str(w / fmt))
    (w / f"{fmt}.yaml").write_text(text)
    folder = w / fmt / CKPT
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"][name]
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _alter(folder / name)
    return folder


READERS = {
    "ckpt verify": lambda w, fmt: ["ckpt", "verify", str(w / fmt / CKPT)],
    "ckpt list": lambda w, fmt: ["ckpt", "list", str(w / fmt / "run")],
    "eval": lambda w, fmt: ["eval", str(w / fmt / CKPT)],
    "generate": lambda w, fmt: ["generate", str(w / fmt / CKPT), "--prompt", "The", "--max-new-tokens", "2"],
    "export": lambda w, fmt: ["export", "--hf", str(w / fmt / CKPT), str(w / "hf")],
    "train": lambda w, fmt: ["train", str(w / f"{fmt}.yaml")],
}
ISSUE = ("tokenizer.json", "config.yaml")


def refuses(argv: list[str], reader: str, name: str, capsys) -> None:
    """One line naming `name` as not listed: a refusal, an INVALID row, or a resume's skip."""
    capsys.readouterr()
    rc = kiln(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    if reader == "ckpt list":
        [line] = [line for line in out.splitlines() if line.startswith("step-00000002")]
        assert "INVALID" in line
    elif reader == "train":
        assert rc == 0, err
        [line] = [line for line in err.splitlines() if line.startswith("skipping corrupt checkpoint: ")]
    else:
        assert rc == 1, (rc, out, err)
        [line] = [line for line in err.splitlines() if line.startswith("kiln: ")]
        assert err.strip().splitlines()[-1] == line
    assert f"'{name}'" in line and "not listed" in line, line


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_dropped_from_the_manifest_is_refused_by_every_reader(runs, tmp_path, capsys, fmt):
    """Every listed file, dropped and altered: `ckpt verify`, the loaders and the pick of a resume each refuse it,
    naming it; the issue's two files against every command that reads a checkpoint."""
    from kiln.checkpoint import check_loads, latest_valid, load_checkpoint

    names = _listed(runs, fmt)
    assert set(ISSUE) <= set(names) and len(names) >= 6, names
    for k, name in enumerate(names):
        w = tmp_path / f"case-{k}"
        folder = tampered(runs, w, fmt, name)
        for reader in list(READERS) if name in ISSUE else ["ckpt verify"]:
            refuses(READERS[reader](w, fmt), reader, name, capsys)
        for load in (lambda: load_checkpoint(folder), lambda: check_loads(folder)):
            with pytest.raises(IntegrityError, match=f"'{name}' is not listed"):
                load()
        seen: list[str] = []
        assert latest_valid(folder.parent, log=seen.append) != folder and f"'{name}' is not listed" in seen[0], seen
        shutil.rmtree(w)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_issue_files_are_never_read_unlisted(runs, tmp_path, fmt):
    """The readers of tokenizer.json and config.yaml themselves (not only the verify before them) refuse them
    unlisted: eval's, generate's and export's helpers open them through the manifest."""
    from kiln.tokenizer import load_tokenizer, tokenizer_sha256
    from kiln.checkpoint import checkpoint_config

    for name, read in (("tokenizer.json", load_tokenizer), ("tokenizer.json", tokenizer_sha256),
                       ("config.yaml", checkpoint_config)):
        w = tmp_path / f"{name}-{read.__name__}"
        folder = tampered(runs, w, fmt, name)
        with pytest.raises(IntegrityError, match=f"'{name}' is not listed"):
            read(folder)
        shutil.rmtree(w)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_reader_refuses_every_unlisted_file(runs, tmp_path, capsys, fmt):
    for k, name in enumerate(_listed(runs, fmt)):
        w = tmp_path / f"case-{k}"
        tampered(runs, w, fmt, name)
        for reader in READERS:
            refuses(READERS[reader](w, fmt), reader, name, capsys)
            shutil.rmtree(w / "hf", ignore_errors=True)
        shutil.rmtree(w)
