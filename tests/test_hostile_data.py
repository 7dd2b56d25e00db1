"""A careless or hostile user on the data -> tokenizer -> shards path, through the real `kiln` command:
each case ends in one line naming the file, record or key and the fix (never a traceback), or works.

Real JSONL files, a real docs folder, tokenizer and shards built once per module. The work folder's
cases (a deleted, cut or changed task outcome, signature or dedup result; a resume with another
data.dedup.bucket_docs) must give the uninterrupted run's docs, byte for byte.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kiln.data.pipeline as pipeline
from kiln.config import DataConfig
from kiln.errors import ConfigError
from kiln.manifest import read_manifest
from test_data import assert_same_output, english


def kiln(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def error_line(r: subprocess.CompletedProcess) -> str:
    """The one line the user reads: no traceback, and the last line of stderr is Kiln's."""
    assert "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


def write_jsonl(path: Path, first: int, n: int, prefix: str = "d") -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{first + i}", "text": english(first + i)}) + "\n"
                            for i in range(n)))
    return path


def flip(path: Path, at: int, n: int = 32) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


QUIET = ["--", "data.workers=1"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """inputs/a.jsonl, b.jsonl -> docs/ -> tok/ -> shards/ with the real commands (about 10 s)."""
    root = tmp_path_factory.mktemp("built")
    (root / "inputs").mkdir()
    write_jsonl(root / "inputs" / "a.jsonl", 0, 40)
    write_jsonl(root / "inputs" / "b.jsonl", 40, 40)
    r = kiln("data", str(root / "inputs" / "a.jsonl"), str(root / "inputs" / "b.jsonl"), "--out", str(root / "docs"),
             "--", "data.workers=1", "data.docs_per_part=30")
    assert r.returncode == 0, r.stderr
    r = kiln("tokenizer", "train", str(root / "docs"), "--out", str(root / "tok"), "tokenizer.vocab_size=300")
    assert r.returncode == 0, r.stderr
    r = kiln("pack", str(root / "docs"), "--tokenizer", str(root / "tok"), "--out", str(root / "shards"),
             "pack.seq_len=32", "pack.samples_per_shard=100", "pack.val_fraction=0.1")
    assert r.returncode == 0, r.stderr
    return root


def copy_of(built: Path, name: str, tmp_path: Path) -> Path:
    shutil.copytree(built / name, tmp_path / name)
    return tmp_path / name


# --- inputs ---------------------------------------------------------------------------------------

def test_a_folder_given_as_an_input_reads_its_files_and_one_without_any_is_refused(tmp_path):
    """A folder is read whole (every data file in it, issue 37 item 9: test_data_hub has the mixed one); a folder
    holding no data file is one line naming the kinds Kiln reads, before any work."""
    (tmp_path / "crawl").mkdir()
    write_jsonl(tmp_path / "crawl" / "a.jsonl", 0, 3)
    (tmp_path / "crawl" / "notes.txt").write_text("not data")
    r = kiln("data", str(tmp_path / "crawl"), "--out", str(tmp_path / "docs"), *QUIET)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "docs" / "stats.json").read_text())["documents"]["read"] == 3
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("not data")
    r = kiln("data", str(tmp_path / "notes"), "--out", str(tmp_path / "docs2"), *QUIET)
    assert r.returncode == 2
    line = error_line(r)
    assert line.startswith(f"kiln: error: input {tmp_path / 'notes'} is a folder with no data files (.parquet, ")
    assert line.endswith(f"give its files or a glob, e.g. '{tmp_path / 'notes' / '*.warc.gz'}' or "
                         f"'{tmp_path / 'notes' / '*.jsonl'}'")
    assert not (tmp_path / "docs2").exists()


