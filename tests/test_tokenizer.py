"""Tokenizer stage: training, the lossless round trip, special tokens, seeded sampling, load errors, manifest.

Covered (all with the real HF `tokenizers` library, trained into tmp folders):
- decode(encode(text)) == text for arbitrary Unicode (hypothesis: CJK, emoji,
  control characters, whitespace runs, mixed scripts), single texts and batches;
- a lone surrogate cannot cross into Rust: `encode` raises TypeError, never garbage;
- <|bos|>, <|eos|>, <|pad|> exist with ids 0, 1, 2; `eos_id` returns 1;
- the training sample is seeded: same seed -> same training_docs.txt and
  byte-identical tokenizer.json; another seed (max_docs < corpus) -> another sample;
  the reservoir sample is a duplicate-free subset of the corpus of size max_docs;
- load_tokenizer: folder and file paths, missing path and invalid JSON -> KilnError;
- the manifest lists every file with its sha256 and verifies; tampering is caught;
- text that spells a special token (e.g. "<|eos|>") stays text: lossless, and it
  never injects the real EOS id;
- `tokenizer.added_tokens` domain terms (ASCII, CJK, with a space) are one token each
  wherever they appear, still lossless, listed in the manifest; an empty term is refused;
- tokenizer.json loads in `transformers.PreTrainedTokenizerFast(tokenizer_file=...)`,
  which encodes to the same ids and decodes to the same text (hypothesis), added terms included.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.config import TokenizerConfig
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import read_manifest, sha256_file, verify_folder
from kiln.tokenizer import (
    BOS, EOS, PAD, SPECIAL_TOKENS, TOKENIZER_FILE, eos_id, load_tokenizer, sample_documents,
    tokenizer_sha256, train_tokenizer,
)

WORDS = ("the quick brown fox jumps over the lazy dog while 東京 の 天気 は 晴れ です and "
         "naïve café façade Ωμέγα 🙂🚀 data pipelines tokenise text into bytes").split()


def make_corpus(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"doc-{i:04d}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + f" #{i}\n"}
            for i in range(n)]


CORPUS = make_corpus(60)
CFG = TokenizerConfig(vocab_size=400, max_docs=1000, min_frequency=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tok = train_tokenizer(CORPUS, out, CFG, seed=3, fingerprint="fp-test")
    return out, tok


# --- lossless round trip ----------------------------------------------------------------------

CJK = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF)
EMOJI = st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF)
CONTROL = st.characters(min_codepoint=0x00, max_codepoint=0x1F) | st.characters(min_codepoint=0x7F, max_codepoint=0x9F)
WHITESPACE = st.sampled_from([" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2028", "\u200b", "\x0b", "\x0c"])
PIECES = st.one_of(
    st.text(),  # arbitrary Unicode (hypothesis excludes lone surrogates by default)
    st.text(CJK, min_size=1),
    st.text(EMOJI, min_size=1),
    st.text(CONTROL, min_size=1),
    WHITESPACE.flatmap(lambda w: st.integers(1, 12).map(lambda n: w * n)),  # whitespace runs
    st.sampled_from(["\u0301", "e\u0301", "👨‍👩‍👧", "🇩🇪", "\ufeff", "\U0010ffff", "\ufffd", "ﬁ", "Å"]),
)
TEXTS = st.lists(PIECES, max_size=8).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_round_trip_is_lossless(trained, text):
    _, tok = trained
    ids = tok.encode(text, add_special_tokens=False).ids
    assert all(0 <= i < tok.get_vocab_size() for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert (len(ids) == 0) == (text == "")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXTS, max_size=6))
def test_batch_encoding_matches_single_and_round_trips(trained, texts):
    _, tok = trained
    batch = tok.encode_batch(texts, add_special_tokens=False)
    assert [e.ids for e in batch] == [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert tok.decode_batch([e.ids for e in batch]) == texts


def test_round_trip_known_strings_after_reload(trained):
    out, tok = trained
    loaded = load_tokenizer(out)
    for text in ["", " ", "   leading and trailing   ", "a\x00b\x01\x1f\x7f", "\r\n\r\n\t\t",
                 "日本語のテキスト", "🙂🚀👨‍👩‍👧🇩🇪", "e\u0301 vs é", "\U0010ffff\ufeff"]:
        ids = loaded.encode(text, add_special_tokens=False).ids
        assert ids == tok.encode(text, add_special_tokens=False).ids
        assert loaded.decode(ids) == text


def test_lone_surrogate_raises_type_error_not_garbage(trained):
    _, tok = trained
    for bad in ["\ud800", "ok \udfff ok", "\ud83d"]:  # half of a surrogate pair
        with pytest.raises(TypeError):
            tok.encode(bad, add_special_tokens=False)
        with pytest.raises(TypeError):
            tok.encode_batch(["fine", bad], add_special_tokens=False)
    # the tokenizer still works afterwards (nothing was corrupted by the failed call)
    assert tok.decode(tok.encode("still fine 🙂").ids) == "still fine 🙂"


def test_text_spelling_a_special_token_is_lossless_and_not_injected(trained):
    _, tok = trained
    for text in ["a<|eos|>b", "<|bos|>", "x <|pad|> y"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert not {0, 1, 2} & set(ids), f"{text!r} encoded to a special token id: {ids}"
        assert tok.decode(ids) == text


# --- special tokens ------------------------------------------------------------------------------

def test_special_tokens_have_ids_0_1_2(trained):
    out, tok = trained
    assert SPECIAL_TOKENS == [BOS, EOS, PAD] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    for t in (tok, load_tokenizer(out)):
        assert [t.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2]
        assert [t.id_to_token(i) for i in (0, 1, 2)] == SPECIAL_TOKENS
        assert eos_id(t) == 1
    added = json.loads((out / TOKENIZER_FILE).read_text())["added_tokens"]
    assert [(a["id"], a["content"], a["special"]) for a in added] == [(0, BOS, True), (1, EOS, True), (2, PAD, True)]
    assert 300 <= tok.get_vocab_size() <= CFG.vocab_size


def test_eos_id_missing_raises_kiln_error():
    from tokenizers import Tokenizer, models
    with pytest.raises(KilnError, match="<\\|eos\\|>"):
        eos_id(Tokenizer(models.BPE()))


# --- seeded sample ------------------------------------------------------------------------------

def test_sample_documents_is_a_seeded_reservoir():
    docs = make_corpus(50)
    a = sample_documents(docs, 10, seed=1)
    assert [d["id"] for d in a] == [d["id"] for d in sample_documents(iter(docs), 10, seed=1)]
    ids = [d["id"] for d in a]
    assert len(ids) == 10 == len(set(ids)) and set(ids) <= {d["id"] for d in docs}
    assert [d["id"] for d in sample_documents(docs, 10, seed=2)] != ids
    assert sample_documents(docs, 100, seed=1) == docs  # fewer docs than max_docs: all of them, in order
    assert sample_documents([], 5, seed=1) == []


def test_sample_memory_is_bounded_by_max_docs_not_the_corpus():
    import tracemalloc

    def corpus(n):  # 60 MB of text, made as it is read
        for i in range(n):
            yield {"id": f"d{i}", "text": f"{i} " + "x" * 2000}

    tracemalloc.start()
    try:
        sample = sample_documents(corpus(30_000), 20, seed=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(sample) == 20 and peak < 1_000_000, peak  # ~20 documents' worth, not 60 MB


def test_same_seed_gives_identical_sample_and_tokenizer_bytes(tmp_path):
    corpus = make_corpus(40, seed=5)
    cfg = TokenizerConfig(vocab_size=350, max_docs=15)
    train_tokenizer(corpus, tmp_path / "a", cfg, seed=11)
    train_tokenizer(iter([dict(d) for d in corpus]), tmp_path / "b", cfg, seed=11)
    train_tokenizer(corpus, tmp_path / "c", cfg, seed=12)
    lines = {k: (tmp_path / k / "training_docs.txt").read_text().splitlines() for k in "abc"}
    assert lines["a"] == lines["b"] == [d["id"] for d in sample_documents(corpus, 15, 11)]
    assert len(lines["a"]) == 15
    assert (tmp_path / "a" / TOKENIZER_FILE).read_bytes() == (tmp_path / "b" / TOKENIZER_FILE).read_bytes()
    assert tokenizer_sha256(tmp_path / "a") == tokenizer_sha256(tmp_path / "b" / TOKENIZER_FILE)
    # a different seed with max_docs < corpus size draws a different sample
    assert lines["c"] != lines["a"] and len(lines["c"]) == 15
    assert read_manifest(tmp_path / "c")["seed"] == 12


def test_training_on_no_documents_raises_kiln_error(tmp_path):
    with pytest.raises(KilnError, match="no documents"):
        train_tokenizer([], tmp_path / "t", CFG, seed=0)
    assert not (tmp_path / "t").exists()


# --- loading -----------------------------------------------------------------------------------

def test_load_tokenizer_missing_path_raises_kiln_error(tmp_path):
    with pytest.raises(KilnError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "does-not-exist")
    with pytest.raises(KilnError, match="no tokenizer at"):
        load_tokenizer(tmp_path)  # an existing folder without tokenizer.json


def test_load_tokenizer_invalid_json_raises_kiln_error(tmp_path):
    bad = tmp_path / TOKENIZER_FILE
    bad.write_text("{ not json")
    with pytest.raises(KilnError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_load_from_file_or_folder_gives_same_tokenizer(trained):
    out, tok = trained
    text = "the quick brown 東京 🙂"
    a = load_tokenizer(out).encode(text).ids
    b = load_tokenizer(out / TOKENIZER_FILE).encode(text).ids
    assert a == b == tok.encode(text).ids


# --- manifest ----------------------------------------------------------------------------------

def test_manifest_verifies_and_describes_the_tokenizer(trained):
    out, tok = trained
    m = verify_folder(out)
    assert m["stage"] == "tokenizer" and m["fingerprint"] == "fp-test" and m["seed"] == 3
    assert m["vocab_size"] == tok.get_vocab_size()
    assert m["special_tokens"] == SPECIAL_TOKENS
    assert m["training_docs"] == len(CORPUS)
    assert set(m["files"]) == {TOKENIZER_FILE, "training_docs.txt"}
    for name, meta in m["files"].items():
        assert meta["size"] == (out / name).stat().st_size
        assert meta["sha256"] == sha256_file(out / name)
    assert m["files"][TOKENIZER_FILE]["sha256"] == tokenizer_sha256(out)
    assert (out / "training_docs.txt").read_text() == "".join(d["id"] + "\n" for d in CORPUS)
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]  # staging folder renamed away


def test_tampered_tokenizer_fails_verification(trained, tmp_path):
    out, _ = trained
    copy = tmp_path / "tok"
    shutil.copytree(out, copy)
    raw = bytearray((copy / TOKENIZER_FILE).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (copy / TOKENIZER_FILE).write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="tokenizer.json"):
        verify_folder(copy)
    verify_folder(out)  # the original is untouched


# --- domain terms and transformers ------------------------------------------------------------------

TERMS = ["Kubernetes", "東京都庁", " spaced term"]


@pytest.fixture(scope="module")
def with_terms(tmp_path_factory):
    out = tmp_path_factory.mktemp("terms") / "tokenizer"
    cfg = TokenizerConfig(vocab_size=400, max_docs=1000, min_frequency=2, added_tokens=TERMS)
    return out, train_tokenizer(CORPUS, out, cfg, seed=3)


def test_added_tokens_are_kept_whole_and_lossless(with_terms, trained):
    out, tok = with_terms
    _, plain = trained
    ids = {t: tok.token_to_id(t) for t in TERMS}
    assert None not in ids.values() and len(set(ids.values())) == 3
    assert tok.get_vocab_size() == plain.get_vocab_size() + 3  # after the trained vocabulary
    text = "We run Kubernetes near 東京都庁; a spaced term, Kubernetesish, and 東京 alone."
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.ids.count(ids["Kubernetes"]) == 2 and enc.ids.count(ids["東京都庁"]) == 1
    assert enc.ids.count(ids[" spaced term"]) == 1
    assert len(plain.encode("Kubernetes", add_special_tokens=False).ids) > 1  # without the term it is split
    assert tok.decode(enc.ids) == text
    reloaded = load_tokenizer(out)
    assert reloaded.encode(text, add_special_tokens=False).ids == enc.ids
    assert read_manifest(out)["added_tokens"] == TERMS


def test_empty_or_special_added_token_is_refused(tmp_path):
    for bad in ["", "<|eos|>"]:
        with pytest.raises(KilnError, match="tokenizer.added_tokens"):
            train_tokenizer(CORPUS, tmp_path / "t", TokenizerConfig(vocab_size=400, added_tokens=["ok", bad]), seed=0)
    assert not (tmp_path / "t").exists()


NO_SPECIAL_SPELLING = TEXTS.filter(lambda t: "<|" not in t)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=NO_SPECIAL_SPELLING)
def test_transformers_fast_tokenizer_gives_the_same_ids_and_text(with_terms, text):
    from transformers import PreTrainedTokenizerFast

    out, tok = with_terms
    hf = _hf(out)
    assert isinstance(hf, PreTrainedTokenizerFast)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert hf.encode(text, add_special_tokens=False) == ids
    assert hf.decode(ids, clean_up_tokenization_spaces=False) == text


def test_transformers_sees_the_special_tokens_and_terms(with_terms):
    out, tok = with_terms
    hf = _hf(out)
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert len(hf) == tok.get_vocab_size()
    text = "Kubernetes at 東京都庁 🙂"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids
    assert hf.convert_ids_to_tokens(hf.encode("Kubernetes", add_special_tokens=False)) == ["Kubernetes"]


_HF_CACHE: dict = {}


def _hf(out: Path):
    from transformers import PreTrainedTokenizerFast

    if out not in _HF_CACHE:
        _HF_CACHE[out] = PreTrainedTokenizerFast(tokenizer_file=str(out / TOKENIZER_FILE))
    return _HF_CACHE[out]


def test_kiln_tokenizer_train_honours_tokenizer_path_as_kiln_run_does(prepared, tmp_path, capsys):
    """`-- tokenizer.path=MY.json` commits the user's tokenizer byte for byte (nothing is trained); a file that is
    not a tokenizer (/etc/passwd, say) is a one-line error, not a freshly trained BPE."""
    from kiln.cli import main

    mine = tmp_path / "mine" / "tokenizer.json"
    mine.parent.mkdir()
    mine.write_bytes((prepared.out / "tokenizer" / "tokenizer.json").read_bytes())
    docs, out = str(prepared.out / "docs"), tmp_path / "tok"
    assert main(["tokenizer", "train", docs, "--out", str(out), "--", f"tokenizer.path={mine}"]) == 0
    assert (out / "tokenizer.json").read_bytes() == mine.read_bytes()
    assert read_manifest(out)["source"] == str(mine) and "training_docs" not in read_manifest(out)
    capsys.readouterr()
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    assert main(["tokenizer", "train", docs, "--out", str(tmp_path / "tok2"), "--", f"tokenizer.path={passwd}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kiln: error: {passwd}: not a valid tokenizer.json") and "\n" not in err
    assert not (tmp_path / "tok2").exists()
