"""examples/llama-3.2-1b.yaml, llama-3.1-8b.yaml and llama-3.1-70b.yaml are shaped exactly like Meta's models.

Each is built on the meta device (no memory) and holds the published parameter count (within 0.1%: it is
exact); every weight has the shape of the same weight in transformers' LlamaForCausalLM built from the
published config.json values; RoPE's scaled frequencies equal transformers' llama3 rule; and `kiln plan` on
each says the configured layout fits its devices (8 x H100; 64 for 70B).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from kiln.cli import main as kiln
from kiln.config import load_config
from kiln.model.build import build_model

# The published config.json values (meta-llama on the Hugging Face Hub) and safetensors parameter totals.
PUBLISHED = {
    "llama-3.2-1b": ({"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "intermediate_size": 8192, "rope_theta": 500000.0,
                      "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      "vocab_size": 128256, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}, 1_235_814_400, 8),
    "llama-3.1-8b": ({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "intermediate_size": 14336, "rope_theta": 500000.0,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      "vocab_size": 128256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}, 8_030_261_248, 8),
    "llama-3.1-70b": ({"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                       "num_key_value_heads": 8, "intermediate_size": 28672, "rope_theta": 500000.0,
                       "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       "vocab_size": 128256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
                      70_553_706_496, 64),
}


def example(name: str) -> Path:
    return ROOT / "examples" / f"{name}.yaml"


def meta_model(cfg):
    with torch.device("meta"):
        return build_model(cfg.model, cfg.tokenizer.vocab_size, cfg.pack.seq_len)


@pytest.mark.parametrize("name", PUBLISHED)
def test_example_holds_the_published_parameter_count(name):
    cfg = load_config(example(name))
    model = meta_model(cfg)
    params = sum(p.numel() for p in model.parameters())  # a tied head is counted once, as published
    published = PUBLISHED[name][1]
    assert abs(params - published) <= 0.001 * published, (params, published)
    assert params == published


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_weight_has_the_shape_of_transformers_llama_from_the_published_config(name):
    transformers = pytest.importorskip("transformers")
    from kiln.ops.export import to_hf

    hf_config, _, _ = PUBLISHED[name]
    cfg = load_config(example(name))
    with torch.device("meta"):
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config)).state_dict()
    ours = to_hf(meta_model(cfg).state_dict(), example(name))
    if hf_config["tie_word_embeddings"]:
        assert ours.pop("lm_head.weight") is not None  # the export leaves a tied head out; HF ties it on load
        theirs.pop("lm_head.weight")
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    m = cfg.model
    assert (m.norm_eps, m.rope_theta, m.tie_embeddings) == (hf_config["rms_norm_eps"], hf_config["rope_theta"],
                                                            hf_config["tie_word_embeddings"])


@pytest.mark.parametrize("name", PUBLISHED)
def test_rope_frequencies_follow_transformers_llama3_rule(name):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kiln.model.llama import scale_frequencies

    hf_config, _, _ = PUBLISHED[name]
    cfg = load_config(example(name))
    head_dim = cfg.model.head_dim
    plain = 1.0 / cfg.model.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ours = scale_frequencies(plain, cfg.model.rope_scaling).float()
    config = transformers.LlamaConfig(**hf_config)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", PUBLISHED)
def test_kiln_plan_says_the_configured_layout_fits(name, capsys):
    devices = PUBLISHED[name][2]
    assert kiln(["plan", str(example(name)), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["devices"] == devices and plan["device"] == "H100"
    memory = plan["memory"]
    assert memory["fits"] is True and memory["total"] < 0.9 * 80e9
    assert plan["hours"] > 0 and plan["params_non_embedding"] < PUBLISHED[name][1]
    assert kiln(["plan", str(example(name))]) == 0  # and the table prints
    assert "fits" in capsys.readouterr().out
