"""How `kiln data` runs: tasks (large gzipped WARCs split at gzip-member boundaries), the local
pool and Ray, resume after a real SIGKILL, stats.json, the progress bar, and a real crawl.

Every check compares outputs byte for byte with a plain single-process run.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import write_warc
from kiln.config import DataConfig
from kiln.tasks.executor import run_tasks
from kiln.data.docs import read_docs, read_part
from kiln.data.pipeline import plan_tasks, run_data
from kiln.errors import KilnError
from kiln.data.read import find_member
from kiln.data.tables import table
from test_data import BASIC_GATES_ONLY, assert_same_output, english, members, page, rejects

ROOT = Path(__file__).resolve().parents[1]
QUIET_GATES = [f"data.quality.{k}.enabled=false" for k in BASIC_GATES_ONLY]


def cfg(**kw) -> DataConfig:
    return DataConfig(**{"min_chars": 200, "quality": BASIC_GATES_ONLY, "docs_per_part": 40, **kw})


@pytest.fixture(scope="module")
def whole(tmp_path_factory, sample_warc):
    """The sample read as one task, in this process: the reference output."""
    out = tmp_path_factory.mktemp("whole") / "docs"
    stats = run_data([str(sample_warc)], out, cfg())
    return stats, out


def test_byte_ranges_tile_the_file_at_member_boundaries(sample_warc):
    starts = [m["offset"] for m in members(sample_warc)]
    size = sample_warc.stat().st_size
    with open(sample_warc, "rb") as f:
        for at in (1, 590, 591, 100_000, 1_500_000, size - 10):
            want = next((s for s in starts if s >= at), None)
            assert find_member(f, at, size) == want
        assert find_member(f, starts[5] + 1, starts[6]) is None  # no member starts inside a member


@pytest.mark.parametrize("task_bytes, workers", [(300_000, 1), (97_000, 2)])
def test_split_file_output_is_identical(tmp_path, sample_warc, whole, task_bytes, workers):
    stats0, out0 = whole
    tasks = plan_tasks([str(sample_warc)], cfg(task_bytes=task_bytes))
    assert len(tasks) == -(-sample_warc.stat().st_size // task_bytes) > 3
    out = tmp_path / "docs"
    stats = run_data([str(sample_warc)], out, cfg(task_bytes=task_bytes), workers=workers)
    assert stats["tasks"] == len(tasks)
    assert stats["warc_records"] == stats0["warc_records"]  # every record read exactly once
    assert_same_output(out0, out)


@pytest.mark.slow  # 60 s; the default suite's Ray check is test_dedup_stages_identical_on_pool_and_ray_...
def test_ray_executor_matches_local(tmp_path, sample_warc, whole, monkeypatch):
    """A local 2-CPU Ray, started by the run and shut down after it, on split WARC tasks."""
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    out = tmp_path / "docs"
    try:
        stats = run_data([str(sample_warc)], out, cfg(task_bytes=400_000, executor="ray"), workers=2)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert stats["tasks"] == 8
    assert_same_output(whole[1], out)


@pytest.mark.parametrize("executor, workers", [("local", 1), ("local", 2),
                                               pytest.param("ray", 2, marks=pytest.mark.slow)])  # Ray: 15 s
def test_a_task_error_reaches_the_driver_as_its_own_message(tmp_path, monkeypatch, executor, workers):
    # under Ray it arrived wrapped in a RayTaskError whose text is the remote traceback. The task function is
    # one of Kiln's (workers import it by name): listing inputs, where a missing file is a KilnError.
    from kiln.data.sources import expand_inputs

    present = [tmp_path / f"{i}.warc.gz" for i in range(3)]
    for p in present:
        p.write_bytes(b"")
    tasks = [[str(present[0])], [str(present[1])], [str(tmp_path / "missing.warc.gz")], [str(present[2])]]
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    try:
        with pytest.raises(KilnError) as info:
            list(run_tasks(expand_inputs, tasks, workers, executor))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert (
        type(info.value) is KilnError
        and str(info.value) == f"input {tmp_path / 'missing.warc.gz'} does not exist or is not a file"
    )


def edited(text: str, rng: random.Random, target: float) -> str:
    """`text` with words replaced at random until its 5-gram Jaccard with the original is about `target`."""
    from kiln.data.dedup.shingles import jaccard, shingle_hashes

    words, base = text.split(), shingle_hashes(text)
    while jaccard(base, shingle_hashes(" ".join(words))) > target + 0.02:
        words[rng.randrange(len(words))] = rng.choice(["kiln", "ember", "glaze", "slip", "cone"])
    return " ".join(words)


def planted_jsonl(folder: Path) -> tuple[list[str], dict[str, str]]:
    """Three JSONL files: distinct pages, near copies in later files, exact copies, and a chain A < B < C whose
    middle document pairs only with the later one. Returns the paths and {id: the id that must survive it}."""
    rng = random.Random(11)
    pages = {f"p{i}": english(i, 14) for i in range(36)}
    files: list[list[dict]] = [[], [], []]
    for i, (k, text) in enumerate(pages.items()):
        files[i % 3].append({"id": k, "text": text})
    truth = {}
    for i in range(0, 12, 2):
        files[2].append({"id": f"near{i}", "text": edited(pages[f"p{i}"], rng, 0.85)})
        truth[f"near{i}"] = f"p{i}"
    files[1].append({"id": "exact3", "text": pages["p3"].upper()})
    truth["exact3"] = "p3"
    c = english(99, 14)
    files[0].append({"id": "A", "text": edited(c, rng, 0.86)})
    files[1].append({"id": "B", "text": edited(c, rng, 0.86)})
    files[2].append({"id": "C", "text": c})
    truth |= {"B": "A", "C": "A"}
    paths = []
    for n, recs in enumerate(files):
        path = folder / f"part{n}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        paths.append(str(path))
    return paths, truth


def test_dedup_stages_identical_on_pool_and_ray_for_any_worker_count(tmp_path, monkeypatch):
    inputs, truth = planted_jsonl(tmp_path)
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    outs = {}
    try:
        for executor, workers, bucket_docs in (("local", 1, 10**6), ("local", 2, 7), ("ray", 2, 7)):
            out = tmp_path / f"{executor}-{workers}" / "docs"
            stats = run_data(inputs, out, cfg(executor=executor, dedup={"bucket_docs": bucket_docs}), workers=workers)
            outs[executor, workers] = out
            ranges, groups = -(-46 // min(bucket_docs, 46)), 1 if bucket_docs > 46 else 3  # a shingle task per task
            assert stats["documents"]["read"] == 46 and stats["dedup_tasks"] == 41 * ranges + groups + 1
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    first = outs["local", 1]
    for out in outs.values():
        assert_same_output(first, out)
    removed = {r["id"]: r for r in rejects(first) if r["stage"] == "dedup"}
    assert {k: r["signals"]["duplicate_of"] for k, r in removed.items()} == truth
    assert removed["exact3"]["reason"] == "exact_duplicate"
    ledger = {r["member"]: r for r in read_part(first / "dedup_ledger.jsonl.zst")}
    assert (ledger["B"]["survivor"], ledger["B"]["linked_to"], ledger["C"]["linked_to"]) == ("A", "C", "A")
    assert stats["dedup"]["near_removed"] == 8 and stats["dedup"]["exact_removed"] == 1


def test_stats_per_source_stage_and_step(tmp_path, sample_warc):
    other = write_warc(
        tmp_path / "o.warc.gz",
        [(f"https://o.example/{i}", page(english(i)), "text/html") for i in range(3)]
        + [("https://o.example/dup", page(english(0)), "text/html")],
    )
    out = tmp_path / "docs"
    stats = run_data([str(other), str(sample_warc)], out, cfg())
    by_source = table(out, "by_source")  # a side file: a dump has an input per WARC file
    assert list(by_source) == [str(other), str(sample_warc)] and stats["tables"]["by_source"]["rows"] == 2
    assert by_source[str(other)] == {"read": 4, "kept": 3, "rejected": 1}
    s = by_source[str(sample_warc)]
    assert s["read"] == 120 == s["kept"] + s["rejected"]
    assert sum(v["kept"] for v in by_source.values()) == stats["documents"]["kept"]
    assert sum(stats["rejected_by_stage"].values()) == stats["documents"]["rejected"]
    assert stats["rejected_by_stage"]["dedup"] == 1
    steps = stats["timings_s"]["steps"]
    assert set(steps) == {"read", "extract", "language", "gates", "dedup"}
    assert all(v >= 0 for v in steps.values()) and steps["extract"] > 0


def test_cpu_seconds_by_step_count_the_pool_workers(tmp_path, sample_warc):
    import resource

    def used():
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    (me0, kids0) = used()
    stats = run_data([str(sample_warc)], tmp_path / "docs", cfg(task_bytes=200_000), workers=2)
    (me1, kids1) = used()
    cpu = stats["timings_s"]["cpu"]
    assert set(cpu) == {"process", "dedup_stages", "profiles", "merge"} and all(v >= 0 for v in cpu.values())
    # the pools' workers ran the tasks: their CPU is in the steps' (which sum to less than the whole call's)
    assert kids1 - kids0 > 0.2 and kids1 - kids0 <= sum(cpu.values()) <= (me1 - me0) + (kids1 - kids0) + 0.01
    assert cpu["process"] >= 0.5 * (kids1 - kids0)


def kiln_data(inputs: list[str], out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln", "data", *inputs, "--out", str(out), "data.min_chars=200",
                             "data.docs_per_part=40", *QUIET_GATES, *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_then_rerun_redoes_only_unfinished_tasks(tmp_path, sample_warc, whole):
    out = tmp_path / "docs"
    args = ([str(sample_warc)], out, "data.task_bytes=100000")  # 30 tasks
    proc = kiln_data(*args)
    deadline = time.monotonic() + 90
    while (
        len(list(tmp_path.glob(".docs-work-*/task-*.done.json"))) < 3
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [work] = tmp_path.glob(".docs-work-*")
    done = len(list(work.glob("task-*.done.json")))
    assert 3 <= done < 30 and not out.exists()

    proc = kiln_data(*args)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    stats = json.loads(stdout)
    assert (stats["tasks"], stats["tasks_resumed"]) == (30, done)
    assert_same_output(whole[1], out)
    # the progress bar: records/s, MB/s and the kept share, on stderr
    assert "records/s" in stderr and "MB/s" in stderr and "kept" in stderr and "%" in stderr
    assert not list(tmp_path.glob(".docs-work-*"))


KILLED_AT = """
import os, signal, sys
from kiln.data import merge
kind, n = sys.argv[1], int(sys.argv[2])
real, seen = merge.write_atomic, []
def marking(path, data):  # a merge marker written: the n-th of its kind is the last thing this process does
    real(path, data)
    seen.extend([path] if path.name.startswith(kind) and path.name.endswith(".done.json") else [])
    if seen and len(seen) == n:
        os.kill(os.getpid(), signal.SIGKILL)
