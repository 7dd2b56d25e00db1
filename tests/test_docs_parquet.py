"""`kiln data --docs-format parquet` (data.docs_format): the kept documents in the Hub's layout
(data/train-NNNNN-of-MMMMM.parquet), read by the real `datasets` library as exactly the documents and provenance
of the JSONL docs of the same run, rejects as their own config, byte-identical on 1 and 2 workers (and Ray:
slow), and read by every stage that reads docs (tokenizer, pack, explain) through the one docs reader."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import SAMPLE_WARC, TINY, html_page, warc_pages, write_warc
from kiln.config import DataConfig, PackConfig, TokenizerConfig
from kiln.data.docs import read_docs, read_part
from kiln.data.pipeline import fingerprint, run_data
from kiln.data.plan import index_key
from kiln.errors import IntegrityError
from test_data import assert_same_output

PROVENANCE = ("id", "source", "offset", "length", "record_id", "url", "date", "content_type")
PER_PART = 16


def cfg(**kw) -> DataConfig:
    return DataConfig(docs_per_part=PER_PART, **kw)


@pytest.fixture(scope="module")
def warc(tmp_path_factory) -> Path:
    """40 pages of the sample, two of them with an e-mail address (an edit), and three too short to keep."""
    pages = [(u, body, "text/html") for u, body in warc_pages(SAMPLE_WARC)[:40]]
    pages[3] = (pages[3][0], pages[3][1].replace(b"</body>", b"<p>Write to jane.doe@example.com today.</p></body>"),
                "text/html")
    pages += [(f"http://short{i}.example/", html_page(f"<p>too short {i}</p>"), "text/html") for i in range(3)]
    return write_warc(tmp_path_factory.mktemp("warc") / "in.warc.gz", pages)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warc):
    """The same input as JSONL docs, Parquet docs on one worker (through the CLI flag) and on two (5 tasks)."""
    from kiln.cli import main

    tmp = tmp_path_factory.mktemp("runs")
    jsonl = run_data([str(warc)], tmp / "jsonl", cfg())
    config = tmp / "kiln.yaml"
    config.write_text(f"data:\n  docs_per_part: {PER_PART}\n")
    assert main(["data", str(warc), "--out", str(tmp / "pq1"), "--config", str(config), "--workers", "1",
                 "--docs-format", "parquet"]) == 0
    two = run_data([str(warc)], tmp / "pq2", cfg(docs_format="parquet", task_bytes=warc.stat().st_size // 5),
                   workers=2)
    assert two["tasks"] >= 5 and jsonl["documents"]["rejected"] >= 3 and jsonl["documents"]["kept"] > PER_PART * 2
    return jsonl, tmp / "jsonl", tmp / "pq1", tmp / "pq2"


def _jsonl_rejects(folder: Path) -> list[dict]:
    return [r for part in sorted((folder / "rejects").glob("part-*.jsonl.zst")) for r in read_part(part)]


def _same_record(row: dict, rec: dict) -> None:
    """A Parquet row as `datasets` gives it against the JSONL record: every field equal (dicts are JSON text), and
    the columns the record lacks are null."""
    for key, value in row.items():
        want = rec.get(key)
        got = json.loads(value) if key in ("edits", "signals") and value is not None else value
        assert got == want, (rec["id"], key, got, want)
    assert set(rec) <= set(row), set(rec) - set(row)


def test_load_dataset_gives_exactly_the_kept_documents_and_their_provenance(runs, tmp_path):
    from datasets import load_dataset

    stats, jsonl, pq, _ = runs
    kept = list(read_docs(jsonl))
    rows = load_dataset("parquet", data_dir=str(pq / "data"), split="train", cache_dir=str(tmp_path)).to_list()
    assert [r["id"] for r in rows] == [d["id"] for d in kept] and len(rows) == stats["documents"]["kept"]
    for row, rec in zip(rows, kept):
        _same_record(row, rec)
    assert set(PROVENANCE) <= set(rows[0]) and any(r["edits"] for r in rows)
    n = -(-len(kept) // PER_PART)
    assert sorted(p.name for p in (pq / "data").iterdir()) == [f"train-{k:05d}-of-{n:05d}.parquet" for k in range(n)]


def test_the_folder_is_a_hub_dataset_with_the_rejects_as_their_own_config(runs, tmp_path):
    from datasets import load_dataset

    stats, jsonl, pq, _ = runs
    default = load_dataset(str(pq), split="train", cache_dir=str(tmp_path))
    assert default["id"] == [d["id"] for d in read_docs(jsonl)]
    rejects = load_dataset(str(pq), "rejects", split="train", cache_dir=str(tmp_path)).to_list()
    want = _jsonl_rejects(jsonl)
    assert len(rejects) == len(want) == stats["documents"]["rejected"]
    for row, rec in zip(rejects, want):
        _same_record(row, rec)
    assert [p.name for p in (pq / "rejects").iterdir()] == ["rejects-00000-of-00001.parquet"]


def test_parquet_docs_are_byte_identical_on_one_and_two_workers(runs):
    _, _, one, two = runs
    assert_same_output(one, two)


def test_every_docs_reader_reads_the_parquet_folder(runs, tmp_path):
    """read_docs (tokenizer, classifier, ablate's sample and overlap check), pack's tasks over parts, explain:
    the same records, the same tokenizer and the same shards from either layout."""
    from kiln.data.explain import find
    from kiln.shards.pack import pack
    from kiln.tokenizer import train_tokenizer

    _, jsonl, pq, _ = runs
    assert list(read_docs(pq)) == list(read_docs(jsonl))
    made = {}
    for name, docs in (("jsonl", jsonl), ("parquet", pq)):
        tok = tmp_path / name / "tokenizer"
        train_tokenizer(read_docs(docs), tok, TokenizerConfig(**TINY["tokenizer"]), 0)
        pack(read_docs(docs), tok, tmp_path / name / "shards", PackConfig(**TINY["pack"], task_parts=1))
        made[name] = {p.relative_to(tmp_path / name).as_posix(): p.read_bytes()
                      for p in (tmp_path / name).rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert made["parquet"].keys() == made["jsonl"].keys() and any(k.endswith(".bin") for k in made["jsonl"])
    for name, data in made["jsonl"].items():
        assert made["parquet"][name] == data, name
    first, reject = next(iter(read_docs(pq))), _jsonl_rejects(jsonl)[0]
    assert [(r["outcome"], r["part"]) for r in find(first["id"], pq)] == [("kept", "data/train-00000-of-00003.parquet")]
    assert [(r["outcome"], r["reason"]) for r in find(reject["id"], pq)] == [("rejected", reject["reason"])]


def test_a_changed_parquet_part_is_refused_naming_it(runs, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(runs[2], docs)
    part = docs / "data" / "train-00001-of-00003.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"train-00001-of-00003\.parquet: sha256 .* run `kiln data` again"):
        list(read_docs(docs))


def test_the_layout_is_in_the_fingerprint_but_not_the_index_key(warc):
    """JSONL's fingerprint is what it was before the key existed (the index key); Parquet's differs, so a
    folder of the other layout is not skipped, and the data.dedup.index entry is the same documents' either way."""
    files = [str(warc)]
    assert fingerprint(files, cfg()) == index_key(files, cfg()) == index_key(files, cfg(docs_format="parquet"))
    assert fingerprint(files, cfg(docs_format="parquet")) != fingerprint(files, cfg())


@pytest.mark.slow  # a local Ray: ~60 s
def test_parquet_docs_are_byte_identical_on_ray(runs, warc, tmp_path, monkeypatch):
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    try:
        run_data([str(warc)], tmp_path / "docs", cfg(docs_format="parquet", executor="ray",
                                                     task_bytes=warc.stat().st_size // 5), workers=2)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert_same_output(runs[2], tmp_path / "docs")


def test_parquet_without_pyarrow_is_one_config_line_before_any_work(tmp_path, monkeypatch, warc):
    import sys

    from kiln.errors import ConfigError

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if the parquet extra were not installed
    with pytest.raises(ConfigError, match=r"data.docs_format: parquet needs pyarrow, .* pip install"):
        run_data([str(warc)], tmp_path / "docs", cfg(docs_format="parquet"))
    assert not any(tmp_path.iterdir())
