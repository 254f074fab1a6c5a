"""Tree-masked verification attention: Pallas kernel (interpret mode) vs jnp reference vs numpy,
plus lowering/export of the kernel for GPU (Triton) and TPU (Mosaic) from a CPU-only host."""

from __future__ import annotations

import importlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdjax.errors import HsdjaxError
from hsdjax.kernels.tree_attention import (
    MASKED_SCORE,
    attention_fn,
    tree_attention,
    tree_attention_reference,
)
from hsdjax.runtime.config import BACKENDS, ModelConfig, resolve_backend

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

def ancestor_mask(parents) -> np.ndarray:
    """parents[t] < t (or -1 for a root) -> [T, T] bool: t attends itself and its ancestors."""
    t = len(parents)
    mask = np.zeros((t, t), dtype=bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_parents(rng: np.random.Generator, t: int) -> list[int]:
    """A random forest in topological order: node 0 is a root, node i > 0 hangs under one of
    0..i-1 (or, rarely, is another root)."""
    return [-1] + [int(rng.integers(-1, i)) if rng.random() < 0.1 else int(rng.integers(0, i))
                   for i in range(1, t)]


def make_inputs(seed: int, *, b: int, t: int, k: int, g: int, s: int, d: int, dtype=jnp.float32,
                lens=None, parents=None):
    rng = np.random.default_rng(seed)
    h = k * g

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

    q, ck, cv = normal(b, t, h, d), normal(b, k, s, d), normal(b, k, s, d)
    nk, nv = normal(b, t, k, d), normal(b, t, k, d)
    if lens is None:
        # always cover an empty and a full cache, then random lengths
        lens = [0, s, *rng.integers(0, s + 1, size=max(0, b - 2)).tolist()][:b]
    if parents is None:
        parents = [random_parents(rng, t) for _ in range(b)]
    mask = np.stack([ancestor_mask(p) for p in parents])
    return q, ck, cv, jnp.asarray(lens, jnp.int32), nk, nv, jnp.asarray(mask)


def naive_numpy(q, ck, cv, lens, nk, nv, mask) -> np.ndarray:
    """Per (row, query, head) loops in float64: softmax over valid cache slots and allowed new tokens."""
    q, ck, cv, nk, nv = (np.asarray(x, np.float64) for x in (q, ck, cv, nk, nv))
    lens, mask = np.asarray(lens), np.asarray(mask)
    b, t, h, d = q.shape
    k = ck.shape[1]
    out = np.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                kv = hi // (h // k)
                keys = np.concatenate([ck[bi, kv, : lens[bi]], nk[bi, mask[bi, ti], kv]])
                vals = np.concatenate([cv[bi, kv, : lens[bi]], nv[bi, mask[bi, ti], kv]])
                logits = keys @ q[bi, ti, hi] / np.sqrt(d)
                w = np.exp(logits - logits.max())
                out[bi, ti, hi] = (w / w.sum()) @ vals
    return out


def assert_close(actual, expected, dtype):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               **TOL[dtype])


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def test_reference_matches_naive_numpy():
    args = make_inputs(0, b=3, t=5, k=2, g=3, s=24, d=8, lens=[0, 24, 11])
    ref = tree_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(ref), naive_numpy(*args), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), s_log=st.integers(4, 9), block_log=st.integers(4, 6), b=st.integers(1, 3),
       t=st.sampled_from([1, 3, 8]), data=st.data())
def test_blocked_reference_over_random_lengths_and_buckets(seed, s_log, block_log, b, t, data):
    """The blocked online softmax (a loop up to the longest row) equals one pass over the whole bucket
    and a float64 loop, for any lengths, bucket sizes and block sizes (also blocks >= the bucket)."""
    s = 2 ** s_log
    lens = [data.draw(st.integers(0, s)) for _ in range(b)]
    args = make_inputs(seed, b=b, t=t, k=2, g=2, s=s, d=8, lens=lens)
    blocked = tree_attention_reference(*args, block_s=2 ** block_log)
    whole = tree_attention_reference(*args, block_s=s)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(blocked), naive_numpy(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [[0, 0], [0, 40]])
