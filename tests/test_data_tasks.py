"""One big input file cut into tasks (`kiln.data.plan`): plain JSONL in byte ranges at lines, .gz/.zst
decompressed once into spooled chunks, Parquet in runs of row groups.

The properties: the pieces' records, end to end, are those of the whole file read as one task (ids, offsets,
line numbers, rejections and the cut of a damaged stream included), for any cut; the plan depends on the file
and data.task_bytes, not on the workers; `kiln data` gives byte-identical docs on 1 and 2 workers (and on
Ray, a slow test) whatever the cut; a spooled chunk is reused by a re-run, and one that changed is refused.
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.config import DataConfig
from kiln.data.document import ReadReport
from kiln.data.pipeline import run_data
from kiln.data.plan import SPOOL, plan_tasks, read_task
from kiln.errors import IntegrityError
from test_data import BASIC_GATES_ONLY, assert_same_output, english

WHOLE = 1 << 40  # a task_bytes no test file reaches: the file is one task


def cfg(**kw) -> DataConfig:
    return DataConfig(**{"min_chars": 200, "quality": BASIC_GATES_ONLY, "docs_per_part": 40, **kw})


def small(**kw) -> DataConfig:
    """For the readers: lines over 700 bytes are read/too_large (streamed past, never held)."""
    return cfg(max_record_bytes=700, **kw)


def outcome(doc) -> dict:
    return doc.kept_record() if doc.rejection is None else doc.reject_record(with_text=True)


def read_pieces(path: Path, config: DataConfig, work: Path | None) -> tuple[list[dict], list, int]:
    """Every task's records in order, the cuts the tasks reported, and the number of tasks."""
    records, cuts = [], []
    tasks = plan_tasks([str(path)], config, work)
    for task in tasks:
        report = ReadReport()
        records += [outcome(d) for d in read_task(task, config, report)]
        cuts.append(report.truncated_at)
    return records, [c for c in cuts if c is not None], len(tasks)


WORDS = "river mill bank stone light water green field house road winter summer árbol 川 naïve".split()
line = st.one_of(
    st.builds(lambda n, seed, with_id: json.dumps(
        {**({"id": f"r{seed}"} if with_id else {}), "text": " ".join(random.Random(seed).choices(WORDS, k=n)),
         "url": f"https://t.example/{seed}"}, ensure_ascii=seed % 2 == 0),
        st.integers(1, 160), st.integers(0, 10**6), st.booleans()),
    st.sampled_from(["", "   ", "{not json", "[1, 2]", '{"id": "x"}', '{"text": 5}', '"\\ud800"']),
)


def jsonl_bytes(lines: list[str], trailing_newline: bool) -> bytes:
    """The lines after one of text (an empty file is a file error, not a cut)."""
    return ("\n".join([json.dumps({"text": "first"}), *lines]) + ("\n" if trailing_newline else "")).encode()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(line, min_size=1, max_size=120), trailing=st.booleans(), step=st.integers(4096, 9000))
def test_plain_jsonl_ranges_read_what_the_whole_file_reads(lines, trailing, step):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one.jsonl"
        path.write_bytes(jsonl_bytes(lines, trailing) * 3)  # up to ~90 KB: many ranges of `step` bytes
        whole, _, one = read_pieces(path, small(task_bytes=WHOLE), None)
        pieces, _, n = read_pieces(path, small(task_bytes=step), None)
        assert one == 1 and n == -(-path.stat().st_size // step)
        assert pieces == whole


def compress(raw: bytes, kind: str, members: int) -> bytes:
    """`raw` as .gz or .zst in `members` concatenated members (frames), as tools that append write them."""
    cuts = sorted(random.Random(len(raw)).sample(range(1, len(raw)), min(members - 1, len(raw) - 1)))
    parts = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    pack = gzip.compress if kind == ".gz" else zstandard.ZstdCompressor().compress
    return b"".join(pack(p) for p in parts)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(line, min_size=1, max_size=120), trailing=st.booleans(), kind=st.sampled_from([".gz", ".zst"]),
       members=st.integers(1, 4), cut=st.none() | st.floats(0.05, 0.999), step=st.integers(4096, 12000))
