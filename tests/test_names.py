"""kiln.names: a name read from a Kiln file is a plain relative name inside its folder, or a one-line refusal."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kiln.errors import IntegrityError
from kiln.manifest import read_manifest, verify_folder, write_manifest
from kiln.names import check_name, listed_name, resolve_name

PLAIN = ["a", "model.safetensors", "train/00000.bin", "run-00000/task-00001.ids.json", "a b", "caf\u00e9", "..x",
         "x..", ".hidden"]
ESCAPES = ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "./a", "a//b", "a/", "..", ".", "a\\..\\x", "a\0b",
           "/", "//x"]


@pytest.mark.parametrize("name", PLAIN)
def test_plain_names_pass(name):
    assert check_name(name, "index.json") == name


@pytest.mark.parametrize("name", ESCAPES + [None, 3, ["a"], {"a": 1}])
def test_every_escape_is_one_line_naming_the_file_and_the_entry(name):
    with pytest.raises(IntegrityError) as err:
        check_name(name, "/ckpt/index-00000.json")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("/ckpt/index-00000.json: the entry ") and repr(name) in msg


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "..", ".", "", "c.bin", "/"]), min_size=1, max_size=5))
def test_a_name_passes_exactly_when_it_stays_inside(parts):
    name = "/".join(parts)
    inside = bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in name.split("/"))
    try:
        check_name(name, "f")
        passed = True
    except IntegrityError:
        passed = False
    assert passed == inside
    if passed:  # what passes never leaves the folder, as the OS would resolve it
        assert os.path.normpath(os.path.join("/data/folder", name)).startswith("/data/folder/")


def test_symlinks_that_leave_the_folder_are_refused_and_those_inside_pass(tmp_path):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "x.bin").write_bytes(b"outside")
    (folder / "real.bin").write_bytes(b"inside")
    (folder / "out.bin").symlink_to(outside / "x.bin")
    (folder / "rel.bin").symlink_to("../outside/x.bin")
    (folder / "sub" / "up").symlink_to("../..")
    (folder / "in.bin").symlink_to("real.bin")
    (folder / "dirlink").symlink_to(outside)
    for name in ("out.bin", "rel.bin", "sub/up/outside/x.bin", "dirlink/x.bin"):
        with pytest.raises(IntegrityError, match="symlink that leads outside"):
            resolve_name(folder, name, folder / "manifest.json")
    assert resolve_name(folder, "in.bin", "m") == folder / "in.bin"
    assert resolve_name(folder, "real.bin", "m") == folder / "real.bin"
    assert resolve_name(folder, "not-yet.bin", "m") == folder / "not-yet.bin"
    # a folder reached through a symlink of its own is still itself
    (tmp_path / "alias").symlink_to(folder)
    assert resolve_name(tmp_path / "alias", "in.bin", "m") == tmp_path / "alias" / "in.bin"


def test_listed_name_needs_size_and_sha256_in_the_manifest(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x")
    files = {"a.bin": {"size": 1, "sha256": "0" * 64}, "b.bin": {"size": 1}}
    assert listed_name(tmp_path, "a.bin", files, "idx.json") == tmp_path / "a.bin"
    for name in ("b.bin", "c.bin"):
        with pytest.raises(IntegrityError, match="not listed with its size and sha256"):
            listed_name(tmp_path, name, files, "idx.json")


def _rewrite_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("escape", ["../outside/x.bin", "ABSOLUTE", "link.bin"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path, escape):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (folder / "a.bin").write_bytes(b"abc")
    write_manifest(folder, stage="t")
    (outside / "x.bin").write_bytes(b"abc")  # the same bytes: only the name is wrong
    (folder / "link.bin").symlink_to(outside / "x.bin")
    name = str(outside / "x.bin") if escape == "ABSOLUTE" else escape
    _rewrite_manifest(folder, lambda m: m["files"].__setitem__(name, m["files"].pop("a.bin")))
    for read in (read_manifest, verify_folder):
        with pytest.raises(IntegrityError) as err:
            read(folder)
        assert repr(name) in str(err.value) and "manifest.json" in str(err.value)


def test_a_file_table_row_naming_a_file_outside_is_refused(tmp_path):
    from kiln.manifest import FileList

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"abc")
    write_manifest(folder, table="files.jsonl", lists={"files": FileList(["a.bin"])})
    rows = [json.loads(line) for line in (folder / "files.jsonl").read_text().splitlines()]
    rows[0]["name"] = str(tmp_path / "a.bin")
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (folder / "files.jsonl").write_bytes(data)
    _rewrite_manifest(folder, lambda m: m["files"]["files.jsonl"].update(size=len(data),
                                                                       sha256=hashlib.sha256(data).hexdigest()))
    with pytest.raises(IntegrityError, match=r"files.jsonl: the entry '/.*a.bin' is an absolute path"):
        read_manifest(folder)