def test_a_long_pass_attends_in_query_blocks(lens, monkeypatch):
    """A pass longer than ``QUERY_BLOCK`` (a prompt piece) attends in blocks of queries, each to the new
    tokens up to its own: the same attention as one block, for causal prompts with padding and for
    trees listed ancestors first, with and without a filled cache."""
    ta = importlib.import_module("hsdjax.kernels.tree_attention")  # the module (the package exports the function)

    rng = np.random.default_rng(11)
    causal = [list(range(-1, 69)), list(range(-1, 51)) + [-1] * 18]  # the second: 52 tokens, then padding
    for parents in (causal, [random_parents(rng, 70) for _ in range(2)]):
        args = make_inputs(4, b=2, t=70, k=2, g=2, s=64, d=8, lens=lens, parents=parents)
        whole = np.asarray(tree_attention_reference(*args))
        monkeypatch.setattr(ta, "QUERY_BLOCK", 16)
        blocked = np.asarray(tree_attention_reference(*args))
        monkeypatch.setattr(ta, "QUERY_BLOCK", 128)
        np.testing.assert_allclose(blocked, whole, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(blocked, naive_numpy(*args), atol=1e-5, rtol=1e-5)


def test_blocked_reference_skips_blocks_past_the_longest_row():
    """Blocks past the longest row are never read: NaN/inf there cannot leak into the output."""
    q, ck, cv, lens, nk, nv, mask = make_inputs(3, b=2, t=4, k=2, g=3, s=256, d=8, lens=[40, 70])
    poisoned_k = ck.at[:, :, 96:].set(jnp.nan)  # blocks of 32: [64, 96) holds row 1's last slots
    poisoned_v = cv.at[:, :, 96:].set(jnp.inf)
    out = jax.jit(lambda *a: tree_attention_reference(*a, block_s=32))(q, poisoned_k, poisoned_v, lens, nk, nv, mask)
    np.testing.assert_allclose(np.asarray(out), naive_numpy(q, ck, cv, lens, nk, nv, mask), atol=1e-5, rtol=1e-5)


def rectangular_inputs(seed, *, b=2, t=3, u=7, k=2, g=2, s=64, d=16):
    """T queries over U new keys (drafter attention: chain or tree-local keys), each query sees >= 1."""
    q, ck, cv, lens, _, _, _ = make_inputs(seed, b=b, t=t, k=k, g=g, s=s, d=d)
    rng = np.random.default_rng(seed)
    nk = jnp.asarray(rng.standard_normal((b, u, k, d), dtype=np.float32))
    nv = jnp.asarray(rng.standard_normal((b, u, k, d), dtype=np.float32))
    mask = rng.random((b, t, u)) < 0.4
    mask[:, np.arange(t), np.arange(t) % u] = True
    return q, ck, cv, lens, nk, nv, jnp.asarray(mask)


@pytest.mark.parametrize("variant", ["loop", "grid"])
def test_rectangular_new_keys(variant):
    args = rectangular_inputs(4)
    np.testing.assert_allclose(np.asarray(tree_attention_reference(*args, block_s=16)), naive_numpy(*args),
                               atol=1e-5, rtol=1e-5)
    assert_close(tree_attention(*args, interpret=True, block_s=16, variant=variant),
                 tree_attention_reference(*args), jnp.float32)


def test_attention_fn_settings():
    assert attention_fn("reference") is tree_attention_reference
    assert resolve_backend("pallas") == "pallas" and resolve_backend("reference") == "reference"
    assert resolve_backend("cpu-kernel") == "cpu-kernel"
    for unresolved in ("auto", "fast"):
        with pytest.raises(ValueError, match="resolved backend"):
            attention_fn(unresolved)
    with pytest.raises(HsdjaxError, match="backend must be one of"):
        resolve_backend("fast")
    with pytest.raises(HsdjaxError, match="backend must be one of"):
        ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                    num_kv_heads=1, head_dim=8, backend="fast")
    assert BACKENDS == ("auto", "reference", "pallas", "cpu-kernel")


def test_one_masked_score_in_python_and_cpp():
    """The masked-score constant is defined once in Python; the C++ kernel's ``kNegInf`` holds the same
    float32 value (one constexpr, read here from the source)."""
    import re
    from pathlib import Path

    import hsdjax.kernels.cpu_attention as cpu_attention

    source = Path(cpu_attention.__file__).with_name("cpu_attention.cc").read_text()
    defined = re.findall(r"constexpr float kNegInf = ([-+0-9.eE]+)f;", source)
    assert len(defined) == 1 and np.float32(defined[0]) == np.float32(MASKED_SCORE)
    code = re.sub(r"//[^\n]*", "", source)  # comments may cite the value
    assert code.count(defined[0]) == 1 and "INFINITY" not in code and "infinity()" not in code
    assert np.isfinite(np.float32(MASKED_SCORE))  # an all-masked softmax never computes inf - inf


# ----------------------------------------------------------------------------------------------
# Kernel (interpret mode) vs reference
# ----------------------------------------------------------------------------------------------

