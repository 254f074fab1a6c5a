"""Pallas kernel for tree-masked speculative-verification attention.

The T new tokens of each row (e.g. the nodes of a draft tree) attend to the valid prefix of
the KV cache plus those new tokens they are allowed to see under ``tree_mask``; one softmax
spans both parts (the semantics of :func:`hsdjax.runtime.model.attention`, with the cache validity
given as a length per row instead of a bool mask).

Shapes (B batch rows, T new tokens, H query heads, K kv heads with H = K * G, S cache slots,
D head dim):

=============  ===============  ==========================================================
q              [B, T, H, D]     RoPE'd queries, not yet scaled (scaled by D**-0.5 here)
cache_k/v      [B, K, S, D]     the KV cache
cache_len      [B] int32        slots >= cache_len are invalid (clipped to [0, S])
new_k/new_v    [B, U, K, D]     the new tokens' own keys / values (U = T for a tree)
tree_mask      [B, T, U] bool   query t may attend new token u; each query must see at least one
out            [B, T, H, D]     dtype of q; float32 accumulation
=============  ===============  ==========================================================

Kernel design (both variants share the math: an online, flash-attention style softmax that
starts from the new-token scores -- the diagonal guarantees a finite running max -- and then
folds in the cache block by block; invalid slots are masked to ``MASKED_SCORE`` and blocks past
``cache_len`` are skipped entirely):

* Queries are regrouped GQA-style per kv head: the G query heads x T tokens of one kv head form
  the M = G*T rows of one matrix (row ``g*T + t``), so every K/V block is loaded once per kv
  head and fed to one [M, D] x [D, block_s] matmul. The tree mask is expanded to these rows
  ([B, M, T], int32) by the wrapper.

* ``"loop"`` variant (GPU / Triton, and the default under ``interpret=True``): grid
  (B, K, M_pad // block_m). Each program holds ``block_m`` query rows and walks the cache with a
  ``fori_loop`` whose trip count is ``cdiv(cache_len, block_s)``, so work beyond ``cache_len`` is
  never issued. Triton needs power-of-two arrays and matmul dims >= 16, so M, T and D are padded
  to powers of two >= 16 (D is padded -- which copies the cache -- only when it is not already a
  power of two >= 16, i.e. never for real head dims 64 / 128).

* ``"grid"`` variant (TPU / Mosaic): grid (B, K, S // block_s) with the cache-block axis
  "arbitrary" and (m, l, acc) kept in VMEM scratch across it. ``cache_len`` is scalar-prefetched
  into SMEM; the cache index_map clamps the block index to the last valid block, so blocks past
  ``cache_len`` are neither fetched (the block index repeats, so no new DMA) nor computed
  (``pl.when``). Block shapes satisfy Mosaic tiling: cache blocks are (block_s, D) with D the
  full head dim (no cache copy, also for D = 64), query rows are padded to a multiple of 8
  (16 for 16-bit dtypes) and new-token columns to a multiple of 128 (lane width).

``tree_attention`` picks the variant with ``jax.lax.platform_dependent`` (TPU -> "grid",
anything else -> "loop"), decided at lowering time, so exporting from a CPU host for
``platforms=["cuda"]`` or ``["tpu"]`` gets the right kernel. Lowering for several platforms at once
(``platforms=["cuda", "tpu"]``) is not supported: JAX lowers every kept ``platform_dependent``
branch for all requested platforms, and each variant's pallas_call only lowers on its own
backend. The GPU kernel is the Triton custom call ``__gpu$xla.gpu.triton``, which ``jax.export``
only serializes with ``disabled_checks=[DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]``
(Triton IR has no cross-version stability guarantee); the TPU one is a stable ``tpu_custom_call``.
Which implementation a model runs (this kernel, the jnp reference, or the C++ kernel of
``cpu_attention``) is its config's ``backend`` (``hsdjax.runtime.config.BACKENDS``); ``attention_fn`` maps the
two implemented here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "MASKED_SCORE",
    "attention_fn",
    "tree_attention",
    "tree_attention_reference",
]

# The score of a masked (or invalid) attention key, everywhere hsdjax masks attention: these kernels,
# the jnp reference, the C++ kernel (``kNegInf`` in cpu_attention.cc, checked equal by
# tests/test_tree_attention.py) and the drafters' training rollouts. Finite, so a softmax over scores
# that are all masked never computes inf - inf (NaN). Not for logits: sampling drops tokens with -inf.
MASKED_SCORE = -1e30
REFERENCE_BLOCK_S = 256  # cache slots per block of the jnp reference (the CPU path)

_VARIANTS = ("auto", "loop", "grid")


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def tree_attention_reference(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, *,
                             interpret: bool = False, block_s: int = REFERENCE_BLOCK_S, block_m: int = 64,
                             variant: str = "auto"):
    """Pure-jnp tree attention (same signature as :func:`tree_attention`; ``interpret``, ``block_m``
    and ``variant`` are accepted and ignored). The CPU path of the model and the drafters.

    Like the kernels, it walks the cache in blocks of ``block_s`` slots with an online softmax and
    stops after the block holding the longest row's last valid slot, so its cost follows the filled
    length, not the cache bucket. ``cache_k`` None means no cache (a prompt's own causal pass).
    """
    del interpret, block_m, variant
    qg, (m, l, acc) = new_token_softmax(q, new_k, new_v, tree_mask)
    if cache_k is not None and cache_k.shape[2] > 0:
        m, l, acc = _reference_cache_part(qg, cache_k, cache_v, cache_len.astype(jnp.int32), m, l, acc, block_s)
    return finish_softmax(q, l, acc)


QUERY_BLOCK = 128  # a long pass (a prompt piece) attends to its own tokens in blocks of this many queries


def new_token_softmax(q, new_k, new_v, tree_mask):
    """The queries regrouped per kv head and pre-scaled ([B, K, G, T, D]) and the online-softmax state
    (max, sum, weighted values) of the new tokens' part, where every softmax starts (each query sees at
    least itself, so the max is finite).

    A pass longer than ``QUERY_BLOCK`` (T = U, a prompt piece) runs in blocks of queries, each against
    the new tokens up to its own last one: no query sees a later new token (causal prompts, and trees
    listed ancestors first), so the skipped scores are masked ones. That halves a long piece's score
    work and keeps each block's scores small (at 8 x 512 tokens, 1.5x faster on a 2-core Xeon)."""
    b, t, h, d = q.shape
    kh = new_k.shape[2]
    qg = (q * (d ** -0.5)).reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4)
    if t <= QUERY_BLOCK or new_k.shape[1] != t:
        return qg, _scores_softmax(qg, new_k, new_v, tree_mask)
    parts = [_scores_softmax(qg[:, :, :, s:s + QUERY_BLOCK], new_k[:, :s + QUERY_BLOCK],
                             new_v[:, :s + QUERY_BLOCK], tree_mask[:, s:s + QUERY_BLOCK, :s + QUERY_BLOCK])
             for s in range(0, t, QUERY_BLOCK)]
    return qg, tuple(jnp.concatenate([p[i] for p in parts], axis=3) for i in range(3))


