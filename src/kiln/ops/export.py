"""`kiln export --hf` and `kiln import --hf`: a checkpoint to and from a Hugging Face Llama folder.

Kiln's Llama uses HF's rotate-half RoPE and the same RMSNorm order (normalise in fp32, cast, scale),
so the weights map one to one by name with no permutation. Neither direction needs `transformers`
installed: the folder is config.json + safetensors + tokenizer files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from kiln.config import Config
from kiln.errors import KilnError
from kiln.lock import pinned
from kiln.manifest import read_manifest, staging_dir, verify_folder, write_atomic, write_manifest, writes_folder
from kiln.names import check_name, listed_name
from kiln.tokenizer import NAME_KEYS, load_tokenizer, tokenizer_file, tokenizer_sha256

# Kiln name -> Hugging Face LlamaForCausalLM name; {i} is the layer number.
NAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]
EXPORT_STAGE = "hf-export"
MAX_SHARD_SIZE = 5 * 10**9  # bytes of one weight file: transformers' save_pretrained default ("5GB")
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + escaped + "$")


def rename(name: str, to_hf: bool) -> str | None:
    for kiln_name, hf_name in NAMES:
        src, dst = (kiln_name, hf_name) if to_hf else (hf_name, kiln_name)
        if m := _pattern(src).match(name):
            return dst.replace("{i}", m.groupdict().get("i") or "")
    return None


# Per-expert slices of Kiln's stacked expert weights (Mixtral's legacy layout, which transformers 4 and 5 both load).
EXPERT_NAMES = [
    ("layers.{i}.feed_forward.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
    ("layers.{i}.feed_forward.experts.w1", "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"),
    ("layers.{i}.feed_forward.experts.w3", "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"),
    ("layers.{i}.feed_forward.experts.w2", "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"),
]


def moe_settings(cfg: Config, where: Path) -> dict | None:
    """The Mixtral settings of an MoE model, None for a dense one; a clear error for what Mixtral cannot express."""
    moe = getattr(cfg.model, "moe", None)
    if moe is None or not moe.n_experts:
        return None
    if moe.every_n_layers != 1:
        raise KilnError(f"{where}: model.moe.every_n_layers={moe.every_n_layers} mixes dense and MoE blocks; "
                        "export --hf writes Mixtral, which has experts in every block, so this model is not supported")
    if moe.top_k == 1:
        raise KilnError(
            f"{where}: model.moe.top_k=1 weights the expert by its probability (Switch); Mixtral renormalises "
            "the top-k weights to 1, so export --hf does not support top_k=1"
        )
    return {"num_local_experts": moe.n_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False, "sliding_window": None}


def rope_parameters(cfg: Config) -> dict:
    theta = cfg.model.rope_theta
    s = getattr(cfg.model, "rope_scaling", None)
    if s is None:
        return {"rope_type": "default", "rope_theta": theta}
    if s.type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": s.factor}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}


def token_names(cfg: Config, tok) -> dict[str, str | None]:
    """{bos_token, eos_token, pad_token} of the export: the config's names (tokenizer.*) that the tokenizer has,
    others None; bos_token is the EOS token, the one every document follows in training (GPT-2's convention:
    a <|bos|> the model never saw would be a worse start for lm-eval's empty contexts and for generate)."""
    names = {k: getattr(cfg.tokenizer, k) for k in NAME_KEYS}
    names = {k: v if v is not None and tok.token_to_id(v) is not None else None for k, v in names.items()}
    return names | {"bos_token": names["eos_token"]}


def exported_tokenizer_json(tokenizer_file: Path, eos_token: str) -> str:
    """The export's tokenizer.json: the run's tokenizer with a post-processor that puts `eos_token` first, so
    transformers' `tok(text)` (and lm-eval on the folder) gives the model the conditioning it had in training."""
    from tokenizers import processors

    tok = load_tokenizer(tokenizer_file)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{eos_token} $A", pair=f"{eos_token} $A {eos_token}:1 $B:1",
        special_tokens=[(eos_token, tok.token_to_id(eos_token))])
    return tok.to_str()


