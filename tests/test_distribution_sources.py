"""The distribution gate on real sources (issue 16, item 6): `data.distribution.source_key` groups
documents into sources (input file, URL host, or a JSONL/Parquet field), the gate weights each source,
`kiln pack` packs down-weighted sources into their own shard groups, and the trainer's loader draws
from a drifting source its weight's share less. Real JSONL, real tokenizer, real shards and loader."""

from __future__ import annotations

import json
import pickle
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import tiny_config

from kiln.config import DataConfig, SourceConfig, build_config
from kiln.data.gates.distribution import NO_HOST, source_group
from kiln.data.docs import read_docs
from kiln.data.pipeline import run_data
from kiln.data.tables import table
from kiln.errors import ConfigError, KilnError
from kiln.ops.report import composition_table
from kiln.shards.reader import ShardSet
from kiln.train.data import open_splits
from kiln.train.loader import Loader

BASIC_GATES_ONLY = {name: {"enabled": False} for name in
                    ("gopher_quality", "gopher_repetition", "c4", "fineweb", "noise", "residue", "pii")}
EN = [
    "river", "garden", "harbour", "bridge", "market", "doctor", "farmer", "painter", "sailor", "village", "school",
    "church", "tower", "orchard", "kitchen", "window", "letter", "story", "song", "winter", "summer", "morning",
    "evening", "storm", "lantern", "wagon", "horse", "basket",
]
DE = [
    "Fluss", "Garten", "Hafen", "Brücke", "Markt", "Arzt", "Bauer", "Maler", "Seemann", "Dorf", "Schule", "Kirche",
    "Turm", "Obstgarten", "Küche", "Fenster", "Brief", "Geschichte", "Lied", "Winter", "Sommer", "Morgen", "Abend",
    "Sturm", "Laterne", "Wagen", "Pferd", "Korb",
]


def prose(seed: int, german: bool = False, sentences: int = 10) -> str:
    """Distinct plain prose per seed; English and German share no common word."""
    rng = random.Random(seed)
    nouns = DE if german else EN
    form = ("Der {} und die {} sahen den {} am {} im Jahr {}, und alle waren sehr froh darüber." if german else
            "The {} and the {} watched a {} by the {} in {}, and everyone was glad of it.")
    return " ".join(form.format(*rng.sample(nouns, 4), 1500 + rng.randrange(500)) for _ in range(sentences))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def data_cfg(**distribution) -> DataConfig:
    return DataConfig(min_chars=200, lang_threshold=0, quality=BASIC_GATES_ONLY, distribution=distribution)


# --- grouping ------------------------------------------------------------------------------------


def test_source_group_by_file_host_and_field():
    assert source_group("file", "a.jsonl", "https://x.org/p", "s1") == "a.jsonl"
    assert source_group("host", "a.jsonl", "https://Docs.Example.org:8443/p?q=1", None) == "docs.example.org"
    assert source_group("host", "a.jsonl", None, None) == NO_HOST
    assert source_group("host", "a.jsonl", "not a url", None) == NO_HOST
    assert source_group("field:site", "a.jsonl", "https://x.org/p", "forum") == "forum"
    assert source_group("field:site", "crawl.warc.gz", "https://x.org/p", None) == "crawl.warc.gz"  # WARC: no fields


def test_bad_source_key_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match="source_key must be file, host or field:NAME, got 'site'"):
        build_config({"out_dir": str(tmp_path), "data": {"distribution": {"source_key": "site"}}})
    with pytest.raises(ConfigError, match="source_key"):
        build_config({"out_dir": str(tmp_path), "data": {"distribution": {"source_key": "field:"}}})


@pytest.mark.parametrize("key, expected", [
    ("field:site", {"docs": 2, "forum": 1, "(no site)": 1}),
    ("host", {"a.example": 2, "b.example": 1, NO_HOST: 1}),
    ("file", None),  # today's behaviour: the input file
])
def test_kiln_data_groups_sources_by_source_key(tmp_path, key, expected):
    recs = [{"text": prose(1), "url": "https://a.example/1", "site": "docs"},
            {"text": prose(2), "url": "https://A.example/2", "site": "docs"},
            {"text": prose(3, german=True), "url": "https://b.example/3", "site": "forum"},
            {"text": prose(4)}]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    expected = expected or {str(src): 4}
    stats = run_data([str(src)], tmp_path / "docs", data_cfg(source_key=key))
    docs = list(read_docs(tmp_path / "docs"))
    assert Counter(d["source_group"] for d in docs) == expected
    assert {s: w["docs"] for s, w in table(tmp_path / "docs", "source_weights").items()} == expected
    by_source = table(tmp_path / "docs", "composition_by_source")
    assert {s: r["documents"] for s, r in by_source.items()} == expected
    for group in expected:  # characters: the kept texts of that source, exactly
        assert by_source[group]["chars"] == sum(len(d["text"]) for d in docs if d["source_group"] == group)
    by_lang = stats["composition"]["by_lang"]
    assert {lang: r["documents"] for lang, r in by_lang.items()} == {"en": 3, "de": 1}
    assert by_lang["en"]["char_share"] == round(by_lang["en"]["chars"] / sum(len(d["text"]) for d in docs), 4)


