"""Bring your own tokenizer and model: a Llama made by transformers here (its own tokenizer, no <|eos|>,
sharded safetensors) is imported, pretrained further and exported back, with logits within 1e-4 each way."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_config

from kiln.cli import main as kiln
from kiln.checkpoint import list_checkpoints, load_checkpoint
from kiln.model.build import build_model

transformers = pytest.importorskip("transformers")
SIZES = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128}


def hub_tokenizer(path: Path):
    """A byte-level BPE with Hub-style special tokens (<s>, </s>, <unk>) and none of Kiln's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(ROOT / "README.md").read_text(encoding="utf-8")] * 2, trainer=trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hub") / "tiny-llama"
    folder.mkdir()
    tok = hub_tokenizer(folder / "tokenizer.json")
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # far from uniform logits, so 1e-4 means something
    model.save_pretrained(str(folder), max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def kiln_logits(cfg, ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    weights = load_checkpoint(ckpt)["model"]
    model = build_model(cfg.model, weights["tok_embeddings.weight"].shape[0], cfg.pack.seq_len)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(ids)


def own_config(prepared, root: Path, hub: Path, **tokenizer):
    out = root / "out"
    shutil.copytree(prepared.out / "docs", out / "docs")  # the same data section: the data stage is skipped
    tok = {"path": str(hub), "eos_token": "</s>", "bos_token": "<s>", "pad_token": None, **tokenizer}
    cfg = tiny_config(out, tokenizer=tok, model=SIZES, train={"max_steps": 3, "eval_every": 0},
                      checkpoint={"every": 3})
    path = root / "own.yaml"
    path.write_text(cfg.to_yaml())
    return cfg, path


def test_continue_pretraining_a_transformers_llama_and_export_it_back(prepared, hub_model, tmp_path, capsys):
    cfg, config = own_config(prepared, tmp_path, hub_model)
    assert kiln(["run", str(config), "--until", "pack"]) == 0
    shards = json.loads((cfg.out / "shards" / "manifest.json").read_text())
    assert shards["eos_id"] == 2 and shards["pad_id"] is None  # </s>; the Hub tokenizer has no pad
    assert (cfg.out / "tokenizer" / "tokenizer.json").read_bytes() == (hub_model / "tokenizer.json").read_bytes()

    assert kiln(["import", "--hf", str(hub_model), "--config", str(config)]) == 0
    step0 = Path(json.loads(capsys.readouterr().out)["checkpoint"])
    ids = torch.randint(0, shards["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(kiln_logits(cfg, step0, ids), hf_logits(hub_model, ids), atol=1e-4, rtol=0)

    assert kiln(["train", str(config)]) == 0
    last = list_checkpoints(cfg.out / "run" / "checkpoints")[-1]
    assert last.name == "step-00000003"
    capsys.readouterr()
    assert kiln(["export", "--hf", str(cfg.out / "run"), str(tmp_path / "back")]) == 0
    back = tmp_path / "back"
    trained = kiln_logits(cfg, last, ids)
    assert not torch.allclose(trained, hf_logits(hub_model, ids), atol=1e-3)  # it did train
    assert torch.allclose(hf_logits(back, ids), trained, atol=1e-4, rtol=0)

    # The export speaks the model's own tokens, without Kiln's.
    tok_cfg = json.loads((back / "tokenizer_config.json").read_text())
    # bos_token is the EOS: Kiln's documents follow </s> (never <s>), and the tokenizer puts it first by default.
    assert tok_cfg["eos_token"] == "</s>" and tok_cfg["bos_token"] == "</s>" and "pad_token" not in tok_cfg
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(back))
    assert hf_tok.eos_token_id == 2 and hf_tok("hello")["input_ids"][0] == 2


def test_export_nits_generation_config_file_modes_and_model_card(prepared, hub_model, tmp_path, capsys):
    from kiln.ops.export import export_hf

    cfg, config = own_config(prepared, tmp_path, hub_model)
    assert kiln(["run", str(config), "--until", "pack"]) == 0
    assert kiln(["import", "--hf", str(hub_model), "--config", str(config)]) == 0
    export_hf(list_checkpoints(cfg.out / "run" / "checkpoints")[-1], tmp_path / "hf")
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert "max_length" not in gen and gen["eos_token_id"] == 2
    mode = stat.S_IMODE((tmp_path / "hf" / "model.safetensors").stat().st_mode)
    assert mode & 0o044 == 0o044  # readable by group and others, like any file cp would write
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "library_name: transformers" in card and "LlamaForCausalLM" in card
    assert "lm_eval --model hf --model_args pretrained=" in card and "| training steps / tokens | 0 / 0 |" in card
    # Its install line is one that works: the model needs transformers and torch; Kiln is on no index.
    assert "`pip install transformers torch`" in card and "kiln-lm" not in card


def test_a_tokenizer_without_the_eos_it_is_told_names_its_special_tokens(prepared, hub_model, tmp_path, capsys):
    _, config = own_config(prepared, tmp_path, hub_model, eos_token="<|eos|>")
    assert kiln(["run", str(config), "--until", "pack"]) == 2
    err = capsys.readouterr().err
    assert "has no token '<|eos|>' (tokenizer.eos_token); set tokenizer.eos_token to one of its special tokens: " \
           "<unk>, <s>, </s>" in err and "Traceback" not in err


def test_import_names_a_missing_shard(prepared, hub_model, tmp_path, capsys):
    hub = tmp_path / "hub"
    shutil.copytree(hub_model, hub)
    shard = sorted(hub.glob("model-*.safetensors"))[1]
    shard.unlink()
    _, config = own_config(prepared, tmp_path, hub)
    assert kiln(["run", str(config), "--until", "pack"]) == 0
    capsys.readouterr()
    assert kiln(["import", "--hf", str(hub), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"names {shard.name}, which is not in {hub}; download every shard" in err and "Traceback" not in err


def test_import_with_another_tokenizer_says_to_set_tokenizer_path(workdir, hub_model, tmp_path, capsys):
    config = tmp_path / "kiln-tok.yaml"
    config.write_text(tiny_config(workdir, model=SIZES).to_yaml())  # shards packed with Kiln's own tokenizer
    assert kiln(["import", "--hf", str(hub_model), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"set tokenizer.path: {hub_model} (and tokenizer.eos_token to its end-of-text token)" in err
    assert "Traceback" not in err and not (workdir / "run").exists()
