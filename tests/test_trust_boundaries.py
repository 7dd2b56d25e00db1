"""Every name inside Kiln's files stays inside what a hash covers (issue 25's walk-every-name test).

One prepared run gives every stage's output: docs, tokenizer, shards, a dedup index, a full and a sharded
checkpoint and an HF export. For each JSON file in them, every string that names a file of its folder is
rewritten the three ways an attacker would: a `../` escape and an absolute path (the file copied there, the
inside one dropped with its manifest entry, every hash that covers the rewritten file updated), and the file
itself replaced by a symlink to a copy outside (names and hashes unchanged). Then each command that reads that
folder (verify, list, inspect, load, eval, generate, train, export, import, pack, tokenizer, data) must refuse
in one line and open nothing outside (inotify: any process, any open, Rust and C included).

The default suite runs every case against the folder's cheap readers and one of its expensive readers in turn;
`-m slow` runs every reader on every case.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import tiny_config
from fs_audit import OpenWatch
from kiln.cli import main as kiln

HOWS = ("escape", "absolute", "symlink")
CKPT = "out/run/checkpoints/step-00000002"
SHARDED = "outs/run/checkpoints/step-00000002"
# Each folder kind: where it is in the prepared tree, and whether its part names are file prefixes.
FOLDERS = {"docs": "out/docs", "tokenizer": "out/tokenizer", "shards": "out/shards", "dedup-index": "index",
           "checkpoint": CKPT, "sharded-checkpoint": SHARDED, "hf-export": "hf"}


# --- the prepared run -----------------------------------------------------------------------------------

def _jsonl(prepared, path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"id": d["id"], "url": d["url"], "text": d["text"]}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def stages(prepared, tmp_path_factory) -> Path:
    """Every stage's output under one folder (never changed: each case works on a copy)."""
    from kiln.data.docs import read_docs
    from kiln.data.pipeline import run_data
    from kiln.ops.export import export_hf
    from kiln.train.trainer import Trainer

    root = tmp_path_factory.mktemp("stages")
    for out, fmt in (("out", "full"), ("outs", "sharded")):
        for name in ("docs", "tokenizer", "shards"):
            shutil.copytree(prepared.out / name, root / out / name)
        cfg = tiny_config(root / out, train={"max_steps": 2, "eval_every": 0}, checkpoint={"every": 2, "format": fmt})
        Trainer(cfg, log=lambda *_: None).run()
    export_hf(root / CKPT, root / "hf")
    docs = list(itertools.islice(read_docs(prepared.out / "docs"), 60))
    _jsonl(prepared, root / "a.jsonl", docs[:30])
    _jsonl(prepared, root / "b.jsonl", docs[30:])
    data = tiny_config(root / "unused", data={"dedup": {"index": str(root / "index")}}).data
    run_data([str(root / "a.jsonl")], root / "docs-a", data)
    assert (root / "index" / "run-00000" / "manifest.json").is_file()
    return root


# --- the cases: every string that names a file, in every JSON file of every stage's folder ----------------

@dataclass(frozen=True)
class Case:
    kind: str
    json: str  # the JSON file, relative to the folder
    name: str  # the string in it
    how: str

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.json}:{self.name}:{self.how}"


def _strings(node: Any):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _load(path: Path) -> list[Any]:
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else \
        [json.loads(text)]


def targets(folder: Path, name: str, kind: str) -> list[Path]:
    """What `name` (read from a file of `folder`) names: a file or folder, or, in a dedup index, the files a
    part name prefixes (task-00000 -> run-NNNNN/task-00000.exact.npy, ...)."""
    if os.path.isabs(name) or name.strip(".") == "" or "\n" in name:
        return []
    if (folder / name).exists():
        return [folder / name]
    if kind == "dedup-index":
        return [Path(p) for d in folder.iterdir() if d.is_dir() for p in glob.glob(f"{glob.escape(str(d / name))}.*")]
    return []


def cases(root: Path) -> list[Case]:
    found: list[Case] = []
    for kind, rel in FOLDERS.items():
        folder = root / rel
        links: set[str] = set()
        for path in sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file()):
            names = sorted({s for doc in _load(path) for s in _strings(doc) if targets(folder, s, kind)})
            for name in names:
                found += [Case(kind, path.relative_to(folder).as_posix(), name, how) for how in ("escape", "absolute")]
                links.add(name)
        found += [Case(kind, "", name, "symlink") for name in sorted(links)]
    return found


# --- making an attack -------------------------------------------------------------------------------------

def _write(path: Path, data: bytes) -> None:
    path.unlink()  # the case's tree shares files with the prepared one (hard links): never write through them
    path.write_bytes(data)


def _dump(docs: list[Any], path: Path) -> bytes:
    if path.suffix == ".jsonl":
        return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    return json.dumps(docs[0], indent=1).encode()


