"""The model's one config: the `model:` section of a Kiln config, read by the model itself (litgpt's idea).

`kiln.config` imports these classes into its `Config`, so the YAML keys, their defaults and descriptions
(`kiln config show`) are defined here once; the model reads them directly, with no mirrored args class.
Validation lives here too (head counts, RoPE scaling factors, MoE top_k), so a config that loads builds.
Sizes that are not model keys come as arguments: the vocabulary (the shards' tokenizer) and the longest
sequence (`pack.seq_len`).

Pure pydantic: nothing else from kiln, so `kiln.model` stays importable on its own.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """The base of every config section (kiln.config uses it too): unknown keys are errors, assignments are
    validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScalingConfig(Section):
    """RoPE position scaling for a longer context than training saw (rules: kiln.model.llama's docstring)."""

    type: Literal["linear", "llama3"] = Field(
        description="linear position interpolation, or Llama 3.1's per-frequency rule"
    )
    factor: float = Field(gt=0, description="context extension factor; 1 changes nothing")
    original_max_seq_len: int = Field(8192, ge=1, description="llama3: the context the model was trained at")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above original/low are fully scaled")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below original/high are kept")

    @model_validator(mode="after")
    def _factors_ordered(self) -> "RopeScalingConfig":
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")
        return self


class MoEConfig(Section):
    """Mixture-of-experts feed-forward (rules: kiln.model.moe's docstring)."""
    n_experts: int = Field(0, ge=0, description="0 = dense SwiGLU in every block")
    top_k: int = Field(2, ge=1, description="experts per token")
    capacity_factor: float | None = Field(
        1.25,
        gt=0,
        description="expert capacity = ceil(factor * tokens * top_k / n_experts); "
        "assignments over it are dropped and counted; null = no drops",
    )
    every_n_layers: int = Field(1, ge=1, description="layer i is MoE when i % every_n_layers == 0")
    ffn_hidden: int | None = Field(None, ge=1, description="each expert's hidden width; null = the dense width")
    aux_loss_coef: float = Field(0.01, ge=0, description="load-balancing loss weight (Switch, Mixtral)")
    z_loss_coef: float = Field(0.001, ge=0, description="router z-loss weight (ST-MoE)")

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoEConfig":
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} must not exceed model.moe.n_experts={self.n_experts}")
        return self

    def is_moe_layer(self, layer_id: int) -> bool:
        """Megatron's moe_layer_freq: layer i is MoE when i % every_n_layers == 0."""
        return self.n_experts > 0 and layer_id % self.every_n_layers == 0


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
    rope_scaling: RopeScalingConfig | None = Field(None, description="null = plain RoPE")
    moe: MoEConfig = Field(default_factory=MoEConfig)
    document_masking: bool = Field(
        False, description="attention stays inside its document (block-causal): a token sees the tokens from the "
        "EOS before it on, never an earlier document packed into the same sample (kiln.model.attention)")
    document_positions: bool = Field(
        False, description="with document_masking: RoPE positions restart at 0 at each document's EOS")
    document_attention: Literal["auto", "flex", "sdpa"] = Field(
        "auto", description="the kernel of document masking: flex_attention, or scaled_dot_product_attention "
        "with an exact boolean mask; auto = flex on CUDA, masked SDPA elsewhere")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        kv = self.n_kv_heads or self.n_heads
        if self.document_positions and not self.document_masking:
            raise ValueError("model.document_positions restarts positions per document, which only means something "
                             "with model.document_masking: true; set both, or neither")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % kv:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={kv}")
        return self

    # The sizes the weights have, resolved from the keys (an exporter writes these, not the raw keys).
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        """The dense SwiGLU width: ffn_hidden, else 8/3·dim (floored, as Meta's Llama) up to multiple_of."""
        if self.ffn_hidden:
            return self.ffn_hidden
        h = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(h / self.multiple_of)
