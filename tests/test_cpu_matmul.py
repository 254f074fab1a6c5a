"""hsdjax's CPU matmul kernel: equal to its jnp reference, rows independent of the batch (bitwise), the
packed model equal to the unpacked one, and speculative decoding through it equal to `ar`."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdjax.drafters import PromptLookupDrafter
from hsdjax.errors import HsdjaxError
from hsdjax.kernels import cpu_matmul
from hsdjax.loading import use_cpu_matmul
from hsdjax.model import Transformer, causal_mask, init_params
from tests.conftest import TINY_LLAMA, run_engine

# every width a multiple of the 32-column panel
PANEL_LLAMA = TINY_LLAMA.replace(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                                 head_dim=16)


@pytest.fixture(scope="module")
def kernel():
    if not cpu_matmul.is_built():
        if not (shutil.which("g++") or shutil.which("c++")):
            pytest.skip("no C++ compiler: the optional CPU matmul kernel cannot be built here")
        cpu_matmul.build()
    assert cpu_matmul.load()


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


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_equals_the_unpacked_one(kernel, tied):
    cfg = PANEL_LLAMA.replace(tie_embeddings=tied)
    params = init_params(cfg, seed=3)
    packed_cfg = cfg.replace(cpu_matmul=True)
    packed = cpu_matmul.pack_params(params, tied)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    mask = causal_mask(jnp.array([11, 7]), 11)

    def logits(c, p):
        model = Transformer(c)
        out = model.apply({"params": p}, tokens, pos, mask)
        return np.asarray(model.apply({"params": p}, out["hidden"], method=Transformer.logits))

    np.testing.assert_allclose(logits(packed_cfg, packed), logits(cfg, params), rtol=1e-4, atol=1e-4)


def test_speculative_decoding_through_the_kernel_equals_ar(kernel):
    cfg = PANEL_LLAMA.replace(cpu_matmul=True)
    params = cpu_matmul.pack_params(init_params(PANEL_LLAMA, seed=5), True)
    rng = np.random.default_rng(2)
    motif = rng.integers(0, cfg.vocab_size, 6).tolist()
    prompts = [motif * 3 + rng.integers(0, cfg.vocab_size, 4).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()]
    want = run_engine(cfg, params, prompts, 24)
    got = run_engine(cfg, params, prompts, 24, drafter=PromptLookupDrafter(width=2, depth=4))
    assert got == want


def test_load_setting_is_checked_and_explained(kernel):
    with pytest.raises(HsdjaxError, match="auto, on or off"):
        use_cpu_matmul("fast", PANEL_LLAMA, None)
    assert use_cpu_matmul("off", PANEL_LLAMA, None) is False
    assert use_cpu_matmul("auto", PANEL_LLAMA, None) is True
    assert use_cpu_matmul("auto", TINY_LLAMA, None) is False  # widths of 48: not whole panels
    with pytest.raises(HsdjaxError, match="not a multiple of 32"):
        use_cpu_matmul("on", TINY_LLAMA, None)
    with pytest.raises(HsdjaxError, match="float32"):
        use_cpu_matmul("on", PANEL_LLAMA.replace(dtype="bfloat16"), None)


def test_real_model_loads_with_the_kernel_and_hsd_equals_ar(kernel, smollm):
    """The default model through the kernel (``auto`` picks it once built): greedy `hsd` with its
    lookup graft equals `ar`, and `ar` equals `ar` through XLA's matmul."""
    from hsdjax.api import Generator, load_model

    assert smollm.cfg.cpu_matmul
    prompt = "List three uses of a paperclip, then explain the second one."
    ar = Generator(smollm, "ar").generate(prompt, max_new_tokens=40)[0]
    hsd = Generator(smollm, "hsd").generate(prompt, max_new_tokens=40)[0]
    assert hsd.tokens == ar.tokens
    xla = load_model("smollm2-135m", cpu_matmul="off")
    assert not xla.cfg.cpu_matmul
    assert Generator(xla, "ar").generate(prompt, max_new_tokens=40)[0].tokens == ar.tokens
