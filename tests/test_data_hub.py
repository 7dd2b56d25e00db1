"""Inputs in the Hugging Face on-disk formats (kiln.data.hub), on folders the tests build with `datasets` and
`pyarrow` (no download): a `save_to_disk` folder (Dataset and DatasetDict) and a Hub dataset folder of Parquet
shards in FineWeb's layout run through `kiln data` with provenance as file and row; names the folder lists
that leave it, missing files, a missing text column and a cut Arrow file are one-line errors or cuts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kiln.config import DataConfig
from kiln.data.docs import read_docs
from kiln.data.document import ReadReport
from kiln.data.hub import folder_files
from kiln.data.sources import read_arrow
from kiln.data.pipeline import run_data
from kiln.errors import KilnError
from test_data import BASIC_GATES_ONLY, GERMAN, english, rejects

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ROOT = Path(__file__).resolve().parents[1]


def cfg(**kw) -> DataConfig:
    return DataConfig(**{"min_chars": 200, "quality": BASIC_GATES_ONLY, **kw})


def rows(first: int, n: int) -> dict[str, list]:
    ids = range(first, first + n)
    return {"content": [english(i) for i in ids], "doc_id": [f"r{i}" for i in ids]}


def saved(path: Path, first: int = 0, n: int = 30, shards: int = 3) -> Path:
    datasets.Dataset.from_dict(rows(first, n)).save_to_disk(str(path), num_shards=shards)
    return path


def row_text(source: str, row: int) -> str:
    """The text at `row` of an Arrow or Parquet file, read by pyarrow: what provenance points at."""
    if source.endswith(".parquet"):
        table = pq.read_table(source)
    else:
        table = pa.ipc.open_stream(source).read_all()
    return table.column("content")[row].as_py()


def test_a_save_to_disk_folder_runs_through_kiln_data_with_file_and_row_provenance(tmp_path):
    folder = saved(tmp_path / "saved", n=30, shards=3)
    out = tmp_path / "docs"
    r = subprocess.run([sys.executable, "-m", "kiln", "data", str(folder), "--out", str(out), "--",
                        "data.text_field=content", "data.id_field=doc_id", "data.workers=1", "data.min_chars=200"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["documents"]["read"] == 30
    kept = list(read_docs(out))
    assert [d["id"] for d in kept] == [f"r{i}" for i in range(30) if f"r{i}" in {d["id"] for d in kept}]
    assert len(kept) >= 25  # the english paragraphs pass the basic gates; a few may be near duplicates
    files = sorted((folder).glob("data-*.arrow"))
    assert len(files) == 3
    for d in kept:  # file and row name the record: the text there is the document's
        assert Path(d["source"]).parent == folder and d["length"] == 1
        assert row_text(d["source"], d["offset"]) == d["text"]
        i = int(d["id"][1:])
        assert (Path(d["source"]).name, d["offset"]) == (files[i // 10].name, i % 10)


def test_a_dataset_dict_folder_reads_every_split_in_its_order(tmp_path):
    train = datasets.Dataset.from_dict(rows(0, 6))
    test = datasets.Dataset.from_dict(rows(100, 2))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    files = folder_files(tmp_path / "dd")
    assert [Path(f).parent.name for f in files] == ["train", "test"]
    out = tmp_path / "docs"
    stats = run_data([str(tmp_path / "dd")], out, cfg(text_field="content", id_field="doc_id"))
    assert stats["documents"]["read"] == 8
    assert [d["id"] for d in read_docs(out)] == [f"r{i}" for i in (0, 1, 2, 3, 4, 5, 100, 101)]


FINEWEB_CARD = """---
license: odc-by
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# a FineWeb-shaped folder
"""


def hub_folder(root: Path, card: str | None = FINEWEB_CARD) -> Path:
    """FineWeb's layout: data/CC-MAIN-*/NNN_NNNNN.parquet, and sample/10BT/ copies of some rows."""
    for k, dump in enumerate(["CC-MAIN-2024-10", "CC-MAIN-2024-18"]):
        (root / "data" / dump).mkdir(parents=True)
        for j in range(2):
            first = 100 * k + 10 * j
            table = pa.table({**rows(first, 4), "url": [f"https://h.example/{i}" for i in range(first, first + 4)]})
            pq.write_table(table, root / "data" / dump / f"000_{j:05d}.parquet", row_group_size=2)
    (root / "sample" / "10BT").mkdir(parents=True)
    pq.write_table(pa.table(rows(0, 4)), root / "sample" / "10BT" / "000_00000.parquet")
    if card is not None:
        (root / "README.md").write_text(card)
    return root


