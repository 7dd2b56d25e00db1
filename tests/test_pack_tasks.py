"""`kiln pack` of a docs folder in tasks (kiln.shards.pack): each task packs a fixed range of docs parts into
shards of its own, a final step links them under global names and writes files.jsonl and the manifest.

Checked: byte-identical shards for 1 and 2 local workers (and Ray, slow), whatever the engine; one task gives
the shards of packing the same documents as one stream; a document's number is its place in the docs folder;
shard groups are numbered on across tasks; a run stopped part way (in this process, and by a real SIGKILL)
redoes only the tasks without a marker that still vouches for their files; a part that does not hold the
folder's docs_per_part is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kiln.config import PackConfig
from kiln.data.docs import PartWriter, read_docs
from kiln.errors import IntegrityError
from kiln.manifest import read_manifest, staging_dir, write_manifest
from kiln.shards import pack as packing
from kiln.shards.format import read_index
from kiln.shards.pack import pack
from kiln.shards.provenance import read_rows, side_file
from test_data import output_files

ROOT = Path(__file__).resolve().parents[1]
CFG = PackConfig(seq_len=63, samples_per_shard=20, val_fraction=0.2, task_parts=2, batch_docs=8)


def docs_folder(folder: Path, docs: list[dict], per_part: int, record: bool = True) -> Path:
    """`docs` as a docs folder of `per_part` documents a part (as `kiln data` writes one)."""
    with staging_dir(folder) as tmp:
        writer = PartWriter(tmp, per_part)
        for d in docs:
            writer.add(d)
        writer.flush()
        write_manifest(tmp, stage="data", documents=len(docs), **({"docs_per_part": per_part} if record else {}))
    return folder


def copies(prepared, n: int) -> list[dict]:
    """The prepared docs `n` times over, each copy its own ids and source, texts cut to 3,000 characters."""
    docs = list(read_docs(prepared.out / "docs"))
    return [{**d, "id": f"{d['id']}-{k}", "source": f"{d['source']}#{k}", "source_group": f"{d['source']}#{k}",
             "text": d["text"][:3000]} for k in range(n) for d in docs]


@pytest.fixture(scope="module")
def folder(prepared, tmp_path_factory) -> Path:
    """Two copies of the prepared docs, 6 documents a part: ~35 parts, ~18 tasks."""
    return docs_folder(tmp_path_factory.mktemp("parts") / "docs", copies(prepared, 2), 6)


def shards_of(folder: Path, tok: Path, out: Path, cfg: PackConfig = CFG, **kw) -> dict:
    return pack(read_docs(folder), tok, out, cfg, **kw)


def test_pack_tasks_give_the_same_bytes_on_1_and_2_workers(prepared, folder, tmp_path):
    tok = prepared.out / "tokenizer"
    one = shards_of(folder, tok, tmp_path / "w1", CFG.model_copy(update={"workers": 1}))
    two = shards_of(folder, tok, tmp_path / "w2", CFG.model_copy(update={"workers": 2}))
    assert output_files(tmp_path / "w1") == output_files(tmp_path / "w2") and one == two
    parts = len([n for n in read_manifest(folder)["files"] if n.startswith("part-")])
    assert parts > 20 and len(one["splits"]["train"]["files"]) > parts // 2  # a task's own shards, at least one
    assert not [p for p in tmp_path.iterdir() if "-work-" in p.name]  # the work folder goes once committed

    # a document's number (.idx, provenance) is its place in the docs folder, both splits counted
    ids = [d["id"] for d in read_docs(folder)]
    for split, info in one["splits"].items():
        for name in info["files"]:
            rows = read_rows(tmp_path / "w1" / side_file(name))
            assert all(ids[doc] == row["id"] and row["split"] == split for doc, row in rows.items())
            assert {int(e["doc"]) for e in read_index((tmp_path / "w1" / name).with_suffix(".idx"))} == set(rows)
    assert one["documents"] == len(ids) and one["splits"]["train"]["dropped_tail_tokens"] > 63  # a tail per task


def test_one_task_is_packing_the_documents_as_one_stream(prepared, folder, tmp_path):
    tok = prepared.out / "tokenizer"
    whole = CFG.model_copy(update={"task_parts": 1000})
    tasks = shards_of(folder, tok, tmp_path / "tasks", whole)
    stream = pack(list(read_docs(folder)), tok, tmp_path / "stream", whole)
    assert output_files(tmp_path / "tasks") == output_files(tmp_path / "stream") and tasks == stream


def test_shard_groups_are_numbered_on_across_tasks(prepared, folder, tmp_path):
    tok = prepared.out / "tokenizer"
    sources = sorted({d["source_group"] for d in read_docs(folder)})
    weights = {sources[0]: {"weight": 0.25, "z": 4.0}}
    made = {w: shards_of(folder, tok, tmp_path / f"w{w}", CFG.model_copy(update={"workers": w}),
                         source_weights=weights) for w in (1, 2)}
    assert output_files(tmp_path / "w1") == output_files(tmp_path / "w2")
    groups = made[1]["splits"]["train"]["groups"]
    assert [(g["group"], g["weight"]) for g in groups] == [(None, 1.0), (sources[0], 0.25)]
    grouped = groups[1]["files"]
    prefix = grouped[0][: -len("00000.bin")]
    assert grouped == [f"{prefix}{k:05d}.bin" for k in range(len(grouped))] and len(grouped) > 1
    assert [f for g in groups for f in g["files"]] == made[1]["splits"]["train"]["files"]


def test_a_stopped_pack_redoes_only_the_tasks_without_a_good_marker(prepared, folder, tmp_path, monkeypatch):
    tok = prepared.out / "tokenizer"
    shards_of(folder, tok, tmp_path / "fresh")
    real, ran = packing.pack_range, []

    def stop_after_three(job):
        if len(ran) == 3:
            raise KeyboardInterrupt("stopped")
        ran.append(job[0].index)
        return real(job)

    monkeypatch.setattr(packing, "pack_range", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        shards_of(folder, tok, tmp_path / "resumed")
    work = next(p for p in tmp_path.iterdir() if p.name.startswith(".resumed-work-"))
    assert sorted(p.name for p in work.glob("*.done.json")) == [f"task-{k:05d}.done.json" for k in range(3)]
    victim = next((work / "task-00001").rglob("*.bin"))
    victim.write_bytes(victim.read_bytes()[:-2])  # its marker no longer vouches for it: task 1 is done again
    ran.clear()
    monkeypatch.setattr(packing, "pack_range", lambda job: ran.append(job[0].index) or real(job))
    shards_of(folder, tok, tmp_path / "resumed")
    assert ran[0] == 1 and 0 not in ran and 2 not in ran and len(ran) > 5
    assert output_files(tmp_path / "fresh") == output_files(tmp_path / "resumed")
    assert not work.exists()


def test_a_full_disk_mid_pack_leaves_no_half_written_task_and_a_rerun_resumes(prepared, folder, tmp_path,
                                                                             monkeypatch):
    """The disk fills inside a task: the one-line error's "nothing half-written was kept" is true (the failed
    task's partial shards go, giving their space back), the committed tasks stay, and a re-run resumes."""
    import errno

    from kiln.errors import KilnError
    from kiln.shards import writer

    tok = prepared.out / "tokenizer"
    shards_of(folder, tok, tmp_path / "fresh")
    real_write, writes = writer.ShardFile.write, []

    def fills_up(self, *args):
        real_write(self, *args)  # bytes reach the disk, then it is full
        writes.append(1)
        if len(writes) == 60:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.bin.name))

    monkeypatch.setattr(writer.ShardFile, "write", fills_up)
    with pytest.raises(KilnError, match=r"^no space left on the device writing .*nothing half-written was kept"):
        shards_of(folder, tok, tmp_path / "shards")
    [work] = tmp_path.glob(".shards-work-*")
    done = sorted(p.name.removesuffix(".done.json") for p in work.glob("task-*.done.json"))
    assert done and sorted(p.name for p in work.iterdir() if p.is_dir()) == done  # no task folder without a marker
    assert not list(tmp_path.glob("shards*"))  # nor a staging folder
    monkeypatch.undo()
    ran, real = [], packing.pack_range
    monkeypatch.setattr(packing, "pack_range", lambda job: ran.append(job[0].name) or real(job))
    shards_of(folder, tok, tmp_path / "shards")
    assert not set(ran) & set(done) and output_files(tmp_path / "fresh") == output_files(tmp_path / "shards")


