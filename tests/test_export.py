"""Export to Hugging Face and import back: transformers loads the folder as Llama (or Mixtral) with Kiln's
logits to 1e-4 and `kiln eval --text`'s perplexity; an imported folder is where a new run starts."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, tiny_config
from kiln.cli import main as kiln
from kiln.errors import KilnError
from kiln.ops.export import export_hf, import_hf
from kiln.tokenizer import load_tokenizer
from kiln.checkpoint import list_checkpoints, load_checkpoint, write_checkpoint, rng_state
from kiln.model.build import build_model
from kiln.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
QUIET = lambda *_: None  # noqa: E731
TEXT = (ROOT / "README.md").read_text(encoding="utf-8")[:6000]


def fresh_out(prepared, root: Path) -> Path:
    out = root / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    return out


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    out = fresh_out(prepared, tmp_path_factory.mktemp("export"))
    cfg = tiny_config(out, train={"max_steps": 6, "eval_every": 0}, checkpoint={"every": 6})
    Trainer(cfg, log=QUIET).run()
    return cfg, list_checkpoints(out / "run" / "checkpoints")[-1]


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    _, ckpt = trained
    out = tmp_path_factory.mktemp("hf") / "model"
    export_hf(ckpt, out)
    return out


def kiln_logits(cfg, state: dict, ids: torch.Tensor) -> torch.Tensor:
    model = build_model(cfg.model, state["tok_embeddings.weight"].shape[0], cfg.pack.seq_len)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(ids)


def test_transformers_loads_llama_with_kilns_logits_and_tokenizer(trained, exported):
    cfg, ckpt = trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    tok = load_tokenizer(ckpt / "tokenizer.json")
    ids = tok.encode(TEXT[:800], add_special_tokens=False).ids[: cfg.pack.seq_len]
    assert hf_tok(TEXT[:800], add_special_tokens=False)["input_ids"][: cfg.pack.seq_len] == ids
    # bos is <|eos|>: every training document follows it, and the tokenizer puts it first by default.
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 1, 2)
    x = torch.tensor([ids, ids[::-1]])
    with torch.no_grad():
        theirs = hf(x).logits
    ours = kiln_logits(cfg, load_checkpoint(ckpt)["model"], x)
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max().item() < 1e-4
    gen = json.loads((exported / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1 and hf.generation_config.eos_token_id == 1


def test_exported_perplexity_equals_kiln_eval_on_a_text_file(trained, exported, tmp_path, capsys):
    cfg, ckpt = trained
    text_file = tmp_path / "eval.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    assert kiln(["eval", str(ckpt), "--text", str(text_file)]) == 0
    ours = json.loads(capsys.readouterr().out)

    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(exported)(TEXT)["input_ids"]  # <|eos|> first, as in training
    assert ids[0] == 1
    window = cfg.pack.seq_len + 1  # windows of seq_len + 1 tokens sharing one token with the next
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, window - 1):
            w = torch.tensor([ids[i: i + window]])
            logits = hf(w[:, :-1]).logits
            total += F.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
            count += w.shape[1] - 1
    assert count == ours["tokens"] and count > 3 * window
    assert math.exp(total / count) == pytest.approx(ours["perplexity"], rel=1e-4)
    assert total / math.log(2) / len(TEXT.encode()) == pytest.approx(ours["bits_per_byte"], rel=1e-4)


def test_the_exported_tokenizer_reads_a_typed_eos_as_the_token(trained, exported):
    _, ckpt = trained
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    tok = load_tokenizer(ckpt / "tokenizer.json")
    plain = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert hf_tok("a <|eos|> b")["input_ids"] == [1] + plain("a ") + [1] + plain(" b")
    assert hf_tok("<|eos|>a")["input_ids"] == [1, 1] + plain("a")  # the default <|eos|>, then the typed one
    assert hf_tok("a", add_special_tokens=False)["input_ids"] == plain("a")


def short_text(ckpt: Path, tokens: int) -> str:
    """The start of README cut at a token boundary, `tokens` tokens long (so one window holds it and <|eos|>)."""
    tok = load_tokenizer(ckpt / "tokenizer.json")
    return tok.decode(tok.encode(TEXT, add_special_tokens=False).ids[:tokens])


def test_transformers_loss_with_the_tokenizers_defaults_is_kiln_evals(trained, exported, tmp_path, capsys):
    cfg, ckpt = trained
    text = short_text(ckpt, cfg.pack.seq_len - 1)
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    assert kiln(["eval", str(ckpt), "--text", str(tmp_path / "t.txt")]) == 0
    ours = json.loads(capsys.readouterr().out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    inputs = hf_tok(text, return_tensors="pt")
    with torch.no_grad():
        theirs = hf(**inputs, labels=inputs["input_ids"]).loss.item()
    assert ours["tokens"] == inputs["input_ids"].shape[1] - 1 == cfg.pack.seq_len - 1
    assert ours["loss"] == pytest.approx(theirs, rel=1e-5)


def test_greedy_generation_in_transformers_is_kiln_generate(trained, exported, capsys):
    cfg, ckpt = trained
    prompt = short_text(ckpt, 12)
    assert kiln(["generate", str(ckpt), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "30"]) == 0
    ours = capsys.readouterr().out
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    inputs = hf_tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=30)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) > 5 and 1 + 12 + len(new) <= cfg.pack.seq_len  # within one window: no cut on either side
    assert ours == prompt + hf_tok.decode([t for t in new if t != 1]) + "\n"


def test_import_writes_the_checkpoint_a_new_run_starts_from(trained, exported, prepared, tmp_path, capsys):
    cfg, ckpt = trained
    out = fresh_out(prepared, tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(tiny_config(out, train={"max_steps": 8, "eval_every": 0}, checkpoint={"every": 8}).to_yaml())
    assert kiln(["import", "--hf", str(exported), "--config", str(config)]) == 0
    step0 = Path(json.loads(capsys.readouterr().out)["checkpoint"])
    assert step0 == out / "run" / "checkpoints" / "step-00000000"
    assert kiln(["ckpt", "verify", str(step0)]) == 0

    new_cfg = tiny_config(out, train={"max_steps": 8, "eval_every": 0}, checkpoint={"every": 8})
    trainer = Trainer(new_cfg, log=QUIET)
    assert trainer.resume() == step0 and trainer.step == 0
    x = torch.randint(0, 1024, (2, 32))
    with torch.no_grad():
        started = trainer.model.eval()(x)
    assert torch.equal(started, kiln_logits(cfg, load_checkpoint(ckpt)["model"], x))
    summary = Trainer(new_cfg, log=QUIET).run()  # and the run goes on from there
    assert summary["steps"] == 8

    # Importing into the same run again would overwrite it: refused.
    with pytest.raises(KilnError, match="already holds checkpoints"):
        import_hf(exported, new_cfg)


def test_import_starts_no_process_group_loader_or_watchdog(trained, exported, prepared, tmp_path, monkeypatch):
    import threading

    import torch.distributed as dist

    assert not dist.is_initialized()  # (nothing before this test left a process group behind)
    # parallel.mode=fsdp: a Trainer would set up a process group (of one) to shard the model, and the loader
    # prefetches; writing one checkpoint needs neither.
    cfg = tiny_config(fresh_out(prepared, tmp_path), parallel={"mode": "fsdp"}, loader={"prefetch": 2})
    threads, started, start = set(threading.enumerate()), [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), start(self))[1])
    step0 = import_hf(exported, cfg)
    assert not dist.is_initialized() and started == []  # no kiln-watchdog, loader prefetch or checkpoint thread
    assert not set(threading.enumerate()) - threads, [t.name for t in set(threading.enumerate()) - threads]
    saved = load_checkpoint(step0)
    want = load_checkpoint(trained[1])["model"]
    assert saved["state"]["step"] == 0 and saved["model"].keys() == want.keys()
    assert all(torch.equal(saved["model"][k], want[k].float()) for k in want)


def test_import_refuses_a_config_that_describes_another_model(exported, prepared, tmp_path):
    cfg = tiny_config(fresh_out(prepared, tmp_path), model={"dim": 32})
    with pytest.raises(KilnError, match=r"hidden_size: config.json has 64, the config gives 32"):
        import_hf(exported, cfg)


def test_export_never_overwrites_a_folder_it_did_not_write(trained, tmp_path):
    _, ckpt = trained
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(KilnError, match="not an earlier `kiln export --hf`"):
        export_hf(ckpt, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# --- mixture of experts --------------------------------------------------------------------------

def moe_checkpoint(prepared, root: Path, **moe) -> tuple:
    """A checkpoint of a Kiln MoE model with random weights, written with the checkpoint functions."""
    cfg = tiny_config(root / "out", model={"moe": {"n_experts": 4, "top_k": 2, "capacity_factor": None, **moe}})
    model = build_model(cfg.model, 1024, cfg.pack.seq_len)
    assert any("experts" in k for k in model.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    folder = write_checkpoint(
        root / "ckpts",
        1,
        model.state_dict(),
        {},
        [rng_state()],
        {"tokens_seen": 0},
        cfg.to_yaml(),
        prepared.out / "tokenizer" / "tokenizer.json",
        {},
    )
    return cfg, model, folder


def test_moe_exports_as_mixtral_with_kilns_logits(prepared, tmp_path):
    _, model, folder = moe_checkpoint(prepared, tmp_path)
    export_hf(folder, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    x = torch.randint(0, 1024, (2, 40))
    with torch.no_grad():
        assert (hf(x).logits - model.eval()(x)).abs().max().item() < 1e-4


def test_moe_that_mixtral_cannot_express_is_a_clear_error(prepared, tmp_path):
    _, _, folder = moe_checkpoint(prepared, tmp_path, every_n_layers=2)
    with pytest.raises(KilnError, match=r"every_n_layers=2 mixes dense and MoE blocks"):
        export_hf(folder, tmp_path / "hf")


def test_eval_on_validation_shards_reports_bits_per_byte(trained, capsys):
    from kiln.scoring.losses import token_byte_lengths

    cfg, ckpt = trained
    tok = load_tokenizer(ckpt / "tokenizer.json")
    widths = token_byte_lengths(tok)
    text = "Grüße, 世界! <|eos|> plain text"
    assert widths[tok.encode(text).ids].sum() == len(text.encode())  # byte-level BPE: every byte counted once
    assert widths[tok.token_to_id("<|eos|>")] == 0
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken("naïve-Kiln", special=False)])  # a domain term (tokenizer.added_tokens): plain text
    term = "a naïve-Kiln term"
    assert tok.token_to_id("naïve-Kiln") in tok.encode(term).ids
    assert token_byte_lengths(tok)[tok.encode(term).ids].sum() == len(term.encode())
    assert kiln(["eval", str(ckpt)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["bits_per_byte"] < out["loss"] / math.log(2)  # a token carries more than one byte on average


# --- import --hf: names inside the folder, one-line errors --------------------------------------------------

def _hf_copy(exported: Path, root: Path, kiln_manifest: bool = False) -> Path:
    """A copy of the export as a folder Kiln did not write (no manifest.json), or with it."""
    hf = root / "hf"
    shutil.copytree(exported, hf)
    if not kiln_manifest:
        (hf / "manifest.json").unlink()
    return hf


def _import(hf: Path, prepared, root: Path, capsys) -> tuple[int, str]:
    config = root / "run.yaml"
    config.write_text(tiny_config(fresh_out(prepared, root)).to_yaml())
    capsys.readouterr()
    rc = kiln(["import", "--hf", str(hf), "--config", str(config)])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("escape", ["../outside/stolen.safetensors", "ABSOLUTE", "/etc/passwd"])
def test_import_refuses_an_index_naming_weights_outside_the_folder(exported, prepared, tmp_path, capsys, escape):
    from fs_audit import OpenWatch

    hf = _hf_copy(exported, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(hf / "model.safetensors", outside / "stolen.safetensors")  # real weights, in the wrong place
    name = str(outside / "stolen.safetensors") if escape == "ABSOLUTE" else escape
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": name, "model.norm.weight": name}}))
    with OpenWatch(outside) as watch:
        rc, err = _import(hf, prepared, tmp_path / "run", capsys)
    assert rc == 1 and "\n" not in err and "Traceback" not in err
    assert err.startswith(f"kiln: verification failed: {hf / 'model.safetensors.index.json'}: the entry {name!r}")
    assert watch.opened() == set()  # nothing outside was read
    assert not (tmp_path / "run" / "out" / "run" / "checkpoints").exists()


@pytest.mark.parametrize("damage", ["truncated", "not safetensors", "truncated, Kiln's own export"])
def test_import_of_a_damaged_weights_file_is_one_line(exported, prepared, tmp_path, capsys, damage):
    hf = _hf_copy(exported, tmp_path, kiln_manifest="Kiln's" in damage)
    weights = hf / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 3 // 4] if "truncated" in damage else os.urandom(4096))
    rc, err = _import(hf, prepared, tmp_path / "run", capsys)
    assert rc in (1, 2) and "\n" not in err and "Traceback" not in err and str(weights) in err
    if "Kiln's" in damage:  # its manifest vouches for the size and sha256: checked before it is opened
        assert err.startswith(f"kiln: verification failed: {weights}: size")
    else:
        assert err.startswith(f"kiln: error: {weights}: not a readable safetensors file")


@pytest.mark.parametrize("config, words", [
    ("[1, 2, 3]", "a JSON list, not an object of model settings"),
    ('{"model_type": "llama", "vocab_size": "abc"}', "vocab_size is 'abc', not a whole number"),
    ('{"model_type": "llama", "hidden_size": 64.5}', "hidden_size is 64.5, not a whole number"),
    ("{not json", "not valid JSON"),
])
def test_import_of_a_bad_config_json_is_one_line(exported, prepared, tmp_path, capsys, config, words):
    hf = _hf_copy(exported, tmp_path)
    (hf / "config.json").write_text(config)
    rc, err = _import(hf, prepared, tmp_path / "run", capsys)
    assert rc == 2 and err.startswith(f"kiln: error: {hf / 'config.json'}: ") and words in err and "\n" not in err


def test_export_splits_weights_into_hf_shards_that_transformers_and_import_read(trained, prepared, tmp_path, capsys):
    """--max-shard-size: model-0000K-of-0000N.safetensors of at most that many bytes (a larger tensor alone) and
    Hugging Face's index; transformers' loss is `kiln eval`'s, and `kiln import --hf` reads the files back."""
    from safetensors import safe_open

    cfg, ckpt = trained
    hf_dir = tmp_path / "hf"
    assert kiln(["export", "--hf", str(ckpt), str(hf_dir), "--max-shard-size", "100KB"]) == 0
    capsys.readouterr()
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert not (hf_dir / "model.safetensors").exists()
    total, seen = 0, {}
    for f in files:
        with safe_open(str(hf_dir / f), framework="pt") as st:
            sizes = {k: st.get_tensor(k).numel() * 4 for k in st.keys()}
        assert sum(sizes.values()) <= 100_000 or len(sizes) == 1, (f, sizes)
        total += sum(sizes.values())
        seen |= dict.fromkeys(sizes, f)
    assert seen == index["weight_map"] and index["metadata"] == {"total_size": total}
    one = export_hf(ckpt, tmp_path / "one")  # the default limit: one file, no index
    assert one["parameters"] == total // 4 and (tmp_path / "one" / "model.safetensors").is_file()

    text = short_text(ckpt, cfg.pack.seq_len - 1)
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    assert kiln(["eval", str(ckpt), "--text", str(tmp_path / "t.txt")]) == 0
    ours = json.loads(capsys.readouterr().out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    inputs = hf_tok(text, return_tensors="pt")
    with torch.no_grad():
        theirs = hf(**inputs, labels=inputs["input_ids"]).loss.item()
    assert ours["loss"] == pytest.approx(theirs, rel=1e-5)

    step0 = import_hf(hf_dir, tiny_config(fresh_out(prepared, tmp_path / "run")))
    want = load_checkpoint(ckpt)["model"]
    assert all(torch.equal(load_checkpoint(step0)["model"][k], want[k]) for k in want)


@pytest.mark.parametrize("size", ["5 parsecs", "0", "-3GB", "GB"])
def test_export_max_shard_size_that_is_not_a_size_is_one_line(trained, tmp_path, capsys, size):
    assert kiln(["export", "--hf", str(trained[1]), str(tmp_path / "hf"), f"--max-shard-size={size}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kiln: error: --max-shard-size {size!r} is not a size") and "\n" not in err
    assert not (tmp_path / "hf").exists()
