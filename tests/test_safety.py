"""Never lose a user's data (issue 13): outputs Kiln may replace, one writer per output, leftovers of killed runs,
damaged and oddly gzipped WARCs, long JSONL lines, workers that outlive a SIGTERM, and the one-line errors
where a traceback or silence used to be. Real files and real processes throughout; the only mocks inject a
full disk (OSError 28, torch's "unexpected pos") at the write call, which cannot be made to happen here."""

from __future__ import annotations

import errno
import gzip
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warcio.archiveiterator import ArchiveIterator

from conftest import ROOT, SAMPLE_WARC, tiny_config, write_warc
from kiln.cli import main as kiln
from kiln.config import load_config
from kiln.data.document import ReadReport
from kiln.data.docs import PartWriter, read_docs
from kiln.data.pipeline import run_data
from kiln.data.sources import read_jsonl
from kiln.errors import ConfigError, IntegrityError, KilnError
from kiln.manifest import read_manifest, staging_dir, verify_folder, write_manifest
from test_data import cfg, english, four_pages, members, read_member, rejects

KILN_SRC = Path(importlib.util.find_spec("kiln").origin).parents[1]  # subprocesses import this same copy
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(KILN_SRC)}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def err_of(capsys) -> str:
    return capsys.readouterr().err


def no_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".old-" in p.name or ".tmp-" in p.name or p.name.endswith(".lock")]


# --- 1. an output folder Kiln did not write is never replaced --------------------------------------------

def test_data_refuses_an_out_folder_it_did_not_write(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "thesis.txt").write_text("four years of work")
    assert kiln(["data", str(SAMPLE_WARC), "--out", str(d)]) == 2
    err = err_of(capsys)
    assert str(d) in err and "not an earlier `kiln data` output" in err and "Traceback" not in err
    assert (d / "thesis.txt").read_text() == "four years of work" and sorted(os.listdir(d)) == ["thesis.txt"]
    assert no_leftovers(tmp_path) == []


def test_tokenizer_and_pack_refuse_a_foreign_out_folder(prepared, tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "thesis.txt").write_text("mine")
    docs, tok = prepared.out / "docs", prepared.out / "tokenizer"
    assert kiln(["tokenizer", "train", str(docs), "--out", str(d), "tokenizer.vocab_size=300"]) == 2
    assert "not an earlier `kiln tokenizer train` output" in err_of(capsys)
    assert kiln(["pack", str(docs), "--tokenizer", str(tok), "--out", str(d)]) == 2
    assert "not an earlier `kiln pack` output" in err_of(capsys)
    # a Kiln folder of another stage is not replaced either
    other = shutil.copytree(tok, tmp_path / "other")
    assert kiln(["pack", str(docs), "--tokenizer", str(tok), "--out", str(other)]) == 2
    assert "holds a `tokenizer` output" in err_of(capsys)
    assert (d / "thesis.txt").read_text() == "mine" and verify_folder(other)


def test_an_output_that_is_or_holds_an_input_is_refused(prepared, tmp_path, capsys):
    s = tmp_path / "s"
    s.mkdir()
    crawl = shutil.copy(SAMPLE_WARC, s / "in.warc.gz")
    assert kiln(["data", str(crawl), "--out", str(s)]) == 2
    err = err_of(capsys)
    assert "overlap" in err and str(crawl) in err
    assert Path(crawl).read_bytes() == SAMPLE_WARC.read_bytes()
    docs = shutil.copytree(prepared.out / "docs", tmp_path / "docs")
    before = {p.name: p.read_bytes() for p in docs.iterdir() if p.is_file()}
    for argv in (["pack", str(docs), "--tokenizer", str(prepared.out / "tokenizer"), "--out", str(docs)],
                 ["tokenizer", "train", str(docs), "--out", str(docs)],
                 ["pack", str(docs), "--tokenizer", str(prepared.out / "tokenizer"), "--out", str(docs / "shards")]):
        assert kiln(argv) == 2
        assert "overlap" in err_of(capsys)
    assert {p.name: p.read_bytes() for p in docs.iterdir() if p.is_file()} == before and verify_folder(docs)


def test_out_dot_and_out_file_get_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("keep")
    assert kiln(["data", str(SAMPLE_WARC), "--out", "."]) == 2
    assert "is the current folder" in err_of(capsys)
    assert kiln(["data", str(SAMPLE_WARC), "--out", "notes.txt"]) == 2
    assert "is a file, not a folder" in err_of(capsys)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "keep"