def test_a_part_that_does_not_hold_docs_per_part_is_refused(prepared, tmp_path):
    folder = docs_folder(tmp_path / "docs", copies(prepared, 1)[:30], 10)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["docs_per_part"] = 12  # as if the parts were written otherwise than the manifest says
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=r"part-00000.jsonl.zst: 10 documents, not the docs folder's"):
        shards_of(folder, prepared.out / "tokenizer", tmp_path / "shards")


def test_a_docs_folder_without_docs_per_part_counts_its_first_part(prepared, folder, tmp_path):
    docs = list(read_docs(folder))
    old = docs_folder(tmp_path / "old", docs, 6, record=False)  # written before the manifest recorded it
    a = shards_of(folder, prepared.out / "tokenizer", tmp_path / "a")
    b = shards_of(old, prepared.out / "tokenizer", tmp_path / "b")
    assert output_files(tmp_path / "a") == output_files(tmp_path / "b") and a == b


def _work_markers(parent: Path) -> int:
    return sum(len(list(p.glob("*.done.json"))) for p in parent.glob(".shards-work-*"))


@pytest.mark.slow  # a real SIGKILL mid-pack, and Ray: ~40 s
def test_sigkill_mid_pack_then_rerun_gives_the_same_bytes_and_ray_too(prepared, tmp_path, monkeypatch):
    folder = docs_folder(tmp_path / "docs", copies(prepared, 12), 10)
    tok = prepared.out / "tokenizer"
    shards_of(folder, tok, tmp_path / "fresh")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = [sys.executable, "-m", "kiln", "pack", str(folder), "--tokenizer", str(tok), "--out",
            str(tmp_path / "shards"), "pack.workers=2", *(f"pack.{k}={v}" for k, v in CFG.model_dump().items()
                                                          if k not in ("workers", "executor", "ray_address"))]
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 120
    while _work_markers(tmp_path) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its workers, mid-pack
    proc.wait()
    assert not (tmp_path / "shards").exists() and _work_markers(tmp_path) >= 3
    done = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert output_files(tmp_path / "fresh") == output_files(tmp_path / "shards")

    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    try:
        shards_of(folder, tok, tmp_path / "ray", CFG.model_copy(update={"workers": 2, "executor": "ray"}))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert output_files(tmp_path / "fresh") == output_files(tmp_path / "ray")