def test_compressed_jsonl_chunks_read_what_the_whole_file_reads(lines, trailing, kind, members, cut, step):
    """Spooled at any chunk size: the same records, and a cut or damaged stream ends at the same line with the
    same `truncated_at`, reported once."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = jsonl_bytes(lines, trailing) * 4
        blob = compress(raw, kind, members)
        if cut is not None:
            blob = blob[:max(int(len(blob) * cut), 5)]
        path = Path(tmp) / f"one.jsonl{kind}"
        path.write_bytes(blob)
        whole, whole_cuts, _ = read_pieces(path, small(task_bytes=WHOLE), None)
        work = Path(tmp) / "work"
        pieces, cuts, n = read_pieces(path, small(task_bytes=step), work)
        assert pieces == whole and cuts == whole_cuts
        spooled = len(list((work / SPOOL).glob("*.jsonl.zst")))
        assert spooled == (n if n > 1 else 0)  # one chunk: read in place, nothing kept
        if len(raw) > 3 * step and cut is None and len(blob) >= step // 4:
            assert n >= 3


def parquet_file(path: Path, rows: int, group_rows: int) -> None:
    rng = random.Random(rows)
    texts = [None if i % 17 == 3 else " ".join(rng.choices(WORDS, k=rng.randint(1, 200))) for i in range(rows)]
    table = pa.table({"id": [f"p{i}" if i % 5 else None for i in range(rows)], "text": texts,
                      "url": [f"https://p.example/{i}" for i in range(rows)]})
    pq.write_table(table, path, row_group_size=group_rows)


@pytest.mark.parametrize("group_rows", [7, 50, 1000])
def test_parquet_row_group_runs_read_what_the_whole_file_reads(tmp_path, group_rows):
    path = tmp_path / "one.parquet"
    parquet_file(path, 600, group_rows)
    whole, _, _ = read_pieces(path, cfg(task_bytes=WHOLE), None)
    pieces, _, n = read_pieces(path, cfg(task_bytes=4096), None)
    assert pieces == whole and len(whole) == 600
    assert n == 1 if group_rows == 1000 else n > 3  # a row group is the smallest piece


def test_the_plan_depends_on_the_file_not_the_workers(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_bytes(b"".join(json.dumps({"id": f"d{i}", "text": english(i)}).encode() + b"\n" for i in range(200)))
    one = plan_tasks([str(path)], cfg(task_bytes=8192), tmp_path / "w1", workers=1)
    two = plan_tasks([str(path)], cfg(task_bytes=8192), tmp_path / "w2", workers=2)
    assert one == two and len(one) == -(-path.stat().st_size // 8192)
    assert [t.before for t in one] == sorted(t.before for t in one) and one[0].before == 0


def corpus(folder: Path) -> list[str]:
    """One plain JSONL, one .zst and one Parquet file, each large enough to be cut, with near and exact copies
    across the cuts (the dedup numbering runs over the pieces in order)."""
    folder.mkdir()
    docs = [{"id": f"d{i}", "text": english(i, 10), "url": f"https://c.example/{i}"} for i in range(120)]
    docs += [{"id": f"copy{i}", "text": docs[i]["text"], "url": f"https://c.example/copy{i}"} for i in range(0, 120, 9)]
    random.Random(0).shuffle(docs)
    raw = b"".join(json.dumps(d).encode() + b"\n" for d in docs)
    (folder / "a.jsonl").write_bytes(raw[: len(raw) // 2] + b"{broken\n" + raw[len(raw) // 2:])
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({k: [d[k] for d in docs] for k in ("id", "text", "url")}), folder / "c.parquet",
                   row_group_size=10)
    return [str(folder / n) for n in ("a.jsonl", "b.jsonl.zst", "c.parquet")]


def test_one_file_cut_into_tasks_gives_the_docs_of_one_task_on_1_and_2_workers(tmp_path):
    inputs = corpus(tmp_path / "in")
    whole = run_data(inputs, tmp_path / "whole" / "docs", cfg(task_bytes=WHOLE))
    assert whole["tasks"] == 3
    for workers in (1, 2):
        out = tmp_path / f"cut{workers}" / "docs"
        stats = run_data(inputs, out, cfg(task_bytes=8192), workers=workers)
        assert stats["tasks"] > 12
        assert_same_output(tmp_path / "whole" / "docs", out)
    assert whole["dedup"]["exact_removed"] > 30
    assert whole["rejected_by_reason"]["read/invalid_json"] == 2  # the line the broken one was put into, in two


@pytest.mark.slow  # Ray's start-up: ~15 s
def test_one_file_cut_into_tasks_is_the_same_on_ray(tmp_path, monkeypatch):
    inputs = corpus(tmp_path / "in")
    run_data(inputs, tmp_path / "local" / "docs", cfg(task_bytes=8192), workers=2)
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    try:
        run_data(inputs, tmp_path / "ray" / "docs", cfg(task_bytes=8192, executor="ray"), workers=2)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert_same_output(tmp_path / "local" / "docs", tmp_path / "ray" / "docs")


def test_spooled_chunks_are_reused_and_a_changed_one_is_refused(tmp_path):
    path = tmp_path / "one.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps({"text": english(i)}).encode() + b"\n" for i in range(300))))
    config, work = cfg(task_bytes=8192), tmp_path / "work"
    tasks = plan_tasks([str(path)], config, work)
    chunks = sorted((work / SPOOL).glob("*.jsonl.zst"))
    assert len(tasks) == len(chunks) > 3
    stamps = [c.stat().st_mtime_ns for c in chunks]
    assert plan_tasks([str(path)], config, work) == tasks  # a re-run reuses the spool
    assert [c.stat().st_mtime_ns for c in chunks] == stamps

    raw = bytearray(chunks[1].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunks[1].write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="changed after it was written"):
        list(read_task(tasks[1], config, ReadReport()))
    again = plan_tasks([str(path)], config, work)  # the index went with the refusal: spooled again
    assert again == tasks and chunks[1].read_bytes() != bytes(raw)
    assert [outcome(d) for d in read_task(again[1], config, ReadReport())]


def test_a_damaged_row_group_cuts_its_own_task_only(tmp_path):
    """A whole read stops at a damaged row group, keeping the rows of the batches before it (pyarrow's batches
    of 1,024 rows span row groups: here none); read in runs of row groups, only the run holding it stops, and
    every other run is read in full."""
    path = tmp_path / "one.parquet"
    parquet_file(path, 600, 50)
    meta = pq.ParquetFile(path).metadata
    column = meta.row_group(6).column(meta.schema.to_arrow_schema().names.index("text"))
    raw = bytearray(path.read_bytes())
    raw[column.data_page_offset:column.data_page_offset + 16] = b"\xff" * 16  # its page header, unreadable
    path.write_bytes(bytes(raw))
    whole, whole_cuts, _ = read_pieces(path, small(task_bytes=WHOLE), None)
    pieces, cuts, n = read_pieces(path, small(task_bytes=4096), None)
    assert whole_cuts == [0] and whole == []
    run = next(t for t in plan_tasks([str(path)], small(task_bytes=4096)) if t.start <= 6 < t.end)
    assert n > 3 and cuts == [run.before]  # the damaged run's cut, at its first batch
    assert [r["offset"] for r in pieces] == [k for k in range(600) if not run.before <= k < run.end * 50]


def test_a_full_disk_while_spooling_leaves_no_partial_chunk(tmp_path, monkeypatch):
    """ENOSPC half-way through decompressing an input: its chunks so far are removed (they would hold the full
    disk's space until the next run), the error goes on to the driver, and a re-run spools the file afresh."""
    import errno

    from kiln.data import plan

    path = tmp_path / "one.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps({"text": english(i)}).encode() + b"\n" for i in range(300))))
    config, work = cfg(task_bytes=8192), tmp_path / "work"
    add, calls = plan._Chunk.add, []

    def fills_the_disk(self, piece):
        calls.append(1)
        if len(calls) > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return add(self, piece)

    monkeypatch.setattr(plan._Chunk, "add", fills_the_disk)
    with pytest.raises(OSError) as caught:
        plan_tasks([str(path)], config, work)
    assert caught.value.errno == errno.ENOSPC
    assert not list((work / SPOOL).glob("*.jsonl.zst"))
    monkeypatch.setattr(plan._Chunk, "add", add)
    assert len(plan_tasks([str(path)], config, work)) == len(list((work / SPOOL).glob("*.jsonl.zst"))) > 3