def test_a_kiln_folder_with_a_file_it_did_not_write_is_not_replaced(tmp_path):
    warc = write_warc(tmp_path / "a.warc.gz", four_pages("a", 60))
    out = tmp_path / "docs"
    run_data([str(warc)], out, cfg())
    run_data([str(warc)], out, cfg(min_chars=100))  # its own output, same stage: replaced
    assert read_manifest(out)["stage"] == "data" and no_leftovers(tmp_path) == []
    (out / "notes.txt").write_text("added by hand")
    with pytest.raises(KilnError, match="notes.txt, which Kiln did not write"):
        run_data([str(warc)], out, cfg(min_chars=150))
    assert (out / "notes.txt").read_text() == "added by hand"


def kill_inside_staging(final: Path) -> None:
    """A real process that dies (SIGKILL) in the middle of writing `final`'s staging folder."""
    code = ("import os, sys; from pathlib import Path; from kiln.manifest import staging_dir\n"
            "with staging_dir(Path(sys.argv[1])) as tmp:\n"
            "    (tmp / 'half.bin').write_bytes(b'x' * 100)\n"
            "    os.kill(os.getpid(), 9)\n")
    assert subprocess.run([sys.executable, "-c", code, str(final)], env=ENV).returncode == -9


def test_staging_folders_of_a_killed_run_are_removed_by_the_next_run_and_nothing_else(tmp_path):
    warc = write_warc(tmp_path / "a.warc.gz", four_pages("a", 60))
    out = tmp_path / "docs"
    kill_inside_staging(out)
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith("docs.tmp-")]
    user = tmp_path / "docs.tmp-0123abcd"  # Kiln's naming, but not Kiln's: no staging mark inside
    user.mkdir()
    (user / "mine.txt").write_text("mine")
    run_data([str(warc)], out, cfg())
    assert not left.exists() and (user / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.warc.gz", "docs", "docs.tmp-0123abcd"]


# --- 2. one writer per output --------------------------------------------------------------------------

def test_a_second_data_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    from kiln.lock import lock_path

    inputs = [str(shutil.copy(SAMPLE_WARC, tmp_path / f"s{i}.warc.gz")) for i in range(4)]
    out = tmp_path / "docs"
    first = subprocess.Popen([sys.executable, "-m", "kiln", "data", *inputs, "--out", str(out)], env=ENV, cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not lock_path(out).is_file() or not lock_path(out).read_text():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.02)
        second = subprocess.run([sys.executable, "-m", "kiln", "data", *inputs, "--out", str(out)], env=ENV,
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert first.poll() is None, "the first writer should still be running"
        assert second.returncode == 2
        assert f"pid {first.pid} on host {socket.gethostname()}" in second.stderr and "Traceback" not in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # dies holding the lock, with no chance to clean up
        first.wait()
    assert lock_path(out).is_file()  # left behind by the dead holder ...
    stats = run_data(inputs[:1], out, cfg())  # ... and simply taken over
    assert stats["files"] == 1 and not lock_path(out).exists()


def test_locks_exclude_within_one_process_and_release(tmp_path):
    from kiln.lock import OutputLock

    with OutputLock(tmp_path / "x", "test writer"):
        with pytest.raises(KilnError, match=f"pid {os.getpid()}"):
            OutputLock(tmp_path / "x", "test writer").acquire()
    with OutputLock(tmp_path / "x", "test writer"):
        pass


# --- 6, 7. WARC files gzipped as one member, and damage in the middle -----------------------------------

def single_member(src: Path, dst: Path) -> Path:
    with gzip.open(src) as f:
        dst.write_bytes(gzip.compress(f.read()))
    assert subprocess.run(["gzip", "-t", str(dst)]).returncode == 0
    return dst


def test_a_warc_gzipped_as_one_member_is_read_whole_with_offsets_that_fetch_each_record(tmp_path):
    multi = write_warc(tmp_path / "multi.warc.gz", four_pages("m", 40))
    one = single_member(multi, tmp_path / "one.warc.gz")
    a, b = run_data([str(multi)], tmp_path / "a", cfg()), run_data([str(one)], tmp_path / "b", cfg())
    assert b["truncated"] == [] and b["rejected_by_reason"] == {} and b["documents"] == a["documents"]
    kept = list(read_docs(tmp_path / "b"))
    assert [d["url"] for d in kept] == [d["url"] for d in read_docs(tmp_path / "a")] and len(kept) == 4
    stream = gzip.decompress(one.read_bytes())
    for doc in kept:  # offset/length: the record's bytes in the decompressed stream
        [rec] = list(ArchiveIterator(io.BytesIO(stream[doc["offset"]: doc["offset"] + doc["length"]])))
        assert rec.rec_type == "response" and rec.rec_headers.get_header("WARC-Target-URI") == doc["url"]
    last = kept[-1]
    assert last["offset"] + last["length"] == len(stream)


def test_a_cut_single_member_warc_keeps_the_records_before_the_cut(tmp_path):
    one = single_member(write_warc(tmp_path / "m.warc.gz", four_pages("c", 40)), tmp_path / "one.warc.gz")
    cut = tmp_path / "cut.warc.gz"
    cut.write_bytes(one.read_bytes()[:-300])
    stats = run_data([str(cut)], tmp_path / "docs", cfg())
    [t] = stats["truncated"]
    urls = [d["url"] for d in read_docs(tmp_path / "docs")]
    assert urls == [f"https://c.example/{i}" for i in range(len(urls))] and 1 <= len(urls) < 4
    d = stats["documents"]
    assert d["read"] == d["kept"] + d["rejected"]
    assert all(r["offset"] <= t["offset"] for r in rejects(tmp_path / "docs"))
    stream = gzip.decompress(one.read_bytes())  # the offsets are into it, as for the uncut file
    for doc in read_docs(tmp_path / "docs"):
        [rec] = list(ArchiveIterator(io.BytesIO(stream[doc["offset"]: doc["offset"] + doc["length"]])))
        assert rec.rec_headers.get_header("WARC-Target-URI") == doc["url"]
    assert stream[t["offset"]:].startswith(b"WARC/1.")


def damage(path: Path, member: dict) -> None:
    raw = bytearray(path.read_bytes())
    for i in range(member["offset"] + 30, member["offset"] + member["length"] - 12):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("which", ["response", "request"])
def test_damage_mid_file_resynchronises_at_the_next_record(tmp_path, which):
    warc = write_warc(tmp_path / "w.warc.gz", four_pages("p", 10) + four_pages("q", 20))
    recs = members(warc)
    hit = next(i for i, r in enumerate(recs) if r["type"] == which and r["url"] == "https://p.example/2")
    damage(warc, recs[hit])
    out = tmp_path / "docs"
    stats = run_data([str(warc)], out, cfg())
    urls = {d["url"] for d in read_docs(out)}
    lost = {"https://p.example/2"} if which == "response" else set()
    assert urls == {f"https://{p}.example/{i}" for p in "pq" for i in range(4)} - lost
    [bad] = [r for r in rejects(out) if r["reason"] == "unreadable"]
    span = [recs[hit]["offset"], recs[hit + 1]["offset"]]
    assert (bad["offset"], bad["offset"] + bad["length"]) == tuple(span)
    if which == "request":
        assert bad["signals"]["bytes"] == span
    d = stats["documents"]
    assert d["read"] == d["kept"] + d["rejected"] and stats["truncated"] == []
    for doc in read_docs(out):  # every kept record still fetches its own member (none runs to the end)
        assert read_member(warc, doc["offset"], doc["length"])["WARC-Target-URI"] == doc["url"]


def test_damage_is_accounted_once_whatever_the_task_ranges(tmp_path):
    pages = four_pages("r", 30) + four_pages("s", 40) + four_pages("t", 50) + four_pages("u", 60)
    warc = write_warc(tmp_path / "w.warc.gz", pages)
    recs = members(warc)
    damage(warc, next(r for r in recs if r["type"] == "response" and r["url"] == "https://r.example/3"))
    assert warc.stat().st_size > 3 * 4096
    whole = run_data([str(warc)], tmp_path / "whole", cfg())
    split = run_data([str(warc)], tmp_path / "split", cfg(task_bytes=4096))
    assert split["tasks"] >= 3 and whole["tasks"] == 1
    assert split["documents"] == whole["documents"] and whole["rejected_by_reason"] == split["rejected_by_reason"]
    assert list(read_docs(tmp_path / "split")) == list(read_docs(tmp_path / "whole"))
    assert rejects(tmp_path / "split") == rejects(tmp_path / "whole")


# --- 8. SIGTERM ends the pool workers --------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _sigterm(proc, children: list[int]) -> bytes:
    """SIGTERM to `proc`, its stderr once it ends (an orphaned worker would hold the pipes open); children
    still alive afterwards are killed so a failing test leaves none behind."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)[1]
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_to_kiln_data_ends_its_workers(tmp_path):
    inputs = [str(shutil.copy(SAMPLE_WARC, tmp_path / f"s{i}.warc.gz")) for i in range(6)]
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "data", *inputs, "--out", str(tmp_path / "docs"),
                             "--workers", "2"], env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 60
    while len(_children(proc.pid)) < 2:
        assert proc.poll() is None and time.time() < deadline, "the workers never started"
        time.sleep(0.02)
    workers = _children(proc.pid)
    err = _sigterm(proc, workers)
    assert proc.returncode == 130 and b"interrupted" in err
    time.sleep(0.2)
    assert [pid for pid in workers if _alive(pid)] == []


# --- 9. long JSONL lines ------------------------------------------------------------------------------

def _read_seconds(path: Path, limit: int | None = None) -> float:
    """The best of 5 reads in CPU seconds of this process: other jobs on a loaded machine stretch wall time, not
    this (a quadratic reader still spends 64x the CPU on 8x the bytes)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        docs = list(read_jsonl(str(path), ReadReport(), ("text", "id", "url"), None, limit))
        best = min(best, time.process_time() - t0)
    assert len(docs) == 2
    return best


def test_a_long_jsonl_line_is_read_in_linear_time(tmp_path):
    for mb in (2, 16):
        write_jsonl(tmp_path / f"l{mb}.jsonl", [{"id": "long", "text": "a" * (mb << 20)}, {"id": "short", "text": "b"}])
    small, large = _read_seconds(tmp_path / "l2.jsonl"), _read_seconds(tmp_path / "l16.jsonl")
    assert large < 3.0 and large / max(small, 1e-3) < 24  # 8x the bytes; quadratic would be 64x


def test_a_jsonl_line_over_max_record_bytes_is_a_rejection_and_the_rest_goes_on(tmp_path):
    rows = [{"id": "a", "text": english(1)}, {"id": "big", "text": "y" * (2 << 20)}, {"id": "c", "text": english(2)}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    lines = src.read_bytes().split(b"\n")
    docs = list(read_jsonl(str(src), ReadReport(), ("text", "id", "url"), None, 1 << 20))
    assert [d.rejection.reason if d.rejection else d.id for d in docs] == ["a", "too_large", "c"]
    big = docs[1]
    assert (big.offset, big.length) == (len(lines[0]) + 1, len(lines[1]) + 1)
    assert big.rejection.signals == {"line": 2, "bytes": len(lines[1]) + 1, "limit": 1 << 20}
    assert docs[2].offset == len(lines[0]) + len(lines[1]) + 2 and docs[2].text == english(2)
    stats = run_data([str(src)], tmp_path / "docs", cfg(min_chars=100, max_record_bytes=1 << 20))
    assert stats["rejected_by_reason"] == {"read/too_large": 1} and stats["documents"]["kept"] == 2


# --- 10, 11. a line where a traceback or silence used to be ----------------------------------------------

def test_duplicate_keys_in_a_config_file_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.001\n  max_steps: 5\n  lr: 0.01\n")
    with pytest.raises(ConfigError, match=r"line 4.*'lr' appears twice \(first at line 2\)"):
        load_config(path)


def test_an_empty_input_the_same_input_twice_and_negative_workers_are_said(tmp_path, capsys):
    good = write_warc(tmp_path / "good.warc.gz", four_pages("g", 20))
    empty = tmp_path / "empty.warc.gz"
    empty.write_bytes(b"")
    assert kiln(["data", str(empty), str(good), "--out", str(tmp_path / "docs"), "data.min_chars=200"]) == 0
    captured = capsys.readouterr()
    assert f"kiln: warning: {empty}: empty file (0 bytes)" in captured.err
    assert json.loads(captured.out)["file_errors"][0]["source"] == str(empty)
    assert kiln(["data", str(good), str(tmp_path / "." / "good.warc.gz"), "--out", str(tmp_path / "d2")]) == 2
    assert "is given twice" in err_of(capsys)
    assert kiln(["data", str(good), "--out", str(tmp_path / "d3"), "--workers", "-3"]) == 2
    assert "--workers must be at least 1, got -3" in err_of(capsys)


def test_train_without_tokenizer_or_shards_says_how_to_make_them(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    (tmp_path / "c.yaml").write_text(f"out_dir: {tmp_path / 'out'}\n")
    for config in (tmp_path / "c.yaml", empty):
        assert kiln(["train", str(config), f"out_dir={tmp_path / 'out'}"]) == 2
        err = err_of(capsys)
        assert "kiln run CONFIG --until pack" in err and "tokenizer.json" in err and "Traceback" not in err


def test_disk_full_in_the_data_stage_is_a_clear_message(tmp_path, capsys, monkeypatch):
    import kiln.data.pipeline as pipeline

    warc = write_warc(tmp_path / "a.warc.gz", four_pages("a", 60))
    real = pipeline.write_atomic

    def full(path, data):
        if Path(path).name == "stats.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(pipeline, "write_atomic", full)  # a full disk, injected at the write call
    assert kiln(["data", str(warc), "--out", str(tmp_path / "docs"), "data.min_chars=200"]) == 2
    err = err_of(capsys)
    assert "kiln: error: no space left on the device writing" in err and "run the same command" in err
    assert "Traceback" not in err
    assert not (tmp_path / "docs").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    def commit_full(path, data):  # the task outcomes, written outside any staging folder
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pipeline, "write_atomic", commit_full)
    assert kiln(["data", str(warc), "--out", str(tmp_path / "docs"), "data.min_chars=200"]) == 2
    assert "no space left on the device" in err_of(capsys)


# --- training: resume checks, shard verification, checkpoints ---------------------------------------------

def train(out: Path, log: list | None = None, **train_keys):
    from kiln.train.trainer import Trainer

    cfg = tiny_config(out, train={"max_steps": 10, **train_keys})
    return Trainer(cfg, log=(log.append if log is not None else (lambda *_: None))).run()


def repack(prepared, out: Path, skip: int = 10, tokenizer: Path | None = None) -> None:
    """The same pack settings on other documents: what `kiln run` does after data.* changes."""
    from kiln.shards.pack import pack

    docs = list(read_docs(prepared.out / "docs"))[skip:]
    pack(docs, tokenizer or out / "tokenizer", out / "shards", prepared.pack)


def test_resume_onto_other_shards_is_refused_and_resumed_deliberately_from_a_clean_position(prepared, workdir):
    from kiln.train.metrics import read_metrics

    train(workdir)
    repack(prepared, workdir)
    with pytest.raises(KilnError, match=r"trained on other data: the shards changed .*resume_on_new_data=true"):
        train(workdir, max_steps=15)
    log: list[str] = []
    train(workdir, log, max_steps=15, resume_on_new_data=True)
    assert any("resuming" in line and "on new data" in line for line in log)
    metrics = read_metrics(workdir / "run" / "metrics.jsonl")
    [reset] = [m for m in metrics if m["event"] == "resume_on_new_data"]
    assert reset["step"] == 10 and "the shards changed" in reset["changed"][0]
    first = next(m for m in metrics if m["event"] == "step" and m["step"] == 11)
    assert (first["epoch"], first["data_position"]) == (0, 8)  # one batch of 8 into the new shards
    state = json.loads((workdir / "run" / "checkpoints" / "step-00000015" / "state.json").read_text())
    assert [r["step"] for r in state["data_resets"]] == [10]
    train(workdir, max_steps=20)  # the checkpoint now names the new data: resumes without the override


def test_a_changed_tokenizer_is_named(prepared, workdir):
    train(workdir, max_steps=5)
    tok = workdir / "tokenizer" / "tokenizer.json"
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=2))  # same tokens, other bytes
    shutil.rmtree(workdir / "tokenizer" / "manifest.json", ignore_errors=True)
    write_manifest(workdir / "tokenizer", stage="tokenizer")
    repack(prepared, workdir, skip=0)
    with pytest.raises(KilnError, match="the tokenizer changed"):
        train(workdir)


def rehash(folder: Path, name: str) -> None:
    """Make the manifest vouch for changed bytes (what a buggy writer would have committed)."""
    manifest = read_manifest(folder)
    write_manifest(folder, **{k: v for k, v in manifest.items() if k not in ("files", "kiln_version")})


def test_a_changed_token_stops_training_naming_the_shard(workdir, tmp_path, capsys):
    shard = workdir / "shards" / "train" / "00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[64 + 2 * 1000] ^= 0x01
    shard.write_bytes(bytes(raw))
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir, train={"max_steps": 3}).to_yaml())
    assert kiln(["train", str(config)]) == 1
    err = err_of(capsys)
    assert str(shard) in err and "sha256" in err and "Traceback" not in err
    assert not (workdir / "run" / "checkpoints").exists() or not list((workdir / "run" / "checkpoints").iterdir())


