"""`kiln pack --format megatron | olmo-core` (kiln.shards.external), read back by the trainers' own readers.

Checked: megatron-core's IndexedDataset and OLMo-core's numpy datasets (FSL, and padded FSL with its document
bounds from the metadata file and from EOS) give every document of each split, token for token and in pack order,
as the tokenizer encodes it and as Kiln's own shards of the same docs hold it; the `.bin`/`.idx` are byte for byte
megatron-core's IndexedDatasetBuilder's; the files are byte-identical on 1 and 2 workers (and Ray, slow);
`kiln shards verify` and `kiln shards inspect` read them; kiln train and `kiln run` refuse them in one line.
"""

from __future__ import annotations

import json

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kiln.config import PackConfig
from kiln.data.docs import read_docs
from kiln.errors import ConfigError, IntegrityError, KilnError
from kiln.shards.format import read_index, verify_shards
from kiln.shards.pack import pack, split_of
from kiln.shards.provenance import documents as provenance_rows
from kiln.tokenizer import load_tokenizer
from test_data import output_files
from test_pack_tasks import copies, docs_folder

CFG = PackConfig(seq_len=63, samples_per_shard=20, val_fraction=0.2, task_parts=2, batch_docs=8)
FORMATS = ("megatron", "olmo-core")


@pytest.fixture(scope="module")
def packed(prepared, tmp_path_factory) -> dict:
    """40 prepared documents (texts cut to 2,000 characters), 4 a part: 5 tasks, packed in each format."""
    base = tmp_path_factory.mktemp("formats")
    docs = [d | {"text": d["text"][:2000]} for d in copies(prepared, 1)[:40]]
    folder = docs_folder(base / "docs", docs, 4)
    tok = prepared.out / "tokenizer"
    made = {fmt: pack(read_docs(folder), tok, base / fmt, CFG.model_copy(update={"format": fmt}), progress=False)
            for fmt in ("kiln", *FORMATS)}
    return {"base": base, "folder": folder, "tok": tok, "manifests": made}


def expected(packed) -> dict[str, list[tuple[int, list[int]]]]:
    """Each split's documents in pack order, (number, ids + EOS), encoded here by the tokenizer itself."""
    tok = load_tokenizer(packed["tok"])
    eos = packed["manifests"]["kiln"]["eos_id"]
    out: dict[str, list] = {"train": [], "val": []}
    for n, d in enumerate(read_docs(packed["folder"])):
        out[split_of(d["id"], CFG.val_fraction)].append((n, tok.encode(d["text"], add_special_tokens=False).ids
                                                         + [eos]))
    return out


def kiln_documents(folder: Path, manifest: dict) -> dict[int, list[int]]:
    """Each document's tokens as Kiln's own shards hold them (the .idx entries, in shard order); a document
    in a task's dropped tail is cut short or absent."""
    docs: dict[int, list[int]] = {}
    for info in manifest["splits"].values():
        for name in info["files"]:
            tokens = np.fromfile(folder / name, dtype=manifest["dtype"], offset=64)
            for e in read_index((folder / name).with_suffix(".idx")):
                docs.setdefault(int(e["doc"]), []).extend(tokens[e["start"]:e["start"] + e["length"]].tolist())
    return docs


def check_against_kiln(packed, split: str, got: list[list[int]]) -> None:
    """`got` (a reader's documents of `split`, in order) is the split's documents, token for token, and agrees
    with Kiln's own shards of the same docs wherever those hold a document (whole, or up to the dropped tail)."""
    want = expected(packed)[split]
    assert got == [ids for _, ids in want] and len(got) > 3
    kiln = kiln_documents(packed["base"] / "kiln", packed["manifests"]["kiln"])
    whole = [n for n, ids in want if len(kiln.get(n, [])) == len(ids)]
    assert whole  # (a task tail is dropped per split: few whole val documents in Kiln's shards)
    for n, ids in want:
        assert kiln.get(n, []) == ids[:len(kiln.get(n, []))], n
    rows = [r for r in provenance_rows(packed["base"] / "kiln", packed["manifests"]["kiln"]) if r["split"] == split]
    assert [r["doc"] for r in rows] == [n for n, _ in want if n in kiln]  # the same documents, in the same order


