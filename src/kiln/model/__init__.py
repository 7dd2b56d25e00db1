"""The model architecture only: pure math, no I/O, no distributed code, nothing else from kiln."""

from kiln.model.llama import Llama, ModelArgs

__all__ = ["Llama", "ModelArgs"]
