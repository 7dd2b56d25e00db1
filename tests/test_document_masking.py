"""Document masking (model.document_masking): attention stays inside each packed document.

A token's loss does not move when the document before it in the sample is replaced (and does without
masking); a packed row gives the per-token losses of its documents run one by one, each after its EOS; the
exact masked SDPA and flex_attention agree; training with it resumes bitwise, evaluates, and exports to a
transformers model whose loss on each document alone is Kiln's loss on the packed row. Rows are real
documents (paragraphs of this repository's README) encoded with the real tokenizer of the prepared corpus,
packed as `kiln pack` packs: each document followed by EOS.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, tiny_config
from kiln.cli import main as kiln
from kiln.errors import ConfigError, KilnError
from kiln.model.attention import DocumentMask, attend, document_ids, document_positions
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.tokenizer import eos_id, load_tokenizer
from kiln.checkpoint import list_checkpoints, load_checkpoint
from kiln.train.metrics import read_metrics
from kiln.train.trainer import Trainer

QUIET = lambda *_: None  # noqa: E731
MASKED = {"document_masking": True}


def paragraphs(tok, n: int, length: int, skip: int = 0) -> list[list[int]]:
    """`n` documents of up to `length` tokens: paragraphs of README.md, encoded without special tokens."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    paras = [p for p in text.split("\n\n") if len(p) > 200][skip:]
    return [tok.encode(p, add_special_tokens=False).ids[:length] for p in paras[:n]]


def pack(docs: list[list[int]], eos: int) -> list[int]:
    """`kiln pack`'s stream: each document followed by EOS."""
    return [t for d in docs for t in (*d, eos)]


def token_losses(model, row: list[int]) -> torch.Tensor:
    """Per-position next-token loss (nats) of one row: position i predicts row[i + 1]."""
    x = torch.tensor([row])
    with torch.no_grad():
        logits = model.eval()(x[:, :-1])
    return F.cross_entropy(logits[0].float(), x[0, 1:], reduction="none")


@pytest.fixture(scope="module")
def tok(prepared):
    return load_tokenizer(prepared.out / "tokenizer" / "tokenizer.json")


def model_of(tok, seed: int = 0, **model) -> torch.nn.Module:
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, **model)
    torch.manual_seed(seed)
    m = build_model(cfg, tok.get_vocab_size(), 256, eos_id(tok))
    with torch.no_grad():  # larger weights than the init: attention far from uniform, so leaks would show
        for p in m.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.15)
    return m


@pytest.mark.parametrize("positions", [False, True])
def test_a_tokens_loss_ignores_the_document_before_it_only_with_masking(tok, positions):
    eos = eos_id(tok)
    a, b, c, a_other, a_longer = paragraphs(tok, 5, 40)
    a_longer = a_longer + a  # a different length too: the later documents move
    masked, plain = model_of(tok, document_masking=True, document_positions=positions), model_of(tok)
    for replacement in (a_other[: len(a)], a_longer):
        row, changed = pack([a, b, c], eos), pack([replacement, b, c], eos)
        shift = len(replacement) - len(a)
        start = len(a)  # the EOS after a: where b's document begins, first prediction b[0]
        for model, same in ((masked, True), (plain, False)):
            before = token_losses(model, row)[start:]
            after = token_losses(model, changed)[start + shift:]
            assert len(before) == len(after) == len(b) + len(c) + 2
            if same:  # RoPE scores see position differences only: a shift changes nothing but rounding
                assert torch.allclose(before, after, atol=1e-5, rtol=0), (before - after).abs().max()
            else:
                assert (before - after).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [False, True])