def hf_config(cfg: Config, vocab_size: int, tok, where: Path = Path(".")) -> dict:
    args = cfg.model  # its properties are the resolved sizes (ffn hidden, kv heads) the weights have
    moe = moe_settings(cfg, where)
    rope = rope_parameters(cfg)
    config = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": (cfg.model.moe.ffn_hidden or args.hidden) if moe else args.hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.pack.seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope,
        # transformers 4 reads the scaling from rope_scaling; 5 from rope_parameters.
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": args.init_std,
        "use_cache": True,
        **{f"{k}_id": tok.token_to_id(v) if v else None for k, v in token_names(cfg, tok).items()},
    }
    return config | (moe or {})


def to_hf(weights: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in weights.items():
        if (hf := rename(name, to_hf=True)) is not None:
            out[hf] = t.contiguous()
            continue
        for kiln_name, hf_name in EXPERT_NAMES:
            if m := _pattern(kiln_name).match(name):
                hf_name = hf_name.replace("{i}", m["i"])
                if "{e}" not in hf_name:
                    out[hf_name] = t.contiguous()
                for e in range(t.shape[0]) if "{e}" in hf_name else []:
                    out[hf_name.replace("{e}", str(e))] = t[e].contiguous()
                break
        else:
            raise KilnError(f"{where}: weight {name!r} has no Hugging Face Llama/Mixtral equivalent")
    return out


def hf_sources(names, where: Path) -> dict[str, list[str]]:
    """{Kiln name: the HF names it is made of} for HF tensor `names`: one name, or a stacked expert tensor's
    experts in order; RoPE tables of older exports are left out (Kiln recomputes them)."""
    out: dict[str, list[str]] = {}
    experts: dict[str, dict[int, str]] = {}
    for name in names:
        if "rotary_emb" in name:
            continue
        if (kiln := rename(name, to_hf=False)) is not None:
            out[kiln] = [name]
            continue
        for kiln_name, hf_name in EXPERT_NAMES:
            if m := _pattern(hf_name).match(name):
                target = kiln_name.replace("{i}", m["i"])
                if "e" in m.groupdict():
                    experts.setdefault(target, {})[int(m["e"])] = name
                else:
                    out[target] = [name]
                break
        else:
            raise KilnError(f"{where}: tensor {name!r} is not part of a Kiln Llama or Mixtral")
    return out | {target: [parts[e] for e in sorted(parts)] for target, parts in experts.items()}


def tokenizer_files(names: dict[str, str | None], seq_len: int) -> dict[str, dict]:
    # Kiln pads on the right in training (samples are packed, no padding). A prompt that a user types with
    # <|eos|> in it means the token (split_special_tokens false), unlike crawled text in Kiln's own encoding.
    # add_bos_token: the post-processor (exported_tokenizer_json) already puts bos_token (= EOS) first; a
    # transformers version that rebuilt it from this flag would put the same token first.
    present = {k: v for k, v in names.items() if v}
    return {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", **present,
            "add_bos_token": True, "add_eos_token": False, "padding_side": "right", "model_max_length": seq_len,
            "split_special_tokens": False, "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": present,
    }


def _readable(folder: Path) -> None:
    """Files as a plain `cp` would make them (0666 less the umask): the staging writes leave some at 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~umask)


def _count(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def model_card(cfg: Config, config: dict, checkpoint: Path, out_dir: Path, params: int) -> str:
    """README.md of the export: what the model is, what it was trained on, how to load and evaluate it."""
    from kiln import __version__ as kiln_version

    state = json.loads((Path(checkpoint) / "state.json").read_text())
    step, tokens = state.get("step"), state.get("tokens_seen")
    val = (state.get("history") or {}).get("val_loss", {}).get(str(step))
    arch = config["architectures"][0]
    sizes = (f'{config["num_hidden_layers"]} / {config["hidden_size"]} / {config["num_attention_heads"]} '
             f'({config["num_key_value_heads"]})')
    inputs = ", ".join(cfg.data.inputs) or "(not recorded)"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [kiln, pretraining, {config["model_type"]}]
---

# {out_dir.name}

A {arch} of {params:,} parameters trained with Kiln {kiln_version}. It loads with `transformers` alone
(`pip install transformers torch`).

| | |
|---|---|
| layers / hidden size / heads (kv) | {sizes} |
| vocabulary | {config["vocab_size"]:,} |
| context | {cfg.pack.seq_len} tokens |
| training steps / tokens | {_count(step)} / {_count(tokens)} |
| validation loss at the last step | {"n/a" if val is None else f"{val:.4f}"} |
| data | {inputs} |
| exported from | {checkpoint} |

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("{out_dir}")
model = AutoModelForCausalLM.from_pretrained("{out_dir}")
```

Documents in training follow `{cfg.tokenizer.eos_token}`, so the tokenizer puts it first by default
(`tok(text)`; it is also the `bos_token`): that is the model's view of "the start of a document". A
`{cfg.tokenizer.eos_token}` typed in a prompt is that token.

## Evaluate with lm-eval-harness

```
lm_eval --model hf --model_args pretrained={out_dir} --tasks hellaswag --device cpu
```

The harness downloads its data sets; offline, `kiln eval CHECKPOINT --mc FILE.jsonl` scores a local
multiple-choice file with the harness's definitions of acc, acc_norm and acc_bytes, and the same numbers.
"""


@writes_folder(EXPORT_STAGE, out="out_dir", inputs=("checkpoint",))
def export_hf(checkpoint: Path, out_dir: Path, max_shard_size: int = MAX_SHARD_SIZE) -> dict:
    """Write `out_dir` as a transformers Llama (or, for MoE, Mixtral) folder from a verified Kiln checkpoint, pinned
    while it is read: the retention of a training still running spares it (`kiln.lock.pinned`). The weights go
    tensor by tensor into safetensors files of at most `max_shard_size` bytes (`_write_hf_weights`)."""
    with pinned(checkpoint, "was removed before it could be read (the checkpoint.keep_last retention of a training "
                            "still running); export again, naming the run folder for its newest checkpoint"):
        return _export_hf(Path(checkpoint), Path(out_dir), max_shard_size)


def _export_hf(checkpoint: Path, out_dir: Path, max_shard_size: int) -> dict:
    from kiln.checkpoint import CheckpointWeights, check_loads, checkpoint_config

    verify_folder(checkpoint)  # first: every file read below is one its manifest lists, inside it (kiln.names)
    check_loads(checkpoint)
    cfg = checkpoint_config(checkpoint)  # config.yaml and tokenizer.json: files its manifest lists (hashed above)
    tok_file = tokenizer_file(checkpoint)
    tok = load_tokenizer(tok_file)
    with CheckpointWeights(checkpoint) as weights, staging_dir(out_dir) as tmp:
        config = hf_config(cfg, weights.shape("tok_embeddings.weight")[0], tok, checkpoint)
        params = _write_hf_weights(weights, tmp, checkpoint, config["tie_word_embeddings"], max_shard_size)
        write_atomic(tmp / "config.json", json.dumps(config, indent=1))
        # No max_length: transformers would warn on every generate that it overrides max_new_tokens.
        write_atomic(tmp / "generation_config.json", json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
             "pad_token_id": config["pad_token_id"]}, indent=1))
        names = token_names(cfg, tok)
        write_atomic(tmp / "tokenizer.json", exported_tokenizer_json(tok_file, names["eos_token"]))
        for name, content in tokenizer_files(names, cfg.pack.seq_len).items():
            write_atomic(tmp / name, json.dumps(content, indent=1))
        write_atomic(tmp / "README.md", model_card(cfg, config, checkpoint, out_dir, params))
        _readable(tmp)
        write_manifest(tmp, stage=EXPORT_STAGE, source=str(checkpoint), step=read_manifest(checkpoint).get("step"))
    result = {
        "out_dir": str(out_dir),
        "model_type": config["model_type"],
        "parameters": params,
    }
    notes = []
    if config["model_type"] == "mixtral" and cfg.model.moe.capacity_factor is not None:
        notes.append(f"model.moe.capacity_factor={cfg.model.moe.capacity_factor} is not exported: Mixtral routes "
                     "without capacity limits, so outputs match Kiln's only where no token was dropped")
    if cfg.model.document_masking:
        notes.append("trained with model.document_masking: give transformers one document per sequence, after "
                     f"its {cfg.tokenizer.eos_token} (a packed sequence would attend across its documents)")
    if notes:
        result["note"] = "; ".join(notes)
    return result