def test_a_token_outside_the_vocabulary_is_caught_even_when_the_manifest_vouches_for_it(workdir):
    import numpy as np

    from kiln.shards.reader import ShardSet

    shard = workdir / "shards" / "train" / "00000.bin"
    vocab = read_manifest(workdir / "shards")["vocab_size"]
    raw = bytearray(shard.read_bytes())
    raw[64 + 2 * 5: 64 + 2 * 6] = (vocab + 7).to_bytes(2, "little")
    shard.write_bytes(bytes(raw))
    rehash(workdir / "shards", "train/00000.bin")
    samples = ShardSet(workdir / "shards", "train")
    with pytest.raises(IntegrityError, match=f"token id {vocab + 7}, outside the vocabulary of {vocab}"):
        samples.gather(np.array([0]), np.empty((1, samples.sample_len), np.int64))


def test_a_cut_index_is_caught_at_start(workdir):
    from kiln.shards.reader import ShardSet

    idx = workdir / "shards" / "train" / "00000.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(IntegrityError, match=r"00000\.idx: .* bytes, manifest.json says"):
        ShardSet(workdir / "shards", "train")


def test_shards_are_hashed_once_when_first_used_in_the_loaders_thread(workdir, monkeypatch):
    import threading

    from kiln.shards.reader import ShardSet
    from kiln.shards.verify import SplitVerifier
    from kiln.train.loader import Loader

    threads: list[str] = []
    real = SplitVerifier._hash_bin

    def counted(self, name, vocab):
        threads.append(threading.current_thread().name)
        return real(self, name, vocab)

    monkeypatch.setattr(SplitVerifier, "_hash_bin", counted)
    samples = ShardSet(workdir / "shards", "train")
    assert threads == []  # nothing hashed at start
    loader = Loader(samples, 8, 8, 0, 1, seed=1, prefetch=2)
    for _ in range(len(samples) // 8 * 2):  # two epochs: every shard used, many times
        loader.next_batch()
    loader.close()
    assert len(samples.names) > 1 and threads == ["kiln-prefetch"] * len(samples.names)


def two_part_docs(prepared, folder: Path) -> Path:
    """A docs folder as `kiln data` commits it, in two parts."""
    docs = list(read_docs(prepared.out / "docs"))
    with staging_dir(folder) as tmp:
        writer = PartWriter(tmp, len(docs) // 2 + 1)
        for d in docs:
            writer.add(d)
        writer.flush()
        write_manifest(tmp, stage="data", documents=len(docs))
    assert (folder / "part-00001.jsonl.zst").is_file()
    return folder


def test_pack_and_tokenizer_refuse_a_docs_folder_with_a_missing_or_changed_part(prepared, tmp_path, capsys):
    docs = two_part_docs(prepared, tmp_path / "docs")
    part = docs / "part-00001.jsonl.zst"
    good = part.read_bytes()
    tok = str(prepared.out / "tokenizer")
    part.unlink()
    for argv in (["pack", str(docs), "--tokenizer", tok, "--out", str(tmp_path / "shards")],
                 ["tokenizer", "train", str(docs), "--out", str(tmp_path / "tok")]):
        assert kiln(argv) == 1
        assert f"{part}: listed in manifest.json but missing" in err_of(capsys)
    raw = bytearray(good)
    raw[len(raw) // 2] ^= 0xFF
    part.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="part-00001.jsonl.zst"):
        from kiln.shards.pack import pack

        pack(read_docs(docs), prepared.out / "tokenizer", tmp_path / "shards", prepared.pack)
    assert not (tmp_path / "shards").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_disk_full_during_a_checkpoint_is_a_clear_message_and_the_earlier_ones_stay(workdir, tmp_path, capsys,
                                                                                    monkeypatch):
    import torch

    import kiln.checkpoint.full as ckpt

    real, calls = torch.save, []

    def full(obj, path, *a, **k):
        calls.append(path)
        if len(calls) > 4:  # the third checkpoint (two files each): torch's own words for ENOSPC
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4372")
        return real(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full)
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir, train={"max_steps": 20}).to_yaml())
    assert kiln(["train", str(config)]) == 2
    err = err_of(capsys)
    assert "no space left on the device writing" in err and "step-00000015" in err and "Traceback" not in err
    root = workdir / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005", "step-00000010"]


