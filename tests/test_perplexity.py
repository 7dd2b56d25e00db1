"""The perplexity gate end to end through `kiln data`: a tiny Kiln model trained on the sample crawl (the
reference corpus: de, en, es, fr, it, ja, pt, zh) scores planted pages. English pages like the reference are
kept with `perplexity_bpb`; word salad that passes every heuristic gate and Russian and Korean pages (scripts
the model never saw) are rejected with `quality/perplexity_above_max` and `signals.bits_per_byte`; the number
equals an independent computation with kiln.eval's unbatched loss, whatever the batch size."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, english_pages, tiny_config, warc_pages, write_warc

from kiln.cli import main as kiln
from kiln.data.docs import read_docs, read_part
from kiln.checkpoint.model import load_model
from kiln.model.loss import summed_loss
from kiln.scoring.losses import text_windows
from kiln.tokenizer import eos_id
from kiln.checkpoint import list_checkpoints
from kiln.train.trainer import Trainer

MAX_BPB = 5.0  # the trained model: English pages 3.7-4.6 bits per byte, word salad ~5.5, ru/ko far above
STOP = ["the", "and", "of", "to", "is", "in", "that", "with"]


def word_salad(rng: random.Random) -> str:
    """Sentences of random-letter words around English stop words: passes the Gopher, C4 and FineWeb rules."""
    def word():
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))

    sentence = lambda: " ".join(" ".join([word(), rng.choice(STOP), word(), rng.choice(STOP), word()])  # noqa: E731
                                for _ in range(5)).capitalize() + "."
    return "</p><p>".join(sentence() for _ in range(12))


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("perplexity")
    out = tmp / "ref"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    Trainer(tiny_config(out, train={"max_steps": 40, "eval_every": 0}), log=lambda *_: None).run()
    checkpoint = list_checkpoints(out / "run" / "checkpoints")[-1]
    rng = random.Random(0)
    good = english_pages()[:8]
    salad = [(f"http://salad{i}.example/", f"<html><body><p>{word_salad(rng)}</p></body></html>".encode())
             for i in range(3)]
    foreign = warc_pages(ROOT / "tests" / "data" / "docs_pages.warc.gz", lambda u: u.endswith(("kernel.ru.html",
                                                                                              "kernel.ko.html")))
    assert len(foreign) == 2
    warc = write_warc(tmp / "crawl.warc.gz", [(u, p, "text/html") for u, p in good + salad + foreign])
    return tmp, checkpoint, warc, {u for u, _ in good}, {u for u, _ in salad + foreign}


def rejects(out):
    return {r["url"]: r for part in sorted((out / "rejects").glob("part-*.jsonl.zst")) for r in read_part(part)}


def run(warc, out, checkpoint, *overrides) -> int:
    return kiln(["data", str(warc), "--out", str(out), "data.dedup.method=none",
                 f"data.quality.perplexity.checkpoint={checkpoint}", *overrides])


def bits_per_byte(checkpoint, text: str) -> float:
    """Independently: the whole text's windows through kiln.eval's unbatched mean loss, times the count."""
    model, tok, cfg = load_model(checkpoint)
    ids = [eos_id(tok)] + tok.encode(text, add_special_tokens=False).ids
    total, _ = summed_loss(model, text_windows(ids, cfg.pack.seq_len + 1), torch.device("cpu"))
    return total / math.log(2) / len(text.encode("utf-8"))


def test_without_the_gate_the_bad_pages_pass_the_heuristics(reference):
    tmp, _, warc, good, bad = reference
    out = tmp / "plain"
    assert kiln(["data", str(warc), "--out", str(out), "data.dedup.method=none"]) == 0
    assert {d["url"] for d in read_docs(out)} == good | bad  # what the learned gate is for


def test_perplexity_gate_keeps_the_reference_like_pages_and_records_bits_per_byte(reference, capsys):
    tmp, checkpoint, warc, good, bad = reference
    out = tmp / "gated"
    assert run(warc, out, checkpoint, f"data.quality.perplexity.max_bits_per_byte={MAX_BPB}") == 0
    kept = {d["url"]: d for d in read_docs(out)}
    assert set(kept) == good
    assert all(0 < d["perplexity_bpb"] <= MAX_BPB for d in kept.values())
    rej = rejects(out)
    assert set(rej) == bad
    for r in rej.values():
        assert (r["stage"], r["reason"]) == ("quality", "perplexity_above_max")
        assert r["signals"]["bits_per_byte"] > MAX_BPB and r["signals"]["max"] == MAX_BPB
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rejected_by_reason"]["quality/perplexity_above_max"] == len(bad)

    doc = kept[min(good)]
    assert len(doc["text"]) > 2000  # several windows of the model's 64-token context
    assert doc["perplexity_bpb"] == pytest.approx(bits_per_byte(checkpoint, doc["text"][:10_000]), abs=2e-4)
    capsys.readouterr()
    assert kiln(["data", "explain", doc["url"], "--out", str(out)]) == 0
    assert f"perplexity_bpb: {doc['perplexity_bpb']}" in capsys.readouterr().out


def test_scores_do_not_depend_on_the_batch_and_a_run_folder_resolves(reference):
    tmp, checkpoint, warc, good, _ = reference
    scores = []
    for name, ckpt, batch in (("b1", checkpoint, 1), ("b64", checkpoint.parents[1], 64)):  # run/ -> newest step
        out = tmp / name
        assert run(warc, out, ckpt, f"data.quality.perplexity.batch_size={batch}",
                   "data.quality.perplexity.max_chars=3000") == 0  # no threshold: all kept and scored
        scores.append({d["url"]: d["perplexity_bpb"] for d in read_docs(out)})
    assert len(scores[0]) == len(good) + 5 and set(scores[0]) == set(scores[1])
    for url, bpb in scores[0].items():
        assert scores[1][url] == pytest.approx(bpb, abs=2e-4)
    assert max(scores[0][u] for u in good) < min(v for u, v in scores[0].items() if u not in good)


def test_perplexity_config_errors(reference, tmp_path, capsys):
    _, checkpoint, warc, _, _ = reference
    assert kiln(["data", str(warc), "--out", str(tmp_path / "x"), "data.quality.perplexity.max_bits_per_byte=2"]) == 2
    err = capsys.readouterr().err
    assert "data.quality.perplexity.checkpoint is not set" in err and len(err.strip().splitlines()) == 1
    assert run(warc, tmp_path / "y", tmp_path / "nothing") == 2
    err = capsys.readouterr().err
    assert f"data.quality.perplexity.checkpoint {tmp_path / 'nothing'}: no Kiln checkpoint there" in err
    broken = tmp_path / "step-00000040"
    shutil.copytree(checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    assert run(warc, tmp_path / "z", broken) == 2
    assert f"data.quality.perplexity.checkpoint {broken}:" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "xyz")


def test_kiln_data_imports_torch_only_when_the_gate_is_on():
    code = "import sys, kiln.cli, kiln.data.pipeline, kiln.data.gates.perplexity; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
