"""Portability: the jitted engine (plain and speculative) lowers for TPU and CUDA with jax.export,
which works on a CPU-only host, so nothing CPU-only sneaks into it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from hsdjax import engine
from hsdjax.drafters import ARDrafter
from hsdjax.drafters.pld import PromptLookupDrafter
from hsdjax.drafters.sps import DraftLMDrafter
from hsdjax.model import init_params
from hsdjax.sampling import SamplingParams
from tests.conftest import TINY_QWEN


@pytest.mark.parametrize("scan_layers,method,top_logprobs", [(True, "ar", None), (False, "ar", None),
                                                            (True, "pld", None), (True, "sps", None), (True, "pld", 20)])
def test_engine_exports_for_tpu_and_cuda(scan_layers, method, top_logprobs):
    cfg = TINY_QWEN.replace(dtype="bfloat16", scan_layers=scan_layers)
    params = jax.eval_shape(lambda: init_params(cfg))
    drafter, dparams = {
        "ar": (ARDrafter(), ()),
        "pld": (PromptLookupDrafter(width=2, depth=3), ()),
        "sps": (DraftLMDrafter(draft_cfg=cfg, depth=3), params),
    }[method]
    b, p, s = 2, 32, 256
    prefill_args = (params, jnp.zeros((b, p), jnp.int32), jnp.full((b,), 5, jnp.int32), jnp.full((b,), 9, jnp.int32),
                    SamplingParams.make(b, 0.7, 10, 0.9), jax.random.split(jax.random.PRNGKey(0), b),
                    engine.stop_array([1]))
    platforms = ["tpu", "cuda"]

    def prefill(*a):
        return engine.prefill(*a, cfg=cfg, cache_size=s, spare=drafter.spare, top_logprobs=top_logprobs)

    exp = export.export(jax.jit(prefill), platforms=platforms)(*prefill_args)
    assert exp.platforms == tuple(platforms)
    gen, fwd = jax.eval_shape(prefill, *prefill_args)
    state = jax.eval_shape(lambda dp, g, f: engine.start_decoding(dp, g, f, drafter=drafter), dparams, gen, fwd)
    exp = export.export(
        jax.jit(lambda pr, dp, st, n: engine.decode(pr, dp, st, n, cfg=cfg, drafter=drafter)), platforms=platforms,
    )(params, dparams, state, jnp.int32(4))
    assert "while" in exp.mlir_module()
