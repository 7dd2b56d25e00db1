"""Kiln: from raw web crawls to a trained language model."""

__version__ = "0.1.0"
