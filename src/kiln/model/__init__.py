"""The model: its config, the architecture, its loss and how it is built. Pure math, no I/O, no distributed
code, nothing from kiln outside kiln.model (tests/test_layout.py checks it)."""

from kiln.model.build import build_model
from kiln.model.config import ModelConfig, MoEConfig, RopeScalingConfig
from kiln.model.llama import Llama

__all__ = ["Llama", "ModelConfig", "MoEConfig", "RopeScalingConfig", "build_model"]