def test_a_packed_row_gives_the_losses_of_its_documents_one_by_one(tok, positions, dtype):
    eos = eos_id(tok)
    docs = paragraphs(tok, 4, 30, skip=3)
    model = model_of(tok, seed=1, document_masking=True, document_positions=positions)
    head = docs[0][:7]  # a sample may start inside a document: the tail of one the boundary cut, no EOS before it
    row = head + [eos] + pack(docs[1:], eos)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        packed = token_losses(model, row)
        alone = [token_losses(model, head + [eos])]  # each document after its EOS, up to the next EOS
        alone += [token_losses(model, [eos, *d, eos]) for d in docs[1:]]
    one_by_one = torch.cat(alone)
    assert len(one_by_one) == len(packed) == len(row) - 1
    # bf16 keeps 8 bits of mantissa: the packed and the lone rows round differently (losses here are ~8 nats)
    atol, rtol = (1e-5, 0) if dtype == torch.float32 else (0, 0.02)
    assert torch.allclose(packed, one_by_one, atol=atol, rtol=rtol), (packed - one_by_one).abs().max()


def test_documents_and_positions_are_read_from_the_eos_tokens():
    tokens = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 4], [1, 2, 3, 1, 1, 5, 6, 7]])
    assert document_ids(tokens, 1).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 2, 3, 3, 3, 3]]
    assert document_positions(tokens, 1).tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1, 2, 3]]
    mask = DocumentMask.of(tokens, 1, "sdpa").dense[1, 0]
    assert mask[4].tolist() == [False, False, False, False, True, False, False, False]  # a lone EOS: itself
    assert mask[7].tolist() == [False] * 4 + [True] * 4


def test_document_positions_without_masking_and_masking_with_pipeline_stages_are_refused(prepared, tmp_path):
    with pytest.raises(Exception, match="model.document_positions restarts positions per document"):
        tiny_config(tmp_path, model={"document_positions": True})
    from kiln.train.parallel.mesh import Degrees, check_model

    cfg = tiny_config(tmp_path, model=MASKED)
    with pytest.raises(ConfigError, match="parallel.pp>1 does not combine with model.document_masking"):
        check_model(Degrees(pp=2), cfg, 1024, 8)


@pytest.mark.slow  # compiling flex_attention on a CPU takes a minute or more
def test_flex_attention_equals_the_exact_masked_sdpa():
    """The forward only: torch 2.13 has no flex_attention backward on CPU (a GPU run checks the gradients)."""
    torch.manual_seed(0)
    tokens = torch.randint(3, 50, (2, 256))
    tokens[0, [20, 100, 101, 200]] = 1
    tokens[1, [128, 129]] = 1
    q = torch.randn(2, 4, 256, 16)
    k, v = (torch.randn(2, 2, 256, 16) for _ in range(2))
    sdpa = attend(q, k, v, DocumentMask.of(tokens, 1, "sdpa"))
    flex = attend(q, k, v, DocumentMask.of(tokens, 1, "flex"))
    assert (sdpa - flex).abs().max() < 1e-5


def test_flex_attention_training_on_a_cpu_is_refused_in_one_line(workdir):
    cfg = tiny_config(workdir, model={**MASKED, "document_attention": "flex"})
    with pytest.raises(KilnError, match=r"^model.document_attention=flex: torch .* has no flex_attention "
                       r"backward on a CPU; use model.document_attention=sdpa \(or auto\)$"):
        Trainer(cfg, log=QUIET)


# --- training, evaluation and export --------------------------------------------------------------

def masked_run(prepared, root, **train):
    out = root / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    return tiny_config(out, model=MASKED, train={"max_steps": 12, "log_every": 1, **train},
                       checkpoint={"every": 6})


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """A 12-step run with document masking (checkpoints at 6 and 12) and what it logged."""
    cfg = masked_run(prepared, tmp_path_factory.mktemp("masked"))
    lines = []
    Trainer(cfg, log=lines.append).run()
    return cfg, lines


