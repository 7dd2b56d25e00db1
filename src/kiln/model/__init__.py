"""The model architecture only: pure math, no I/O, no distributed code, nothing else from kiln."""

from kiln.model.llama import Llama, ModelArgs, RopeScaling
from kiln.model.moe import MoEArgs

__all__ = ["Llama", "ModelArgs", "MoEArgs", "RopeScaling"]