def test_export_into_a_file_is_refused(workdir, tmp_path, capsys):
    train(workdir, max_steps=5)
    target = tmp_path / "model.bin"
    target.write_bytes(b"not yours")
    assert kiln(["export", "--hf", str(workdir / "run" / "checkpoints" / "step-00000005"), str(target)]) == 2
    assert "is a file, not a folder" in err_of(capsys) and target.read_bytes() == b"not yours"


def test_a_checkpoint_that_verifies_but_does_not_load_is_skipped(workdir):
    from kiln.checkpoint import latest_valid

    train(workdir)
    newest = workdir / "run" / "checkpoints" / "step-00000010"
    (newest / "model.safetensors").write_bytes(b"\x00" * 64)
    rehash(newest, "model.safetensors")
    verify_folder(newest)  # the manifest vouches for it ...
    log: list[str] = []
    assert latest_valid(newest.parent, log=log.append).name == "step-00000005"  # ... but it does not load
    assert "does not load" in log[0]
    lines: list[str] = []
    train(workdir, lines, max_steps=10)
    assert any("resumed from" in line and "step-00000005" in line for line in lines)


def test_batch_size_changed_and_max_steps_below_the_checkpoint_are_said(workdir):
    train(workdir)
    lines: list[str] = []
    train(workdir, lines, max_steps=12, batch_size=16)
    assert any("train.batch_size=8, this run uses 16" in line for line in lines)
    lines.clear()
    summary = train(workdir, lines, max_steps=5, batch_size=16)
    assert any("step-00000012 is at step 12, beyond train.max_steps=5" in line for line in lines)
    assert summary["steps"] == 12