def _rename(node: Any, old: str, new: str) -> Any:
    if isinstance(node, str):
        return new if node == old else node
    if isinstance(node, dict):
        return {(new if k == old else k): _rename(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_rename(v, old, new) for v in node]
    return node


def _listing(folder: Path, path: Path) -> tuple[Path, dict, str] | None:
    """(manifest, its parsed JSON, the entry) of the nearest manifest.json above `path` that lists it inline."""
    for d in [path.parent, *path.parent.parents]:
        if not str(d).startswith(str(folder)):
            return None
        m = d / "manifest.json"
        if m.is_file() and m != path:
            manifest = json.loads(m.read_text())
            entry = path.relative_to(d).as_posix()
            return (m, manifest, entry) if entry in manifest.get("files", {}) else None
    return None


def _rehash(folder: Path, path: Path) -> None:
    """The hash of a rewritten file, updated wherever it is listed (a manifest, or shards' files.jsonl)."""
    data = path.read_bytes()
    meta = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if (found := _listing(folder, path)) is not None:
        m, manifest, entry = found
        manifest["files"][entry].update(meta)
        _write(m, json.dumps(manifest, indent=1).encode())
        return
    table = folder / "files.jsonl"
    if table.is_file() and path != table:
        rows = _load(table)
        for row in rows:
            if row["name"] == path.relative_to(folder).as_posix():
                row.update(meta)
        _write(table, _dump(rows, table))
        _rehash(folder, table)


def attack(folder: Path, outside: Path, case: Case) -> None:
    ts = targets(folder, case.name, case.kind)
    assert ts, case
    for t in ts:
        copy = outside / t.relative_to(folder)
        copy.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if t.is_dir() else shutil.copyfile)(t, copy)
    if case.how == "symlink":
        for t in ts:
            shutil.rmtree(t) if t.is_dir() else t.unlink()
            t.symlink_to(outside / t.relative_to(folder))
        return
    base = ts[0].parent if case.kind == "dedup-index" and ts[0].parent != folder else folder
    target = outside / base.relative_to(folder) / case.name
    new = str(target) if case.how == "absolute" else os.path.relpath(target, base)
    path = folder / case.json
    _write(path, _dump([_rename(doc, case.name, new) for doc in _load(path)], path))
    if not path.name.startswith(("manifest", "files")):  # the attacker drops the inside file and its entry
        for t in ts:
            if (found := _listing(folder, t)) is not None:
                m, manifest, entry = found
                del manifest["files"][entry]
                _write(m, json.dumps(manifest, indent=1).encode())
            shutil.rmtree(t) if t.is_dir() else t.unlink()
    if path.name != "manifest.json":
        _rehash(folder, path)


# --- the readers of each folder ---------------------------------------------------------------------------

def _config(w: Path, out: str, **train) -> Path:
    path = w / f"{out}.yaml"
    if not path.exists():
        path.write_text(tiny_config(w / out, train={"max_steps": 2, "eval_every": 0, **train},
                                    checkpoint={"every": 2}).to_yaml())
    return path


Reader = Callable[[Path], list[str]]
DOCS_ID = "DOCS_ID"
READERS: dict[str, dict[str, Reader]] = {
    "docs": {
        "tokenizer train": lambda w: ["tokenizer", "train", str(w / "out/docs"), "--out", str(w / "tok2"),
                                      "--config", str(_config(w, "out"))],
        "pack": lambda w: ["pack", str(w / "out/docs"), "--tokenizer", str(w / "out/tokenizer"), "--out",
                           str(w / "shards2"), "--config", str(_config(w, "out"))],
        "data explain": lambda w: ["data", "explain", DOCS_ID, "--out", str(w / "out/docs")],
    },
    "tokenizer": {
        "pack": lambda w: ["pack", str(w / "out/docs"), "--tokenizer", str(w / "out/tokenizer"), "--out",
                           str(w / "shards2"), "--config", str(_config(w, "out"))],
        "shards inspect": lambda w: ["shards", "inspect", str(w / "out/shards"), "--at", "0"],
        "train": lambda w: ["train", str(_config(w, "out", max_steps=3))],
    },
    "shards": {
        "shards verify": lambda w: ["shards", "verify", str(w / "out/shards")],
        "shards inspect": lambda w: ["shards", "inspect", str(w / "out/shards"), "--at", "0"],
        "train": lambda w: ["train", str(_config(w, "out", max_steps=3))],
    },
    "dedup-index": {
        "data": lambda w: ["data", str(w / "b.jsonl"), "--out", str(w / "docs-b"), "--",
                           f"data.dedup.index={w / 'index'}", "data.min_chars=200", "data.workers=1"],
    },
    "hf-export": {
        "import": lambda w: ["import", "--hf", str(w / "hf"), "--config", str(_config(w, "imp"))],
    },
}
for _kind, _out in (("checkpoint", "out"), ("sharded-checkpoint", "outs")):
    _ck = f"{_out}/run/checkpoints/step-00000002"
    READERS[_kind] = {
        "ckpt verify": lambda w, ck=_ck: ["ckpt", "verify", str(w / ck)],
        "ckpt list": lambda w, o=_out: ["ckpt", "list", str(w / o / "run")],
        "eval": lambda w, ck=_ck: ["eval", str(w / ck)],
        "generate": lambda w, ck=_ck: ["generate", str(w / ck), "--prompt", "The", "--max-new-tokens", "2"],
        "export": lambda w, ck=_ck: ["export", "--hf", str(w / ck), str(w / "hf2")],
        "train": lambda w, o=_out: ["train", str(_config(w, o, max_steps=3))],
    }
