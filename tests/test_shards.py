"""Token shards: integrity, headers, split assignment, exact packing, the document index and provenance.

Covered, on the session's `prepared` corpus (copied before anything is corrupted):
- `verify_shards` passes; flipping one byte in EACH file the manifest lists
  (every .bin and .idx, one at a time, on a fresh copy) raises IntegrityError
  naming that file; `kiln shards verify` exits 0 on the good folder, 1 on a flipped one;
- header checks (magic, version, token width, size, cut file, vocabulary,
  index header and entries) raise IntegrityError with a clear message, both from
  `read_header`/`read_index` and from `verify_shards` once the manifest is re-hashed
  (so the header check itself, not the sha256, is what fires);
- `ShardSet` with another tokenizer's sha256 raises KilnError naming the tokenizer;
- the file table (`files.jsonl`): manifest.json's bytes are the same at 1 and at 25+ shards a split
  but for the table's row count, size and sha256; a flipped byte in it, a wrong row count or name, a
  missing table are one-line IntegrityErrors; a manifest with its files inline (written before the
  table) still reads; pack replaces its own folder with a damaged table but not one holding a foreign file;
- train/val document ids are disjoint and follow `split_of`, which is stable when
  documents are added (synthetic ids, and a real re-pack of a superset);
- manifest token counts equal the sum of shard headers; every sample has
  sample_len tokens and ShardSet's samples tile the shard stream;
- packing: each split's documents, encoded independently (+ EOS, in order),
  reproduce that split's shard stream exactly, except the dropped tail;
- the .idx entries give each document's token range and ordinal, tiling the shard;
- provenance: a token position -> .idx entry -> manifest document -> WARC gzip
  member at (source, offset, length) whose WARC-Target-URI is the url and whose
  record id is the document id; the tokens of that range decode to document text;
- a small pack with many shards: entries straddling shard boundaries are split
  correctly (per document, the pieces' lengths sum to its token count and the
  pieces concatenate to its tokens);
- `pack.mode: best_fit` on the sample splits fewer documents than concat (only those
  longer than a sample), keeps every document's tokens in order, pads the rest with
  <|pad|>, records pad tokens and efficiency, verifies, and is byte-identical when repeated;
- encoding with 1 or 2 worker processes gives byte-identical shards; the progress line
  reports documents and MB;
- `kiln shards inspect DIR --at N` names the documents (id, url, source offset) whose tokens
  make up sample N, with their token ranges, and decodes the sample; bad index or tokenizer
  exit 2; overlapping index entries fail verification.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import main as cli_main
from kiln.config import PackConfig
from kiln.data.docs import read_docs
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import read_manifest
from kiln.shards.format import FILES_TABLE, IDX_ENTRY, IDX_HEADER, read_header, read_index, read_tokens, verify_shards
from kiln.shards.reader import ShardSet
from kiln.shards.pack import pack, split_of
from kiln.shards.provenance import documents as provenance_rows
from kiln.tokenizer import eos_id, load_tokenizer, tokenizer_sha256


# --- helpers --------------------------------------------------------------------------------------

def flip_byte(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))


def sized(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rehash(folder: Path, name: str) -> None:
    """Make the manifest vouch for the (altered) file again, so that only the header checks can catch it:
    its row in the file table, then the table's entry in manifest.json."""
    table = folder / FILES_TABLE
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    for row in rows:
        if row["name"] == name:
            row.update(sized((folder / name).read_bytes()))
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    mpath = folder / "manifest.json"
    m = json.loads(mpath.read_text())
    m["files"][FILES_TABLE] = sized(table.read_bytes())
    mpath.write_text(json.dumps(m))


def stream(folder: Path, files: list[str]) -> np.ndarray:
    parts = [np.asarray(read_tokens(folder / f), dtype=np.int64) for f in files]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def global_entries(folder: Path, files: list[str]) -> list[tuple[int, int, int, int, int]]:
    """(global start, length, doc, shard number, local start) for every .idx entry of a split, in order."""
    out, offset = [], 0
    for k, name in enumerate(files):
        for e in read_index((folder / name).with_suffix(".idx")):
            out.append((offset + int(e["start"]), int(e["length"]), int(e["doc"]), k, int(e["start"])))
        offset += read_header(folder / name).num_tokens
    return out


@pytest.fixture(scope="module")
def shards(prepared) -> Path:
    return prepared.out / "shards"


@pytest.fixture(scope="module")
def manifest(shards) -> dict:
    return read_manifest(shards)


@pytest.fixture(scope="module")
def rows(shards, manifest) -> list[dict]:
    """Every document's provenance row, from the per-shard side files."""
    return provenance_rows(shards, manifest)


@pytest.fixture(scope="module")
def encoded(prepared):
    """The docs folder's documents and their tokens (+ EOS), encoded here, independently of pack()."""
    docs = list(read_docs(prepared.out / "docs"))
    tok = load_tokenizer(prepared.out / "tokenizer")
    eos = eos_id(tok)
    encs = tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    return docs, tok, [np.array(e.ids + [eos], dtype=np.int64) for e in encs]


@pytest.fixture
def copy(shards, tmp_path) -> Path:
    dst = tmp_path / "shards"
    shutil.copytree(shards, dst)
    return dst


# --- integrity --------------------------------------------------------------------------------------

def test_verify_shards_passes_on_prepared(shards, manifest):
    m = verify_shards(shards)
    assert m == manifest
    names = set(m["files"])
    listed = {f for s in m["splits"].values() for f in s["files"]}
    side = {f[:-4] + ".idx" for f in listed} | {f[:-4] + ".docs.jsonl.zst" for f in listed}
    assert listed and names == listed | side | {FILES_TABLE}
    assert len(m["splits"]["train"]["files"]) >= 2  # the flip test below covers several shards