def test_a_killed_saves_staging_folder_is_removed_by_the_next_run(workdir):
    root = workdir / "run" / "checkpoints"
    train(workdir, max_steps=5)
    kill_inside_staging(root / "step-00000007")
    keep = root / "step-00000009.tmp-deadbeef"  # not marked as Kiln's staging: left alone
    keep.mkdir()
    train(workdir, max_steps=10)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005", "step-00000009.tmp-deadbeef", "step-00000010"]


@pytest.mark.slow  # ~20 s: two real trainings (the lock itself is tested with real `kiln data` processes above)
def test_two_trainings_on_one_out_dir_the_second_is_refused(workdir, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir, train={"max_steps": 100000}, checkpoint={"every": 5}).to_yaml())
    first = subprocess.Popen([sys.executable, "-m", "kiln", "train", str(config)], env=ENV, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (workdir / "run" / "checkpoints" / "step-00000005").is_dir():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "-m", "kiln", "train", str(config)], env=ENV, cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and f"pid {first.pid}" in second.stderr and "being written by" in second.stderr
        assert first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    lines: list[str] = []
    train(workdir, lines, max_steps=12)  # the dead holder's lock is taken over; it resumes
    assert any("resumed from" in line for line in lines)


def test_retention_and_the_shard_cache_delete_only_their_own_files(workdir, tmp_path):
    from kiln.shards.remote import ShardCache
    from kiln.checkpoint import retain

    train(workdir, max_steps=10)
    root = workdir / "run" / "checkpoints"
    mine = root / "step-00000001"  # a checkpoint's name, but no Kiln manifest
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert [p.name for p in retain(root, 1, None, None)] == ["step-00000005"]
    assert (mine / "notes.txt").read_text() == "mine"
    cache = tmp_path / "cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "thesis.txt").write_bytes(b"x" * 100)
    entry = cache / "ab" / ("ab" + "0" * 62)
    entry.write_bytes(b"y" * 100)
    ShardCache(cache, 150)._make_room(100)
    assert (cache / "ab" / "thesis.txt").exists() and not entry.exists()