CHEAP = {"ckpt verify", "ckpt list", "shards verify", "data explain", "import", "data", "shards inspect"}


def _workspace(stages: Path, w: Path) -> None:
    """A copy of the prepared tree (hard links: cheap; files the attack rewrites are replaced, not written)."""
    shutil.copytree(stages, w, copy_function=os.link, symlinks=True)
    for name in ("tokenizer", "shards"):  # import writes a new run: it needs the run's prepared data
        shutil.copytree(stages / "out" / name, w / "imp" / name, copy_function=os.link)


def refuses(reader: str, argv: list[str], capsys) -> None:
    capsys.readouterr()
    rc = kiln(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out, err
    if reader == "ckpt list":  # a row per checkpoint: this one INVALID, with its one-line reason
        [row] = [line for line in out.splitlines() if line.startswith("step-00000002")]
        assert "INVALID" in row, out
        return
    lines = err.strip().splitlines()
    if reader == "train" and rc == 0:  # the tampered checkpoint is skipped like a corrupt one, in one line
        assert any(line.startswith("skipping corrupt checkpoint: ") for line in lines), err
        return
    assert rc in (1, 2), (rc, out, err)
    assert len([line for line in lines if line.startswith("kiln: ")]) == 1 and lines[-1].startswith("kiln: "), err


def run_case(stages: Path, w: Path, case: Case, readers: list[str], capsys) -> list[str]:
    """The failures of `readers` on `case` (empty: each refused in one line and read nothing outside)."""
    _workspace(stages, w)
    outside = w / "outside"
    outside.mkdir()
    attack(w / FOLDERS[case.kind], outside, case)
    failures = []
    for reader in readers:
        argv = [_docs_id(stages) if a == DOCS_ID else a for a in READERS[case.kind][reader](w)]
        with OpenWatch(outside) as watch:
            try:
                refuses(reader, argv, capsys)
            except AssertionError as exc:
                failures.append(f"{case.id} | {reader}: {str(exc)[-600:]}")
        if watch.opened():
            failures.append(f"{case.id} | {reader}: opened {sorted(watch.opened())} outside")
    return failures


def _docs_id(stages: Path) -> str:
    from kiln.data.docs import read_docs

    return next(iter(read_docs(stages / "out" / "docs")))["id"]


def _walk(stages: Path, tmp_path: Path, kind: str, capsys, every_reader: bool) -> None:
    found = [c for c in cases(stages) if c.kind == kind]
    assert found, kind
    cheap = [r for r in READERS[kind] if r in CHEAP]
    costly = itertools.cycle([r for r in READERS[kind] if r not in CHEAP] or [None])
    failures = []
    for k, case in enumerate(found):
        readers = list(READERS[kind]) if every_reader else [*cheap, *filter(None, [next(costly)])]
        failures += run_case(stages, tmp_path / f"case-{k}", case, readers, capsys)
        shutil.rmtree(tmp_path / f"case-{k}")
    assert not failures, f"{len(failures)} of {len(found)} cases failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_every_name_in_every_stage_file_stays_inside_its_folder(stages, tmp_path, capsys, kind):
    _walk(stages, tmp_path, kind, capsys, every_reader=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FOLDERS))
def test_every_reader_refuses_every_rewritten_name(stages, tmp_path, capsys, kind):
    _walk(stages, tmp_path, kind, capsys, every_reader=True)


def test_the_walk_finds_the_names_the_issue_names(stages):
    """The cases include the three holes issue 25 found: a sharded checkpoint's piece file, a shards file table
    row, and (in the HF export, with an index added by the HF-import tests) the weights' names."""
    found = {(c.kind, c.json, c.name) for c in cases(stages) if c.how == "absolute"}
    assert ("sharded-checkpoint", "index-00000.json", "model-00000.safetensors") in found
    assert ("shards", "files.jsonl", "train/00000.bin") in found
    assert ("dedup-index", "index.json", "run-00000") in found and ("dedup-index", "index.json", "task-00000") in found
    assert ("checkpoint", "manifest.json", "model.safetensors") in found
    assert ("hf-export", "manifest.json", "model.safetensors") in found
