"""The distribution profile's faster forms give the bytes and the candidates the plain ones gave (issue 44).

`plain_profile_part` is profile_part as it was (a Python setdefault per token, a crc per token, the task's sums
folded apart from its source's); `plain_candidates` ranks every token of the corpus. The texts hold what the
faster forms must not change: one-character words (pickle's memo), Han/kana, final sigmas, empty pages, ties.
"""

from __future__ import annotations

import functools
import heapq
import json
import pickle
import random
from collections import Counter, defaultdict

import numpy as np
import zstandard

from kiln.config import DataConfig
from kiln.data import pipeline
from kiln.data.docs import read_part
from kiln.data.gates.distribution import (SOURCE_PARTITIONS, TOKEN_PARTITIONS, SpilledProfiles, _crc, _Sums,
                                          part_bytes, profile_part, rank_key)
from kiln.data.gates.text import words
from kiln.data.tables import read_frames


def plain_profile_part(documents, batch: int = 512) -> dict:
    vocab: dict[str, int] = {}
    docs: Counter[str] = Counter()
    sums: dict[str, _Sums] = defaultdict(_Sums)
    task = _Sums()
    for k, (source, text) in enumerate(documents, start=1):
        counts = Counter(map(str.lower, words(text)))
        n = sum(counts.values())
        docs[source] += 1
        if n:
            ids = np.fromiter((vocab.setdefault(t, len(vocab)) for t in counts), np.int64, len(counts))
            fs = np.fromiter(counts.values(), np.float64, len(counts)) / n
            sums[source].add(ids, fs)
            task.add(ids, fs)
        if k % batch == 0:
            for pending in (task, *sums.values()):
                pending.fold()
    tokens = np.asarray(list(vocab), dtype=object)
    task.fold()
    by_token: dict[int, list[int]] = defaultdict(list)
    for i, token in zip(task.ids.tolist(), tokens[task.ids].tolist()):
        by_token[_crc(token) % TOKEN_PARTITIONS].append(i)
    totals = np.zeros(len(tokens))
    totals[task.ids] = task.f1
    by_source: dict[int, list[tuple]] = defaultdict(list)
    for source, n in docs.items():
        own = sums[source].fold() if source in sums else _Sums()
        by_source[_crc(source) % SOURCE_PARTITIONS].append((source, n, tokens[own.ids].tolist(), own.f1, own.f2))
    dump = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
    return {"tokens": {p: dump((tokens[i].tolist(), totals[i])) for p, i in sorted(by_token.items())},
            "sources": {q: dump(frames) for q, frames in sorted(by_source.items())},
            "fragments": {q: len(frames) for q, frames in by_source.items()}}


WORDS = ["<", ">", "a", "A", "é", "É", "=", "ΟΔΟΣ", "ΣΑΣ'Β", "Σ\u0301", "İstanbul", "straße", "the", "The", "THE",
         "中文", "日本語テキスト", "ΑΣーB", "😀", "𝔘𝔫𝔦", "x\u00a0y"] + [f"w{i}" for i in range(300)]