@pytest.mark.slow  # ~20 s: torchrun with two gloo ranks
def test_under_torchrun_a_held_run_lock_stops_every_rank(workdir, tmp_path):
    from kiln.lock import OutputLock

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir, train={"max_steps": 2}).to_yaml())
    with OutputLock(workdir / "run", "test holder"):  # this process holds the run folder
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "kiln", "train", str(config)], env=ENV, cwd=ROOT, capture_output=True, text=True,
                              timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"pid {os.getpid()}" in out and "rank 0 could not lock the run folder" in out
    assert not (workdir / "run" / "checkpoints").exists()


# --- follow-ups: import's lock, pack's workers, Parquet's limit, a new vocabulary, report --out -----------------

def test_import_into_a_run_folder_a_training_holds_is_refused_naming_the_holder(workdir, tmp_path):
    from kiln.lock import OutputLock
    from kiln.ops.export import export_hf, import_hf

    train(workdir, max_steps=5)
    export_hf(workdir / "run" / "checkpoints" / "step-00000005", tmp_path / "hf")
    out = tmp_path / "fresh"
    for name in ("tokenizer", "shards"):
        shutil.copytree(workdir / name, out / name)
    cfg = tiny_config(out, train={"max_steps": 5})
    holder = rf"being written by `kiln train`: pid {os.getpid()} "
    with OutputLock(out / "run", "`kiln train`"), pytest.raises(KilnError, match=holder):  # a training's lock
        import_hf(tmp_path / "hf", cfg)
    assert not (out / "run" / "checkpoints").exists()
    assert import_hf(tmp_path / "hf", cfg) == out / "run" / "checkpoints" / "step-00000000"  # once it has ended


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_sigterm_to_kiln_pack_ends_its_encoding_workers(prepared, tmp_path):
    docs = list(read_docs(prepared.out / "docs"))
    folder = tmp_path / "docs"
    with staging_dir(folder) as tmp:  # enough text that the encoding is still going when both workers are up, in
        writer = PartWriter(tmp, 100)  # parts enough for pack tasks on both
        copies = max(1, (24 << 20) // sum(len(d["text"]) for d in docs))
        for k in range(copies):
            for d in docs:
                writer.add({**d, "id": f"{d['id']}-{k}"})
        writer.flush()
        write_manifest(tmp, stage="data", documents=copies * len(docs))
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "pack", str(folder), "--tokenizer",
                             str(prepared.out / "tokenizer"), "--out", str(tmp_path / "shards"), "pack.workers=2"],
                            env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 90
    while len([pid for pid in _children(proc.pid) if "spawn_main" in _cmdline(pid)]) < 2:
        assert proc.poll() is None and time.time() < deadline, "the encoding workers never started"
        time.sleep(0.02)
    children = _children(proc.pid)  # the two workers and multiprocessing's resource tracker
    err = _sigterm(proc, children)
    assert proc.returncode == 130 and b"interrupted" in err, err.decode()[-2000:]
    time.sleep(0.2)
    assert [pid for pid in children if _alive(pid)] == []
    assert not (tmp_path / "shards").exists()