def test_manifest_size_does_not_grow_with_the_document_count(prepared, tmp_path):
    cfg = PackConfig(seq_len=63, val_fraction=0.1, samples_per_shard=10_000)  # one shard per split either way
    sizes, docs = {}, {}
    for n in (50, 1000):
        corpus = [{"id": f"d{i}", "text": "kiln " * (6000 // n), "source": "s.jsonl", "offset": i, "length": 9}
                  for i in range(n)]
        m = pack(corpus, prepared.out / "tokenizer", tmp_path / str(n), cfg)
        sizes[n], docs[n] = len((tmp_path / str(n) / "manifest.json").read_bytes()), m["documents"]
        dropped = m["splits"]["train"]["dropped_tail_tokens"] + m["splits"]["val"]["dropped_tail_tokens"]
        assert n - dropped <= len(provenance_rows(tmp_path / str(n), m)) <= n  # a row for every document with tokens
    assert docs == {50: 50, 1000: 1000} and abs(sizes[1000] - sizes[50]) < 100, sizes


def pack_synthetic(prepared, out: Path, samples_per_shard: int, n: int = 400) -> dict:
    cfg = PackConfig(seq_len=63, val_fraction=0.2, samples_per_shard=samples_per_shard)
    corpus = [{"id": f"d{i}", "text": f"kiln {i} fires " * 30, "source": "s.jsonl", "offset": i, "length": 9}
              for i in range(n)]
    return pack(corpus, prepared.out / "tokenizer", out, cfg)


def test_manifest_bytes_do_not_depend_on_the_shard_count(prepared, tmp_path):
    one, many = pack_synthetic(prepared, tmp_path / "one", 100_000), pack_synthetic(prepared, tmp_path / "many", 20)
    assert [len(one["splits"][s]["files"]) for s in ("train", "val")] == [1, 1]
    assert len(many["splits"]["train"]["files"]) >= 20 and len(many["splits"]["val"]["files"]) >= 4
    raw = {k: (tmp_path / k / "manifest.json").read_bytes() for k in ("one", "many")}
    parsed = {k: json.loads(v) for k, v in raw.items()}
    table = {k: (m["file_table"]["files"], m["files"][FILES_TABLE]["size"]) for k, m in parsed.items()}
    assert table["many"][0] == len(many["files"]) - 1 > table["one"][0] == len(one["files"]) - 1 == 6
    # What differs is the file table's row count, size and sha256: the same bytes with those set alike
    for m in parsed.values():
        assert set(m["files"]) == {FILES_TABLE} and m["file_table"]["name"] == FILES_TABLE
        assert all(info["files"] == [] for info in m["splits"].values())
        m["file_table"]["files"] = m["files"][FILES_TABLE]["size"] = m["files"][FILES_TABLE]["sha256"] = 0
    assert json.dumps(parsed["one"], indent=1) == json.dumps(parsed["many"], indent=1)
    digits = sum(len(str(a)) - len(str(b)) for a, b in zip(table["many"], table["one"]))
    assert len(raw["many"]) - len(raw["one"]) == digits <= 4, (len(raw["many"]), len(raw["one"]))
    # and the same samples, every file listed and verified
    assert verify_shards(tmp_path / "many") == read_manifest(tmp_path / "many") == many
    for split in ("train", "val"):
        a, b = ShardSet(tmp_path / "one", split), ShardSet(tmp_path / "many", split)
        got, want = (np.zeros((len(a), a.sample_len), dtype=np.int64) for _ in range(2))
        a.gather(np.arange(len(a)), want)
        b.gather(np.arange(len(b)), got)
        assert len(a) == len(b) > 0 and np.array_equal(got, want)


def test_write_manifest_table_round_trips_nested_file_lists(tmp_path):
    from kiln.manifest import FileList, write_manifest

    for name in ("a/2.bin", "a/10.bin", "b/1.bin", "other.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    lists = {"a": {"files": FileList(["a/2.bin", "a/10.bin"]), "groups": [{"files": FileList(["a/10.bin"])}]},
             "b": {"files": FileList(["b/1.bin"])}, "empty": {"files": FileList([])}}
    written = write_manifest(tmp_path, table="t.jsonl", stage="x", splits=lists)
    assert written == read_manifest(tmp_path) and "file_table" not in written
    assert written["splits"] == {"a": {"files": ["a/2.bin", "a/10.bin"], "groups": [{"files": ["a/10.bin"]}]},
                                 "b": {"files": ["b/1.bin"]}, "empty": {"files": []}}
    assert list(written["files"]) == sorted(["a/2.bin", "a/10.bin", "b/1.bin", "other.txt", "t.jsonl"])
    assert json.loads((tmp_path / "manifest.json").read_text())["files"].keys() == {"t.jsonl"}
    with pytest.raises(ValueError, match="not in the order"):  # lists the rows cannot all give back
        write_manifest(tmp_path, table="t.jsonl", x=FileList(["a/2.bin", "b/1.bin"]),
                       y=FileList(["b/1.bin", "a/2.bin"]))
    assert write_manifest(tmp_path, table="t.jsonl", stage="x", splits=lists) == written  # the table rewritten


def test_a_flipped_byte_in_the_file_table_is_one_line_naming_it(copy, capsys):
    flip_byte(copy / FILES_TABLE, 20)
    for read in (lambda: ShardSet(copy, "train"), lambda: verify_shards(copy), lambda: read_manifest(copy)):
        with pytest.raises(IntegrityError, match="sha256 .* the file table changed after Kiln wrote it") as info:
            read()
        assert str(copy / FILES_TABLE) in str(info.value) and "\n" not in str(info.value)
    assert cli_main(["shards", "verify", str(copy)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kiln: verification failed: ") and str(copy / FILES_TABLE) in err and "\n" not in err


def test_file_table_row_count_and_name_are_checked(copy):
    mpath = copy / "manifest.json"
    good = json.loads(mpath.read_text())
    for change, message in ((lambda m: m["file_table"].update(files=m["file_table"]["files"] + 1), "rows"),
                            (lambda m: m["file_table"].update(name="elsewhere.jsonl"), "does not name a file")):
        m = json.loads(json.dumps(good))
        change(m)
        mpath.write_text(json.dumps(m))
        with pytest.raises(IntegrityError, match=message):
            ShardSet(copy, "train")
    mpath.write_text(json.dumps(good))
    (copy / FILES_TABLE).unlink()
    with pytest.raises(IntegrityError, match=f"{copy / FILES_TABLE}: listed in manifest.json but missing"):
        verify_shards(copy)


def test_a_manifest_with_its_files_inline_still_reads(shards, manifest, copy):
    """A folder packed before the file table: every file and the shard lists in manifest.json itself."""
    from kiln.shards.inspect import sample_provenance

    old = {**manifest, "files": {k: v for k, v in manifest["files"].items() if k != FILES_TABLE}}
    (copy / FILES_TABLE).unlink()
    (copy / "manifest.json").write_text(json.dumps(old, indent=1))
    assert verify_shards(copy) == read_manifest(copy) == old
    for split in ("train", "val"):
        a, b = ShardSet(copy, split), ShardSet(shards, split)
        assert a.names == b.names and len(a) == len(b) and np.array_equal(a.sample(len(a) - 1), b.sample(len(b) - 1))
    at = len(ShardSet(shards, "train")) - 1
    assert sample_provenance(copy, "train", at)["pieces"] == sample_provenance(shards, "train", at)["pieces"]


def test_pack_replaces_its_own_folder_with_a_damaged_file_table_but_not_foreign_files(prepared, tmp_path):
    out = tmp_path / "shards"
    first = pack_synthetic(prepared, out, 20)
    table = (out / FILES_TABLE).read_bytes()
    at = table.index(b'"sha256": "') + len(b'"sha256": "')
    (out / FILES_TABLE).write_bytes(table[:at] + (b"0" if table[at:at + 1] != b"0" else b"1") + table[at + 1:])
    with pytest.raises(IntegrityError):
        read_manifest(out)
    assert pack_synthetic(prepared, out, 20) == first  # Kiln's own folder: replaced
    (out / "train" / "notes.txt").write_text("mine")
    with pytest.raises(KilnError, match="holds train/notes.txt, which Kiln did not write"):
        pack_synthetic(prepared, out, 20)


def test_training_path_never_reads_the_provenance(shards, copy, manifest):
    for name in manifest["files"]:  # unreadable side files: sampling does not notice, verification does
        if name.endswith(".docs.jsonl.zst"):
            (copy / name).write_bytes(b"not zstd")
    for split in ("train", "val"):
        damaged, intact = ShardSet(copy, split), ShardSet(shards, split)
        got, want = (np.zeros((len(intact), intact.sample_len), dtype=np.int64) for _ in range(2))
        damaged.gather(np.arange(len(damaged)), got)
        intact.gather(np.arange(len(intact)), want)
        assert len(damaged) == len(intact) > 0 and np.array_equal(got, want)
    with pytest.raises(IntegrityError, match="docs.jsonl.zst"):
        verify_shards(copy)


def test_one_flipped_byte_in_each_listed_file_is_caught(shards, manifest, tmp_path):
    names = sorted(manifest["files"])
    assert any(n.endswith(".bin") for n in names) and any(n.endswith(".idx") for n in names)
    for i, name in enumerate(names):
        dst = tmp_path / f"c{i}"
        shutil.copytree(shards, dst)
        size = (dst / name).stat().st_size
        flip_byte(dst / name, size // 2 if i % 2 else size - 1)
        with pytest.raises(IntegrityError) as info:
            verify_shards(dst)
        assert str(dst / name) in str(info.value), f"{name}: {info.value}"
        assert "sha256" in str(info.value)
        shutil.rmtree(dst)


def test_cli_shards_verify_exit_codes(shards, manifest, copy, capsys):
    assert cli_main(["shards", "verify", str(shards)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: ") and str(manifest["splits"]["train"]["tokens"]) in out
    name = manifest["splits"]["val"]["files"][0]
    flip_byte(copy / name, 100)
    assert cli_main(["shards", "verify", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "verification failed" in err and str(copy / name) in err


def test_cli_shards_verify_missing_manifest_exits_1(tmp_path, capsys):
    assert cli_main(["shards", "verify", str(tmp_path)]) == 1
    assert "no manifest.json" in capsys.readouterr().err


# --- headers ----------------------------------------------------------------------------------------

HEADER_CASES = {
    # name: (mutation of the raw .bin bytes, expected message)
    "magic": (lambda r: r.__setitem__(slice(0, 8), b"NOTKILN\0"), "not a Kiln token shard"),
    "version": (lambda r: struct.pack_into("<I", r, 8, 2), "shard format version 2, this Kiln reads 1"),
    "width4": (lambda r: struct.pack_into("<I", r, 12, 4), "4-byte tokens for a vocabulary of 1024"),
    "width3": (lambda r: struct.pack_into("<I", r, 12, 3), "3-byte tokens"),
    "vocab_needs_u4": (lambda r: struct.pack_into("<I", r, 16, 70000), "2-byte tokens for a vocabulary of 70000"),
    "count": (lambda r: struct.pack_into("<Q", r, 24, struct.unpack_from("<Q", r, 24)[0] + 1), "header promises"),
    "cut": (lambda r: r.__delitem__(slice(-2, None)), "header promises"),
    "padded": (lambda r: r.extend(b"\0\0"), "header promises"),
    "cut_header": (lambda r: r.__delitem__(slice(40, None)), "shorter than the 64-byte shard header"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_altered_header_raises_integrity_error(copy, manifest, case):
    mutate, message = HEADER_CASES[case]
    name = manifest["splits"]["train"]["files"][1]
    path = copy / name
    raw = bytearray(path.read_bytes())
    mutate(raw)
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value)
    # caught by the sha256 first...
    with pytest.raises(IntegrityError, match="sha256|size"):
        verify_shards(copy)
    # ...and by the header check itself once the manifest vouches for the altered bytes
    rehash(copy, name)
    with pytest.raises(IntegrityError, match=message):
        verify_shards(copy)
    with pytest.raises(IntegrityError, match=message):
        ShardSet(copy, "train")


def test_header_vocab_or_tokenizer_differing_from_manifest(copy, manifest):
    name = manifest["splits"]["train"]["files"][0]
    raw = bytearray((copy / name).read_bytes())
    struct.pack_into("<I", raw, 16, 1000)  # still 2-byte tokens: passes read_header, not the manifest check
    (copy / name).write_bytes(bytes(raw))
    assert read_header(copy / name).vocab_size == 1000
    rehash(copy, name)
    with pytest.raises(IntegrityError, match="tokenizer, vocabulary or sample length differ"):
        verify_shards(copy)

    raw[16:20] = struct.pack("<I", manifest["vocab_size"])
    raw[32:64] = b"\x11" * 32
    (copy / name).write_bytes(bytes(raw))
    rehash(copy, name)
    with pytest.raises(IntegrityError, match="tokenizer, vocabulary or sample length differ"):
        verify_shards(copy)
    with pytest.raises(IntegrityError, match="sample length or tokenizer"):
        ShardSet(copy, "train")


IDX_CASES = {
    "magic": (lambda r: r.__setitem__(slice(0, 8), b"KILNTOK\0"), "not a Kiln shard index"),
    "version": (lambda r: struct.pack_into("<I", r, 8, 7), "version 7"),
    "count": (lambda r: struct.pack_into("<Q", r, 16, struct.unpack_from("<Q", r, 16)[0] + 1), "the file is cut"),
    "cut": (lambda r: r.__delitem__(slice(10, None)), "shorter than the index header"),
    "entry_past_end": (lambda r: struct.pack_into("<Q", r, IDX_HEADER.size, 10**9), "points past"),
    "doc_past_list": (lambda r: struct.pack_into("<I", r, IDX_HEADER.size + 12, 10**6), "points past"),
}


@pytest.mark.parametrize("case", sorted(IDX_CASES))
def test_altered_index_raises_integrity_error(copy, manifest, case):
    mutate, message = IDX_CASES[case]
    name = manifest["splits"]["train"]["files"][0][:-4] + ".idx"
    raw = bytearray((copy / name).read_bytes())
    mutate(raw)
    (copy / name).write_bytes(bytes(raw))
    rehash(copy, name)
    with pytest.raises(IntegrityError, match=message) as info:
        verify_shards(copy)
    assert str(copy / name) in str(info.value)


def test_manifest_token_total_mismatch(copy, manifest):
    m = json.loads((copy / "manifest.json").read_text())
    m["splits"]["val"]["tokens"] += 1
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match=f"manifest.json says {manifest['splits']['val']['tokens'] + 1}"):
        verify_shards(copy)


def test_shardset_rejects_another_tokenizer(shards, prepared, manifest):
    with pytest.raises(KilnError, match="tokenizer") as info:
        ShardSet(shards, "train", tokenizer_sha256="0" * 64)
    assert "re-run `kiln pack`" in str(info.value) and manifest["tokenizer_sha256"][:12] in str(info.value)
    good = tokenizer_sha256(prepared.out / "tokenizer")
    assert good == manifest["tokenizer_sha256"]
    assert len(ShardSet(shards, "train", tokenizer_sha256=good)) == manifest["splits"]["train"]["samples"]
    with pytest.raises(KilnError, match="no 'test' split"):
        ShardSet(shards, "test")


# --- counts and samples -------------------------------------------------------------------------------

def test_manifest_counts_equal_shard_headers(shards, manifest, prepared, rows):
    L = manifest["sample_len"]
    assert L == prepared.pack.seq_len + 1 == manifest["seq_len"] + 1
    assert manifest["dtype"] == "uint16" and manifest["eos_id"] == 1
    packed = dropped = 0
    for split, info in manifest["splits"].items():
        headers = [read_header(shards / f) for f in info["files"]]
        total = sum(h.num_tokens for h in headers)
        assert total == info["tokens"] and info["samples"] == total // L and total % L == 0
        assert all(h.num_tokens % L == 0 and h.sample_len == L and h.token_bytes == 2 for h in headers)
        assert all(h.num_tokens == prepared.pack.samples_per_shard * L for h in headers[:-1])
        assert all(h.tokenizer_sha256 == manifest["tokenizer_sha256"] and h.vocab_size == manifest["vocab_size"]
                   for h in headers)
        assert 0 <= info["dropped_tail_tokens"] < L
        assert info["documents"] == sum(d["split"] == split for d in rows)
        packed += total
        dropped += info["dropped_tail_tokens"]
    assert manifest["packing_efficiency"] == round(packed / (packed + dropped), 6)


def test_every_sample_has_sample_len_tokens_and_tiles_the_stream(shards, manifest):
    L = manifest["sample_len"]
    for split in ("train", "val"):
        ss = ShardSet(shards, split)
        s = stream(shards, manifest["splits"][split]["files"])
        assert len(ss) == manifest["splits"][split]["samples"] == len(s) // L
        for i in range(len(ss)):
            sample = ss.sample(i)
            assert sample.shape == (L,)
            if i % 97 == 0 or i == len(ss) - 1:
                assert np.array_equal(np.asarray(sample, dtype=np.int64), s[i * L:(i + 1) * L])


# --- splits ----------------------------------------------------------------------------------------

def test_train_val_disjoint_and_follow_split_of(manifest, encoded, prepared, rows):
    docs, _, _ = encoded
    assert [d["id"] for d in rows] == [d["id"] for d in docs]
    train = {d["id"] for d in rows if d["split"] == "train"}
    val = {d["id"] for d in rows if d["split"] == "val"}
    assert train and val and not train & val
    assert len(train) + len(val) == len(rows)
    for d in rows:
        assert d["split"] == split_of(d["id"], prepared.pack.val_fraction)


def test_split_of_is_stable_when_documents_are_added():
    ids = [f"urn-{i:06d}" for i in range(4000)]
    first = {i: split_of(i, 0.2) for i in ids[:1000]}
    again = {i: split_of(i, 0.2) for i in ids}  # a bigger corpus, in another order too
    assert all(again[i] == s for i, s in first.items())
    assert {split_of(i, 0.2) for i in reversed(ids[:1000])} == set(first.values())
    frac = sum(s == "val" for s in again.values()) / len(again)
    assert 0.17 < frac < 0.23
    assert all(split_of(i, 0.0) == "train" for i in ids[:500])
    # raising the fraction only moves documents train -> val, never val -> train
    assert all(split_of(i, 0.3) == "val" for i in ids if split_of(i, 0.2) == "val")


def test_repacking_a_superset_keeps_existing_documents_in_their_split(prepared, tmp_path):
    rng = random.Random(0)
    words = "alpha beta gamma delta kiln shard token 東京 🙂".split()
    docs = [{"id": f"s{i}", "text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))} for i in range(120)]
    cfg = PackConfig(seq_len=15, val_fraction=0.3, samples_per_shard=4, batch_docs=7)
    small = pack(docs[:60], prepared.out / "tokenizer", tmp_path / "a", cfg)
    big = pack(docs, prepared.out / "tokenizer", tmp_path / "b", cfg)
    before = {d["id"]: d["split"] for d in provenance_rows(tmp_path / "a", small)}
    after = {d["id"]: d["split"] for d in provenance_rows(tmp_path / "b", big)}
    assert {k: after[k] for k in before} == before
    assert set(before.values()) == {"train", "val"}


# --- packing reproduces the stream ---------------------------------------------------------------------

def test_documents_plus_eos_reproduce_each_split_stream(shards, manifest, encoded, rows):
    docs, _, ids = encoded
    for d, m, t in zip(docs, rows, ids):
        assert m["tokens"] == len(t) and t[-1] == manifest["eos_id"]
        assert (m["id"], m["url"], m["source"], m["offset"], m["length"]) == (
            d["id"],
            d["url"],
            d["source"],
            d["offset"],
            d["length"],
        )
    for split in ("train", "val"):
        expected = np.concatenate([t for t, m in zip(ids, rows) if m["split"] == split])
        got = stream(shards, manifest["splits"][split]["files"])
        info = manifest["splits"][split]
        assert len(got) == info["tokens"]
        assert len(expected) - len(got) == info["dropped_tail_tokens"]
        assert np.array_equal(got, expected[:len(got)])


def test_index_entries_give_each_documents_range_and_ordinal(shards, manifest, encoded, rows):
    _, _, ids = encoded
    for split in ("train", "val"):
        files = manifest["splits"][split]["files"]
        s = stream(shards, files)
        # within a shard the entries tile [0, num_tokens) in order
        for name in files:
            idx = read_index((shards / name).with_suffix(".idx"))
            ends = idx["start"] + idx["length"]
            assert idx["start"][0] == 0 and ends[-1] == read_header(shards / name).num_tokens
            assert np.array_equal(idx["start"][1:], ends[:-1]) and (idx["length"] > 0).all()
        entries = global_entries(shards, files)
        seen: dict[int, list[np.ndarray]] = defaultdict(list)
        for gstart, length, doc, _, _ in entries:
            assert rows[doc]["split"] == split
            seen[doc].append(s[gstart:gstart + length])
        order = [doc for _, _, doc, _, _ in entries]
        assert order == sorted(order)  # documents appear in manifest order
        members = [i for i, m in enumerate(rows) if m["split"] == split]
        pos = 0
        for i in members:  # each document's pieces are exactly its tokens, cut only by the dropped tail
            n = len(ids[i])
            covered = max(0, min(n, len(s) - pos))
            got = np.concatenate(seen[i]) if seen[i] else np.zeros(0, dtype=np.int64)
            assert len(got) == covered and np.array_equal(got, ids[i][:covered]), f"doc {i}"
            pos += n
        # split_documents counts the documents that cross a sample boundary
        L, pos, crossing = manifest["sample_len"], 0, 0
        for i in members:
            crossing += pos // L != (pos + len(ids[i]) - 1) // L
            pos += len(ids[i])
        assert manifest["splits"][split]["split_documents"] == crossing


# --- provenance -------------------------------------------------------------------------------------------

def read_member(source: str, offset: int, length: int) -> bytes:
    with open(source, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    d = zlib.decompressobj(31)
    data = d.decompress(raw)
    assert d.eof and d.unused_data == b"", "the (offset, length) range is not exactly one gzip member"
    return data


def warc_headers(record: bytes) -> dict[str, str]:
    head = record.split(b"\r\n\r\n", 1)[0].decode("utf-8")
    lines = head.split("\r\n")
    assert lines[0].startswith("WARC/")
    return dict(line.split(": ", 1) for line in lines[1:])


def test_token_position_traces_back_to_the_warc_record(shards, manifest, encoded, rows):
    docs, tok, ids = encoded
    files = manifest["splits"]["train"]["files"]
    s = stream(shards, files)
    entries = global_entries(shards, files)
    starts = np.array([e[0] for e in entries])
    rng = random.Random(1234)
    positions = [0, len(s) - 1, len(s) // 2] + [rng.randrange(len(s)) for _ in range(5)]
    for pos in positions:
        k = int(np.searchsorted(starts, pos, side="right") - 1)
        gstart, length, doc, shard, local = entries[k]
        assert gstart <= pos < gstart + length
        # the entry as stored in that shard's .idx covers the position within that shard
        idx = read_index((shards / files[shard]).with_suffix(".idx"))
        assert any(e["start"] == local and e["length"] == length and e["doc"] == doc for e in idx)
        meta = rows[doc]
        record = read_member(meta["source"], meta["offset"], meta["length"])
        h = warc_headers(record)
        assert h["WARC-Type"] == "response"
        assert h["WARC-Target-URI"] == meta["url"]
        assert h["WARC-Record-ID"] == f"<urn:uuid:{meta['id']}>"
        # the token at pos is that document's token, and the range decodes to a piece of its text
        before = sum(e[1] for e in entries[:k] if e[2] == doc)
        assert s[pos] == ids[doc][before + pos - gstart]
        piece = tok.decode([int(t) for t in s[gstart:gstart + length] if t != manifest["eos_id"]])
        piece = piece.strip("\ufffd")  # a cut at a shard boundary may split a multi-byte character
        assert len(piece) > 0 and piece in docs[doc]["text"]


def test_provenance_of_a_val_document(shards, manifest, rows):
    files = manifest["splits"]["val"]["files"]
    gstart, length, doc, _, _ = global_entries(shards, files)[0]
    meta = rows[doc]
    assert meta["split"] == "val"
    h = warc_headers(read_member(meta["source"], meta["offset"], meta["length"]))
    assert h["WARC-Target-URI"] == meta["url"]


# --- a small pack: many shards, entries straddling boundaries --------------------------------------------

def test_small_pack_splits_entries_across_shard_boundaries(prepared, tmp_path):
    tok_dir = prepared.out / "tokenizer"
    tok = load_tokenizer(tok_dir)
    eos = eos_id(tok)
    rng = random.Random(5)
    words = "the kiln packs tokens into shards; 東京 café 🙂 straddle boundary".split()
    docs = [{"id": f"doc{i}", "text": " ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 5, 9, 40])))}
            for i in range(40)]
    docs.append({"id": "long", "text": " ".join(words * 12)})  # longer than several shards
    docs.append({"id": "empty", "text": ""})  # just EOS
    cfg = PackConfig(seq_len=7, val_fraction=0.0, samples_per_shard=3, batch_docs=5)
    L, per_shard = 8, 24
    m = pack(docs, tok_dir, tmp_path / "small", cfg)
    out = tmp_path / "small"
    assert verify_shards(out) == read_manifest(out)
    info = m["splits"]["train"]
    assert m["splits"]["val"] == {"files": [], "tokens": 0, "samples": 0, "documents": 0, "dropped_tail_tokens": 0,
                                  "split_documents": 0, "pad_tokens": 0}
    ids = [np.array(tok.encode(d["text"], add_special_tokens=False).ids + [eos]) for d in docs]
    total = sum(map(len, ids))
    assert info["tokens"] == (total // L) * L and info["dropped_tail_tokens"] == total % L
    assert len(info["files"]) == -(-info["tokens"] // per_shard) >= 5
    sizes = [read_header(out / f).num_tokens for f in info["files"]]
    assert all(n == per_shard for n in sizes[:-1]) and 0 < sizes[-1] <= per_shard and sizes[-1] % L == 0

    s = stream(out, info["files"])
    entries = global_entries(out, info["files"])
    pieces: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for gstart, length, doc, shard, local in entries:
        pieces[doc].append((gstart, length, shard, local))
    straddling = 0
    pos = 0
    for i, t in enumerate(ids):
        covered = max(0, min(len(t), info["tokens"] - pos))
        ps = pieces.get(i, [])
        assert sum(p[1] for p in ps) == covered, f"doc {i}: pieces {ps}, {covered} tokens packed"
        if covered:
            assert np.array_equal(np.concatenate([s[g:g + n] for g, n, _, _ in ps]), t[:covered])
            assert ps[0][0] == pos
        for (g0, n0, k0, _), (g1, n1, k1, l1) in zip(ps, ps[1:]):
            # a later piece starts at the very beginning of the next shard, right where the last one ended
            assert k1 == k0 + 1 and l1 == 0 and g1 == g0 + n0
            assert g1 % per_shard == 0
        straddling += len(ps) > 1
        pos += len(t)
    assert straddling >= 3
    assert len(pieces[len(docs) - 2]) >= 3  # the long document spans at least three shards
    by_id = {r["id"]: r for r in provenance_rows(out, m)}
    assert ("empty" in by_id) == (covered > 0)  # a row where its one token (EOS) landed; none in the dropped tail
    assert by_id["long"]["tokens"] == len(ids[-2]) and by_id.get("empty", {"tokens": 1})["tokens"] == 1


# --- best-fit packing ------------------------------------------------------------------------------------

def doc_pieces(folder: Path, files: list[str]) -> dict[int, list[tuple[int, int]]]:
    """Each document's (global start, length) pieces, in stream order."""
    pieces: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for gstart, length, doc, _, _ in global_entries(folder, files):
        pieces[doc].append((gstart, length))
    return pieces


BEST_FIT = PackConfig(seq_len=8191, val_fraction=0.1, samples_per_shard=8, mode="best_fit", best_fit_window=16)


@pytest.fixture(scope="module")
def best_fit(prepared, encoded, tmp_path_factory):
    """The sample packed best-fit into samples of 8192 tokens (most of its documents are shorter)."""
    folder = tmp_path_factory.mktemp("bestfit") / "shards"
    return folder, pack(encoded[0], prepared.out / "tokenizer", folder, BEST_FIT)


def concat_split_documents(lengths: list[int], L: int) -> int:
    pos = crossing = 0
    for n in lengths:
        crossing += pos // L != (pos + n - 1) // L
        pos += n
    return crossing


def test_best_fit_splits_fewer_documents_than_concat(best_fit, encoded):
    _, _, ids = encoded
    folder, m = best_fit
    L = m["sample_len"]
    assert m["mode"] == "best_fit"
    concat = 0
    for split in ("train", "val"):
        members = [i for i, d in enumerate(provenance_rows(folder, m)) if d["split"] == split]
        longer = sum(len(ids[i]) > L for i in members)
        assert m["splits"][split]["split_documents"] == longer  # only documents that cannot fit one sample
        assert m["splits"][split]["dropped_tail_tokens"] == 0
        concat += concat_split_documents([len(ids[i]) for i in members], L)
    assert m["split_documents"] == sum(s["split_documents"] for s in m["splits"].values())
    assert m["split_documents"] + 20 < concat, (m["split_documents"], concat)  # concat also splits short ones
    assert verify_shards(folder) == read_manifest(folder)


def test_best_fit_keeps_every_document_whole_in_order_and_counts_padding(best_fit, encoded):
    _, _, ids = encoded
    folder, m = best_fit
    L, pad = m["sample_len"], m["pad_id"]
    assert pad == 2 and m["eos_id"] == 1
    waste = 0
    for split in ("train", "val"):
        files = m["splits"][split]["files"]
        s = stream(folder, files)
        pieces = doc_pieces(folder, files)
        covered = np.zeros(len(s), dtype=bool)
        for i, d in enumerate(provenance_rows(folder, m)):
            if d["split"] != split:
                continue
            ps = pieces[i]
            assert np.array_equal(np.concatenate([s[g:g + n] for g, n in ps]), ids[i]), f"doc {i}"
            assert all(g1 > g0 for (g0, _), (g1, _) in zip(ps, ps[1:]))  # its pieces come in order
            if len(ids[i]) <= L:  # a short document sits inside one sample
                (g, n), = ps
                assert g // L == (g + n - 1) // L
            for g, n in ps:
                covered[g:g + n] = True
        assert (s[~covered] == pad).all()
        assert int((~covered).sum()) == m["splits"][split]["pad_tokens"]
        waste += int((~covered).sum())
    tokens = sum(v["tokens"] for v in m["splits"].values())
    assert m["packing_efficiency"] == round((tokens - waste) / tokens, 6)
    assert 0.5 < m["packing_efficiency"] < 1


def test_best_fit_packer_decisions():
    from kiln.shards.packing import BestFitPacker

    p = BestFitPacker(sample_len=10, window=100, pad_id=0)
    chunks = []
    for doc, n in enumerate([6, 4, 3, 7, 25, 2]):
        chunks += p.add(np.full(n, doc + 1, dtype=np.uint16), doc)
    assert [len(t) for t, _ in chunks] == [20]  # the 25-token document's two whole samples, at once
    assert chunks[0][1] == [(0, 10, 4), (10, 10, 4)]
    (tokens, entries), = p.finish()
    # longest first, each into the fullest sample it fits: [7,3] [6,4] [5,2]
    assert tokens.reshape(-1, 10).tolist() == [[3] * 3 + [4] * 7, [1] * 6 + [2] * 4, [5] * 5 + [6] * 2 + [0] * 3]
    assert p.pad_tokens == 3 and p.split_documents == 1
    assert p.finish() == []


# --- parallel encoding --------------------------------------------------------------------------------

def test_two_encoding_processes_give_byte_identical_shards(prepared, encoded, tmp_path, capsys):
    docs = encoded[0][:40]
    made = {}
    for workers in (1, 2):  # best_fit: the packing decisions are deterministic too
        cfg = BEST_FIT.model_copy(update={"seq_len": 1023, "batch_docs": 4, "workers": workers})
        made[workers] = pack(docs, prepared.out / "tokenizer", tmp_path / f"w{workers}", cfg, progress=workers == 2)
    assert made[1]["files"] == made[2]["files"]
    assert provenance_rows(tmp_path / "w1", made[1]) == provenance_rows(tmp_path / "w2", made[2])
    assert len(made[1]["files"]) >= 4
    err = capsys.readouterr().err
    assert "pack: 40 documents" in err and "MB of text" in err


def _rayon_threads() -> str | None:
    return os.environ.get("RAYON_NUM_THREADS")


def test_encoding_workers_pin_the_tokenizer_threads_by_the_name_rayon_reads(prepared, monkeypatch):
    # rayon ignores RAYON_RS_NUM_THREADS: with it, each worker ran a pool of every core and two workers
    # encoded slower than one process (BENCHMARKS.md, Encoding)
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from kiln.shards.encode import _init_worker

    monkeypatch.setenv("RAYON_NUM_THREADS", "7")  # a user's setting must not leak into the workers
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(str(prepared.out / "tokenizer" / "tokenizer.json"), 1)) as pool:
        assert pool.submit(_rayon_threads).result() == "1"


# --- kiln shards inspect --------------------------------------------------------------------------------

def test_cli_inspect_names_the_documents_of_a_sequence(shards, manifest, capsys, rows):
    files = manifest["splits"]["train"]["files"]
    L = manifest["sample_len"]
    entries = global_entries(shards, files)
    # a sample where one document ends and the next begins
    boundary = next(g for g, _, _, _, _ in entries[1:] if g % L)
    at = boundary // L
    expected = [e for e in entries if e[0] < (at + 1) * L and e[0] + e[1] > at * L]
    assert len(expected) >= 2
    assert cli_main(["shards", "inspect", str(shards), "--at", str(at)]) == 0
    out = capsys.readouterr().out
    first_shard = read_header(shards / files[0]).num_tokens // L
    assert f"train sequence {at} of {manifest['splits']['train']['samples']}" in out.splitlines()[0]
    if at < first_shard:
        assert out.splitlines()[0].endswith(f"train/00000.bin tokens {at * L}..{(at + 1) * L}")
    for gstart, length, doc, _, _ in expected:
        meta = rows[doc]
        assert f"url {meta['url']}" in out
        assert f"source {meta['source']} offset {meta['offset']} length {meta['length']}" in out
        assert f"(id {meta['id']})" in out
    assert cli_main(["shards", "inspect", str(shards), "--at", str(at), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [p["doc"] for p in info["pieces"]] == [e[2] for e in expected]
    tokens = stream(shards, files)[at * L:(at + 1) * L]
    assert info["tokens"] == tokens.tolist()
    first = info["pieces"][0]
    assert first["sample_tokens"][0] == 0 and info["pieces"][-1]["sample_tokens"][1] == L
    # each piece's place in its document: (concat) its pieces are contiguous in the split's stream
    first_start = {doc: min(g for g, _, d, _, _ in entries if d == doc) for _, _, doc, _, _ in expected}
    for piece, (gstart, length, doc, _, _) in zip(info["pieces"], expected):
        lo, hi = max(gstart, at * L), min(gstart + length, (at + 1) * L)
        assert piece["sample_tokens"] == [lo - at * L, hi - at * L]
        assert piece["doc_tokens"] == [lo - first_start[doc], hi - first_start[doc]]
    assert info["text"] == load_tokenizer(shards.parent / "tokenizer").decode(
        tokens.tolist(), skip_special_tokens=False
    )
    assert "<|eos|>" in info["text"]


def test_cli_inspect_bad_index_or_tokenizer(shards, manifest, tmp_path, capsys):
    n = manifest["splits"]["val"]["samples"]
    assert cli_main(["shards", "inspect", str(shards), "--at", str(n), "--split", "val"]) == 2
    assert f"--at must be 0..{n - 1}" in capsys.readouterr().err
    other = tmp_path / "tok.json"
    other.write_text((shards.parent / "tokenizer" / "tokenizer.json").read_text().replace("<|pad|>", "<|pda|>"))
    assert cli_main(["shards", "inspect", str(shards), "--at", "0", "--tokenizer", str(other)]) == 2
    assert "not the tokenizer these shards were encoded with" in capsys.readouterr().err


def test_cli_inspect_names_a_folder_that_is_not_a_tokenizer(shards, prepared, capsys):
    """Issue 45 item 11: --tokenizer naming a docs folder (a Kiln folder of another stage) says just that, not that
    the folder was changed after Kiln wrote it."""
    docs = prepared.out / "docs"
    assert cli_main(["shards", "inspect", str(shards), "--at", "0", "--tokenizer", str(docs)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"kiln: error: {docs} is not a tokenizer folder: it holds a `kiln data` output, with no tokenizer.json; "
        "pass a tokenizer folder ({out_dir}/tokenizer), a checkpoint folder or a tokenizer.json"]


def test_cli_inspect_best_fit_shows_padding(best_fit, prepared, capsys):
    folder, m = best_fit
    L = m["sample_len"]
    files = m["splits"]["train"]["files"]
    s = stream(folder, files)
    at = next(i for i in range(len(s) // L) if s[(i + 1) * L - 1] == m["pad_id"])
    assert (
        cli_main(["shards", "inspect", str(folder), "--at", str(at), "--tokenizer", str(prepared.out / "tokenizer")])
        == 0
    )
    out = capsys.readouterr().out
    assert f"..{L}: padding" not in out and f"-{L}: padding" in out


def test_overlapping_index_entries_fail_verification(copy, manifest):
    name = manifest["splits"]["train"]["files"][0][:-4] + ".idx"
    raw = bytearray((copy / name).read_bytes())
    second = IDX_HEADER.size + IDX_ENTRY.itemsize
    struct.pack_into("<Q", raw, second, struct.unpack_from("<Q", raw, second)[0] - 1)  # starts inside the first entry
    (copy / name).write_bytes(bytes(raw))
    rehash(copy, name)
    with pytest.raises(IntegrityError, match="overlap") as info:
        verify_shards(copy)
    assert str(copy / name) in str(info.value)


def test_pack_streams_its_documents(prepared, tmp_path):
    """Python memory while packing 500 and 4,000 documents from a generator: about the same, not 8x."""
    import tracemalloc

    def corpus(n):
        for i in range(n):
            yield {"id": f"d{i}", "text": f"kiln shard {i} " * 8, "source": "s.jsonl", "offset": i, "length": 40}

    cfg = PackConfig(seq_len=127, val_fraction=0.1, samples_per_shard=64)
    peaks = {}
    for n in (500, 4_000):
        tracemalloc.start()
        try:
            m = pack(corpus(n), prepared.out / "tokenizer", tmp_path / str(n), cfg)
            peaks[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert m["documents"] == n
    assert peaks[4_000] < 1.5 * peaks[500], peaks


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_split_writer_streams_shards_and_holds_less_than_a_sample_whatever_the_shard_size(tmp_path, mode):
    """The writer keeps less than one sample of tokens between documents and only the provenance of
    documents not fully written, however large a shard is (the old writer buffered a whole shard, so a
    realistic pack.samples_per_shard made pack's memory grow with the corpus until a shard filled).
    Its files are those of the stream cut into whole samples and shards."""
    from kiln.config import PackConfig
    from kiln.shards.format import ShardHeader, read_header, read_index, read_tokens
    from kiln.shards.packing import make_packer
    from kiln.shards.provenance import read_rows, side_file
    from kiln.shards.writer import SplitWriter

    L, rng = 33, np.random.default_rng(0)
    cfg = PackConfig(seq_len=L - 1, samples_per_shard=40, mode=mode, best_fit_window=4)
    header = ShardHeader(2, 1000, L, 0, "ab" * 32)
    w = SplitWriter(tmp_path, "train", header, cfg.samples_per_shard, make_packer(cfg, pad_id=999))
    docs = [rng.integers(0, 990, int(rng.integers(1, 3 * L))).astype(np.uint16) for _ in range(600)]
    held = 0
    for k, ids in enumerate(docs):
        w.add(ids, k, {"id": f"d{k}"})
        held = max(held, w.buffered)
        in_held = {doc for _, _, doc, _ in w.held_pieces}
        if mode == "concat":  # provenance kept only for the documents whose tokens are held
            assert set(w.pending) <= in_held | {k}
        else:  # ... or in the packer's window (each of its pieces at least one token)
            assert set(w.pending) <= in_held | {doc for _, doc in w.packer.pieces}
    info = w.close()
    assert held < L, held  # the old writer held up to samples_per_shard * L = 1,320 tokens
    assert len(info["files"]) > 3
    stream = np.concatenate([read_tokens(tmp_path / f) for f in info["files"]])
    assert len(stream) == info["tokens"] == info["samples"] * L
    for f in info["files"][:-1]:
        assert read_header(tmp_path / f).num_tokens == cfg.samples_per_shard * L
    if mode == "concat":
        whole = np.concatenate(docs)
        assert np.array_equal(stream, whole[:len(stream)]) and info["dropped_tail_tokens"] == len(whole) - len(stream)
    pieces: dict[int, list[np.ndarray]] = {}
    for f in info["files"]:
        tokens, rows = read_tokens(tmp_path / f), read_rows(tmp_path / side_file(f))
        entries = read_index(tmp_path / f.replace(".bin", ".idx"))
        assert list(rows) == list(dict.fromkeys(int(d) for d in entries["doc"]))  # a row per document, in order
        for e in entries:
            pieces.setdefault(int(e["doc"]), []).append(tokens[int(e["start"]):int(e["start"]) + int(e["length"])])
            assert rows[int(e["doc"])]["tokens"] == len(docs[int(e["doc"])])
    for k, got in pieces.items():  # every document's pieces, in order, are its tokens (the tail's last cut short)
        joined = np.concatenate(got)
        assert np.array_equal(joined, docs[k][:len(joined)])
        if mode == "concat" and k < max(pieces):
            assert len(joined) == len(docs[k])
