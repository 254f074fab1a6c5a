"""Tree attention for the CPU with the KV cache's share computed by hsdjax's C++ kernel
(``cpu_attention.cc``, built into the same library as ``cpu_matmul``), the new tokens' share in jnp.

Why: the jnp reference walks the cache in 256-slot blocks under a ``fori_loop``; on this CPU each
block cost ~100 us whatever its size, so a one-token step after a 2,000-token prompt spent more time
in attention than in all the matmuls. The kernel walks only the valid slots of each row, in chunks
shared with XLA's thread pool, and returns the online-softmax state (max, sum, weighted values) that
is merged here with the new tokens' part exactly as the reference merges its blocks. Same semantics
and signature as ``tree_attention_reference``; used for passes of at most ``MAX_NEW_TOKENS`` new tokens
(decoding and verification), the reference for longer ones (prompt chunks, where XLA's batched
matmuls win)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hsdjax.kernels.cpu_matmul import ATTENTION_F16_TARGET, ATTENTION_TARGET
from hsdjax.kernels.tree_attention import (NEG_INF, finish_softmax, merge_softmax, new_token_softmax,
                                           tree_attention_reference)

MAX_NEW_TOKENS = 64


def cache_attention(qg: Float[Array, "B K R D"], cache_k: Float[Array, "B K S D"], cache_v: Float[Array, "B K S D"],
                    cache_len: Int[Array, " B"]) -> tuple[Float[Array, "B K R"], Float[Array, "B K R"],
                                                          Float[Array, "B K R D"]]:
    """The cache part of the softmax for pre-scaled queries: (max, sum of exp, sum of exp * v) per row
    (max NEG_INF and zeros where a row has no valid slot). Kernel must be loaded (``cpu_matmul.load``).
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
    s = jnp.where(valid[:, None, None], s, NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid[:, None, None], jnp.exp(s - m[..., None]), 0.0)
    return m, p.sum(-1), jnp.einsum("bkrs,bksd->bkrd", p, cache_v, preferred_element_type=jnp.float32)


def tree_attention_cpu(q: Float[Array, "B T H D"], cache_k, cache_v, cache_len, new_k: Float[Array, "B U K D"],
                       new_v: Float[Array, "B U K D"], tree_mask: Bool[Array, "B T U"], **_: object):
    """``tree_attention_reference`` with the cache part through the kernel (see the module docstring)."""
    b, t, h, d = q.shape
    if cache_k is None or cache_k.shape[2] == 0 or t > MAX_NEW_TOKENS:
        return tree_attention_reference(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask)
    qg, new_part = new_token_softmax(q, new_k, new_v, tree_mask)
    kh, g = qg.shape[1], qg.shape[2]
    m_c, l_c, acc_c = cache_attention(qg.reshape(b, kh, g * t, d), cache_k, cache_v, cache_len)
    cache_part = (m_c.reshape(b, kh, g, t, 1), l_c.reshape(b, kh, g, t, 1), acc_c.reshape(b, kh, g, t, d))
    _, l, acc = merge_softmax(new_part, cache_part)
    return finish_softmax(q, l, acc)
