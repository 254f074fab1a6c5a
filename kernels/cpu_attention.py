"""Tree attention for the CPU through hsdjax's C++ kernels (``cpu_attention.cc``, built into the same
library as ``cpu_matmul``).

Why: the jnp reference walks the cache in 256-slot blocks under a ``fori_loop``; on this CPU each
block cost ~100 us whatever its size, so a one-token step after a 2,000-token prompt spent more time
in attention than in all the matmuls. ``position_ordered_attention`` (what the model uses for passes
of at most ``MAX_NEW_TOKENS`` new tokens: decoding and verification) walks each new token's keys by
position, the cache below the row's prefix and then the token's own path in the pass, in fixed
256-position chunks shared with XLA's thread pool: only filled positions cost anything, and a token's
result is bitwise the same in a one-token step and in a tree pass (its path read from the cache or
from the pass), so greedy speculation cannot leave `ar` even at exact ties. Longer passes (prompt
chunks) keep the reference. Both read a float32 or a float16 cache (``ModelConfig.cache_dtype``).
``cache_attention`` is the cache-only kernel that returns the online-softmax state for a caller to
merge (not used by the model; tested).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hsdjax.kernels.cpu_matmul import (
    ATTENTION_F16_TARGET,
    ATTENTION_TARGET,
    TREE_ATTENTION_F16_TARGET,
    TREE_ATTENTION_TARGET,
)
from hsdjax.kernels.tree_attention import MASKED_SCORE, tree_attention_reference

MAX_NEW_TOKENS = 64


def cache_attention(qg: Float[Array, "B K R D"], cache_k: Float[Array, "B K S D"], cache_v: Float[Array, "B K S D"],
                    cache_len: Int[Array, " B"]) -> tuple[Float[Array, "B K R"], Float[Array, "B K R"],
                                                          Float[Array, "B K R D"]]:
    """The cache part of the softmax for pre-scaled queries: (max, sum of exp, sum of exp * v) per row
    (max MASKED_SCORE and zeros where a row has no valid slot). Kernel must be loaded (``cpu_matmul.load``).
    A float16 cache is read as it is (widened in the kernel); any other dtype is converted to float32."""
    b, k, r, d = qg.shape
    shapes = (jax.ShapeDtypeStruct((b, k, r), jnp.float32), jax.ShapeDtypeStruct((b, k, r), jnp.float32),
              jax.ShapeDtypeStruct((b, k, r, d), jnp.float32))
    half = cache_k.dtype == jnp.float16 and cache_v.dtype == jnp.float16
    cache_dtype = jnp.float16 if half else jnp.float32
    call = jax.ffi.ffi_call(ATTENTION_F16_TARGET if half else ATTENTION_TARGET, shapes, vmap_method="sequential")
    return call(qg.astype(jnp.float32), cache_k.astype(cache_dtype), cache_v.astype(cache_dtype),
                cache_len.astype(jnp.int32))


def cache_attention_reference(qg, cache_k, cache_v, cache_len):
    """``cache_attention`` in jnp (one pass over the whole bucket; for tests)."""
    cache_k, cache_v = cache_k.astype(jnp.float32), cache_v.astype(jnp.float32)
    s = jnp.einsum("bkrd,bksd->bkrs", qg, cache_k, preferred_element_type=jnp.float32)
    valid = jnp.arange(cache_k.shape[2])[None, :] < cache_len[:, None]
    s = jnp.where(valid[:, None, None], s, MASKED_SCORE)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid[:, None, None], jnp.exp(s - m[..., None]), 0.0)
    return m, p.sum(-1), jnp.einsum("bkrs,bksd->bkrd", p, cache_v, preferred_element_type=jnp.float32)


def tree_paths(tree_mask: Bool[Array, "B T T"]) -> tuple[Int[Array, "B T T"], Int[Array, "B T"]]:
    """Each new token's depth (how many of the pass's tokens it sees, minus one) and its path:
    ``anc[b, t, e]`` is the token at depth e that token t sees (itself at its own depth)."""
    t = tree_mask.shape[-1]
    depth = jnp.sum(tree_mask, axis=-1, dtype=jnp.int32) - 1
    at = tree_mask[:, :, :, None] & (depth[:, None, :, None] == jnp.arange(t, dtype=jnp.int32))  # [B, T, U, E]
    return jnp.argmax(at, axis=2).astype(jnp.int32), depth


def position_ordered_attention(q: Float[Array, "B T H D"], cache_k, cache_v, cache_len, new_k, new_v, tree_mask,
                               layer: Int[Array, ""] | None = None):
    """Attention of T new tokens over the cache and their paths in one kernel call that walks keys by
    position (``cpu_attention.cc``: a token's result is bitwise the same in a one-token step and a tree
    pass). A float16 cache is read as it is (widened in the kernel; the model rounds the new tokens' keys
    and values to float16 first, so the property holds); any other dtype is converted to float32. The
    kernel reads q, the new keys and values in the layout the model has them and writes the output in
    it ([B, T, heads, D]): no transposes around the call. ``layer``: the caches are stacks over layers
    ([L, B, K, S, D]) and the kernel reads this layer's in place (the scanned layer loop)."""
    b, t, h, d = q.shape
    anc, depth = tree_paths(tree_mask)
    half = cache_k.dtype == jnp.float16 and cache_v.dtype == jnp.float16
    cache_dtype = jnp.float16 if half else jnp.float32
    call = jax.ffi.ffi_call(TREE_ATTENTION_F16_TARGET if half else TREE_ATTENTION_TARGET,
                            jax.ShapeDtypeStruct((b, t, h, d), jnp.float32), vmap_method="sequential")
    out = call((q * (d ** -0.5)).astype(jnp.float32), cache_k.astype(cache_dtype), cache_v.astype(cache_dtype),
               cache_len.astype(jnp.int32), new_k.astype(jnp.float32), new_v.astype(jnp.float32), anc, depth,
               jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32))
    return out.astype(q.dtype)


def tree_attention_cpu(q: Float[Array, "B T H D"], cache_k, cache_v, cache_len, new_k: Float[Array, "B U K D"],
                       new_v: Float[Array, "B U K D"], tree_mask: Bool[Array, "B T U"],
                       layer: Int[Array, ""] | None = None, **_: object):
    """``tree_attention_reference`` through the kernel (see the module docstring); ``layer``: the caches
    are stacks over layers and this layer's is read."""
    b, t, h, d = q.shape
    if cache_k is None or cache_k.shape[-2] == 0 or t > MAX_NEW_TOKENS:
        if cache_k is not None and layer is not None:
            cache_k, cache_v = cache_k[layer][:b], cache_v[layer][:b]  # a row pool may hold more rows
        return tree_attention_reference(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask)
    return position_ordered_attention(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, layer)