# (K, G, T, D): H = K*G covers H = K, 3K, 6K with K in {1, 2, 3}; T in {1, 5, 16}; D in {8, 64}.
LAYOUTS = [
    (1, 1, 1, 8),
    (2, 1, 16, 64),
    (3, 1, 5, 8),
    (1, 3, 5, 64),
    (2, 3, 16, 8),
    (3, 3, 1, 64),
    (1, 6, 16, 8),
    (2, 6, 5, 64),
    (3, 6, 5, 8),
]


# every layout in float32; bfloat16 on three that cover G = 1, 3, 6, D = 8, 64 and T = 5, 16 (the
# rest in the slow run: the dtype only changes the inputs' rounding, not the kernel's indexing)
BF16_DEFAULT = ((2, 1, 16, 64), (2, 3, 16, 8), (2, 6, 5, 64))
KERNEL_CASES = ([pytest.param(jnp.float32, *lay, id=f"f32-{lay}") for lay in LAYOUTS]
                + [pytest.param(jnp.bfloat16, *lay, id=f"bf16-{lay}",
                                marks=() if lay in BF16_DEFAULT else pytest.mark.slow) for lay in LAYOUTS])


@pytest.mark.parametrize("variant", ["loop", "grid"])
@pytest.mark.parametrize("dtype,k,g,t,d", KERNEL_CASES)
def test_kernel_matches_reference(variant, dtype, k, g, t, d):
    # S = 256 with 128-slot blocks: an empty cache, a full one, and partial last blocks
    args = make_inputs(hash((k, g, t, d)) % 1000, b=4, t=t, k=k, g=g, s=256, d=d, dtype=dtype)
    out = tree_attention(*args, interpret=True, block_s=128, variant=variant)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert_close(out, tree_attention_reference(*args), dtype)


@pytest.mark.parametrize("variant", ["loop", "grid"])
@pytest.mark.parametrize("s,block_s,lens", [
    (64, 16, [0, 1, 16, 17, 63, 64]),  # many small blocks, lengths on and around block edges
    (40, 128, [0, 40, 7, 39, 33, 1]),  # cache smaller than a block, not a power of two (padded)
    (96, 32, [96, 95, 32, 31, 1000, -3]),  # out-of-range lengths are clipped to [0, S]
])
def test_kernel_cache_blocking(variant, s, block_s, lens):
    args = make_inputs(7, b=6, t=5, k=2, g=3, s=s, d=8, lens=lens)
    out = tree_attention(*args, interpret=True, block_s=block_s, variant=variant)
    ref = tree_attention_reference(*args)
    assert_close(out, ref, jnp.float32)
    clipped = np.clip(np.asarray(lens), 0, s)
    np.testing.assert_allclose(np.asarray(out), naive_numpy(*args[:3], clipped, *args[4:]), atol=1e-5)


def test_kernel_block_m_tiling():
    """The GPU variant splits G*T query rows over programs; 6*16 = 96 rows -> 128 padded, 4 x 32."""
    args = make_inputs(3, b=2, t=16, k=1, g=6, s=64, d=8)
    out = tree_attention(*args, interpret=True, block_s=32, block_m=32, variant="loop")
    assert_close(out, tree_attention_reference(*args), jnp.float32)


def test_kernel_chain_and_diagonal_trees():
    """The two extremes: a single chain (causal) and isolated nodes (diagonal only)."""
    t = 5
    args = make_inputs(5, b=2, t=t, k=2, g=3, s=32, d=8, lens=[9, 0],
                       parents=[list(range(-1, t - 1)), [-1] * t])
    np.testing.assert_array_equal(np.asarray(args[-1][0]), np.tril(np.ones((t, t), bool)))
    np.testing.assert_array_equal(np.asarray(args[-1][1]), np.eye(t, dtype=bool))
    for variant in ("loop", "grid"):
        out = tree_attention(*args, interpret=True, block_s=16, variant=variant)
        np.testing.assert_allclose(np.asarray(out), naive_numpy(*args), atol=1e-5)


def test_kernel_under_jit_auto_variant():
    args = make_inputs(11, b=3, t=5, k=1, g=3, s=32, d=8)
    fn = jax.jit(partial(tree_attention, interpret=True, block_s=16))  # "auto": "loop" on CPU
    assert_close(fn(*args), tree_attention_reference(*args), jnp.float32)


_H_T, _H_K, _H_G, _H_S, _H_D, _H_B = 7, 2, 3, 64, 8, 3
_hyp_kernels = {v: jax.jit(partial(tree_attention, interpret=True, block_s=16, variant=v))
                for v in ("loop", "grid")}