def test_a_parquet_row_over_max_record_bytes_is_a_rejection_and_the_rest_goes_on(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.data.sources import read_parquet

    src = tmp_path / "in.parquet"
    big = "é" * (600 << 10)  # 1.2 MB of UTF-8 in 600 K characters: the limit counts bytes
    pq.write_table(pa.table({"id": ["a", "big", "c", "d"], "text": [english(1), big, None, english(2)]}), src)
    docs = list(read_parquet(str(src), ReadReport(), ("text", "id", "url"), None, 1 << 20))
    assert [d.rejection.reason if d.rejection else d.id for d in docs] == ["a", "too_large", "missing_text", "d"]
    assert docs[1].rejection.signals == {"row": 1, "bytes": len(big.encode()), "limit": 1 << 20}
    assert docs[3].text == english(2) and docs[3].offset == 3
    stats = run_data([str(src)], tmp_path / "docs", cfg(min_chars=100, max_record_bytes=1 << 20))
    assert stats["rejected_by_reason"]["read/too_large"] == 1 and stats["documents"]["kept"] == 2


@pytest.mark.slow  # ~15 s: a tokenizer trained, the shards repacked, two trainings
def test_resume_on_new_data_onto_another_vocabulary_size_is_one_line_naming_both(prepared, workdir, tmp_path, capsys):
    from kiln.tokenizer import train_tokenizer

    train(workdir, max_steps=5)
    other = tmp_path / "tok512"
    tok512 = tiny_config(tmp_path, tokenizer={"vocab_size": 512}).tokenizer
    train_tokenizer(read_docs(prepared.out / "docs"), other, tok512, prepared.seed)
    shutil.rmtree(workdir / "tokenizer")
    shutil.copytree(other, workdir / "tokenizer")
    shutil.rmtree(workdir / "shards")
    repack(prepared, workdir, skip=0)
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(workdir, train={"max_steps": 10, "resume_on_new_data": True}).to_yaml())
    assert kiln(["train", str(config)]) == 2
    err = err_of(capsys)
    assert "Traceback" not in err and "size mismatch" not in err
    assert "vocabulary of 1024 tokens" in err and "has 512" in err and "new out_dir" in err and "old tokenizer" in err