def _scores_softmax(qg, new_k, new_v, tree_mask):
    """The online-softmax state of grouped queries ``qg`` against the new tokens ``tree_mask`` shows them."""
    s_new = jnp.einsum("bkgtd,bukd->bkgtu", qg, new_k, preferred_element_type=jnp.float32)
    s_new = jnp.where(tree_mask[:, None, None], s_new, MASKED_SCORE)
    m = jnp.max(s_new, axis=-1, keepdims=True)
    p_new = jnp.exp(s_new - m)
    l = jnp.sum(p_new, axis=-1, keepdims=True)
    acc = jnp.einsum("bkgtu,bukd->bkgtd", p_new.astype(new_v.dtype), new_v, preferred_element_type=jnp.float32)
    return m, l, acc


def merge_softmax(a, b):
    """Two online-softmax states (max, sum, weighted values) over disjoint keys as one."""
    m = jnp.maximum(a[0], b[0])
    wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, wa * a[1] + wb * b[1], wa * a[2] + wb * b[2]


def finish_softmax(q, l, acc):
    """The attention output [B, T, H, D] (dtype of q) from the final state of ``new_token_softmax``'s layout."""
    b, t, h, d = q.shape
    return (acc / l).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def _reference_block(qg, k, v, start, lens, m, l, acc):
    """Fold cache slots start .. start + len(k) into the online softmax state (m, l, acc)."""
    s = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    slot = start + jnp.arange(k.shape[2], dtype=jnp.int32)
    s = jnp.where((slot[None, :] < lens[:, None])[:, None, None, None], s, MASKED_SCORE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
    p = p.astype(jnp.promote_types(v.dtype, qg.dtype))  # a float16 cache under float32 compute: float32
    acc = alpha * acc + jnp.einsum("bkgts,bksd->bkgtd", p, v, preferred_element_type=jnp.float32)
    return m_new, l, acc


def _reference_cache_part(qg, cache_k, cache_v, lens, m, l, acc, block_s):
    """The cache's share of the softmax: one block when the cache is small, else a loop over the
    blocks up to the longest row (a traced trip count: no work past the filled length). Measured on
    this CPU, this beat one ``lax.switch`` over static prefixes (which copies the strided slices)."""
    b, kh, s, d = cache_k.shape
    bs = block_s if (s > block_s and s % block_s == 0) else s
    if bs == s:
        return _reference_block(qg, cache_k, cache_v, 0, lens, m, l, acc)

    def body(i, carry):
        start = i * bs
        k = lax.dynamic_slice(cache_k, (0, 0, start, 0), (b, kh, bs, d))
        v = lax.dynamic_slice(cache_v, (0, 0, start, 0), (b, kh, bs, d))
        return _reference_block(qg, k, v, start, lens, *carry)

    n = jnp.minimum((jnp.max(jnp.clip(lens, 0, s)) + bs - 1) // bs, s // bs)
    return lax.fori_loop(0, n, body, (m, l, acc))


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------

def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _num_blocks(length, block):
    """cdiv(length, block) for length >= 0. lax.div (truncating) rather than `//`: jnp's floor
    division emits a sign() whose Mosaic lowering queries the local TPU generation, which fails
    when exporting for TPU from a host without one."""
    return lax.div(length + (block - 1), jnp.int32(block))


def _precision(dtype):
    # f32 inputs: exact f32 matmuls (Triton would otherwise use TF32); narrower inputs: default.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _dot_nt(a, b, precision):
    """a [M, D] . b [N, D]^T -> [M, N] float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_nn(a, b, precision):
    """a [M, N] . b [N, D] -> [M, D] float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _new_token_part(q, nk, nv, mask, precision):
    """Softmax state (m, l, acc) over the new tokens alone. q [M, D], nk/nv [U, D], mask [M, U]."""
    s = _dot_nt(q, nk.astype(q.dtype), precision)
    s = jnp.where(mask != 0, s, MASKED_SCORE)
    m = jnp.max(s, axis=1, keepdims=True)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=1, keepdims=True)
    acc = _dot_nn(p.astype(nv.dtype), nv, precision)
    return m, l, acc


def _cache_block_update(q, k, v, start, length, m, l, acc, precision):
    """Fold one cache block (slots start .. start + len(k)) into the softmax state."""
    s = _dot_nt(q, k.astype(q.dtype), precision)
    slot = start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(slot < length, s, MASKED_SCORE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + _dot_nn(p.astype(v.dtype), v, precision)
    return m_new, l, acc


def _check_inputs(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, block_s):
    if q.ndim != 4 or cache_k.ndim != 4:
        raise ValueError(f"expected q [B,T,H,D] and cache_k [B,K,S,D], got {q.shape}, {cache_k.shape}")
    b, t, h, d = q.shape
    _, kh, s, dk = cache_k.shape
    if cache_k.shape[0] != b or dk != d or cache_v.shape != cache_k.shape:
        raise ValueError(f"cache shapes {cache_k.shape}/{cache_v.shape} do not match q {q.shape}")
    if h % kh:
        raise ValueError(f"{h} query heads are not a multiple of {kh} kv heads")
    u = new_k.shape[1]
    if new_k.shape != (b, u, kh, d) or new_v.shape != new_k.shape:
        raise ValueError(f"new_k/new_v must be {(b, u, kh, d)}, got {new_k.shape}/{new_v.shape}")
    if tree_mask.shape != (b, t, u):
        raise ValueError(f"tree_mask must be {(b, t, u)}, got {tree_mask.shape}")
    if cache_len.shape != (b,):
        raise ValueError(f"cache_len must be [{b}], got {cache_len.shape}")
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two >= 16, got {block_s}")


def _cache_blocking(s: int, block_s: int) -> tuple[int, int]:
    """(block size, padded cache length): block_s, or the next power of two >= S for tiny caches."""
    bs = block_s if s >= block_s else max(16, _next_pow2(s))
    return bs, _round_up(s, bs)


def _layout(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, *, m_pad, u_pad, d_pad, s_pad):
    """Regroup the inputs into the kernels' padded layout."""
    b, t, h, d = q.shape
    kh, s = cache_k.shape[1], cache_k.shape[2]
    g = h // kh
    qs = q * (d ** -0.5)  # scaled in q's dtype, exactly like the reference
    qm = qs.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, d)
    qm = _pad_axis(_pad_axis(qm, 2, m_pad), 3, d_pad)
    nk = _pad_axis(_pad_axis(new_k.transpose(0, 2, 1, 3), 2, u_pad), 3, d_pad)
    nv = _pad_axis(_pad_axis(new_v.transpose(0, 2, 1, 3), 2, u_pad), 3, d_pad)
    u = tree_mask.shape[2]
    mask = jnp.broadcast_to(tree_mask[:, None], (b, g, t, u)).reshape(b, g * t, u).astype(jnp.int32)
    mask = _pad_axis(_pad_axis(mask, 1, m_pad), 2, u_pad)  # padded rows/columns: fully masked
    ck = _pad_axis(_pad_axis(cache_k, 2, s_pad), 3, d_pad)
    cv = _pad_axis(_pad_axis(cache_v, 2, s_pad), 3, d_pad)
    lens = jnp.clip(cache_len.astype(jnp.int32), 0, s)
    return qm, ck, cv, lens, nk, nv, mask


def _ungroup(out, b, t, h, d, kh):
    g = h // kh
    out = out[:, :, : g * t, :d].reshape(b, kh, g, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


# ----------------------------------------------------------------------------------------------
# "loop" variant: GPU (Triton) friendly
# ----------------------------------------------------------------------------------------------

def _loop_kernel(len_ref, q_ref, ck_ref, cv_ref, nk_ref, nv_ref, mask_ref, o_ref, *,
                 block_s: int, num_blocks: int, precision):
    q = q_ref[...]
    length = len_ref[0]
    m, l, acc = _new_token_part(q, nk_ref[...], nv_ref[...], mask_ref[...], precision)

    def body(i, carry):
        start = pl.multiple_of(i * block_s, block_s)
        k = ck_ref[pl.ds(start, block_s), :]
        v = cv_ref[pl.ds(start, block_s), :]
        return _cache_block_update(q, k, v, start, length, *carry, precision)

    n = jnp.minimum(_num_blocks(length, block_s), num_blocks)
    m, l, acc = lax.fori_loop(0, n, body, (m, l, acc))
    o_ref[...] = (acc / l).astype(o_ref.dtype)


def _tree_attention_loop(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, *,
                         interpret, block_s, block_m):
    b, t, h, d = q.shape
    kh, s = cache_k.shape[1], cache_k.shape[2]
    g = h // kh
    m_pad = max(16, _next_pow2(g * t))
    bm = min(m_pad, max(16, _next_pow2(block_m)))
    u_pad = max(16, _next_pow2(new_k.shape[1]))
    d_pad = d if (d >= 16 and d & (d - 1) == 0) else max(16, _next_pow2(d))
    bs, s_pad = _cache_blocking(s, block_s)
    qm, ck, cv, lens, nk, nv, mask = _layout(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask,
                                             m_pad=m_pad, u_pad=u_pad, d_pad=d_pad, s_pad=s_pad)
    kernel = functools.partial(_loop_kernel, block_s=bs, num_blocks=s_pad // bs,
                               precision=_precision(q.dtype))
    out = pl.pallas_call(
        kernel,
        grid=(b, kh, m_pad // bm),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, j, r: (i, 0)),                         # cache_len
            pl.BlockSpec((None, None, bm, d_pad), lambda i, j, r: (i, j, r, 0)),     # q rows
            pl.BlockSpec((None, None, s_pad, d_pad), lambda i, j, r: (i, j, 0, 0)),  # cache_k
            pl.BlockSpec((None, None, s_pad, d_pad), lambda i, j, r: (i, j, 0, 0)),  # cache_v
            pl.BlockSpec((None, None, u_pad, d_pad), lambda i, j, r: (i, j, 0, 0)),  # new_k
            pl.BlockSpec((None, None, u_pad, d_pad), lambda i, j, r: (i, j, 0, 0)),  # new_v
            pl.BlockSpec((None, bm, u_pad), lambda i, j, r: (i, r, 0)),              # row mask
        ],
        out_specs=pl.BlockSpec((None, None, bm, d_pad), lambda i, j, r: (i, j, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kh, m_pad, d_pad), q.dtype),
        # Triton params select the Triton lowering on GPU (the default there is Mosaic GPU).
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="tree_attention_loop",
    )(lens[:, None], qm, ck, cv, nk, nv, mask)
    return _ungroup(out, b, t, h, d, kh)


# ----------------------------------------------------------------------------------------------
# "grid" variant: TPU (Mosaic) friendly
# ----------------------------------------------------------------------------------------------

def _grid_kernel(len_ref, q_ref, ck_ref, cv_ref, nk_ref, nv_ref, mask_ref, o_ref,
                 m_sc, l_sc, acc_sc, *, block_s: int, precision):
    length = len_ref[pl.program_id(0)]
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m, l, acc = _new_token_part(q_ref[...], nk_ref[...], nv_ref[...], mask_ref[...], precision)
        m_sc[...] = m
        l_sc[...] = l
        acc_sc[...] = acc

    start = j * block_s

    @pl.when(start < length)
    def _block():
        m, l, acc = _cache_block_update(q_ref[...], ck_ref[...], cv_ref[...], start, length,
                                        m_sc[...], l_sc[...], acc_sc[...], precision)
        m_sc[...] = m
        l_sc[...] = l
        acc_sc[...] = acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)


def _tree_attention_grid(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, *,
                         interpret, block_s):
    b, t, h, d = q.shape
    kh, s = cache_k.shape[1], cache_k.shape[2]
    g = h // kh
    m_pad = _round_up(g * t, 8 * max(1, 4 // jnp.dtype(q.dtype).itemsize))  # 8 / 16 (bf16) sublanes
    u_pad = _round_up(new_k.shape[1], 128)
    bs, s_pad = _cache_blocking(s, block_s)
    qm, ck, cv, lens, nk, nv, mask = _layout(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask,
                                             m_pad=m_pad, u_pad=u_pad, d_pad=d, s_pad=s_pad)

    def cache_map(i, j, c, lens_ref):
        last = jnp.maximum(_num_blocks(lens_ref[i], bs) - 1, 0)
        return i, j, jnp.minimum(c, last), 0  # past cache_len: same block again -> no DMA

    kernel = functools.partial(_grid_kernel, block_s=bs, precision=_precision(q.dtype))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, kh, s_pad // bs),
            in_specs=[
                pl.BlockSpec((None, None, m_pad, d), lambda i, j, c, _: (i, j, 0, 0)),  # q rows
                pl.BlockSpec((None, None, bs, d), cache_map),                           # cache_k
                pl.BlockSpec((None, None, bs, d), cache_map),                           # cache_v
                pl.BlockSpec((None, None, u_pad, d), lambda i, j, c, _: (i, j, 0, 0)),  # new_k
                pl.BlockSpec((None, None, u_pad, d), lambda i, j, c, _: (i, j, 0, 0)),  # new_v
                pl.BlockSpec((None, m_pad, u_pad), lambda i, j, c, _: (i, 0, 0)),       # row mask
            ],
            out_specs=pl.BlockSpec((None, None, m_pad, d), lambda i, j, c, _: (i, j, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((m_pad, 1), jnp.float32),  # running max
                pltpu.VMEM((m_pad, 1), jnp.float32),  # running denominator
                pltpu.VMEM((m_pad, d), jnp.float32),  # running numerator
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, kh, m_pad, d), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_grid",
    )(lens, qm, ck, cv, nk, nv, mask)
    return _ungroup(out, b, t, h, d, kh)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def tree_attention(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, *,
                   interpret: bool = False, block_s: int = 128, block_m: int = 64,
                   variant: str = "auto"):
    """Tree-masked GQA attention of T new queries over (cache[:cache_len], new tokens).

    Args:
      q: [B, T, H, D] queries (RoPE'd, unscaled). cache_k, cache_v: [B, K, S, D].
      cache_len: [B] int32 valid cache slots per row. new_k, new_v: [B, T, K, D].
      tree_mask: [B, T, U] bool (U new keys, T for a tree); every query must see at least one.
      interpret: run the Pallas kernel in interpret mode (CPU testing).
      block_s: cache slots per block (power of two >= 16; S is padded to a multiple, which only
        copies the cache when S is not already one).
      block_m: query rows per program in the "loop" (GPU) variant.
      variant: "auto" (TPU -> "grid", otherwise "loop", decided at lowering time), "loop" or
        "grid".
    Returns:
      [B, T, H, D] in q's dtype.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
    _check_inputs(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask, block_s)
    loop = functools.partial(_tree_attention_loop, interpret=interpret, block_s=block_s, block_m=block_m)
    grid = functools.partial(_tree_attention_grid, interpret=interpret, block_s=block_s)
    args = (q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask)
    if variant == "loop":
        return loop(*args)
    if variant == "grid":
        return grid(*args)
    return lax.platform_dependent(*args, tpu=grid, default=loop)


def attention_fn(backend: str):
    """The tree attention of a resolved backend (``hsdjax.runtime.config.resolve_backend``): "reference" is the
    jnp reference, "pallas" the Pallas kernel (whose variant the lowering platform picks), except for
    attention without a cache (a prompt's own pass), which always uses the reference. The C++ kernel of
    "cpu-kernel" lives in ``cpu_attention`` (``hsdjax.runtime.model.attention_for`` maps all three)."""
    if backend == "reference":
        return tree_attention_reference
    if backend != "pallas":
        raise ValueError(f"attention_fn takes a resolved backend, reference or pallas (got {backend!r})")

    def pallas_or_reference(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask):
        fn = tree_attention_reference if cache_k is None else tree_attention
        return fn(q, cache_k, cache_v, cache_len, new_k, new_v, tree_mask)

    return pallas_or_reference