def test_a_hub_parquet_folder_reads_its_default_config_with_provenance(tmp_path):
    folder = hub_folder(tmp_path / "fineweb")
    files = folder_files(folder)
    assert [str(Path(f).relative_to(folder)) for f in files] == [
        "data/CC-MAIN-2024-10/000_00000.parquet", "data/CC-MAIN-2024-10/000_00001.parquet",
        "data/CC-MAIN-2024-18/000_00000.parquet", "data/CC-MAIN-2024-18/000_00001.parquet"]  # not sample/
    out = tmp_path / "docs"
    stats = run_data([str(folder)], out, cfg(text_field="content", id_field="doc_id"))
    assert stats["documents"]["read"] == 16
    kept = list(read_docs(out))
    assert len(kept) == 16 and kept[5]["id"] == "r11" and kept[5]["url"] == "https://h.example/11"
    for d in kept:
        assert row_text(d["source"], d["offset"]) == d["text"]
    # Without a card's configs every Parquet file under the folder is read, sample/ too.
    (folder / "README.md").unlink()
    assert len(folder_files(folder)) == 5


@pytest.mark.parametrize("listing, entry, said", [
    ("state.json", "../outside.arrow", "entry '../outside.arrow' is not a plain relative name inside"),
    ("state.json", "/etc/passwd", "entry '/etc/passwd' is not a plain relative name inside"),
    ("state.json", "missing.arrow", "lists 'missing.arrow', which is not in"),
    ("README.md", "../*/*.parquet", "entry '../*/*.parquet' is not a plain relative name inside"),
    ("dataset_dict.json", "../train", "entry '../train' is not a plain relative name inside"),
])
def test_names_a_folder_lists_must_stay_inside_it(tmp_path, listing, entry, said):
    folder = saved(tmp_path / "saved", n=4, shards=1)
    (tmp_path / "outside.arrow").write_bytes((folder / "data-00000-of-00001.arrow").read_bytes())
    if listing == "state.json":
        state = json.loads((folder / "state.json").read_text())
        state["_data_files"].append({"filename": entry})
        (folder / "state.json").write_text(json.dumps(state))
    elif listing == "README.md":
        folder = hub_folder(tmp_path / "hub", FINEWEB_CARD.replace("data/*/*", entry))
    else:
        (folder / "state.json").unlink()
        (folder / "dataset_dict.json").write_text(json.dumps({"splits": [entry]}))
    r = subprocess.run([sys.executable, "-m", "kiln", "data", str(folder), "--out", str(tmp_path / "docs"), "--",
                        "data.text_field=content", "data.workers=1"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("kiln: error: ") and said in line and listing in line
    assert not (tmp_path / "docs").exists()


def test_a_missing_text_column_and_a_cut_arrow_file_are_reported(tmp_path):
    folder = saved(tmp_path / "saved", n=3000, shards=1)
    [arrow] = folder.glob("*.arrow")
    with pytest.raises(KilnError, match=r"no column 'text' \(data.text_field\); columns are \['content', 'doc_id'\]"):
        list(read_arrow(str(arrow), ReadReport(), ("text", "id", "url")))
    data = arrow.read_bytes()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(data[: len(data) // 2])  # inside the second of three 1,000-row batches
    report = ReadReport()
    docs = list(read_arrow(str(cut), report, ("content", "doc_id", "url")))
    assert report.truncated_at == len(docs) and len(docs) % 1000 == 0 and 0 < len(docs) < 3000
    assert [d.id for d in docs] == [f"r{i}" for i in range(len(docs))]


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.one_of(st.none(), st.text(max_size=30)), max_size=60),
       batch=st.integers(1, 9), file_format=st.booleans())
def test_read_arrow_yields_every_row_in_order_whatever_the_batches(tmp_path_factory, texts, batch, file_format):
    path = tmp_path_factory.mktemp("prop") / "x.arrow"
    table = pa.table({"text": pa.array(texts, pa.string())})
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_file if file_format else pa.ipc.new_stream)(sink, table.schema)
        for b in table.to_batches(max_chunksize=batch):
            writer.write_batch(b)
        writer.close()
    docs = list(read_arrow(str(path), ReadReport(), ("text", "id", "url"), max_record_bytes=40))
    assert [d.offset for d in docs] == list(range(len(texts)))
    for d, t in zip(docs, texts):
        if t is None:
            assert d.rejection.reason == "missing_text"
        elif len(t.encode()) > 40:
            assert d.rejection.reason == "too_large"
        else:
            assert d.text == t and d.id == f"x.arrow:row{d.offset}"


def test_a_german_row_is_rejected_with_its_file_and_row(tmp_path):
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"content": [english(1), GERMAN], "doc_id": ["e", "g"]}).save_to_disk(str(folder))
    out = tmp_path / "docs"
    run_data([str(folder)], out, cfg(text_field="content", id_field="doc_id", languages=["en"]))
    [r] = rejects(out)
    assert (r["id"], Path(r["source"]).name, r["offset"], r["reason"]) == ("g", "data-00000-of-00001.arrow", 1,
                                                                           "lang_not_allowed")