def test_report_out_replaces_only_a_kiln_report(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    write_jsonl(tmp_path / "run" / "metrics.jsonl", [{"event": "step", "step": s, "loss": 5.0 - s, "lr": 1e-3}
                                                     for s in (1, 2)])  # what `kiln train` writes, in brief
    run = str(tmp_path / "run")
    notes = tmp_path / "notes.html"
    notes.write_text("<html><body>my notes</body></html>")
    assert kiln(["report", run, "--out", str(notes)]) == 2
    err = err_of(capsys)
    assert f"{notes} exists and is not a page kiln report wrote; move it away" in err
    assert len(err.strip().splitlines()) == 1
    assert notes.read_text() == "<html><body>my notes</body></html>"
    (tmp_path / "folder").mkdir()
    assert kiln(["report", run, "--out", str(tmp_path / "folder")]) == 2
    assert "not a page kiln report wrote" in err_of(capsys)
    report = tmp_path / "report.html"
    assert kiln(["report", run, "--out", str(report)]) == 0
    first = report.read_text()
    assert first.startswith("<!-- written by kiln report -->\n<!DOCTYPE html>")
    assert kiln(["report", run, "--out", str(report)]) == 0  # its own report: replaced
    assert report.read_text().startswith("<!-- written by kiln report -->") and not no_leftovers(tmp_path)
