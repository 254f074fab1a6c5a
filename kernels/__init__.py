"""Pallas kernels (installed as ``hsdjax.kernels``).

Python started at the repository root also finds this folder as a top-level module ``kernels``, the
name of Hugging Face's kernel-hub package that transformers probes for. Imported under that name it
loads nothing (no hsdjax, no jax), so such a probe stays harmless; the kernels are reached as
``hsdjax.kernels``.
"""

if __name__ == "hsdjax.kernels":
    from hsdjax.kernels.tree_attention import (
        MASKED_SCORE,
        attention_fn,
        tree_attention,
        tree_attention_reference,
    )

    __all__ = ["MASKED_SCORE", "attention_fn", "tree_attention", "tree_attention_reference"]
else:
    __all__ = []