def test_megatron_files_read_by_megatron_core_are_every_document(packed):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    m = packed["manifests"]["megatron"]
    assert m["format"] == "megatron" and m["dtype"] == "uint16"  # vocab 1024 < 65500: Megatron's uint16
    for split in ("train", "val"):
        assert m["splits"][split]["files"] == [f"{split}/tokens.bin"]
        ds = IndexedDataset(str(packed["base"] / "megatron" / split / "tokens"))
        assert ds.index.dtype == np.uint16 and (ds.document_indices == np.arange(len(ds) + 1)).all()
        check_against_kiln(packed, split, [ds[i].tolist() for i in range(len(ds))])
        assert int(ds.sequence_lengths.sum()) == m["splits"][split]["tokens"]


def test_megatron_files_are_megatron_core_builders_bytes(packed, tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    for split in ("train", "val"):
        theirs = tmp_path / split
        builder = IndexedDatasetBuilder(f"{theirs}.bin", dtype=DType.optimal_dtype(1024))
        for _, ids in expected(packed)[split]:  # tools/preprocess_data.py: add_item, end_document a document
            builder.add_item(torch.tensor(ids))
            builder.end_document()
        builder.finalize(f"{theirs}.idx")
        for suffix in (".bin", ".idx"):
            ours = packed["base"] / "megatron" / split / f"tokens{suffix}"
            assert ours.read_bytes() == Path(f"{theirs}{suffix}").read_bytes(), suffix


@pytest.mark.parametrize("bounds", ["metadata", "array"])
def test_olmo_core_files_read_by_its_numpy_datasets_are_every_document(packed, tmp_path, monkeypatch, bounds):
    from olmo_core.data import NumpyFSLDataset, NumpyPaddedFSLDataset
    from olmo_core.data.utils import iter_document_indices

    m = packed["manifests"]["olmo-core"]
    assert m["format"] == "olmo-core" and m["dtype"] == "uint16"  # OLMo-core's rule: vocab - 1 fits uint16
    eos, pad = m["eos_id"], m["pad_id"]
    monkeypatch.setenv("OLMO_DATA_PREP_USE_ARRAY_IF_LOCAL", bounds)  # where its loaders find the documents
    for split in ("train", "val"):
        path = packed["base"] / "olmo-core" / split / "tokens.npy"
        want = expected(packed)[split]
        longest = max(len(ids) for _, ids in want)
        # one instance a document (padded): the documents exactly as OLMo-core's loader bounds them
        docs = NumpyPaddedFSLDataset(path, sequence_length=longest, pad_token_id=pad, eos_token_id=eos,
                                     vocab_size=1024, dtype=np.uint16)
        docs.work_dir = tmp_path / split / bounds
        docs.prepare()
        got = []
        for i in range(len(docs)):
            item = docs[i]
            got.append(item["input_ids"][item["label_mask"]].tolist())
        check_against_kiln(packed, split, got)
        spans = list(iter_document_indices(path, use_array_if_local=bounds == "array", eos_token_id=eos,
                                           dtype=np.uint16))
        ends = np.cumsum([len(ids) for _, ids in want]).tolist()
        assert spans == list(zip([0] + ends[:-1], ends))
        # the fixed-length stream: documents back to back, chunked into sequences
        stream = NumpyFSLDataset(path, sequence_length=32, pad_token_id=pad, eos_token_id=eos, vocab_size=1024,
                                 dtype=np.uint16)
        stream.work_dir = tmp_path / split / f"{bounds}-fsl"
        stream.prepare()
        flat = [t for _, ids in want for t in ids]
        assert len(stream) == len(flat) // 32
        assert [t for i in range(len(stream)) for t in stream[i]["input_ids"].tolist()] == flat[:len(stream) * 32]


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_are_byte_identical_on_1_and_2_workers(packed, tmp_path, fmt):
    cfg = CFG.model_copy(update={"format": fmt, "workers": 2})
    two = pack(read_docs(packed["folder"]), packed["tok"], tmp_path / "w2", cfg, progress=False)
    assert output_files(packed["base"] / fmt) == output_files(tmp_path / "w2") and two == packed["manifests"][fmt]
    assert not [p for p in tmp_path.iterdir() if "-work-" in p.name]


@pytest.mark.slow  # Ray's start: ~20 s
def test_formats_are_byte_identical_on_ray(packed, tmp_path, monkeypatch):
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    try:
        for fmt in FORMATS:
            cfg = CFG.model_copy(update={"format": fmt, "workers": 2, "executor": "ray"})
            pack(read_docs(packed["folder"]), packed["tok"], tmp_path / fmt, cfg, progress=False)
            assert output_files(packed["base"] / fmt) == output_files(tmp_path / fmt)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_kiln_format_writes_what_it_wrote_before(packed):
    m = packed["manifests"]["kiln"]
    assert "format" not in m and m["provenance"] == "{split}/NNNNN.docs.jsonl.zst"
    assert m["splits"]["train"]["files"][0] == "train/00000.bin"


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_verify_and_inspect_read_them(packed, tmp_path, fmt, capsys):
    from kiln.cli import main
    from kiln.shards.inspect import inspect_sample

    folder = packed["base"] / fmt
    assert main(["shards", "verify", str(folder)]) == 0
    assert "ok:" in capsys.readouterr().out
    want = expected(packed)["val"]
    info = inspect_sample(folder, "val", 2, packed["tok"])
    doc = list(read_docs(packed["folder"]))[want[2][0]]
    assert info["tokens"] == want[2][1] and info["samples"] == len(want)
    assert info["pieces"][0]["id"] == doc["id"] and info["pieces"][0]["url"] == doc.get("url")
    assert info["pieces"][0]["doc"] == want[2][0] and doc["text"] in info["text"]

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    token_file = copy / packed["manifests"][fmt]["splits"]["train"]["files"][0]
    raw = bytearray(token_file.read_bytes())
    raw[10] ^= 1
    token_file.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="tokens"):
        verify_shards(copy)