@pytest.mark.parametrize("name, make, said", [
    ("plain.jsonl.gz", lambda raw: raw, "named .gz but is not gzip data (it starts with b'{\"id'); "
                                        "rename it plain.jsonl"),
    ("packed.jsonl", gzip.compress, "not named .gz or .zst but is gzip data; rename it packed.jsonl.gz"),
    ("packed.jsonl.zst", gzip.compress, "named .zst but is gzip data; rename it packed.jsonl.gz"),
])
def test_a_jsonl_whose_compression_is_not_its_name_is_a_file_error(tmp_path, name, make, said):
    # before: a plain file named .gz read as nothing (exit 0, 0 documents, "truncated at 0"); a gzip named
    # .jsonl read as lines of binary, each an invalid_json rejection
    write_jsonl(tmp_path / "raw", 0, 5)
    src = tmp_path / name
    src.write_bytes(make((tmp_path / "raw").read_bytes()))
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET)
    assert r.returncode == 1  # every input failed
    assert error_line(r) == f"kiln: warning: {src}: {said} (Kiln picks the decompression by the name)"
    stats = json.loads((tmp_path / "docs" / "stats.json").read_text())
    assert stats["documents"]["read"] == 0 and stats["truncated"] == []
    assert [e["source"] for e in stats["file_errors"]] == [str(src)]


def test_a_jsonl_line_nested_deeper_than_the_stack_is_one_rejection(tmp_path):
    # before: RecursionError from json.loads ended the whole run with a traceback, no docs folder
    src = tmp_path / "deep.jsonl"
    good = json.dumps({"id": "ok", "text": english(1)})
    src.write_text("[" * 100_000 + "]" * 100_000 + "\n" + good + "\n" + '{"id": "x", "a": ' + "[" * 100_000 + "}\n")
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    stats = json.loads((tmp_path / "docs" / "stats.json").read_text())
    assert stats["documents"] == {"read": 3, "kept": 1, "rejected": 2}
    assert stats["rejected_by_reason"] == {"read/invalid_json": 2}


def test_a_text_file_not_named_by_its_format_says_how_it_was_read(tmp_path):
    src = write_jsonl(tmp_path / "docs.txt", 0, 3)
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET)
    assert r.returncode == 1
    assert error_line(r).endswith("check the path and format (a file not named .jsonl/.ndjson/.json[.gz|.zst] or "
                                  ".parquet is read as WARC: name it by its format)")


# --- data.dedup.index -----------------------------------------------------------------------------

def test_an_index_that_is_a_file_is_refused_before_any_work(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", 0, 3)
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET, f"data.dedup.index={src}")
    assert r.returncode == 2  # before: NotADirectoryError traceback
    assert error_line(r) == (f"kiln: error: data.dedup.index: {src} is a file, not a folder; give a new or empty "
                             "folder, or one an earlier run's data.dedup.index wrote")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]  # no work folder, no docs