def parse_size(text: str, what: str = "--max-shard-size") -> int:
    """A size as transformers writes it ("5GB" = 5·10^9, "500MiB" = 500·2^20, or bytes); one line otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = SIZE_UNITS.get(m[2].upper()) if m else None
    if unit is None or float(m[1]) * unit < 1:
        raise KilnError(f"{what} {text!r} is not a size; give bytes or a number with KB, MB, GB (powers of 10) "
                        "or KiB, MiB, GiB, e.g. 5GB")
    return int(float(m[1]) * unit)


def shard_files(names: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int) -> list[list]:
    """`names` (in order) cut into weight files of at most `max_shard_size` bytes each, as huggingface_hub's
    split_torch_state_dict_into_shards cuts them: a tensor that would overflow the current file starts the next;
    a tensor larger than the limit is a file of its own."""
    files: list[list] = [[]]
    size = 0
    for entry in names:
        nbytes = torch.Size(entry[2]).numel() * torch.empty((), dtype=entry[1]).element_size()
        if files[-1] and size + nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def _write_hf_weights(weights, folder: Path, checkpoint: Path, tied: bool, max_shard_size: int) -> int:
    """The export's weights, one Kiln tensor in memory at a time (read, renamed, written, dropped): the names and
    shapes come from meta tensors first, then each tensor is read as its file reaches it. One model.safetensors
    when they fit in `max_shard_size` bytes, else Hugging Face's layout: model-0000K-of-0000N.safetensors and
    model.safetensors.index.json ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). A tied
    lm_head is left out (HF ties it to embed_tokens on load). Returns the parameter count written."""
    from kiln.checkpoint import write_safetensors

    source: dict[str, str] = {}
    names = []
    for key in weights.keys():
        for hf_name, t in to_hf({key: weights.get_meta(key)}, checkpoint).items():
            if not (tied and hf_name == "lm_head.weight"):
                source[hf_name] = key
                names.append((hf_name, t.dtype, tuple(t.shape)))
    current: dict[str, Any] = {}

    def tensor_for(hf_name: str) -> torch.Tensor:
        key = source[hf_name]
        if current.get("key") != key:  # experts: one stacked tensor gives several HF tensors in a row
            current.clear()  # the previous tensor goes before the next is read
            current.update(key=key, hf=to_hf({key: weights.get(key)}, checkpoint))
        return current["hf"][hf_name]

    files = shard_files(names, max_shard_size)
    weight_map = {}
    for k, entries in enumerate(files, 1):
        file = "model.safetensors" if len(files) == 1 else f"model-{k:05d}-of-{len(files):05d}.safetensors"
        write_safetensors(folder / file, entries, tensor_for, metadata={"format": "pt"})
        weight_map.update({name: file for name, _, _ in entries})
    if len(files) > 1:
        total = sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for _, dt, shape in names)
        write_atomic(folder / "model.safetensors.index.json",
                     json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return sum(torch.Size(shape).numel() for _, _, shape in names)


# --- import -------------------------------------------------------------------------------------

def _config_mismatches(hf: dict, expected: dict) -> list[str]:
    keys = [
        "model_type",
        "vocab_size",
        "num_local_experts",
        "num_experts_per_tok",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
    ]
    out = [f"{k}: config.json has {hf.get(k)!r}, the config gives {expected.get(k)!r}"
           for k in keys if (k in hf or k in expected) and hf.get(k, expected.get(k)) != expected.get(k)]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {"rope_type": "default"}
    rope = {
        "rope_theta": hf.get("rope_theta", 10000.0),
        **rope,
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
    }
    for k, v in expected["rope_parameters"].items():
        if rope.get(k) != v:
            out.append(f"rope {k}: config.json has {rope.get(k)!r}, the config's model.rope_* gives {v!r}")
    if hf.get("max_position_embeddings", expected["max_position_embeddings"]) < expected["max_position_embeddings"]:
        out.append(
            f"max_position_embeddings {hf['max_position_embeddings']} "
            f"< pack.seq_len {expected['max_position_embeddings']}"
        )
    return out


def safetensors_files(hf_dir: Path) -> list[Path]:
    """model.safetensors, or the shards that model.safetensors.index.json's weight_map names, each a plain name
    inside `hf_dir` (`kiln.names`) and, in a folder Kiln exported (its manifest.json), listed and hashed there."""
    files = _export_manifest_files(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()), key=str)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KilnError(f"{index}: not a safetensors index (a JSON object with a weight_map): {exc}") from None
        paths = [_weight_file(hf_dir, n, files, index) for n in names]
        missing = [n for n, p in zip(names, paths) if not p.is_file()]
        if missing:
            raise KilnError(f"{index} names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                            f"not in {hf_dir}; download every shard")
        return paths
    if (hf_dir / "model.safetensors").is_file():
        return [_weight_file(hf_dir, "model.safetensors", files, hf_dir)]
    raise KilnError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json; import reads safetensors "
                    "weights (convert a pytorch_model.bin with transformers' save_pretrained)")


def _export_manifest_files(hf_dir: Path) -> dict[str, Any] | None:
    """The files of a folder `kiln export --hf` wrote, verified (sizes and sha256); None for another HF folder."""
    if not (hf_dir / "manifest.json").exists():
        return None
    return verify_folder(hf_dir)["files"]


def _weight_file(hf_dir: Path, name: str, files: dict[str, Any] | None, where: Path) -> Path:
    """A weight file a name in `where` gives. A folder Kiln did not write is the user's (no manifest to list it):
    its names must still be plain names inside it, but its symlinks are followed (a Hub cache snapshot's point
    into the cache's blobs/)."""
    return hf_dir / check_name(name, where) if files is None else listed_name(hf_dir, name, files, where)


def _read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """config.json as a JSON object whose sizes are integers (a one-line error naming the key otherwise); in a
    folder Kiln exported, a file its manifest lists (and safetensors_files verified)."""
    path = hf_dir / "config.json"
    if (hf_dir / "manifest.json").exists():
        path = listed_name(hf_dir, "config.json", read_manifest(hf_dir)["files"], hf_dir)
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KilnError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise KilnError(f"{path}: a JSON {type(hf).__name__}, not an object of model settings; give the config.json "
                        "of a Hugging Face Llama or Mixtral")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "num_local_experts",
                "num_experts_per_tok"):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise KilnError(f"{path}: {key} is {value!r}, not a whole number; the file is not a model config "
                            "transformers wrote")
    return hf