def test_kiln_train_and_run_refuse_them_in_one_line(packed, prepared, tmp_path):
    from kiln.flow import run_all
    from kiln.shards.reader import ShardSet

    with pytest.raises(KilnError, match="packed for megatron .*pack.format=kiln"):
        ShardSet(packed["base"] / "megatron", "train")
    cfg = prepared.model_copy(update={"out_dir": str(tmp_path / "out"),
                                      "pack": prepared.pack.model_copy(update={"format": "olmo-core"})})
    with pytest.raises(ConfigError, match="pack.format: olmo-core .*--until pack"):
        run_all(cfg, lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_kiln_pack_format_flag(packed, tmp_path, capsys):
    from kiln.cli import main

    out = tmp_path / "shards"
    overrides = [f"pack.{k}={v}" for k, v in CFG.model_dump().items() if k not in ("executor", "ray_address")]
    assert main(["pack", str(packed["folder"]), "--tokenizer", str(packed["tok"]), "--out", str(out),
                 "--format", "megatron", *overrides]) == 0
    made, direct = output_files(out), output_files(packed["base"] / "megatron")
    fingerprint = json.loads(made.pop("manifest.json")).pop("fingerprint")  # `kiln pack` records its inputs'
    assert made == {k: v for k, v in direct.items() if k != "manifest.json"} and fingerprint
    # The same command again finds the shards complete for the same docs, tokenizer and settings: nothing written.
    before = {f: f.stat().st_mtime_ns for f in out.iterdir()}
    capsys.readouterr()
    assert main(["pack", str(packed["folder"]), "--tokenizer", str(packed["tok"]), "--out", str(out),
                 "--format", "megatron", *overrides]) == 0
    assert {f: f.stat().st_mtime_ns for f in out.iterdir()} == before
    assert f"kiln pack: {out} is complete and up to date" in capsys.readouterr().err