@pytest.mark.parametrize("where", ["docs/index", "docs"])
def test_an_index_overlapping_the_docs_folder_is_refused_before_any_work(tmp_path, where):
    # before: the whole run, then "docs already exists and is not an earlier `kiln data` output" at the commit,
    # with the index written inside the docs folder (and the same refusal on every run after)
    src = write_jsonl(tmp_path / "a.jsonl", 0, 3)
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET, f"data.dedup.index={tmp_path / where}")
    assert r.returncode == 2
    assert error_line(r) == (f"kiln: error: data.dedup.index: {tmp_path / where} and the docs folder "
                             f"{tmp_path / 'docs'} overlap (the docs folder is replaced as a whole, and the index must "
                             "outlive it): give an index folder outside it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_a_changed_input_rerun_into_the_same_docs_with_an_index_is_refused(tmp_path):
    # before: the second run deduplicated against the first run's entry of the same docs folder and kept
    # 0 of 31 documents (every one a "duplicate" of itself), exit 0
    src = write_jsonl(tmp_path / "a.jsonl", 0, 30)
    docs, index = tmp_path / "docs", tmp_path / "index"
    r = kiln("data", str(src), "--out", str(docs), *QUIET, f"data.dedup.index={index}")
    assert r.returncode == 0, r.stderr
    before = read_manifest(docs)
    with open(src, "a") as f:
        f.write(json.dumps({"id": "late", "text": english(99)}) + "\n")
    r = kiln("data", str(src), "--out", str(docs), *QUIET, f"data.dedup.index={index}")
    assert r.returncode == 2
    assert error_line(r) == (f"kiln: error: data.dedup.index: run-00000 of {index} was written into this same docs "
                             f"folder {docs} from other inputs or settings; deduplicating against it would remove "
                             "every document the two share: write this run to a new --out (one docs folder per "
                             "dump), or start a new index folder")
    assert read_manifest(docs) == before and not list(tmp_path.glob(".docs-work-*"))
    # the same refusal for a caller of run_data (the check before the index is written), and the docs stay
    with pytest.raises(ConfigError, match="run-00000 of .* was written into this same docs folder"):
        pipeline.run_data([str(src)], docs, DataConfig(workers=1, dedup={"index": str(index)}))
    assert read_manifest(docs) == before
    assert len(json.loads((index / "index.json").read_text())["runs"]) == 1
    # the next dump into a docs folder of its own is what the index is for
    r = kiln("data", str(src), "--out", str(tmp_path / "next"), *QUIET, f"data.dedup.index={index}")
    assert r.returncode == 0, r.stderr
    stats = json.loads((tmp_path / "next" / "stats.json").read_text())
    assert stats["dedup"]["removed_against_index"] == 30 and stats["documents"]["kept"] == 1


def test_the_same_inputs_into_a_second_docs_folder_on_one_index_are_refused(tmp_path):
    # before: the second folder was taken for a rerun of the first (the same index key), deduplicated against
    # nothing, and kept all 30 documents again: training on both folders saw each twice
    src = write_jsonl(tmp_path / "a.jsonl", 0, 30)
    index = tmp_path / "index"
    assert kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET, f"data.dedup.index={index}").returncode == 0
    r = kiln("data", str(src), "--out", str(tmp_path / "again"), *QUIET, f"data.dedup.index={index}")
    assert r.returncode == 2
    assert error_line(r) == (f"kiln: error: data.dedup.index: run-00000 of {index} holds these same inputs and "
                             f"settings, written to {tmp_path / 'docs'}; a second docs folder of them would keep every "
                             "document again (training on both would see each twice): run into "
                             f"{tmp_path / 'docs'} (it resumes or is skipped), or use another index folder")
    assert not (tmp_path / "again").exists()
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET, f"data.dedup.index={index}")
    assert r.returncode == 0, r.stderr  # the rerun into its own folder is still a rerun
    assert len(json.loads((index / "index.json").read_text())["runs"]) == 1


