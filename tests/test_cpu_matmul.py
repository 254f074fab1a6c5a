"""hsdjax's CPU matmul kernel: equal to its jnp reference, rows independent of the batch (bitwise), the
packed model equal to the unpacked one, and speculative decoding through it equal to `ar`."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdjax.core.drafters import PromptLookupDrafter
from hsdjax.core.sampling import argmax_last
from hsdjax.errors import HsdjaxError
from hsdjax.kernels import cpu_matmul
from hsdjax.runtime.loading import use_cpu_matmul
from hsdjax.runtime.model import Transformer, causal_mask, init_params
from tests.conftest import TINY_LLAMA, run_engine

# every width a multiple of the 32-column panel
PANEL_LLAMA = TINY_LLAMA.replace(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                                 head_dim=16)


@pytest.fixture(scope="module")
def kernel(cpu_kernel):
    """The kernels built (honouring ``$CXX``) and loaded: conftest's ``cpu_kernel``."""
    return cpu_kernel


def test_pack_and_unpack_are_inverse():
    w = jnp.arange(3 * 5 * 64, dtype=jnp.float32).reshape(3, 5, 64)
    wp = cpu_matmul.pack(w)
    assert wp.shape == (3, 2, 5, 32)
    assert np.array_equal(np.asarray(cpu_matmul.unpack(wp)), np.asarray(w))
    assert np.array_equal(np.asarray(wp[1, 1, 2]), np.asarray(w[1, 2, 32:]))


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 19), k=st.integers(1, 70), panels=st.integers(1, 40), seed=st.integers(0, 99))
def test_kernel_equals_the_reference(kernel, m, k, panels, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    wp = jnp.asarray(rng.standard_normal((panels, k, 32), np.float32))
    got = np.asarray(jax.jit(cpu_matmul.panel_matmul)(x, wp))
    want = np.asarray(x) @ np.asarray(cpu_matmul.unpack(wp))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    np.testing.assert_allclose(np.asarray(cpu_matmul.panel_matmul_reference(x, wp)), want, rtol=1e-5,
                               atol=1e-5 * np.sqrt(k))


def test_each_row_is_bitwise_the_same_in_any_batch(kernel):
    """One multiply-add chain per output whatever M is: a tree pass and a one-token step agree exactly."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((13, 576), np.float32))
    wp = jnp.asarray(rng.standard_normal((48, 576, 32), np.float32))
    whole = np.asarray(cpu_matmul.panel_matmul(x, wp))
    for i in (0, 7, 8, 12):
        assert np.array_equal(np.asarray(cpu_matmul.panel_matmul(x[i: i + 1], wp)), whole[i: i + 1])
    assert np.array_equal(np.asarray(cpu_matmul.panel_matmul(x[3:11], wp)), whole[3:11])


def test_a_long_prompt_chunk_runs_in_row_blocks_with_the_same_outputs(kernel, monkeypatch):
    """A chunk longer than ``rows_per_call`` rows goes through the kernel in row blocks (its activations
    kept in L2): bitwise the outputs of one call, for float32 and 4-bit panels and a ragged last block."""
    assert cpu_matmul.rows_per_call(576) == 256 and cpu_matmul.rows_per_call(1536) == 128
    assert cpu_matmul.rows_per_call(8960) == 32 and cpu_matmul.rows_per_call(64) == 256
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 37, 64), np.float32))
    wf = jnp.asarray(rng.standard_normal((4, 64, 32), np.float32))
    w4 = cpu_matmul.compress_weight(jnp.asarray(block_quantized(rng, 64, 128, 4)))
    whole = [np.asarray(cpu_matmul.panel_matmul(x, w)) for w in (wf, w4)]
    calls = []
    real_call = jax.ffi.ffi_call
    monkeypatch.setattr(jax.ffi, "ffi_call", lambda name, out, **kw: calls.append(out.shape) or real_call(name, out, **kw))
    monkeypatch.setattr(cpu_matmul, "ROW_BLOCK_BYTES", 32 * 64 * 4)  # 32-row blocks at k = 64
    for w, want in zip((wf, w4), whole):
        calls.clear()
        got = np.asarray(jax.jit(cpu_matmul.panel_matmul)(x, w))
        assert [c[0] for c in calls] == [32, 32, 32, 15], calls  # 111 rows
        assert np.array_equal(got, want)


def block_quantized(rng, k: int, n: int, bits: int) -> np.ndarray:
    """A [k, n] float32 weight as a Q4_1 (bits 4) or Q8_0 (bits 8) GGUF dequantizes to: per block of 32
    k and column, float16 scale d (and offset m), codes q; w = d * q (+ m) in float32."""
    shape = (k // 32, 1, n)
    d = rng.uniform(1e-3, 5e-2, shape).astype(np.float16).astype(np.float32)
    if bits == 4:
        m = -rng.uniform(0, 0.3, shape).astype(np.float16).astype(np.float32)
        q = rng.integers(0, 16, (k // 32, 32, n)).astype(np.float32)
        q[:, 3, :], q[:, 17, :] = 0, 15  # a quantizer's block minimum and maximum
        return ((d * q) + m).reshape(k, n).astype(np.float32)
    q = rng.integers(-127, 128, (k // 32, 32, n)).astype(np.float32)
    q[:, 5, :] = 127 * np.sign(rng.standard_normal((k // 32, n)))  # the block's largest magnitude
    return (d * q).reshape(k, n).astype(np.float32)


@settings(max_examples=8, deadline=None)
@given(bits=st.sampled_from([4, 8]), kb=st.integers(1, 4), panels=st.integers(1, 5), seed=st.integers(0, 99))
def test_compressed_panels_hold_exactly_the_weight(bits, kb, panels, seed):
    w = block_quantized(np.random.default_rng(seed), 32 * kb, 32 * panels, bits)
    wq = cpu_matmul.compress_weight(jnp.asarray(w))
    assert wq is not None and wq.dtype == jnp.uint8
    assert wq.shape == (panels, 32 * kb // cpu_matmul.BLOCK_ROWS[bits], cpu_matmul.BLOCK_BYTES[bits])
    assert np.array_equal(np.asarray(cpu_matmul.unpack(cpu_matmul.decompress(wq))), w)
    stacked = cpu_matmul.compress_weight(jnp.asarray(np.stack([w, w[::-1]])))  # stacked layers
    assert np.array_equal(np.asarray(cpu_matmul.unpack(cpu_matmul.decompress(stacked)))[1], w[::-1])


def k_quantized(rng, k: int, n: int, kind: str) -> tuple[np.ndarray, tuple]:
    """A weight as a Q4_K (``kind`` "q4k": 32-row sub-blocks, scale d * sc and offset -dmin * m from
    6-bit integers) or Q6_K ("q6k": 16-row sub-blocks, scale d * int8, 6-bit signed codes) GGUF
    dequantizes to, and the (scale, offset, rows) hint ``weights.gguf_block_scales`` would give."""
    rows = 32 if kind == "q4k" else 16
    shape = (k // rows, n)
    d = rng.uniform(1e-4, 2e-3, (1, n)).astype(np.float16).astype(np.float32)
    if kind == "q4k":
        scale = d * rng.integers(1, 64, shape).astype(np.float32)
        offset = -(d * rng.integers(0, 64, shape).astype(np.float32))
        q = rng.integers(0, 16, (k, n)).astype(np.float32)
    else:
        scale = d * rng.integers(-128, 128, shape).astype(np.float32)
        offset = np.zeros(shape, np.float32)
        q = rng.integers(-32, 32, (k, n)).astype(np.float32)
    w = q * np.repeat(scale, rows, axis=0) + np.repeat(offset, rows, axis=0)
    return w.astype(np.float32), (scale, offset, rows)


@pytest.mark.parametrize("kind", ["q4k", "q6k"])
def test_k_quant_weights_compress_exactly_with_the_files_scales(kernel, kind):
    rng = np.random.default_rng(3)
    w, hint = k_quantized(rng, 256, 96, kind)
    wq = cpu_matmul.compress_weight(jnp.asarray(w), hint)
    assert wq is not None and cpu_matmul.compressed_bits(wq) == (4 if kind == "q4k" else 8)
    assert np.array_equal(np.asarray(cpu_matmul.unpack(cpu_matmul.decompress(wq))), w)
    x = jnp.asarray(rng.standard_normal((9, 256), np.float32))
    assert np.array_equal(np.asarray(cpu_matmul.panel_matmul(x, wq)),
                          np.asarray(cpu_matmul.panel_matmul(x, cpu_matmul.pack(jnp.asarray(w)))))
    wrong = (hint[0] * 2, hint[1], hint[2])  # a hint that does not describe the weight: stays float32
    assert cpu_matmul.compress_weight(jnp.asarray(w), wrong) is None


def test_weights_that_are_not_block_codes_stay_float32():
    rng = np.random.default_rng(0)
    assert cpu_matmul.compress_weight(jnp.asarray(rng.standard_normal((64, 64), np.float32))) is None
    w = block_quantized(rng, 64, 64, 4)
    w[40, 7] = np.nextafter(w[40, 7], np.float32(1))  # one value off the grid
    assert cpu_matmul.compress_weight(jnp.asarray(w)) is None or np.array_equal(
        np.asarray(cpu_matmul.unpack(cpu_matmul.decompress(cpu_matmul.compress_weight(jnp.asarray(w))))), w)
    assert cpu_matmul.compress_weight(jnp.asarray(w[:48])) is None  # k not whole blocks
    params = cpu_matmul.pack_params(init_params(PANEL_LLAMA, seed=1), True)  # random weights: float32 panels
    assert params["head_panels"].dtype == jnp.float32


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_products_are_bitwise_the_float32_ones(kernel, bits):
    """Decoding is exact and the chain over k is the same, so compressed and float32 panels give the
    same bits, for every row count (one-token step, tree pass) and every row of a batch."""
    rng = np.random.default_rng(bits)
    w = block_quantized(rng, 576, 320, bits)
    wq, wp = cpu_matmul.compress_weight(jnp.asarray(w)), cpu_matmul.pack(jnp.asarray(w))
    x = jnp.asarray(rng.standard_normal((19, 576), np.float32))
    whole = np.asarray(cpu_matmul.panel_matmul(x, wq))
    assert np.array_equal(whole, np.asarray(cpu_matmul.panel_matmul(x, wp)))
    for lo, hi in ((0, 1), (5, 6), (2, 10), (8, 19)):
        assert np.array_equal(np.asarray(jax.jit(cpu_matmul.panel_matmul)(x[lo:hi], wq)), whole[lo:hi])
    np.testing.assert_allclose(np.asarray(cpu_matmul.panel_matmul_reference(x, wq)), np.asarray(x) @ w,
                               rtol=1e-4, atol=1e-4)


def test_bf16x_products_round_only_the_activations_and_are_the_same_for_every_row_count(kernel):
    """``cpu_matmul="bf16x"``: x rounded to bfloat16, each code * x exact, the block scale applied once:
    the product of the rounded x with the exact weight up to float32 rounding; and, like the float32
    chains, every row comes out bitwise the same whether alone or in a batch (tree pass = `ar` step).
    8-bit panels keep the float32 products."""
    if not cpu_matmul.has_bf16x():
        pytest.skip("this CPU has no AVX512-BF16 / AVX512-VBMI")
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((19, 576), np.float32))
    w8 = cpu_matmul.compress_weight(jnp.asarray(block_quantized(rng, 576, 64, 8)))
    assert np.array_equal(np.asarray(cpu_matmul.panel_matmul(x, w8, activations="bfloat16")),
                          np.asarray(cpu_matmul.panel_matmul(x, w8)))
    w = block_quantized(rng, 576, 320, 4)
    wq = cpu_matmul.compress_weight(jnp.asarray(w))
    whole = np.asarray(cpu_matmul.panel_matmul(x, wq, activations="bfloat16"))
    rounded = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    want = rounded @ w.astype(np.float64)
    np.testing.assert_allclose(whole, want, rtol=0, atol=2e-5 * np.abs(want).max())
    exact = np.asarray(x, np.float64) @ w.astype(np.float64)
    assert np.abs(whole - exact).max() > 1e3 * np.abs(want - whole).max()  # it is not the float32 product
    for lo, hi in ((0, 1), (5, 6), (2, 10), (8, 19)):
        part = jax.jit(functools.partial(cpu_matmul.panel_matmul, activations="bfloat16"))(x[lo:hi], wq)
        assert np.array_equal(np.asarray(part), whole[lo:hi])
    np.testing.assert_allclose(np.asarray(cpu_matmul.panel_matmul_reference(x, wq, activations="bfloat16")), want,
                               rtol=0, atol=2e-5 * np.abs(want).max())


def test_int8x_products_quantize_only_the_activations_and_are_the_same_for_every_row_count(kernel):
    """``cpu_matmul="int8x"``: x quantized to int8 per 32 k (scale max|x| / 127), products summed exactly
    in int32, the block's scale and offset applied once: the product of the quantized x with the exact
    weight up to float32 rounding, for 4-bit and 8-bit (signed codes) panels; every row bitwise the same
    alone or in a batch; rows of zeros handled; the jnp reference quantizes the same way."""
    if not cpu_matmul.has_int8x():
        pytest.skip("this build has no integer products (AVX512-VNNI, AVX2 or NEON)")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((19, 576)).astype(np.float32)
    x[3] = 0.0  # a row of zeros: scale 0, no division by zero
    x[4, :32] *= 1e3  # one large block: the others keep their own scales
    x = jnp.asarray(x)
    for bits, n in ((8, 96), (4, 320)):
        int8x_products_check(x, block_quantized(rng, 576, n, bits))


def test_int16x_products_quantize_only_the_activations_and_are_the_same_for_every_row_count(kernel):
    """``cpu_matmul="int16x"``: x quantized to int16 per 32 k (scale max|x| / 32767), products summed
    exactly in int32, the block's scale and offset applied once: the product of the quantized x with the
    exact weight up to float32 rounding, within ~1e-5 of the float32 product; every row bitwise the same
    alone or in a batch; rows of zeros handled; 8-bit panels keep the float32 products."""
    if not cpu_matmul.has_int16x():
        pytest.skip("this CPU has no AVX512-VNNI / AVX512-BW")
    rng = np.random.default_rng(12)
    x = rng.standard_normal((19, 576)).astype(np.float32)
    x[3] = 0.0
    x[4, :32] *= 1e3
    x = jnp.asarray(x)
    w8 = cpu_matmul.compress_weight(jnp.asarray(block_quantized(rng, 576, 64, 8)))
    assert np.array_equal(np.asarray(cpu_matmul.panel_matmul(x, w8, activations="int16")),
                          np.asarray(cpu_matmul.panel_matmul(x, w8)))
    w = block_quantized(rng, 576, 320, 4)
    wq = cpu_matmul.compress_weight(jnp.asarray(w))
    whole = np.asarray(cpu_matmul.panel_matmul(x, wq, activations="int16"))
    quantized = np.asarray(cpu_matmul.quantize_activations(x, 32767), np.float64)
    want = quantized @ w.astype(np.float64)
    np.testing.assert_allclose(whole, want, rtol=0, atol=2e-6 * np.abs(want).max())
    exact = np.asarray(x, np.float64) @ w.astype(np.float64)
    err = np.abs(whole - exact).max()
    assert 10 * np.abs(want - whole).max() < err < 1e-4 * np.abs(exact).max()  # near float32, not it
    assert np.all(whole[3] == whole[3][0])
    for lo, hi in ((0, 1), (5, 6), (2, 10), (8, 19), (0, 19)):
        part = jax.jit(functools.partial(cpu_matmul.panel_matmul, activations="int16"))(x[lo:hi], wq)
        assert np.array_equal(np.asarray(part), whole[lo:hi])
    np.testing.assert_allclose(np.asarray(cpu_matmul.panel_matmul_reference(x, wq, activations="int16")), want,
                               rtol=0, atol=2e-6 * np.abs(want).max())


def int8x_products_check(x, w):
    wq = cpu_matmul.compress_weight(jnp.asarray(w))
    whole = np.asarray(cpu_matmul.panel_matmul(x, wq, activations="int8"))
    quantized = np.asarray(cpu_matmul.quantize_activations(x), np.float64)
    levels = np.asarray(cpu_matmul.quantize_activations(x)).reshape(19, 18, 32)
    per_block = np.abs(levels).max(-1, keepdims=True)
    steps = np.divide(levels, per_block / 127, out=np.zeros_like(levels), where=per_block > 0)
    assert np.allclose(steps, np.round(steps), atol=1e-3) and np.abs(steps).max() <= 127.001  # int8 levels
    want = quantized @ w.astype(np.float64)
    np.testing.assert_allclose(whole, want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert np.all(whole[3] == whole[3][0])  # x = 0: the offsets times 0 (8-bit blocks: none), nothing else
    exact = np.asarray(x, np.float64) @ w.astype(np.float64)
    assert np.abs(whole - exact).max() > 1e3 * np.abs(want - whole).max()  # it is not the float32 product
    for lo, hi in ((0, 1), (5, 6), (2, 10), (8, 19), (0, 19)):
        part = jax.jit(functools.partial(cpu_matmul.panel_matmul, activations="int8"))(x[lo:hi], wq)
        assert np.array_equal(np.asarray(part), whole[lo:hi])
    np.testing.assert_allclose(np.asarray(cpu_matmul.panel_matmul_reference(x, wq, activations="int8")), want,
                               rtol=0, atol=2e-5 * np.abs(want).max())


def test_bfloat16_panels_give_the_float32_panels_products_bitwise(kernel):
    """A matrix whose values are bfloat16 values (a drafter checkpoint's) is packed in bfloat16: the
    kernel widens each value exactly, so every row count (8-row tiles and the decoded sweep past 8)
    gives the float32 panels' bits; anything else stays float32."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((200, 96), np.float32)).astype(jnp.bfloat16).astype(jnp.float32)
    wb, wp = cpu_matmul.pack_exact(w), cpu_matmul.pack(w)
    assert wb.dtype == jnp.bfloat16 and wb.shape == wp.shape
    x = jnp.asarray(rng.standard_normal((19, 200), np.float32))
    whole = np.asarray(jax.jit(cpu_matmul.panel_matmul)(x, wb))
    assert np.array_equal(whole, np.asarray(cpu_matmul.panel_matmul(x, wp)))
    for lo, hi in ((0, 1), (3, 5), (0, 8), (4, 19)):
        assert np.array_equal(np.asarray(cpu_matmul.panel_matmul(x[lo:hi], wb)), whole[lo:hi])
    np.testing.assert_allclose(np.asarray(cpu_matmul.panel_matmul_reference(x, wb)), np.asarray(x @ w),
                               rtol=1e-5, atol=1e-4)
    off = w.at[7, 3].add(1e-3)  # one value that is not a bfloat16 value
    assert cpu_matmul.pack_exact(off).dtype == jnp.float32


@pytest.mark.parametrize("bits", [4, 8])
def test_a_subset_of_columns_compresses_with_the_weights_own_scales(kernel, bits):
    """A drafter's head is some rows of the target's LM head: its panels are built from the target's
    compressed panels' block scales and give the same products as float32 panels of those columns."""
    rng = np.random.default_rng(10 + bits)
    w = block_quantized(rng, 128, 320, bits)
    wq = cpu_matmul.compress_weight(jnp.asarray(w))
    ids = np.sort(rng.choice(320, 64, replace=False))
    sub = cpu_matmul.compress_columns(wq, ids, jnp.asarray(w[:, ids]))
    assert sub is not None and cpu_matmul.compressed_bits(sub) == bits and sub.shape[0] == 2
    assert np.array_equal(np.asarray(cpu_matmul.unpack(cpu_matmul.decompress(sub))), w[:, ids])
    x = jnp.asarray(rng.standard_normal((3, 128), np.float32))
    assert np.array_equal(np.asarray(cpu_matmul.panel_matmul(x, sub)),
                          np.asarray(cpu_matmul.panel_matmul(x, cpu_matmul.pack(jnp.asarray(w[:, ids])))))
    other = w[:, ids].copy()
    other[0, 0] += 1.0  # not those columns: refused, the caller keeps float32
    assert cpu_matmul.compress_columns(wq, ids, jnp.asarray(other)) is None


def tiny_logits(cfg, params, t: int, short: int) -> np.ndarray:
    """The logits of two random rows of t tokens (the second padded after ``short``), one causal pass."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    model = Transformer(cfg)
    out = model.apply({"params": params}, tokens, pos, causal_mask(jnp.array([t, short]), t))
    return np.asarray(model.apply({"params": params}, out["hidden"], method=Transformer.logits))


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_equals_the_unpacked_one(kernel, tied):
    cfg = PANEL_LLAMA.replace(tie_embeddings=tied)
    params = init_params(cfg, seed=3)
    packed_cfg = cfg.replace(backend="cpu-kernel")
    packed = cpu_matmul.pack_params(params, tied)
    np.testing.assert_allclose(tiny_logits(packed_cfg, packed, 11, 7), tiny_logits(cfg, params, 11, 7),
                               rtol=1e-4, atol=1e-4)


def test_speculative_decoding_through_the_kernel_equals_ar(kernel):
    cfg = PANEL_LLAMA.replace(backend="cpu-kernel")
    params = cpu_matmul.pack_params(init_params(PANEL_LLAMA, seed=5), True)
    rng = np.random.default_rng(2)
    motif = rng.integers(0, cfg.vocab_size, 6).tolist()
    prompts = [motif * 3 + rng.integers(0, cfg.vocab_size, 4).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()]
    want = run_engine(cfg, params, prompts, 24)
    got = run_engine(cfg, params, prompts, 24, drafter=PromptLookupDrafter(width=2, depth=4))
    assert got == want


@pytest.mark.parametrize("activations", ["bfloat16", "int8", "int16"])
def test_speculative_decoding_with_bf16x_int8x_or_int16x_activations_equals_ar(kernel, activations):
    """A tiny model whose weights are block codes (as a Q4_1 / Q8_0 GGUF's), run with activations
    rounded to bfloat16 or quantized to int8 or int16: every pass rounds the same way, so `pld`'s tree
    passes give `ar`'s tokens."""
    has = {"bfloat16": cpu_matmul.has_bf16x, "int8": cpu_matmul.has_int8x, "int16": cpu_matmul.has_int16x}
    if not has[activations]():
        pytest.skip(f"this CPU lacks the {activations} activation products")
    rng = np.random.default_rng(7)
    params = init_params(PANEL_LLAMA, seed=6)

    def codes(w, bits):
        w = np.asarray(w)
        flat = w.reshape(-1, *w.shape[-2:])
        return jnp.asarray(np.stack([block_quantized(rng, *m.shape, bits) * 8 for m in flat]).reshape(w.shape))

    layers = {k: codes(v, 4) if k in cpu_matmul.PACKED_WEIGHTS else v for k, v in params["layers"].items()}
    params = {**params, "layers": layers, "embed": codes(params["embed"].T, 8).T}
    packed = cpu_matmul.pack_params(params, True)
    assert all(cpu_matmul.is_compressed(packed["layers"][k]) for k in ("wq", "wk", "w_up", "w_down"))
    assert cpu_matmul.is_compressed(packed["head_panels"])
    cfg = PANEL_LLAMA.replace(backend="cpu-kernel", cpu_matmul_activations=activations)
    motif = rng.integers(0, cfg.vocab_size, 6).tolist()
    prompts = [motif * 3 + rng.integers(0, cfg.vocab_size, 4).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()]
    want = run_engine(cfg, packed, prompts, 24)
    got, state = run_engine(cfg, packed, prompts, 24, drafter=PromptLookupDrafter(width=2, depth=4),
                            return_state=True)
    assert got == want
    assert int(np.asarray(state.stats.accepted_drafts).sum()) > 0  # trees were verified and accepted from


def screen_rows(rng, m: int, k: int) -> np.ndarray:
    """Rows of x as a final norm gives them (a few outlier channels), plus the cases the screen must not
    get wrong: all zeros (every logit 0: index 0), a NaN (the first NaN wins), an infinity."""
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.05, 4, (m, 1)).astype(np.float32)
    x[:, rng.integers(0, k, 3)] *= 20
    x[1 % m] = 0
    if m > 3:
        x[2, 7], x[3, 0] = np.nan, np.inf
    return x


@settings(max_examples=10, deadline=None)
@given(kb=st.integers(1, 6), panels=st.integers(1, 40), m=st.integers(1, 19), seed=st.integers(0, 999))
def test_screened_argmax_is_the_float32_products_argmax(kernel, kb, panels, m, seed):
    """The int8 screen's token is that of the float32 chains bit for bit: on exact ties (a duplicated
    column: the first wins), on near-ties (one code apart), for every row count (tiles of 4 int8 rows,
    sweeps of more than 8), on zero, NaN and infinite rows."""
    if not cpu_matmul.has_int8x():  # asked after the kernel is built (not at collection)
        pytest.skip("the int8 screen needs integer products (AVX512-VNNI, AVX2 or NEON)")
    rng = np.random.default_rng(seed)
    k, n = 32 * kb, 32 * panels
    w = block_quantized(rng, k, n, 8)
    if n > 2:
        w[:, n - 1] = w[:, 1]  # an exact tie with an earlier column
        w[:, n // 2] = w[:, 0]
        step = np.abs(w[5, 0]) / 127  # block 0's scale in column 0 (row 5 holds the code +-127)
        w[0, n // 2] = w[0, 0] + (step if w[0, 0] < 126 * step else -step)  # one code away: a near-tie
    wq = cpu_matmul.compress_weight(jnp.asarray(w))
    assert wq is not None and cpu_matmul.compressed_bits(wq) == 8 and cpu_matmul.can_screen(wq)
    x = jnp.asarray(screen_rows(rng, m, k))
    full = np.asarray(argmax_last(cpu_matmul.panel_matmul(x, wq)))
    got = np.asarray(jax.jit(cpu_matmul.screened_argmax)(x, wq, jnp.asarray(cpu_matmul.column_abs_sums(wq))))
    assert got.dtype == np.int32 and np.array_equal(got, full)
    exact = np.asarray(x).astype(np.float64) @ w  # where the top two are clearly apart, the real argmax too
    top2 = np.sort(exact, axis=1)[:, -2:] if n > 1 else None
    clear = np.isfinite(exact).all(axis=1) & ((top2[:, 1] - top2[:, 0] > 1e-3) if n > 1 else True)
    assert np.array_equal(got[clear], np.argmax(exact[clear], axis=1))


def test_column_abs_sums_bound_the_weights(kernel):
    w = block_quantized(np.random.default_rng(3), 96, 64, 8)
    wq = cpu_matmul.compress_weight(jnp.asarray(w))
    sums = cpu_matmul.column_abs_sums(wq)  # [N/32, K/32, 32]
    want = np.abs(w.astype(np.float64)).reshape(3, 32, 2, 32).sum(axis=1).transpose(1, 0, 2)
    assert sums.shape == (2, 3, 32) and (sums >= want).all()
    np.testing.assert_allclose(sums, want, rtol=1e-6)
    assert not cpu_matmul.can_screen(wq, "int8")  # in int8x the int8 products are the model
    assert not cpu_matmul.can_screen(cpu_matmul.pack(jnp.asarray(w)))  # float32 panels: nothing to screen


def test_speculative_decoding_with_the_screened_head_equals_ar(kernel):
    """A tiny model with an 8-bit head: greedy tokens through the screen equal the full logits' argmax,
    for `ar` and for `pld`'s tree passes (and sampled rows still draw from the full logits)."""
    if not cpu_matmul.has_int8x():
        pytest.skip("the int8 screen needs integer products (AVX512-VNNI, AVX2 or NEON)")
    rng = np.random.default_rng(11)
    params = init_params(PANEL_LLAMA, seed=8)
    params = {**params, "embed": jnp.asarray(block_quantized(rng, 64, 96, 8).T * 4)}
    packed = cpu_matmul.pack_params(params, True)
    assert cpu_matmul.can_screen(packed["head_panels"])
    screened = {**packed, "head_colabs": jnp.asarray(cpu_matmul.column_abs_sums(packed["head_panels"]))}
    cfg = PANEL_LLAMA.replace(backend="cpu-kernel")
    motif = rng.integers(0, cfg.vocab_size, 6).tolist()
    prompts = [motif * 3 + rng.integers(0, cfg.vocab_size, 4).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()]
    want = run_engine(cfg, packed, prompts, 24)
    on = cfg.replace(screened_head=True)
    assert run_engine(on, screened, prompts, 24) == want
    got, state = run_engine(on, screened, prompts, 24, drafter=PromptLookupDrafter(width=2, depth=4), return_state=True)
    assert got == want and int(np.asarray(state.stats.accepted_drafts).sum()) > 0
    sampled = dict(temperature=0.8, seed=4)
    assert run_engine(on, screened, prompts, 16, **sampled) == run_engine(cfg, packed, prompts, 16, **sampled)


def test_recording_through_the_kernel_head_equals_a_teacher_forced_pass(kernel):
    """The self-distillation recorder on a kernel model reads the head panels (the model's own logits):
    its states and top-k logits equal one forward over the finished sequence."""
    from hsdjax.frontends.api import LoadedModel
    from hsdjax.train.datagen import flatten_recorded, fused_layer_indices, recording_drafter

    cfg = PANEL_LLAMA.replace(backend="cpu-kernel")
    params = cpu_matmul.pack_params(init_params(PANEL_LLAMA, seed=3), True)
    params = jax.tree_util.tree_map(lambda a: a * 4.0 if a.ndim >= 2 else a, params)  # answers that vary
    model = LoadedModel("panel", cfg, params, None, None, "panel-record-test", {})
    drafter, dparams = recording_drafter(model, 4)
    assert set(dparams) == {"head_panels"}
    prompts = [[5, 9, 17, 33, 2], [60, 61, 7]]
    _, state = run_engine(cfg, params, prompts, 12, drafter=drafter, dparams=dparams, return_state=True)
    data = flatten_recorded(state, [len(p) for p in prompts])
    toks = data["tokens"][data["doc"] == 0]
    t = len(toks)
    fwd = Transformer(cfg).apply({"params": params}, jnp.asarray(toks)[None], jnp.arange(t)[None],
                                 causal_mask(jnp.array([t]), t))
    want = np.stack([np.asarray(fwd["layers"][i][0]) for i in fused_layer_indices(cfg.num_layers)], axis=1)
    got = data["states"][data["doc"] == 0].view(jnp.bfloat16).astype(np.float32)
    np.testing.assert_allclose(got, want, atol=0.05, rtol=0.02)  # bfloat16 storage
    logits = Transformer(cfg).apply({"params": params}, fwd["hidden"], method=Transformer.logits)[0]
    vals, ids = jax.lax.top_k(logits, 4)
    assert np.array_equal(data["top_ids"][data["doc"] == 0], np.asarray(ids))
    np.testing.assert_allclose(data["top_logits"][data["doc"] == 0], np.asarray(vals), rtol=1e-3, atol=1e-3)


def test_load_setting_is_checked_and_explained(kernel):
    with pytest.raises(HsdjaxError, match="auto, on, off, float32, bf16x, int8x, int16x"):
        use_cpu_matmul("fast", PANEL_LLAMA, None)
    assert use_cpu_matmul("off", PANEL_LLAMA, None) is False
    assert use_cpu_matmul("auto", PANEL_LLAMA, None) is True
    assert use_cpu_matmul("auto", TINY_LLAMA, None) is False  # widths of 48: not whole panels
    with pytest.raises(HsdjaxError, match="not a multiple of 32"):
        use_cpu_matmul("on", TINY_LLAMA, None)
    with pytest.raises(HsdjaxError, match="float32"):
        use_cpu_matmul("on", PANEL_LLAMA.replace(dtype="bfloat16"), None)


def test_real_model_loads_with_the_kernel_compressed_and_float32_panels_agree(kernel, smollm):
    """The default model through the kernel (``auto`` picks it once built), its panels stored compressed;
    float32 panels give the same greedy tokens. (Every method equals `ar` through the kernels and through
    XLA's dot in tests/test_real_methods.py; `hsd` on this default load in the demo test.)"""
    from hsdjax.frontends.api import Generator, load_model

    assert smollm.cfg.backend == "cpu-kernel"
    # SmolLM2's GGUF is Q4_1 (projections) and Q8_0 (tied head): every panel is stored compressed, and
    # since every layer stores its parts alike, q/k/v and gate/up are joined after packing
    layer = next(v for k, v in smollm.params.items() if k == "layers" or k.startswith("blocks_"))
    assert smollm.cfg.fused_projections
    assert {k: str(v.dtype) for k, v in layer.items() if k in cpu_matmul.PACKED_WEIGHTS} == {
        k: "uint8" for k in ("wqkv", "wo", "w_gate_up", "w_down")}
    assert cpu_matmul.compressed_bits(smollm.params["head_panels"]) == 8
    assert smollm.cfg.screened_head == cpu_matmul.screen_pays()  # greedy tokens through the int8 screen (VNNI)
    prompt = "List three uses of a paperclip, then explain the second one."
    ar = Generator(smollm, "ar").generate(prompt, max_new_tokens=40)[0]
    float32 = load_model("smollm2-135m", cpu_matmul="float32")
    assert float32.params["head_panels"].dtype == jnp.float32
    assert Generator(float32, "ar").generate(prompt, max_new_tokens=40)[0].tokens == ar.tokens


# ------------------------------------------------------------------------------------------ cache attention


def path_mask(parent: list[int]) -> np.ndarray:
    """The tree attention mask of a parent list: each node sees itself and its ancestors."""
    mask = np.eye(len(parent), dtype=bool)
    for i in range(len(parent)):
        j = parent[i]
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


@settings(max_examples=16, deadline=None)
@given(b=st.integers(1, 3), kh=st.integers(1, 3), r=st.integers(1, 12), d=st.sampled_from([16, 24, 64, 128]),
       s=st.sampled_from([8, 256, 700]), seed=st.integers(0, 99), cache=st.sampled_from(["float32", "float16"]))
def test_cache_attention_equals_its_reference(kernel, b, kh, r, d, s, seed, cache):
    """The kernel's online-softmax state of the cache part, for any filled length (0, partial chunks,
    more than the bucket) and a float32 or float16 cache, equals one masked pass over the whole bucket."""
    from hsdjax.kernels.cpu_attention import cache_attention, cache_attention_reference

    rng = np.random.default_rng(seed)
    qg = jnp.asarray(rng.standard_normal((b, kh, r, d), np.float32) * d**-0.5)  # pre-scaled, as the model's
    ck, cv = (jnp.asarray(rng.standard_normal((b, kh, s, d), np.float32), cache) for _ in range(2))
    lens = jnp.asarray(rng.choice([0, 1, s // 3, s - 1, s, s + 5], b), jnp.int32)
    got = jax.jit(cache_attention)(qg, ck, cv, lens)
    want = cache_attention_reference(qg, ck, cv, jnp.minimum(lens, s))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got[1])[np.asarray(lens) == 0] == 0)  # no valid slot: empty sums


@pytest.mark.parametrize("d, cache", [(64, "float32"), (128, "float32"), (24, "float32"), (64, "float16")])
def test_cache_attention_rows_do_not_depend_on_each_other(kernel, d, cache):
    """A row's result is bitwise the same whatever other rows share the call: a T-node tree pass and a
    one-token step compute the same attention for the same query (what greedy equality rests on)."""
    from hsdjax.kernels.cpu_attention import cache_attention

    rng = np.random.default_rng(d)
    qg = jnp.asarray(rng.standard_normal((2, 3, 13, d), np.float32))
    ck, cv = (jnp.asarray(rng.standard_normal((2, 3, 1100, d), np.float32), cache) for _ in range(2))
    lens = jnp.asarray([1037, 515], jnp.int32)
    run = jax.jit(cache_attention)
    full = run(qg, ck, cv, lens)
    for rows in (slice(0, 1), slice(5, 8), slice(4, 13)):
        part = run(qg[:, :, rows], ck, cv, lens)
        for f, p in zip(full, part):
            np.testing.assert_array_equal(np.asarray(f)[:, :, rows], np.asarray(p))


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 12), kh=st.sampled_from([1, 3]), g=st.sampled_from([1, 3]),
       d=st.sampled_from([24, 64, 128]), s=st.sampled_from([16, 300, 600]), seed=st.integers(0, 99),
       cache=st.sampled_from(["float32", "float16"]))
def test_position_ordered_attention_equals_the_reference(kernel, b, t, kh, g, d, s, seed, cache):
    """Random trees (each node's parent is an earlier node) over random filled lengths (0, chunk
    edges, more than the bucket) and a float32 or float16 cache: the kernel equals the jnp reference."""
    from hsdjax.kernels.cpu_attention import position_ordered_attention
    from hsdjax.kernels.tree_attention import tree_attention_reference

    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, kh * g, d), np.float32))
    ck, cv = (jnp.asarray(rng.standard_normal((b, kh, s, d), np.float32), cache) for _ in range(2))
    nk, nv = (jnp.asarray(rng.standard_normal((b, t, kh, d), np.float32)) for _ in range(2))
    masks = [path_mask([-1] + [int(rng.integers(0, i)) for i in range(1, t)]) for _ in range(b)]
    lens = jnp.asarray(rng.choice([0, 1, 255, 256, 257, s - 1, s], b), jnp.int32)
    lens = jnp.minimum(lens, s)
    got = jax.jit(position_ordered_attention)(q, ck, cv, lens, nk, nv, jnp.asarray(np.stack(masks)))
    want = tree_attention_reference(q, ck, cv, lens, nk, nv, jnp.asarray(np.stack(masks)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_tree_attention_through_the_kernel_equals_the_reference(kernel):
    from hsdjax.kernels.cpu_attention import tree_attention_cpu
    from hsdjax.kernels.tree_attention import tree_attention_reference

    rng = np.random.default_rng(7)
    b, t, kh, g, d, s = 2, 6, 3, 3, 64, 1024
    q = jnp.asarray(rng.standard_normal((b, t, kh * g, d), np.float32))
    ck, cv = (jnp.asarray(rng.standard_normal((b, kh, s, d), np.float32)) for _ in range(2))
    nk, nv = (jnp.asarray(rng.standard_normal((b, t, kh, d), np.float32)) for _ in range(2))
    mask = path_mask([-1, 0, 0, 1, 1, 2])  # a tree: each node sees itself and its ancestors
    mask = jnp.asarray(np.stack([mask, mask]))
    for lens in ([0, 300], [1024, 257]):
        lens = jnp.asarray(lens, jnp.int32)
        got = jax.jit(tree_attention_cpu)(q, ck, cv, lens, nk, nv, mask)
        want = tree_attention_reference(q, ck, cv, lens, nk, nv, mask)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ bitwise passes


@pytest.mark.parametrize("cache_dtype", [None, "float16"])
def test_tree_pass_logits_are_bitwise_the_one_token_steps(kernel, cache_dtype):
    """SmolLM2 on the CPU kernels: the logits of every node of a tree pass (a chain with a branch, after
    a cached prompt) are bit for bit those of one-token steps along the node's path, so greedy
    speculation picks `ar`'s token even at exact ties (attention walks keys by position whatever their
    source; norms sum in one fixed order). Also with a float16 KV cache (new keys and values rounded
    to what the cache will hold before the pass)."""
    from hsdjax.frontends.api import load_model
    from hsdjax.runtime.model import Transformer, causal_mask, commit, init_cache

    # layers under lax.scan: the same kernels per layer as the unrolled loop, at half its compile time
    model = load_model("smollm2-135m", cpu_matmul="on", cache_dtype=cache_dtype, layer_loop="scan")
    net, params = Transformer(model.cfg), {"params": model.params}
    rng = np.random.default_rng(0)
    n = 252  # the paths below cross position 256, where the kernel's key chunks meet
    prompt = jnp.asarray(rng.integers(0, 5000, (1, n)), jnp.int32)
    cache = init_cache(model.cfg, 1, 512)
    run = jax.jit(lambda tokens, pos, mask, cache: net.apply(params, tokens, pos, mask, cache))
    head = jax.jit(lambda h: net.apply(params, h, method=Transformer.logits))
    for start in range(0, n, 63):  # the prompt in 63-token pieces through the kernel path
        piece = prompt[:, start:start + 63]
        fwd = run(piece, jnp.arange(start, start + 63)[None], causal_mask(jnp.array([63]), 63), cache)
        cache = commit(cache, fwd["k"], fwd["v"], jnp.arange(63)[None], jnp.array([63]))
    # a tree: 0 -> 1 -> 2 -> 3 and 0 -> 1 -> 4 -> 5 -> 6 -> 7 -> 8 (9 nodes: more rows than one matmul panel pass)
    parents = [-1, 0, 1, 2, 1, 4, 5, 6, 7]
    tokens = jnp.asarray(rng.integers(0, 5000, (1, len(parents))), jnp.int32)
    mask, depth = path_mask(parents), []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    tree = run(tokens, n + jnp.asarray(depth)[None], jnp.asarray(mask)[None], cache)
    tree_logits = np.asarray(head(tree["hidden"]))[0]
    for leaf_path in ([0, 1, 2, 3], [0, 1, 4, 5, 6, 7, 8]):
        step_cache = cache
        for d, node in enumerate(leaf_path):
            one = run(tokens[:, node:node + 1], jnp.array([[n + d]]), jnp.ones((1, 1, 1), bool), step_cache)
            step_cache = commit(step_cache, one["k"], one["v"], jnp.zeros((1, 1), jnp.int32), jnp.array([1]))
            np.testing.assert_array_equal(np.asarray(head(one["hidden"]))[0, 0], tree_logits[node])
    if cache_dtype:  # end to end: the engine keeps a float16 cache and `hsd` still gives `ar`'s tokens
        from hsdjax.frontends.api import Generator

        assert cache.k[0].dtype == jnp.float16
        prompt = "Write a short story about a lighthouse keeper."
        ar = Generator(model, "ar").generate(prompt, max_new_tokens=32)[0]
        assert Generator(model, "hsd").generate(prompt, max_new_tokens=32)[0].tokens == ar.tokens


def test_projections_fuse_after_packing_when_stored_alike(kernel):
    """With the kernels, ``load_model`` joins q/k/v and gate/up panels after packing (SmolLM2: every
    part 4-bit) and the fused model computes the separate one's logits bit for bit; parts stored
    differently (a 4-bit panel beside an 8-bit one, or float32) are left apart."""
    from hsdjax.frontends.api import load_model
    from hsdjax.runtime.model import Transformer, causal_mask, fuse_projections, init_cache

    fused = load_model("smollm2-135m", cpu_matmul="on", layer_loop="unrolled")
    apart = load_model("smollm2-135m", cpu_matmul="on", fused_projections=False, layer_loop="unrolled")
    assert fused.cfg.fused_projections and not apart.cfg.fused_projections
    layer = fused.params["blocks_0"]
    assert "wqkv" in layer and "wq" not in layer and layer["wqkv"].dtype == np.uint8
    assert layer["wqkv"].shape[0] == sum(apart.params["blocks_0"][k].shape[0] for k in ("wq", "wk", "wv"))
    tokens = jnp.asarray([[1, 502, 77, 9031, 12, 5]], jnp.int32)
    outs = []
    for m in (fused, apart):
        net = Transformer(m.cfg)
        out = net.apply({"params": m.params}, tokens, jnp.arange(6)[None], causal_mask(jnp.array([6]), 6),
                        init_cache(m.cfg, 1, 16))
        outs.append(np.asarray(net.apply({"params": m.params}, out["hidden"], method=Transformer.logits)))
    np.testing.assert_array_equal(outs[0], outs[1])
    mixed = dict(apart.params)
    blk = dict(mixed["blocks_3"])
    blk["wv"] = jnp.zeros((blk["wv"].shape[0], blk["wv"].shape[1] * 2, 640), jnp.uint8)  # 8-bit blocks
    mixed["blocks_3"] = blk
    assert fuse_projections(mixed, packed=True) is None


# ------------------------------------------------------------------------------------------ the measured default


@pytest.mark.parametrize("ratios, use, prefill_xla", [
    ({1: 2.8, 8: 2.6, 64: 0.9}, True, True),    # this AVX2 machine: kernel for decoding, XLA for prompt chunks
    ({1: 3.2, 8: 2.5, 64: 1.2}, True, False),   # kernel everywhere
    ({1: 1.3, 8: 0.9, 64: 0.5}, False, False),  # tree passes slower: not at all (a pass must take a step's path)
    ({1: 0.5, 8: 2.0, 64: 2.0}, False, False),  # a step slower: XLA's dot
])
def test_the_default_keeps_the_kernel_only_where_it_measured_faster(ratios, use, prefill_xla):
    timings = {m: {"kernel_s": 1.0, "xla_s": r} for m, r in ratios.items()}
    verdict = cpu_matmul.verdict_from(timings, "avx2 (8 floats per vector)")
    assert (verdict["use"], verdict["prefill_xla"]) == (use, prefill_xla)
    assert ("avx2" in verdict["why"]) and (verdict["why"].startswith("XLA's dot") != use)


def test_the_measured_default_times_the_models_own_matmuls(kernel):
    """``measure_against_xla`` on a packed tiny model and its plain params: positive times for every
    row count, and the verdict cached (a second call reads it back without timing)."""
    params = init_params(PANEL_LLAMA, seed=3)
    packed = cpu_matmul.pack_params(params, True)
    layers, head = cpu_matmul.model_weights(packed)
    plain_layers, plain_head = cpu_matmul.model_weights(params)
    assert len(layers) == len(plain_layers) == PANEL_LLAMA.num_layers and head.ndim == 3 and plain_head.ndim == 2
    first = cpu_matmul.measured_verdict(packed, params, fresh=True)
    assert set(first["ratios"]) == {str(m) for m in cpu_matmul.MEASURED_ROWS}
    assert all(t["kernel_s"] > 0 and t["xla_s"] > 0 for t in first["timings"].values())
    assert cpu_matmul.measured_verdict(packed, params) == first


# ------------------------------------------------------------------------------ stacks read at a layer


@pytest.mark.parametrize("form", ["float32", "bfloat16", "4-bit", "8-bit"])
def test_a_stacked_weight_is_read_in_place_at_its_layer(kernel, form):
    """The scanned layer loop passes a whole [L, ...] stack of panels and the layer index: each layer's
    product is bitwise the product of that layer's own panels, whatever the index (traced under a scan);
    an index outside the stack is an error, never a read past it."""
    rng = np.random.default_rng(11)
    k, n, layers = 64, 96, 3
    if form in ("4-bit", "8-bit"):
        ws = [block_quantized(rng, k, n, int(form[0])) for _ in range(layers)]
        stack = jnp.stack([cpu_matmul.compress_weight(jnp.asarray(w)) for w in ws])
        assert cpu_matmul.is_compressed(stack) and cpu_matmul.compressed_bits(stack) == int(form[0])
    elif form == "bfloat16":
        stack = jnp.stack([cpu_matmul.pack(jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16))
                           for _ in range(layers)])
    else:
        stack = jnp.stack([cpu_matmul.pack(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
                           for _ in range(layers)])
    x = jnp.asarray(rng.standard_normal((5, k)), jnp.float32)
    one = jax.jit(cpu_matmul.panel_matmul)
    want = np.stack([np.asarray(one(x, stack[i])) for i in range(layers)])

    def body(carry, i):
        return carry, cpu_matmul.panel_matmul(x, stack, layer=i)

    _, got = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32)))()
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(want[1], np.asarray(cpu_matmul.panel_matmul_reference(x, stack, layer=1)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="layer in range"):
        jax.block_until_ready(jax.jit(cpu_matmul.panel_matmul)(x, stack, layer=jnp.int32(layers)))


@pytest.mark.parametrize("cache", ["float32", "float16"])
def test_a_stacked_cache_is_attended_in_place_at_its_layer(kernel, cache):
    from hsdjax.kernels.cpu_attention import tree_attention_cpu

    rng = np.random.default_rng(5)
    layers, b, t, kh, g, d, s = 3, 2, 4, 2, 2, 32, 300
    q = jnp.asarray(rng.standard_normal((b, t, kh * g, d), np.float32))
    ck, cv = (jnp.asarray(rng.standard_normal((layers, b, kh, s, d), np.float32), cache) for _ in range(2))
    nk, nv = (jnp.asarray(rng.standard_normal((b, t, kh, d), np.float32)) for _ in range(2))
    mask = jnp.asarray(np.stack([path_mask([-1, 0, 0, 1])] * b))
    lens = jnp.asarray([257, 40], jnp.int32)
    run = jax.jit(tree_attention_cpu)
    for i in range(layers):
        want = run(q, ck[i], cv[i], lens, nk, nv, mask)
        got = run(q, ck, cv, lens, nk, nv, mask, layer=jnp.int32(i))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(Exception, match="layer in range"):
        jax.block_until_ready(run(q, ck, cv, lens, nk, nv, mask, layer=jnp.int32(-1)))


def test_the_scanned_kernel_model_equals_the_unrolled_one(kernel):
    """Stacked packed layers under the scan over the layer index (the kernels read each layer in place)
    give the unrolled loop's logits (up to float32 rounding: XLA fuses the elementwise work of the two
    programs differently), and `pld` over them gives their own `ar`'s tokens."""
    from hsdjax.runtime.model import unstack_layers

    cfg = PANEL_LLAMA.replace(backend="cpu-kernel")
    packed = cpu_matmul.pack_params(init_params(PANEL_LLAMA, seed=8), True)
    unrolled = unstack_layers(packed)
    np.testing.assert_allclose(tiny_logits(cfg, packed, 9, 6), tiny_logits(cfg.replace(scan_layers=False), unrolled, 9, 6),
                               rtol=1e-5, atol=1e-6)
    rng = np.random.default_rng(4)
    motif = rng.integers(0, cfg.vocab_size, 5).tolist()
    prompts = [motif * 3 + rng.integers(0, cfg.vocab_size, 3).tolist(), rng.integers(0, cfg.vocab_size, 7).tolist()]
    want = run_engine(cfg, packed, prompts, 20)
    assert run_engine(cfg, packed, prompts, 20, drafter=PromptLookupDrafter(width=2, depth=4)) == want


def test_the_scanned_kernel_decode_copies_no_stack(kernel):
    """The compiled decode loop of the scanned kernel model at batch 2 holds no copy of a KV-cache stack
    or a weight stack (a vmap over the batch axis of the stacks once made XLA keep them batch-major and
    copy both whole every round: 5x slower rounds)."""
    from hsdjax.core import engine
    from hsdjax.core.sampling import SamplingParams
    from tests.test_decode_hlo import COPY

    plain = PANEL_LLAMA.replace(num_layers=3)
    cfg = plain.replace(backend="cpu-kernel")
    params = cpu_matmul.pack_params(init_params(plain, seed=1), True)
    drafter, cache, batch = PromptLookupDrafter(width=2, depth=3), 256, 2
    gen, fwd = engine.prefill(params, jnp.ones((batch, 16), jnp.int32), jnp.full((batch,), 5), jnp.full((batch,), 20),
                              SamplingParams.make(batch), jax.vmap(jax.random.PRNGKey)(jnp.arange(batch)),
                              engine.stop_array(()), cfg=cfg, cache_size=cache, spare=drafter.spare)
    state = engine.start_decoding((), gen, fwd, drafter=drafter)
    hlo = engine.decode.lower(params, (), state, jnp.int32(3), cfg=cfg, drafter=drafter).compile().as_text()
    layer = batch * cfg.num_kv_heads * cache * cfg.head_dim
    big = [m.group(1) for m in COPY.finditer(hlo) if np.prod([int(x) for x in m.group(1).split(",") if x] or [1]) >= layer]
    assert not big, big