@st.composite
def _trees(draw):
    """Per row: a parent array (node i hangs under some j < i, or is a root) and a cache length."""
    rows = []
    for _ in range(_H_B):
        parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, _H_T)]
        rows.append((parents, draw(st.integers(0, _H_S))))
    return rows


@settings(max_examples=15, deadline=None)
@given(rows=_trees(), seed=st.integers(0, 2**16), variant=st.sampled_from(["loop", "grid"]))
def test_kernel_property_random_trees(rows, seed, variant):
    parents = [p for p, _ in rows]
    lens = [n for _, n in rows]
    args = make_inputs(seed, b=_H_B, t=_H_T, k=_H_K, g=_H_G, s=_H_S, d=_H_D, lens=lens, parents=parents)
    out = _hyp_kernels[variant](*args)
    assert_close(out, tree_attention_reference(*args), jnp.float32)


# ----------------------------------------------------------------------------------------------
# Dispatch and validation
# ----------------------------------------------------------------------------------------------

def test_backend_dispatch():
    expected = "pallas" if jax.default_backend() in ("gpu", "tpu") else "reference"
    assert resolve_backend() == resolve_backend("auto") == expected
    args = make_inputs(2, b=2, t=5, k=1, g=3, s=32, d=8)
    out = attention_fn(resolve_backend())(*args)
    assert_close(out, tree_attention_reference(*args), jnp.float32)


def test_rejects_bad_inputs():
    q, ck, cv, lens, nk, nv, mask = make_inputs(0, b=2, t=5, k=2, g=3, s=32, d=8)
    with pytest.raises(ValueError, match="kv heads"):
        tree_attention(q[:, :, :5], ck, cv, lens, nk, nv, mask, interpret=True)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(q, ck, cv, lens, nk, nv, mask[:, :4, :4], interpret=True)
    with pytest.raises(ValueError, match="block_s"):
        tree_attention(q, ck, cv, lens, nk, nv, mask, interpret=True, block_s=24)
    with pytest.raises(ValueError, match="variant"):
        tree_attention(q, ck, cv, lens, nk, nv, mask, interpret=True, variant="fast")


# ----------------------------------------------------------------------------------------------
# Lowering for real accelerators (from this CPU-only host)
# ----------------------------------------------------------------------------------------------

def _abstract_args(b, t, k, g, s, d, dtype):
    h = k * g
    return (jax.ShapeDtypeStruct((b, t, h, d), dtype),
            jax.ShapeDtypeStruct((b, k, s, d), dtype),
            jax.ShapeDtypeStruct((b, k, s, d), dtype),
            jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, t, k, d), dtype),
            jax.ShapeDtypeStruct((b, t, k, d), dtype),
            jax.ShapeDtypeStruct((b, t, t), jnp.bool_))


EXPORT_SHAPES = [  # (B, T, K, G, S, D): smollm2-135m-like verify step, a decode step, tiny test heads
    (2, 16, 3, 3, 512, 64),
    (1, 1, 2, 1, 256, 128),
    (3, 5, 2, 3, 256, 8),
]

# The Pallas Triton kernel is emitted as the custom call "__gpu$xla.gpu.triton". jax.export
# refuses it by default because Triton IR has no cross-version stability guarantee (it is left
# out of jax's list of stable custom-call targets); the lowering itself works, so the export
# opts out of that one check -- an artifact is then only valid for the same jaxlib version.
TRITON_TARGET = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("shape", EXPORT_SHAPES, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_export_cuda(shape, dtype):
    exp = jax.export.export(
        jax.jit(partial(tree_attention, interpret=False)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)],
    )(*_abstract_args(*shape, dtype))
    assert exp.platforms == ("cuda",)
    assert TRITON_TARGET in exp.mlir_module()
    b, t, k, g, _, d = shape
    assert exp.out_avals[0].shape == (b, t, k * g, d) and exp.out_avals[0].dtype == dtype


def test_export_cuda_needs_triton_opt_out():
    """Without the opt-out, export fails only because of the Triton custom call's stability."""
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        jax.export.export(jax.jit(partial(tree_attention, interpret=False)), platforms=["cuda"])(
            *_abstract_args(*EXPORT_SHAPES[0], jnp.bfloat16))


@pytest.mark.parametrize("shape", EXPORT_SHAPES, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_export_tpu(shape, dtype):
    exp = jax.export.export(jax.jit(partial(tree_attention, interpret=False)),
                            platforms=["tpu"])(*_abstract_args(*shape, dtype))
    assert exp.platforms == ("tpu",)
    assert "tpu_custom_call" in exp.mlir_module()
    b, t, k, g, _, d = shape
    assert exp.out_avals[0].shape == (b, t, k * g, d) and exp.out_avals[0].dtype == dtype
