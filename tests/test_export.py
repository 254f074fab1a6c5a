"""Portability: the jitted engine lowers for TPU and CUDA with jax.export (works on a CPU-only host)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from hsdjax import engine
from hsdjax.sampling import SamplingParams
from tests.conftest import TINY_QWEN


@pytest.mark.parametrize("scan_layers", [True, False])
def test_engine_exports_for_tpu_and_cuda(scan_layers):
    from hsdjax.model import init_params

    cfg = TINY_QWEN.replace(dtype="bfloat16", scan_layers=scan_layers)
    params = jax.eval_shape(lambda: init_params(cfg))
    b, p, s = 2, 32, 256
    prefill_args = (params, jnp.zeros((b, p), jnp.int32), jnp.full((b,), 5, jnp.int32), jnp.full((b,), 9, jnp.int32),
                    SamplingParams.make(b, 0.7, 10, 0.9), jax.random.split(jax.random.PRNGKey(0), b),
                    engine.stop_array([1]))
    platforms = ["tpu", "cuda"]
    exp = export.export(jax.jit(lambda *a: engine.prefill(*a, cfg=cfg, cache_size=s)), platforms=platforms)(
        *prefill_args)
    assert exp.platforms == tuple(platforms)
    state = jax.eval_shape(lambda *a: engine.prefill(*a, cfg=cfg, cache_size=s)[0], *prefill_args)
    exp = export.export(jax.jit(lambda pr, st, n: engine.decode(pr, st, n, cfg=cfg)), platforms=platforms)(
        params, state, jnp.int32(4))
    assert "while" in exp.mlir_module()