def test_parquet_field_groups_and_a_missing_column_is_one_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [prose(1), prose(2), prose(3)], "site": ["docs", None, "forum"]}), src)
    run_data([str(src)], tmp_path / "docs", data_cfg(source_key="field:site"))
    assert [d["source_group"] for d in read_docs(tmp_path / "docs")] == ["docs", "(no site)", "forum"]
    with pytest.raises(KilnError, match="none of the 3 kept documents has the field 'lang_code'"):  # no such column
        run_data([str(src)], tmp_path / "docs2", data_cfg(source_key="field:lang_code"))
    assert not (tmp_path / "docs2").exists()


@pytest.mark.parametrize("key, what", [("field:nosuch", "the field 'nosuch'"), ("host", "a URL (data.url_field)")])
def test_a_source_key_no_document_has_stops_instead_of_turning_the_gate_off(tmp_path, key, what):
    """A typo in the field's name (or `host` on records without URLs) would put every document in one source:
    the gate would compare the corpus with itself. One line names the key, nothing is committed."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": prose(i, german=i % 3 == 0)} for i in range(6)])
    with pytest.raises(KilnError) as err:
        run_data([str(src)], tmp_path / "docs", data_cfg(source_key=key))
    assert str(err.value) == (
        f"data.distribution.source_key={key}: none of the 6 kept documents has {what}, so they would all be one "
        "source and the distribution gate would do nothing; fix the key (file, host or field:NAME of a field the "
        "records have), or set data.distribution.enabled=false")
    assert not (tmp_path / "docs").exists()


def test_report_shows_the_composition_with_weights():
    stats = {"composition": {"by_source": {"forum": {"documents": 3, "chars": 900, "doc_share": 0.75,
                                                     "char_share": 0.9}},
                             "by_lang": {"de": {"documents": 3, "chars": 900, "doc_share": 1.0, "char_share": 1.0}}},
             "source_weights": {"forum": {"docs": 3, "z": 4.0, "weight": 0.75}}}
    table = composition_table(stats)
    assert "<h3>Corpus by source</h3>" in table and "<td>forum</td><td>3</td><td>900</td><td>0.7500</td>" \
        "<td>0.9000</td><td>0.7500</td>" in table
    assert "<h3>Corpus by language</h3>" in table and "<td>de</td>" in table
    assert composition_table({}) == ""


# --- end to end: kiln data + pack + the training loader ------------------------------------------


@pytest.fixture(scope="module")
def drifting_corpus(tmp_path_factory):
    """Three English sites of 60 documents and one German site of 8 (4% of the documents, so its
    top tokens sit more than 3 sigma from the corpus), through the data, tokenizer and pack stages."""
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage

    root = tmp_path_factory.mktemp("drift")
    recs = [{"id": f"{site}-{i}", "text": prose(1000 * k + i), "site": site}
            for k, site in enumerate(("alpha", "beta", "gamma"), 1) for i in range(60)]
    recs += [{"id": f"forum-{i}", "text": prose(9000 + i, german=True), "site": "forum"} for i in range(8)]
    random.Random(0).shuffle(recs)
    src = write_jsonl(root / "sites.jsonl", recs)
    cfg = tiny_config(root / "out", data={"lang_threshold": 0, "quality": BASIC_GATES_ONLY,
                                          "distribution": {"source_key": "field:site"}})
    cfg.data.inputs = [str(src)]

    def quiet(*_):
        return None

    stats = run_data_stage(cfg, quiet)
    run_tokenizer_stage(cfg, quiet)
    manifest = run_pack_stage(cfg, quiet)
    return cfg, stats, manifest


def test_a_drifting_source_is_packed_in_its_own_shard_group(drifting_corpus):
    cfg, stats, manifest = drifting_corpus
    weights = {s: w["weight"] for s, w in table(cfg.out / "docs", "source_weights").items()}
    assert weights["alpha"] == weights["beta"] == weights["gamma"] == 1.0
    assert 0 < weights["forum"] < 0.9
    groups = manifest["splits"]["train"]["groups"]
    assert [(g["group"], g["weight"]) for g in groups] == [(None, 1.0), ("forum", weights["forum"])]
    assert sum(g["samples"] for g in groups) == manifest["splits"]["train"]["samples"]
    assert [f for g in groups for f in g["files"]] == manifest["splits"]["train"]["files"]
    forum = ShardSet(cfg.out / "shards", "train", group=1)
    assert len(forum) == groups[1]["samples"] and forum.names[0].startswith("train/forum-")
    # every document of the forum is in its group, no other's (by the shards' provenance side files)
    from kiln.shards.provenance import read_rows, side_file

    def groups_in(files):
        return {row["source_group"] for f in files for row in read_rows(cfg.out / "shards" / side_file(f)).values()}

    assert groups_in(groups[0]["files"]) == {"alpha", "beta", "gamma"}
    assert groups_in(groups[1]["files"]) == {"forum"}


def test_the_trainer_draws_a_drifting_source_by_its_weight(drifting_corpus):
    """One epoch of the training loader: the forum's share of samples is its share of the shards'
    samples scaled by its weight (odds ratio = weight), not its share of documents."""
    cfg, stats, manifest = drifting_corpus
    weight = table(cfg.out / "docs", "source_weights")["forum"]["weight"]
    train, _ = open_splits(cfg, manifest["tokenizer_sha256"])
    groups = manifest["splits"]["train"]["groups"]
    # which group each sample row comes from, by its tokens (independent of how the Mixture numbers them)
    owner = {}
    for k in range(len(groups)):
        part = ShardSet(cfg.out / "shards", "train", group=k)
        for i in range(len(part)):
            owner[part.sample(i).tobytes()] = groups[k]["group"]
    loader = Loader(train, global_batch=1, micro_batch=1, rank=0, world=1, seed=cfg.seed)
    drawn = Counter()
    for _ in range(len(train)):  # exactly one epoch
        (batch,) = loader.next_batch()
        drawn[owner[batch[0].numpy().astype(np.dtype(part.sample(0).dtype)).tobytes()]] += 1
    n_forum, n_rest = groups[1]["samples"], groups[0]["samples"]
    total = n_forum + n_rest
    assert sum(drawn.values()) == total
    expected = weight * n_forum / (weight * n_forum + n_rest) * total
    assert abs(drawn["forum"] - expected) < 1  # largest-remainder rounding
    assert drawn["forum"] < n_forum  # without the weight it would be drawn n_forum times an epoch
    odds = (drawn["forum"] / drawn[None]) / (n_forum / n_rest)
    assert odds == pytest.approx(weight, abs=1.5 / drawn["forum"])
    doc_share = table(cfg.out / "docs", "composition_by_source")["forum"]["doc_share"]
    assert doc_share == round(8 / 188, 4)
    sample_share = drawn["forum"] / total
    print(f"forum: weight {weight}, doc share {doc_share}, shard-sample share {n_forum / total:.4f}, "
          f"drawn share {sample_share:.4f}")


def test_a_grouped_source_with_a_given_weight_keeps_it_in_total(drifting_corpus):
    """loader.sources weights 3 and 1 over the same grouped shards: 3/4 and 1/4 of the draws, each
    split between its groups by samples times group weight."""
    cfg, stats, manifest = drifting_corpus
    shards = str(cfg.out / "shards")
    run = cfg.model_copy(update={"loader": cfg.loader.model_copy(update={"sources": [
        SourceConfig(path=shards, weight=3.0), SourceConfig(path=shards, weight=1.0)]})})
    train, _ = open_splits(run, manifest["tokenizer_sha256"])
    w = table(cfg.out / "docs", "source_weights")["forum"]["weight"]
    n_rest, n_forum = (g["samples"] for g in manifest["splits"]["train"]["groups"])
    total = 2 * (n_rest + n_forum)
    assert len(train.counts) == 4 and int(train.counts.sum()) == total
    expected = [f * total * part / (n_rest + w * n_forum) for f in (0.75, 0.25) for part in (n_rest, w * n_forum)]
    assert all(abs(c - e) < 1 for c, e in zip(train.counts.tolist(), expected))
    with pytest.raises(KilnError, match=r"loader.sources\[1\].weight is missing"):
        open_splits(run.model_copy(update={"loader": run.loader.model_copy(update={"sources": [
            SourceConfig(path=shards, weight=3.0), SourceConfig(path=shards)]})}), manifest["tokenizer_sha256"])


@pytest.mark.parametrize("at_once", [512, 3])
def test_spilled_profiles_report_what_one_profile_of_everything_reports(tmp_path, at_once):
    """The data stage sums the per-task profile parts through SpilledProfiles, which keeps each source's sums
    only for the tokens that can be among the corpus's top_tokens (2 x top_tokens), not every source's whole
    vocabulary, and only SOURCES_AT_ONCE sources at a time (3: every source partition is read in slices):
    with 20 sources of 600 distinct words each, the report equals a SourceProfiles that held all."""
    from kiln.data.gates.distribution import SourceProfiles, SpilledProfiles, profile_part

    rng = random.Random(3)
    common = [f"w{i}" for i in range(30)]
    everything, spilled = SourceProfiles(top_tokens=10), SpilledProfiles(tmp_path / "p", top_tokens=10, max_z=3.0)
    spilled.SOURCES_AT_ONCE = at_once
    for task in range(40):
        part, src = [], f"s{task // 2}"  # two tasks a source, like a file in 2 tasks
        own = [f"s{task}x{i}" for i in range(300)]
        words = common[20:] if task >= 36 else common[:20]  # the last two sources use other common words
        for _ in range(20):
            text = " ".join(rng.choice(words) if rng.random() < 0.6 else rng.choice(own)
                            for _ in range(80))
            part.append((src, text))
            everything.add(src, text)
        spilled.add(profile_part(part))
    if at_once == 3:
        assert max(spilled.fragments) > 3  # some partition holds more than 3 sources' parts: it is sliced
    want = everything.report()
    got = spilled.report()
    assert list(got) == list(want) and len(got) == 20  # the sums of f differ only in float addition order
    for src, w in want.items():
        assert got[src]["docs"] == w["docs"] and got[src]["z"] == pytest.approx(w["z"], abs=2e-4)
        assert got[src]["weight"] == pytest.approx(w["weight"], abs=2e-4)
    assert sorted(got, key=lambda src: got[src]["z"])[-2:] in (["s18", "s19"], ["s19", "s18"])  # the drifting two
    assert not list((tmp_path / "p").glob("sums-*"))  # the per-slice sums are its own, and gone


_TEXT = st.lists(st.sampled_from(["the", "The", "cat", "sat", "mat", "İstanbul", "猫", "日本語", "ﬁ", "x", " ", "\n"]),
                 max_size=30).map(" ".join)


@settings(max_examples=40, deadline=None)
@given(tasks=st.lists(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), _TEXT), max_size=8),
                      min_size=1, max_size=5), at_once=st.sampled_from([1, 2, 512]), top=st.sampled_from([1, 3, 50]),
       batch=st.sampled_from([1, 3, 512]))
def test_spilled_profiles_of_any_parts_report_what_one_profile_of_everything_reports(tmp_path_factory, tasks,
                                                                                    at_once, top, batch):
    """Any documents (empty ones, CJK, case, sources in several tasks), any batches of documents summed at once,
    any slicing, any top_tokens: the same sources, documents and weights as SourceProfiles over all of them, z to
    float rounding."""
    from kiln.data.gates.distribution import SourceProfiles, SpilledProfiles, profile_part

    everything = SourceProfiles(top_tokens=top)
    spilled = SpilledProfiles(tmp_path_factory.mktemp("p"), top_tokens=top, max_z=3.0)
    spilled.SOURCES_AT_ONCE = at_once
    for docs in tasks:
        for src, text in docs:
            everything.add(src, text)
        spilled.add(profile_part(docs, batch=batch))
    want, got = everything.report(), spilled.report()
    assert list(got) == list(want)
    for src, w in want.items():
        assert got[src]["docs"] == w["docs"] and got[src]["z"] == pytest.approx(w["z"], abs=2e-4)
        assert got[src]["weight"] == pytest.approx(w["weight"], abs=2e-4)


def test_spilled_profiles_hold_a_slice_of_the_sources_not_all(tmp_path):
    """A crawl keyed by host has a source per site: the report's memory, apart from its own row per source, does
    not grow with the sources. tracemalloc's peak while reporting 300 and 1,200 sources of 100 words each from
    200 (all candidates at top_tokens=100: the sums held for every source would be ~1,200 x 2 x 80 floats in
    dicts, ~19 MB; 7 KB a source more, measured) grows by less than the report's rows and their sorting (1 KB a
    source, measured; 1.5 allowed)."""
    import tracemalloc

    from kiln.data.gates.distribution import SpilledProfiles, profile_part

    def peak(sources: int) -> int:
        rng = random.Random(sources)
        vocab = [f"t{i}" for i in range(200)]
        spilled = SpilledProfiles(tmp_path / f"p{sources}", top_tokens=100, max_z=3.0)
        spilled.SOURCES_AT_ONCE = 4  # ~5 and ~19 sources a partition: read in slices
        for task in range(8):
            spilled.add(profile_part([(f"site-{k}.example", " ".join(rng.choices(vocab, k=100)))
                                      for k in range(task * sources // 8, (task + 1) * sources // 8)]))
        tracemalloc.start()
        try:
            report = spilled.report()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            assert len(report) == sources

    small, large = peak(300), peak(1200)
    print(f"report peak: 300 sources {small / 1e6:.1f} MB, 1,200 sources {large / 1e6:.1f} MB")
    assert large - small < 900 * 1536


def test_spilled_profiles_rank_the_corpus_one_token_partition_at_a_time(tmp_path):
    """The corpus's vocabulary is never held whole (it keeps growing with a real crawl): the sums of f are
    spilled to TOKEN_PARTITIONS token partitions and ranked one partition at a time. The candidates are exactly the
    ones one Counter of the whole vocabulary, summed in the same order, ranks first; no partition holds more
    than ~1/TOKEN_PARTITIONS of the tokens; a second SpilledProfiles on the same folder (a resumed merge)
    starts over."""
    from kiln.data.gates.distribution import TOKEN_PARTITIONS, SpilledProfiles, profile_part, rank_key

    rng = random.Random(5)
    vocab = [f"t{i}" for i in range(20_000)]
    stale = profile_part([("x", "stale " * 1000)])
    SpilledProfiles(tmp_path / "p", top_tokens=50, max_z=3.0).add(stale)  # a merge that stopped
    spilled, whole = SpilledProfiles(tmp_path / "p", top_tokens=50, max_z=3.0), Counter()
    for task in range(12):
        part, task_sums = [], {}  # the task's sums of f, added document by document
        for src in (f"a{task % 3}", f"b{task % 5}"):
            for _ in range(15):
                text = " ".join(rng.choice(vocab[: rng.choice((300, 20_000))]) for _ in range(120))
                part.append((src, text))
                counts = Counter(text.split())
                for token, c in counts.items():
                    task_sums[token] = task_sums.get(token, 0.0) + c / 120
        whole.update(task_sums)
        spilled.add(profile_part(part))
    ranked = sorted(whole.items(), key=lambda kv: rank_key(kv[1], kv[0]))[:100]
    assert spilled._candidates() == {t for t, _ in ranked}
    sizes = []
    for p in range(TOKEN_PARTITIONS):
        tokens = set()
        with open(spilled._partition(p), "rb") as f:
            while True:
                try:
                    tokens.update(pickle.load(f)[0])
                except EOFError:
                    break
        sizes.append(len(tokens))
    assert sum(sizes) == len(whole) > 10_000 and max(sizes) < 2 * len(whole) / TOKEN_PARTITIONS
    docs = sum((Counter({f"a{t % 3}": 15, f"b{t % 5}": 15}) for t in range(12)), Counter())
    assert {src: row["docs"] for src, row in spilled.report().items()} == dict(sorted(docs.items()))


def test_a_part_on_disk_is_added_a_block_at_a_time_as_the_part_in_memory(tmp_path):
    """The data stage's driver copies each task's part from the file a worker wrote, piece by piece
    (`add_file`): the partitions' files, and so the report, are those of adding the part held in memory."""
    from kiln.data.gates.distribution import SpilledProfiles, part_bytes, profile_part

    rng = random.Random(3)
    vocab = [f"t{i}" for i in range(300)]
    parts = [profile_part([(f"site-{k % 40}.example", " ".join(rng.choices(vocab, k=80))) for k in range(120)])
             for _ in range(3)]
    held, copied = (SpilledProfiles(tmp_path / name, top_tokens=50, max_z=3.0) for name in ("held", "copied"))
    for k, part in enumerate(parts):
        held.add(part)
        (tmp_path / f"part-{k}").write_bytes(part_bytes(part))
        copied.add_file(tmp_path / f"part-{k}")
    assert held.fragments == copied.fragments
    assert {p.name: p.read_bytes() for p in (tmp_path / "held").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "copied").iterdir()}
    assert held.report() == copied.report() and len(copied.report()) == 40
