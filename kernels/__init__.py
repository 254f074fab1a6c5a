"""Pallas kernels (installed as ``hsdjax.kernels``)."""

from hsdjax.kernels.tree_attention import (
    NEG_INF,
    attention_backend,
    attention_fn,
    tree_attention,
    tree_attention_auto,
    tree_attention_reference,
)

__all__ = ["NEG_INF", "attention_backend", "attention_fn", "tree_attention", "tree_attention_auto",
           "tree_attention_reference"]