class HFWeights:
    """The tensors of an HF folder's safetensors files, read one at a time under Kiln's names (`get`: an expert
    tensor stacked from its experts), never all at once. A file that does not open or read is one line naming it.
    Use as a context manager (it keeps the files open)."""

    def __init__(self, files: list[Path], where: Path) -> None:
        from safetensors import safe_open

        self._open: list = []
        self._file_of: dict[str, Any] = {}
        for file in files:
            with self._readable(file):
                f = safe_open(str(file), framework="pt").__enter__()
                self._open.append(f)
                self._file_of.update({name: (file, f) for name in f.keys()})
        self.sources = hf_sources(self._file_of, where)

    @staticmethod
    def _readable(file: Path):
        from contextlib import contextmanager

        from safetensors import SafetensorError

        @contextmanager
        def guard():
            try:
                yield
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise KilnError(f"{file}: not a readable safetensors file ({str(exc)[:160]}); the download is cut "
                                "or the file is another format: download it again (safetensors only)") from None
        return guard()

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open:
            f.__exit__(None, None, None)
        self._open.clear()

    def shape(self, key: str) -> tuple[int, ...]:
        """Kiln tensor `key`'s shape, from the headers only."""
        shapes = [tuple(self._file_of[name][1].get_slice(name).get_shape()) for name in self.sources[key]]
        return shapes[0] if len(shapes) == 1 else (len(shapes), *shapes[0])

    def get(self, key: str) -> torch.Tensor:
        parts = []
        for name in self.sources[key]:
            file, f = self._file_of[name]
            with self._readable(file):
                parts.append(f.get_tensor(name))
        return parts[0] if len(parts) == 1 else torch.stack(parts)