def test_training_logs_its_kernel_and_resumes_bitwise(trained, prepared, tmp_path):
    cfg, lines = trained
    assert any(line.startswith("document masking: scaled_dot_product_attention with an exact mask on cpu")
               for line in lines)
    again = masked_run(prepared, tmp_path)

    class Crash(Exception):
        pass

    def crash_at_step_9(msg: str) -> None:
        if msg.startswith("step 9/"):
            raise Crash

    with pytest.raises(Crash):
        Trainer(again, log=crash_at_step_9).run()
    Trainer(again, log=QUIET).run()  # the same command resumes from step 6

    def steps(c):
        return [m["loss"] for m in read_metrics(c.out / "run" / "metrics.jsonl") if m["event"] == "step"]

    assert steps(again) == steps(cfg) and len(steps(cfg)) == 12
    a = load_checkpoint(list_checkpoints(cfg.out / "run" / "checkpoints")[-1])["model"]
    b = load_checkpoint(list_checkpoints(again.out / "run" / "checkpoints")[-1])["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    evals = [m for m in read_metrics(cfg.out / "run" / "metrics.jsonl") if m["event"] == "eval"]
    assert evals and all(e["val_loss"] > 0 for e in evals)


def test_eval_of_a_masked_checkpoint_masks_too(trained, capsys):
    """`kiln eval` builds the checkpoint's model with its EOS: its loss on the validation shards is the masked
    model's, not that of the same weights attending across documents."""
    from kiln.checkpoint.model import load_model
    from kiln.model.loss import summed_loss
    from kiln.shards.reader import ShardSet

    cfg, _ = trained
    ckpt = list_checkpoints(cfg.out / "run" / "checkpoints")[-1]
    assert kiln(["eval", str(ckpt)]) == 0
    reported = json.loads(capsys.readouterr().out)
    model, _, _ = load_model(ckpt)
    plain = build_model(cfg.model.model_copy(update={"document_masking": False}), model.vocab_size,
                        cfg.pack.seq_len)
    plain.load_state_dict(model.state_dict())
    val = ShardSet(cfg.out / "shards", "val")
    rows = torch.from_numpy(np.stack([val.sample(i) for i in range(len(val))]).astype(np.int64))
    pad = val.manifest.get("pad_id")
    masked_loss = summed_loss(model, [rows], torch.device("cpu"), pad_id=pad)
    assert reported["loss"] == pytest.approx(masked_loss[0] / masked_loss[1], rel=1e-5)
    eos = int(val.manifest["eos_id"])
    two = rows[(rows[:, 1:-1] == eos).any(1)]  # rows where a second document starts after the first position
    assert len(two)
    masked_two = summed_loss(model, [two], torch.device("cpu"), pad_id=pad)
    plain_two = summed_loss(plain, [two], torch.device("cpu"), pad_id=pad)
    assert abs(masked_two[0] - plain_two[0]) / masked_two[1] > 1e-4  # float noise is ~1e-7 a token


def test_transformers_on_each_document_alone_gives_kilns_loss_on_the_packed_row(trained, tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    from kiln.checkpoint.model import load_model
    from kiln.ops.export import export_hf

    cfg, _ = trained
    ckpt = list_checkpoints(cfg.out / "run" / "checkpoints")[-1]
    result = export_hf(ckpt, tmp_path / "hf")
    assert "document_masking" in result.get("note", "")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model, _, _ = load_model(ckpt)
    eos = eos_id(tok)
    docs = paragraphs(tok, 3, 18)
    row = pack(docs, eos)  # three documents, 57 tokens: one sample of seq_len 64
    kiln_losses = token_losses(model, [eos, *row])  # the row as packed, after the previous document's EOS
    offset = 0
    for d in docs:
        ids = torch.tensor([[eos, *d, eos]])  # one document alone, as it starts and ends in the shards
        with torch.no_grad():
            theirs = F.cross_entropy(hf(ids[:, :-1]).logits[0], ids[0, 1:], reduction="sum").item()
        ours = kiln_losses[offset: offset + len(d) + 1].sum().item()
        assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-4)
        offset += len(d) + 1