def mixed_folder(root: Path) -> Path:
    """A folder of every input kind: JSONL (10 rows), a WARC (6 pages), Parquet (4 rows), a save_to_disk
    subfolder (8 rows in 2 Arrow files): 28 documents, each text distinct."""
    from conftest import html_page, write_warc

    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"id": f"j{i}", "text": english(i)}) + "\n" for i in range(10)))
    write_warc(root / "b.warc.gz", [(f"https://w.example/{i}", html_page(f"<p>{english(100 + i)}</p>"), "text/html")
                                    for i in range(6)])
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(4)], "text": [english(200 + i) for i in range(4)]}),
                   root / "c.parquet")
    datasets.Dataset.from_dict({"id": [f"s{i}" for i in range(8)], "text": [english(300 + i) for i in range(8)]}
                               ).save_to_disk(str(root / "saved"), num_shards=2)
    (root / "notes.txt").write_text("not data")
    return root


def test_a_mixed_folder_reads_every_input_in_it(tmp_path):
    """Issue 37 item 9: a folder of JSONL, WARC, Parquet and a save_to_disk subfolder read only its Parquet; now
    every data file is read (sorted, the saved folder's Arrow files at its place) and every document counted."""
    folder = mixed_folder(tmp_path / "mixed")
    files = [Path(f).relative_to(folder).as_posix() for f in folder_files(folder)]
    assert files == ["a.jsonl", "b.warc.gz", "c.parquet", "saved/data-00000-of-00002.arrow",
                     "saved/data-00001-of-00002.arrow"]
    out = tmp_path / "docs"
    stats = run_data([str(folder)], out, cfg(min_chars=50, workers=1))
    assert stats["documents"]["read"] == 28, stats["documents"]
    sources = {Path(d["source"]).name for d in read_docs(out)}
    assert {"a.jsonl", "b.warc.gz", "c.parquet", "data-00000-of-00002.arrow", "data-00001-of-00002.arrow"} <= sources


def test_a_hub_folder_refuses_a_data_file_its_card_does_not_name(tmp_path):
    """With a card, the default config is read and the other configs' files are its alternatives; a data file
    no config names would be left out, so the folder is refused in one line naming it and how to read it."""
    folder = hub_folder(tmp_path / "fineweb")
    (folder / "extra.jsonl").write_text(json.dumps({"id": "x", "text": english(1)}) + "\n")
    with pytest.raises(KilnError, match=r"extra\.jsonl is a data file that no config of .*README\.md names.*glob"):
        folder_files(folder)