def same_tokenizer(run_tokenizer: Path, hf_tokenizer: Path, eos_token: str) -> bool:
    """The folder's tokenizer.json is the run's, byte for byte, or what `export --hf` writes from it."""
    if tokenizer_sha256(run_tokenizer) == tokenizer_sha256(hf_tokenizer):
        return True
    try:
        return hf_tokenizer.read_text(encoding="utf-8") == exported_tokenizer_json(run_tokenizer, eos_token)
    except (UnicodeDecodeError, KilnError):
        return False


def import_hf(hf_dir: Path, cfg: Config) -> Path:
    """Write `{out_dir}/run/checkpoints/step-00000000/` from an HF Llama/Mixtral folder; `kiln train` resumes from it.

    The config must describe the same model (checked against config.json), and the run's tokenizer and shards
    must exist and be the folder's tokenizer. No Trainer is built: no process group, data loader or watchdog
    is started; the checkpoint is the state of a run at step 0 (train/checkpoint/checkpointer.py: its parts start
    fresh), which `kiln train` resumes like any other.
    """
    from kiln.lock import OutputLock
    from kiln.checkpoint import list_checkpoints

    hf_dir = Path(hf_dir)
    for name in ("config.json", "tokenizer.json"):
        if not (hf_dir / name).is_file():
            raise KilnError(f"{hf_dir}: no {name}; import reads a Hugging Face Llama folder: config.json, "
                            "tokenizer.json and model.safetensors (or shards listed in model.safetensors.index.json)")
    weight_files = safetensors_files(hf_dir)
    hf = _read_hf_config(hf_dir)
    run_tok = cfg.layout.tokenizer / "tokenizer.json"  # both folders' tokenizer.json read through their manifests
    if not run_tok.is_file() or not same_tokenizer(tokenizer_file(run_tok.parent), tokenizer_file(hf_dir),
                                                   cfg.tokenizer.eos_token):
        raise KilnError(
            f"{run_tok} is missing or differs from {hf_dir / 'tokenizer.json'}; the run's shards must be packed "
            f"with the model's own tokenizer: set tokenizer.path: {hf_dir} (and tokenizer.eos_token to its "
            "end-of-text token) in the config, then `kiln run CONFIG --until pack`"
        )
    expected = hf_config(cfg, int(hf.get("vocab_size", 0)), load_tokenizer(run_tok.parent), hf_dir)
    mismatches = _config_mismatches(hf, expected)
    if mismatches:
        raise KilnError(f"{hf_dir / 'config.json'} does not match the config's model section: {'; '.join(mismatches)}; "
                        "set the model.* keys to the folder's sizes")
    ckpt_dir = cfg.layout.checkpoints
    with OutputLock(cfg.layout.run, "`kiln import --hf`"):  # the lock `kiln train` takes: no run writes meanwhile
        if list_checkpoints(ckpt_dir):
            raise KilnError(f"{ckpt_dir} already holds checkpoints; import into a new run (another out_dir)")
        with HFWeights(weight_files, hf_dir) as weights:
            return write_step_zero(cfg, weights, weight_files[0])


