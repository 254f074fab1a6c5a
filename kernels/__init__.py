"""Pallas kernels (installed as ``hsdjax.kernels``)."""

from hsdjax.kernels.tree_attention import (
    attention_backend,
    tree_attention,
    tree_attention_auto,
    tree_attention_reference,
)

__all__ = ["attention_backend", "tree_attention", "tree_attention_auto", "tree_attention_reference"]