def corpus(seed: int, pages: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(pages):
        n = rng.choice([0, 1, 3, 20, 200])
        texts.append(" ".join(rng.choice(WORDS) if rng.random() < 0.5 else f"u{rng.randrange(5000)}"
                              for _ in range(n)))
    return texts


def layouts(texts: list[str]) -> dict[str, list[tuple[str, str]]]:
    rng = random.Random(1)
    half = len(texts) // 2
    return {"one source": [("s", t) for t in texts],
            "a second after a fold": [("a", t) for t in texts[:half]] + [(rng.choice("ab"), t) for t in texts[half:]],
            "many": [(f"h{rng.randrange(40)}", t) for t in texts]}


def test_profile_part_is_byte_for_byte_the_plain_one():
    texts = corpus(0, 120)
    for name, docs in layouts(texts).items():
        for batch in (512, 7, 1):
            assert part_bytes(profile_part(docs, batch)) == part_bytes(plain_profile_part(docs, batch)), (name, batch)
    assert part_bytes(profile_part([])) == part_bytes(plain_profile_part([]))
    blank = [("s", ""), ("t", "  ")]
    assert part_bytes(profile_part(blank)) == part_bytes(plain_profile_part(blank))


def plain_candidates(parts: list[dict], want: int) -> set[str]:
    sums: dict[str, float] = {}
    for p in range(TOKEN_PARTITIONS):
        for part in parts:
            if p in part["tokens"]:
                tokens, values = pickle.loads(part["tokens"][p])
                for t, v in zip(tokens, values.tolist()):
                    sums[t] = sums.get(t, 0.0) + v
    return {t for _, t in heapq.nsmallest(want, ((rank_key(v, t)) for t, v in sums.items()))}


def test_candidates_and_rows_are_the_plain_ones(tmp_path):
    texts = corpus(2, 300)
    rng = random.Random(3)
    docs = [(f"h{rng.randrange(30)}", t) for t in texts]
    parts = [profile_part(docs[i:i + 40]) for i in range(0, len(docs), 40)]
    ties = [profile_part([("s", " ".join(f"t{i}" for i in range(3000)))])]  # 3,000 tokens of one frequency
    graded = [profile_part([("s", " ".join(f"g{i}" for i in range(400) for _ in range(i)))])]  # all apart
    for k, (group, top) in enumerate([(parts, 1000), (parts, 3), (parts, 1), (ties, 10), (parts + ties, 50),
                                      (graded, 1), (graded, 5), (graded + ties, 20)]):
        spilled = SpilledProfiles(tmp_path / str(k), top, 3.0)
        for part in group:
            spilled.add(part)
        assert spilled._candidates() == plain_candidates(group, 2 * top), (k, top)
        column = {t: j for j, t in enumerate(sorted(spilled._candidates()))}
        for names, n, s1, s2 in spilled._source_sums(column):  # against the pieces, one source at a time
            for row, src in enumerate(names):
                want1, want2, docs_of = np.zeros(len(column)), np.zeros(len(column)), 0
                for part in group:
                    for frames in (pickle.loads(b) for b in part["sources"].values()):
                        for s, m, tokens, f1, f2 in frames:
                            if s == src:
                                docs_of += m
                                for t, a, b in zip(tokens, f1.tolist(), f2.tolist()):
                                    if t in column:
                                        want1[column[t]] += a
                                        want2[column[t]] += b
                assert n[row] == docs_of and s1[row].tolist() == want1.tolist() and s2[row].tolist() == want2.tolist()
        assert list(read_frames(tmp_path / str(k) / "missing")) == []


def test_candidates_cuts_keep_every_candidate(tmp_path):
    """Few partitions, many tokens each, few candidates: each partition's own cut and the pool's are reached."""
    names = [f"c{i}" for i in range(3000)]
    crowded = [t for t in names if _crc(t) % TOKEN_PARTITIONS in (5, 9, 17)][:90] + names[:10]
    rng = random.Random(5)
    for trial in range(40):
        tasks = [[("s", " ".join(t for t in crowded for _ in range(rng.choice([1, 1, 2, 3, rng.randrange(60)]))))]
                 for _ in range(rng.choice([1, 2, 3]))]
        parts = [profile_part(docs) for docs in tasks]
        top = rng.choice([1, 2, 3, 8])
        spilled = SpilledProfiles(tmp_path / str(trial), top, 3.0)
        for part in parts:
            spilled.add(part)
        assert spilled._candidates() == plain_candidates(parts, 2 * top), (trial, top)


def test_profile_task_reads_the_kept_records_read_part_reads(tmp_path, monkeypatch):
    """Lines are parsed only when needed: a kept page whose text or fields say "reason" is still a kept page, a
    rejection (with its text or without) still none, and a page dedup removed is left out by its number."""
    texts = corpus(4, 12)
    kept = [{"id": f"k{i}", "text": t, "url": f"https://h{i % 3}.example/", "source": "in.warc.gz"}
            for i, t in enumerate(texts)]
    kept[1]["text"] = 'he gave a "reason": none {"reason": 1} \\"reason\\"'
    kept[2]["edits"] = {"reason": 2}
    kept[3]["url"] = "reason"
    rejects = [{"id": "r0", "url": None, "source": "in.warc.gz", "stage": "quality", "reason": "short", "signals": {}},
               {"text": "rejected text", "id": "r1", "source": "in.warc.gz", "stage": "dedup", "reason": "exact"}]
    records = [rejects[0], *kept[:5], rejects[1], *kept[5:]]
    with open(tmp_path / "task-00003.jsonl.zst", "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as z:
        for rec in records:
            z.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
    gone = [0, 4, 7]

    class Verdicts:
        def __init__(self, layout) -> None:
            pass

        def removed_in(self, k: int) -> np.ndarray:
            assert k == 1
            return np.asarray(gone)

    monkeypatch.setattr(pipeline.Layout, "load", staticmethod(lambda work: None))
    monkeypatch.setattr(pipeline, "VerdictFiles", Verdicts)
    cfg = DataConfig.model_validate({"distribution": {"source_key": "host"}})
    (tmp_path / "profiles" / "parts").mkdir(parents=True)
    pipeline.profile_task((str(tmp_path), 3, 1, cfg))
    plain = [rec for rec in read_part(tmp_path / "task-00003.jsonl.zst") if "reason" not in rec]
    assert [rec["id"] for rec in plain] == [rec["id"] for rec in kept]
    want = [(pipeline.source_group("host", r["source"], r.get("url"), None), r["text"])
            for i, r in enumerate(plain) if i not in gone]
    assert len(want) == 9
    assert (tmp_path / "profiles" / "parts" / "00003.pkl").read_bytes() == part_bytes(plain_profile_part(want))