def write_step_zero(cfg: Config, weights: HFWeights, source: Path) -> Path:
    """{out_dir}/run/checkpoints/step-00000000 with `weights`: what a run at step 0 would save.

    The config's model is built on the meta device and the weights' names and shapes checked against it (a
    mismatch is a one-line error naming `source`); then each tensor is read, cast to the model's dtype and
    written in turn (`StreamedWeights`), so the host holds one tensor, never the model. The optimizer state is a
    fresh AdamW's and the RNG state the one a run has after building its model, so the run that resumes from
    here is the run that would have started with these weights.
    """
    from kiln.checkpoint import StreamedWeights, rng_state
    from kiln.train.checkpoint import FullCheckpoint, RunInputs, TrainState, config_hash
    from kiln.train.checkpoint import resume as resume_checks
    from kiln.train.data import open_splits
    from kiln.train.determinism import layout
    from kiln.train.engine import build_optimizer
    from kiln.train.parallel import Dist
    from kiln import env
    from kiln.model.build import build_model

    resume_checks.require_prepared(cfg)
    tokenizer = cfg.layout.tokenizer / "tokenizer.json"
    tok_sha = tokenizer_sha256(cfg.layout.tokenizer)
    train_set, _ = open_splits(cfg, tok_sha)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)  # as the Trainer does before building its model (on meta: nothing drawn)
        model = build_model(cfg.model, int(train_set.manifest["vocab_size"]), cfg.pack.seq_len, device="meta")
        rngs = [rng_state(torch.device("cpu"))]
    names = [(k, v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()]
    tied = ({"output.weight": "tok_embeddings.weight"}
            if cfg.model.tie_embeddings and "output.weight" not in weights.sources else {})
    _check_fits(weights, names, tied, source)
    d = Dist()
    inputs = RunInputs(resume_checks.data_fingerprint(train_set), tok_sha, tokenizer,
                       cfg.layout.shards / "manifest.json", layout(d, cfg.train.deterministic), env.fingerprint)
    state = TrainState((), d.world, config_hash(cfg))  # no parts: each starts fresh on resume
    optimizer = build_optimizer(model, cfg.train, d.device)  # AdamW's state is empty until its first step
    dtypes = dict((k, dt) for k, dt, _ in names)
    streamed = StreamedWeights(names, lambda k: weights.get(tied.get(k, k)).to(dtypes[k]))
    fields = inputs.manifest_fields(state.config_hash)
    return FullCheckpoint().write(cfg.layout.checkpoints, 0, (streamed, optimizer.state_dict()), rngs,
                                  state.state_dict(), cfg.to_yaml(), tokenizer, fields, cfg.checkpoint.signing_key)


def _check_fits(weights: HFWeights, names: list, tied: dict[str, str], source: Path) -> None:
    """The HF tensors are the config's model's, by name and shape (headers only); else one line naming `source`."""
    want = {k: shape for k, _, shape in names}
    have = {k: weights.shape(k) for k in weights.sources}
    have |= {k: have[v] for k, v in tied.items() if k not in have and v in have}
    problems = []
    if missing := [k for k in want if k not in have]:
        problems.append(f"missing {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    if extra := [k for k in have if k not in want]:
        problems.append(f"unexpected {', '.join(extra[:5])}{' …' if len(extra) > 5 else ''}")
    problems += [f"{k} is {list(have[k])} there, {list(s)} in the config's model"
                 for k, s in want.items() if k in have and tuple(have[k]) != tuple(s)][:3]
    if problems:
        raise KilnError(f"{source} does not fit the config's model: {'; '.join(problems)}")