def committing(*args):  # the parts and the ledger already renamed into the staging folder, no manifest yet
    os.kill(os.getpid(), signal.SIGKILL)
if kind == "commit":
    merge._stats = committing
merge.write_atomic = marking
from kiln.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("kind, n", [pytest.param("task-", 3, marks=pytest.mark.slow), ("parts-", 2),
                                     pytest.param("commit", 0, marks=pytest.mark.slow)])  # the default suite: one
def test_sigkill_inside_the_merge_then_rerun_redoes_only_its_unfinished_tasks(tmp_path, sample_warc, whole, kind, n):
    # issue 44.1: the merge is tasks (one per data task, then the parts' jobs) vouched by markers in the work folder
    out = tmp_path / "docs"
    args = ["data", str(sample_warc), "--out", str(out), "data.task_bytes=100000", "data.min_chars=200",
            "data.docs_per_part=40", *QUIET_GATES]  # 30 data tasks, so 30 merge tasks
    killed = subprocess.run([sys.executable, "-c", KILLED_AT, kind, str(n), *args], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    [work] = tmp_path.glob(".docs-work-*")
    assert len(list((work / "merge").glob("task-*.done.json"))) == (n if kind == "task-" else 30)
    assert not out.exists()

    proc = kiln_data([str(sample_warc)], out, "data.task_bytes=100000")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    stats = json.loads(stdout)
    jobs = 1 + len(list(out.rglob("part-*.jsonl.zst")))  # the ledger's first, then a part a job (~4 kept a task)
    redone = {"task-": (30 - n, jobs), "parts-": (0, jobs - 1 - n), "commit": (0, jobs)}[kind]  # the commit had
    ran = stats["timings_s"]["merge_steps"]["ran"]  # moved every part into the staging folder the rerun removed
    assert stats["tasks_resumed"] == 30 and (ran["tasks"], ran["jobs"]) == redone
    assert_same_output(whole[1], out)
    assert not list(tmp_path.glob(".docs-work-*")) and not list(tmp_path.glob("docs.tmp-*"))


KILLED_IN_VERDICTS = """
import os, signal, sys
from kiln.data.dedup import stages
real, calls = stages.Components.task_verdicts, []
def killing(self, k):  # the verdicts task: four data tasks' verdict files written, none vouched by the driver yet
    calls.append(k)
    if len(calls) == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, k)
stages.Components.task_verdicts = killing
from kiln.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_inside_the_verdicts_then_rerun_redoes_the_verdicts_alone(tmp_path, sample_warc, whole, monkeypatch):
    # issue 44.2: the verdicts task writes one file per data task; a kill leaves some written and none vouched
    from kiln.data.dedup import stages

    out = tmp_path / "docs"
    args = ["data", str(sample_warc), "--out", str(out), "data.task_bytes=100000", "data.min_chars=200",
            "data.docs_per_part=40", *QUIET_GATES]  # 30 data tasks
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_VERDICTS, *args], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    [work] = tmp_path.glob(".docs-work-*")
    assert len(list(work.glob("dedup/ranges-*/verdicts/task-*.jsonl.zst"))) == 4 and not out.exists()

    ran = []
    real = stages.stage_task
    monkeypatch.setattr(stages, "stage_task", lambda job: ran.append(job[0]) or real(job))
    stats = run_data([str(sample_warc)], out, cfg(task_bytes=100000))
    assert stats["tasks_resumed"] == 30 and ran == []  # the data tasks and the stage results kept: the verdicts redone
    assert_same_output(whole[1], out)
    assert not list(tmp_path.glob(".docs-work-*"))


# --- a real crawl nobody here wrote ----------------------------------------------------------------

PYDOC = Path(os.environ.get("KILN_PYDOC_HTML", "/usr/share/doc/python3.11/html"))


@pytest.mark.slow  # ~45 s on 2 cores with every default gate
@pytest.mark.skipif(not PYDOC.is_dir(), reason="Debian's python3.11-doc is not installed (or set KILN_PYDOC_HTML)")
def test_real_crawl_accounts_for_every_record(tmp_path):
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    pages = sorted(PYDOC.rglob("*.html"))
    assert len(pages) > 400
    src = tmp_path / "pydoc.warc.gz"
    with open(src, "wb") as f:
        w = WARCWriter(f, gzip=True)
        for p in pages:
            url = f"https://docs.python.org/3.11/{p.relative_to(PYDOC).as_posix()}"
            body = p.read_bytes()
            headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
            rec = w.create_warc_record(
                url,
                "response",
                payload=io.BytesIO(body),
                http_headers=headers,
                warc_headers_dict={
                    "WARC-Record-ID": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, url)}>",
                    "WARC-Date": "2026-11-29T00:00:00Z",
                },
            )
            w.write_record(rec)
    out = tmp_path / "docs"
    stats = run_data([str(src)], out, DataConfig(workers=2, task_bytes=1 << 20))  # every default gate
    d = stats["documents"]
    assert d["read"] == len(pages) == d["kept"] + d["rejected"]
    kept, dropped = list(read_docs(out)), rejects(out)
    urls = [r["url"] for r in kept + dropped]
    assert len(urls) == len(set(urls)) == len(pages)  # each page exactly once: kept or dropped with a reason
    assert d["kept"] > 0 and sum(stats["rejected_by_reason"].values()) == d["rejected"]
    assert {r["lang"] for r in kept} == {"en"}
    assert all(r["reason"] and r["stage"] for r in dropped)


def test_dedup_index_dedups_the_next_dump_against_the_last(tmp_path):
    from kiln.errors import ConfigError

    inputs, _ = planted_jsonl(tmp_path)
    rng = random.Random(12)
    first_dump = [json.loads(line) for line in Path(inputs[0]).read_text().splitlines()]
    nxt = tmp_path / "next.jsonl"  # the next dump: copies of the last one's pages, and new pages
    recs = [{"id": "again-exact", "text": first_dump[1]["text"]},
            {"id": "again-near", "text": edited(first_dump[2]["text"], rng, 0.85)},
            {"id": "new-1", "text": english(500, 14)}, {"id": "new-1-copy", "text": edited(english(500, 14), rng, 0.9)}]
    nxt.write_text("".join(json.dumps(r) + "\n" for r in recs))
    index = tmp_path / "index"
    last = run_data([inputs[0]], tmp_path / "last" / "docs", cfg(dedup={"index": str(index)}))
    assert json.loads((index / "index.json").read_text())["runs"][0]["documents"] == last["documents"]["kept"]

    stats = run_data([str(nxt)], tmp_path / "next" / "docs", cfg(dedup={"index": str(index)}))
    out = {r["id"]: r for r in rejects(tmp_path / "next" / "docs")}
    assert sorted(out) == ["again-exact", "again-near", "new-1-copy"]
    assert out["again-exact"]["signals"] == {"duplicate_of": first_dump[1]["id"], "duplicate_in": "run-00000"}
    assert (out["again-near"]["signals"]["duplicate_of"], out["again-near"]["signals"]["duplicate_in"]) == (
        first_dump[2]["id"], "run-00000")
    copy = out["new-1-copy"]["signals"]
    assert copy["duplicate_of"] == "new-1" and "duplicate_in" not in copy
    ledger = list(read_part(tmp_path / "next" / "docs" / "dedup_ledger.jsonl.zst"))
    assert [(r["member"], r["survivor"], r.get("survivor_run"), r["position"]) for r in ledger] == [
        ("again-near", first_dump[2]["id"], "run-00000", 0),
        ("new-1-copy", "new-1", None, 2)]  # positions leave the exact copies out
    assert stats["dedup"]["removed_against_index"] == 2
    runs = json.loads((index / "index.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["run-00000", "run-00001"] and runs[1]["documents"] == 1

    # the last dump again into its folder: its own entry is found, so it is neither added twice nor deduplicated
    # against itself; into a second folder (the first still there) it is refused: both would keep every document
    shutil.copytree(tmp_path / "last" / "docs", tmp_path / "before")
    run_data([inputs[0]], tmp_path / "last" / "docs", cfg(dedup={"index": str(index)}))
    assert_same_output(tmp_path / "before", tmp_path / "last" / "docs")
    assert len(json.loads((index / "index.json").read_text())["runs"]) == 2
    with pytest.raises(ConfigError, match="run-00000 of .* holds these same inputs and settings"):
        run_data([inputs[0]], tmp_path / "again" / "docs", cfg(dedup={"index": str(index)}))
    with pytest.raises(ConfigError, match="data.dedup.index: .* was built with"):
        run_data([str(nxt)], tmp_path / "other" / "docs", cfg(dedup={"index": str(index), "bands": 10}))


def test_an_index_run_written_before_keys_npy_still_removes_the_copies_of_its_pages(tmp_path):
    # issue 44: a band task tells exact copies apart by the exact keys of its buckets' members (keys.npy); an index
    # run written by an earlier Kiln has none, and the band tasks then use the exact stage's results, as before
    from kiln.manifest import write_manifest

    inputs, _ = planted_jsonl(tmp_path)
    first_dump = [json.loads(line) for line in Path(inputs[0]).read_text().splitlines()]
    nxt = tmp_path / "next.jsonl"
    nxt.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "again-exact", "text": first_dump[1]["text"]}, {"id": "again-exact-2", "text": first_dump[1]["text"]},
        {"id": "new-1", "text": english(500, 14)}]))
    run_data([inputs[0]], tmp_path / "last" / "docs", cfg(dedup={"index": str(tmp_path / "index")}))
    shutil.copytree(tmp_path / "index", tmp_path / "old-index")
    run = tmp_path / "old-index" / "run-00000"
    assert list(run.glob("*.keys.npy"))
    for path in run.glob("*.keys.npy"):
        path.unlink()
    (run / "manifest.json").unlink()
    manifest = json.loads((tmp_path / "index" / "run-00000" / "manifest.json").read_text())
    write_manifest(run, stage="dedup-index", key=manifest["key"], docs=manifest["docs"])
    for index in ("index", "old-index"):
        run_data([str(nxt)], tmp_path / f"next-{index}" / "docs", cfg(dedup={"index": str(tmp_path / index)}))
    assert_same_output(tmp_path / "next-index" / "docs", tmp_path / "next-old-index" / "docs")
    out = {r["id"]: r["signals"] for r in rejects(tmp_path / "next-old-index" / "docs")}
    assert out == {"again-exact": {"duplicate_of": first_dump[1]["id"], "duplicate_in": "run-00000"},
                   "again-exact-2": {"duplicate_of": first_dump[1]["id"], "duplicate_in": "run-00000"}}


def test_distribution_profile_off_when_disabled(tmp_path):
    inputs, _ = planted_jsonl(tmp_path)
    on = run_data(inputs, tmp_path / "on" / "docs", cfg())
    off = run_data(inputs, tmp_path / "off" / "docs", cfg(distribution={"enabled": False}))
    assert sorted(table(tmp_path / "on" / "docs", "source_weights")) == sorted(inputs)
    assert "source_weights" not in off["tables"] and table(tmp_path / "off" / "docs", "source_weights") == {}
    assert on["documents"] == off["documents"]