def test_kiln_run_refuses_a_changed_input_into_the_same_docs_with_an_index(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 0, 25)
    (tmp_path / "crawl.yaml").write_text("out_dir: out\ndata: {inputs: [a.jsonl], workers: 1, dedup: {index: index}}\n")
    r = kiln("run", str(tmp_path / "crawl.yaml"), "--until", "data", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    before = read_manifest(tmp_path / "out" / "docs")
    write_jsonl(tmp_path / "a.jsonl", 0, 26)  # one more document: another fingerprint, the same docs folder
    r = kiln("run", str(tmp_path / "crawl.yaml"), "--until", "data", cwd=tmp_path)
    assert r.returncode == 2  # before: 0 of 26 kept, exit 0
    assert error_line(r).startswith(f"kiln: error: data.dedup.index: run-00000 of {tmp_path / 'index'} was written "
                                    f"into this same docs folder {tmp_path / 'out' / 'docs'} from other inputs")
    assert read_manifest(tmp_path / "out" / "docs") == before


def test_a_second_run_on_the_same_index_stops_at_once(tmp_path):
    # before: two runs on one index ran side by side, neither deduplicated against the other, and the index
    # listed one before the other (a later re-run of the second then deduplicated against the first)
    import time

    write_jsonl(tmp_path / "a.jsonl", 0, 300)
    src = write_jsonl(tmp_path / "b.jsonl", 300, 5)
    index = tmp_path / "index"
    first = subprocess.Popen([sys.executable, "-m", "kiln", "data", str(tmp_path / "a.jsonl"), "--out",
                              str(tmp_path / "first"), *QUIET, f"data.dedup.index={index}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / ".index.lock"
        for _ in range(600):  # the first run takes the index's lock before its work
            if lock.is_file() and lock.read_text():
                break
            time.sleep(0.05)
        r = kiln("data", str(src), "--out", str(tmp_path / "second"), *QUIET, f"data.dedup.index={index}")
        assert first.poll() is None, "the first run ended before the second started; make it longer"
    finally:
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert r.returncode == 2
    line = error_line(r)
    assert line.startswith(f"kiln: error: {index} is being written by a `kiln data` run using it as "
                           f"data.dedup.index: pid {first.pid} on host ")
    assert not (tmp_path / "second").exists()
    assert len(json.loads((index / "index.json").read_text())["runs"]) == 1


def test_an_index_at_a_url_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", 0, 3)
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET, "data.dedup.index=s3://bucket/index",
             cwd=tmp_path)
    assert r.returncode == 2  # before: a local folder named "s3:" in the working directory
    assert error_line(r) == ("kiln: error: bad value for config key 'data.dedup': Value error, data.dedup.index must "
                             "be a local folder (on a cluster, one every node mounts), got the URL 's3://bucket/index'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


@pytest.fixture(scope="module")
def index_of_a(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("index")
    write_jsonl(root / "a.jsonl", 0, 20)
    r = kiln("data", str(root / "a.jsonl"), "--out", str(root / "docs"), *QUIET, f"data.dedup.index={root / 'index'}")
    assert r.returncode == 0, r.stderr
    return root / "index"


@pytest.mark.parametrize("damage, said", [
    (lambda run: (run / "task-00000.bands.npy").write_bytes(b"\x93NUMPY cut"), "task-00000.bands.npy: size 10 != "),
    (lambda run: flip(run / "task-00000.shingles.npy", 300), "task-00000.shingles.npy: sha256 "),
    (lambda run: shutil.rmtree(run), "run-00000, listed in "),
])
def test_a_damaged_index_is_named_not_used(tmp_path, index_of_a, damage, said):
    # before: a cut .npy was a numpy ValueError traceback; changed shingles were used silently (wrong dedup)
    index = tmp_path / "index"
    shutil.copytree(index_of_a, index)
    damage(index / "run-00000")
    src = write_jsonl(tmp_path / "b.jsonl", 10, 20)  # half of it copies of a.jsonl
    r = kiln("data", str(src), "--out", str(tmp_path / "docs"), *QUIET, f"data.dedup.index={index}")
    assert r.returncode == 1
    line = error_line(r)
    assert line.startswith(f"kiln: verification failed: data.dedup.index: {index / 'run-00000'}") and said in line
    assert line.endswith("restore the index folder from a copy, or start a new one")
    assert not (tmp_path / "docs").exists()


def test_an_index_json_without_its_tables_is_named(tmp_path, index_of_a):
    index = tmp_path / "index"
    shutil.copytree(index_of_a, index)
    (index / "index.json").write_text(json.dumps({"kind": "kiln-dedup-index"}))
    r = kiln("data", str(write_jsonl(tmp_path / "b.jsonl", 0, 3)), "--out", str(tmp_path / "docs"), *QUIET,
             f"data.dedup.index={index}")
    assert r.returncode == 1  # before: KeyError 'settings'
    assert error_line(r) == (f"kiln: verification failed: {index / 'index.json'}: has no settings or runs table Kiln "
                             "can read; restore it or start a new index folder")


# --- a docs folder changed after it was committed -------------------------------------------------

def test_explain_names_a_changed_docs_part_instead_of_a_traceback(built, tmp_path):
    docs = copy_of(built, "docs", tmp_path)
    flip(docs / "part-00001.jsonl.zst", 200)
    r = kiln("data", "explain", "d3", "--out", str(docs))
    assert r.returncode == 1  # before: JSONDecodeError (or a zstd error) traceback
    line = error_line(r)
    assert line.startswith(f"kiln: verification failed: {docs / 'part-00001.jsonl.zst'}: sha256 ")
    assert line.endswith("the docs folder changed after `kiln data` wrote it, run `kiln data` again")


def test_explain_names_a_missing_part_instead_of_not_finding_the_document(built, tmp_path):
    docs = copy_of(built, "docs", tmp_path)
    (docs / "part-00000.jsonl.zst").unlink()
    r = kiln("data", "explain", "d3", "--out", str(docs))
    assert r.returncode == 1  # before: "no document with id ... 'd3'" (exit 2), the missing part unsaid
    assert error_line(r) == (f"kiln: verification failed: {docs / 'part-00000.jsonl.zst'}: listed in manifest.json "
                             "but missing; the docs folder changed after `kiln data` wrote it, run `kiln data` again")


def test_explain_on_the_shards_folder_says_what_it_is(built):
    r = kiln("data", "explain", "d3", "--out", str(built / "shards"))
    assert r.returncode == 2  # before: "no document with id ... 'd3'"
    assert error_line(r) == (f"kiln: error: {built / 'shards'}: a `kiln pack` output, not a docs folder; give the "
                             "folder `kiln data` wrote ({out_dir}/docs) with --out")


def test_tokenizer_train_names_a_changed_stats_json(built, tmp_path):
    docs = copy_of(built, "docs", tmp_path)
    (docs / "stats.json").write_text("{}")
    r = kiln("tokenizer", "train", str(docs), "--out", str(tmp_path / "tok"), "tokenizer.vocab_size=300")
    assert r.returncode == 1  # before: KeyError 'documents' traceback
    line = error_line(r)
    assert line.startswith(f"kiln: verification failed: {docs / 'stats.json'}: size 2 != ")
    assert line.endswith("the docs folder changed after `kiln data` wrote it, run `kiln data` again")


# --- shards inspect -------------------------------------------------------------------------------

@pytest.mark.parametrize("damage, said", [
    (lambda s: flip(s / "train" / "00000.docs.jsonl.zst", 40), "train/00000.docs.jsonl.zst: sha256 "),
    (lambda s: (s / "train" / "00000.docs.jsonl.zst").write_bytes(b"["), "train/00000.docs.jsonl.zst: size 1 != "),
    (lambda s: (s / "train" / "00000.docs.jsonl.zst").unlink(), "train/00000.docs.jsonl.zst: listed in manifest.json "
                                                                "but missing"),
    (lambda s: flip(s / "train" / "00000.idx", 40), "train/00000.idx: sha256 "),
])
def test_inspect_names_a_changed_side_file_or_index(built, tmp_path, damage, said):
    shards = copy_of(built, "shards", tmp_path)
    damage(shards)
    r = kiln("shards", "inspect", str(shards), "--at", "1", "--tokenizer", str(built / "tok"))
    assert r.returncode == 1  # before: a zstd / JSON / KeyError traceback, or an overflow warning and garbage
    line = error_line(r)
    assert line.startswith(f"kiln: verification failed: {shards}/{said}"), line
    assert line.endswith("the shards folder changed after `kiln pack` wrote it: re-run `kiln pack`")
    assert "Warning" not in r.stderr


def test_inspect_of_shards_without_side_files_says_to_pack_again(built, tmp_path):
    # a folder whose manifest lists no provenance side files (as before they existed): before, FileNotFoundError
    import hashlib

    shards = copy_of(built, "shards", tmp_path)
    rows = [json.loads(line) for line in (shards / "files.jsonl").read_text().splitlines()]
    table = "".join(json.dumps(r) + "\n" for r in rows if not r["name"].endswith(".docs.jsonl.zst")).encode()
    (shards / "files.jsonl").write_bytes(table)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["files"]["files.jsonl"] = {"size": len(table), "sha256": hashlib.sha256(table).hexdigest()}
    manifest["file_table"]["files"] = table.count(b"\n")
    (shards / "manifest.json").write_text(json.dumps(manifest))
    r = kiln("shards", "inspect", str(shards), "--at", "0", "--tokenizer", str(built / "tok"))
    assert r.returncode == 1
    assert error_line(r) == (f"kiln: verification failed: {shards / 'train' / '00000.docs.jsonl.zst'}: not in "
                             "manifest.json (a folder packed before shards carried their provenance beside them?): "
                             "re-run `kiln pack`")


def test_inspect_without_a_tokenizer_beside_the_shards_says_so(built, tmp_path):
    shards = copy_of(built, "shards", tmp_path)
    r = kiln("shards", "inspect", str(shards), "--at", "0")
    assert r.returncode == 2  # before: "not the tokenizer these shards were encoded with" for a folder not there
    sha = read_manifest(shards)["tokenizer_sha256"]
    assert error_line(r) == (f"kiln: error: {tmp_path / 'tokenizer'}: no tokenizer there (the default: tokenizer/ "
                             "beside the shards folder); pass the one these shards were encoded with "
                             f"({sha[:12]}…) with --tokenizer DIR")
    shutil.copytree(built / "tok", tmp_path / "tokenizer")
    r = kiln("shards", "inspect", str(shards), "--at", "0")
    assert r.returncode == 0 and "tokens 0-" in r.stdout, r.stderr


@pytest.mark.parametrize("at, said", [
    ("-1", "the train split has {n} sequences; --at must be 0..{last}"),
    ("abc", "argument --at: invalid int value: 'abc'"),
])
def test_inspect_at_out_of_range_or_not_a_number(built, at, said):
    n = read_manifest(built / "shards")["splits"]["train"]["samples"]
    r = kiln("shards", "inspect", str(built / "shards"), "--at", at, "--tokenizer", str(built / "tok"))
    assert r.returncode == 2
    assert error_line(r).endswith(said.format(n=n, last=n - 1))


def test_inspect_of_an_empty_split_or_a_docs_folder_says_what_it_is(built, tmp_path):
    r = kiln("pack", str(built / "docs"), "--tokenizer", str(built / "tok"), "--out", str(tmp_path / "shards"),
             "pack.seq_len=32", "pack.val_fraction=0")
    assert r.returncode == 0, r.stderr
    r = kiln("shards", "inspect", str(tmp_path / "shards"), "--split", "val", "--at", "0")
    assert r.returncode == 2  # before: "--at must be 0..-1"
    assert error_line(r) == (f"kiln: error: {tmp_path / 'shards'}: the val split has no sequences (pack.val_fraction "
                             "0, or too few tokens); nothing to inspect there")
    r = kiln("shards", "inspect", str(built / "docs"), "--at", "0")
    assert r.returncode == 2  # before: "no 'train' split in manifest.json; re-run `kiln pack`"
    assert error_line(r) == (f"kiln: error: {built / 'docs'}: a `kiln data` output, not token shards; give the folder "
                             "`kiln pack` wrote ({out_dir}/shards)")


def test_a_reader_that_closes_the_pipe_is_no_traceback(built):
    # `kiln shards inspect ... | head`: before, BrokenPipeError went up as a traceback
    p = subprocess.Popen([sys.executable, "-m", "kiln", "shards", "inspect", str(built / "shards"), "--at", "0",
                          "--json", "--tokenizer", str(built / "tok")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before kiln writes
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "Exception ignored" not in err, err


# --- the work folder of an interrupted run (the lead's files) -------------------------------------

def stop_before_merge(root: Path, cfg: DataConfig) -> Path:
    """In `root`: a run of a.jsonl and b.jsonl into docs/ stopped after its tasks and dedup stages, before the
    merge (its work folder kept), and the same run uninterrupted into whole/. Returns the work folder; the folder
    as it was then is kept beside it (`root.pristine`) for `rerun_after` to start each test from."""

    class Stopped(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stopped

    merge, cwd = pipeline._merge, os.getcwd()
    os.chdir(root)
    try:
        pipeline.run_data(["a.jsonl", "b.jsonl"], Path("whole"), cfg)
        pipeline._merge = stop
        with pytest.raises(Stopped):
            pipeline.run_data(["a.jsonl", "b.jsonl"], Path("docs"), cfg)
    finally:
        pipeline._merge = merge
        os.chdir(cwd)
    (work,) = root.glob(".docs-work-*")
    shutil.copytree(root, root.with_name(f"{root.name}.pristine"))  # copy2: the inputs keep their mtimes
    return work


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("stopped")
    write_jsonl(root / "a.jsonl", 0, 30)
    write_jsonl(root / "b.jsonl", 20, 30, prefix="copy")  # 10 exact copies of a.jsonl's last documents
    return root, stop_before_merge(root, DataConfig(workers=1, docs_per_part=20))


def rerun_after(stopped, tmp_path: Path, damage, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Put the stopped run back where it ran (its inputs are named by their absolute paths, as in any run: the
    work folder resumes there), damage its work folder, run `kiln data` again; its docs/ copied to `tmp_path`."""
    root, work = stopped
    shutil.rmtree(root)
    shutil.copytree(root.with_name(f"{root.name}.pristine"), root)
    damage(work)
    r = kiln("data", "a.jsonl", "b.jsonl", "--out", "docs", "--", "data.workers=1", "data.docs_per_part=20",
             *overrides, cwd=root)
    if (root / "docs").exists():
        shutil.copytree(root / "docs", tmp_path / "docs")
    return r, tmp_path / "docs"


def test_a_resumed_run_with_its_work_folder_intact_gives_the_uninterrupted_docs(stopped, tmp_path):
    r, docs = rerun_after(stopped, tmp_path, lambda work: None)
    assert r.returncode == 0, r.stderr
    stats = json.loads((docs / "stats.json").read_text())
    assert stats["tasks_resumed"] == stats["tasks"] == 2  # the copy resumed: no task was read again
    assert stats["dedup"]["exact_removed"] == 10
    assert_same_output(stopped[0] / "whole", docs)


def _cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage", [
    lambda work: (work / "task-00001.jsonl.zst").unlink(),
    lambda work: _cut(work / "task-00001.jsonl.zst", 60),
    lambda work: (work / "task-00000.done.json").write_text("garbage"),
])
def test_a_damaged_task_outcome_is_redone(stopped, tmp_path, damage):
    r, docs = rerun_after(stopped, tmp_path, damage)
    assert "Traceback" not in r.stderr and r.returncode == 0, r.stderr
    assert_same_output(stopped[0] / "whole", docs)


def _before_the_stages(work: Path, damage=lambda work: None) -> None:
    """Killed after the data tasks, before any dedup stage result: then `damage`."""
    shutil.rmtree(work / "dedup")
    shutil.rmtree(work / "profiles", ignore_errors=True)
    damage(work)


@pytest.mark.parametrize("damage", [
    lambda work: _cut(next((work / "dedup").glob("ranges-*/band-000-*.npy")), 20),
    lambda work: _cut(next((work / "dedup").glob("ranges-*/exact-*.npy")), 20),
    lambda work: [_cut(p, 20) for p in [*(work / "dedup").glob("ranges-*/band-*.npy"), work / "task-00001.bands.npy"]],
    lambda work: _before_the_stages(work, lambda w: _cut(w / "task-00001.exact.npy", 100)),
    lambda work: _before_the_stages(work, lambda w: (w / "task-00001.exact.npy").unlink()),
    lambda work: _before_the_stages(work, lambda w: (w / "task-00000.ids.json").write_text("[]")),
    lambda work: _before_the_stages(work, lambda w: flip(w / "task-00001.exact.npy", 200, 100)),
])
def test_a_damaged_dedup_file_is_recomputed(stopped, tmp_path, damage):
    r, docs = rerun_after(stopped, tmp_path, damage)
    assert "Traceback" not in r.stderr and r.returncode == 0, r.stderr
    assert_same_output(stopped[0] / "whole", docs)


@pytest.fixture(scope="module")
def stopped_in_small_buckets(tmp_path_factory) -> tuple[Path, Path]:
    """As `stopped`, with exact copies across the two files and data.dedup.bucket_docs=10 (7 key ranges)."""
    root = tmp_path_factory.mktemp("buckets")
    write_jsonl(root / "a.jsonl", 0, 35)
    write_jsonl(root / "b.jsonl", 20, 35, prefix="copy")  # 15 copies of a.jsonl's last documents, 20 new
    return root, stop_before_merge(root, DataConfig(workers=1, docs_per_part=20, dedup={"bucket_docs": 10}))


def test_a_resume_with_another_bucket_docs_gives_the_same_docs(stopped_in_small_buckets, tmp_path):
    root = stopped_in_small_buckets[0]
    assert json.loads((root / "whole" / "stats.json").read_text())["dedup"]["exact_removed"] == 15

    def killed_in_the_stage(work: Path) -> None:  # the later key ranges' results not written yet
        for path in [*(work / "dedup").glob("ranges-*/exact-0000[3-9].npy"),
                     *(work / "dedup").glob("ranges-*/band-*-0000[3-9].npy")]:
            path.unlink()

    r, docs = rerun_after(stopped_in_small_buckets, tmp_path, killed_in_the_stage, "data.dedup.bucket_docs=2000000")
    assert r.returncode == 0, r.stderr
    assert_same_output(root / "whole", docs)


# --- paths in a config file -------------------------------------------------------------------------

def test_a_relative_dedup_index_in_a_config_file_is_relative_to_the_file(tmp_path):
    # before: data.dedup.index was not a path key: run from another folder, the config made a new, empty index
    # there each time (no document deduplicated against the last dump), the one beside the config never used
    (tmp_path / "project").mkdir()
    write_jsonl(tmp_path / "project" / "a.jsonl", 0, 5)
    (tmp_path / "project" / "crawl.yaml").write_text("data: {workers: 1, dedup: {index: index}}\n")
    (tmp_path / "elsewhere").mkdir()
    r = kiln("data", "../project/a.jsonl", "--out", "docs", "--config", "../project/crawl.yaml",
             cwd=tmp_path / "elsewhere")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "project" / "index" / "index.json").is_file()
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["docs"]


def test_a_home_relative_path_in_a_config_file_is_the_home_folder(tmp_path, monkeypatch):
    # before: out_dir: ~/runs/x was kept as typed, and a run wrote into a folder named "~" in the working directory
    from kiln.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "c.yaml").write_text("out_dir: ~/runs/x\ndata: {inputs: [~/crawl/*.warc.gz], dedup: {index: ~/idx}}\n")
    cfg = load_config(tmp_path / "c.yaml")
    home = tmp_path / "home"
    assert (str(cfg.out), cfg.data.inputs, cfg.data.dedup.index) == (
        str(home / "runs" / "x"), [str(home / "crawl" / "*.warc.gz")], str(home / "idx"))


def test_the_same_run_finds_its_entry_after_the_index_folder_moved(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", 0, 10)
    r = kiln("data", str(src), "--out", str(tmp_path / "first"), *QUIET, f"data.dedup.index={tmp_path / 'index'}")
    assert r.returncode == 0, r.stderr
    (tmp_path / "index").rename(tmp_path / "moved")
    r = kiln("data", str(src), "--out", str(tmp_path / "first"), *QUIET, f"data.dedup.index={tmp_path / 'moved'}")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "first" / "stats.json").read_text())["documents"]["kept"] == 10
    assert len(json.loads((tmp_path / "moved" / "index.json").read_text())["runs"]) == 1
