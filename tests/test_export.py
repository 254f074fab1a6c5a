"""Portability: the jitted engine lowers for TPU and CUDA with jax.export, which works on a CPU-only host.

Two exports. With the backend this host resolves (``auto``: the jnp reference on a CPU), the engine
lowers for both platforms at once, so nothing CPU-only sneaks into it. With the Pallas backend forced
(model and drafters: ``backend="pallas"``), the decode loop of every method and a chunked-prefill piece
lower for each platform alone (a Pallas kernel lowers only on its own platform, see
``kernels/tree_attention.py``) and hold that platform's tree-attention kernel calls, Mosaic's
``tpu_custom_call`` or Triton's ``__gpu$xla.gpu.triton``, and none of the other's. The TPU exports run
under an abstract TPU device (``jax.sharding.AbstractMesh`` with an ``AbstractDevice``), which is what
Mosaic's generation-dependent lowering rules read (``tpu_info.get_device_kind``): without one they read
this host's device ("cpu") and fail, as ``test_the_abstract_tpu_device_reaches_mosaic`` shows.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from hsdjax.core import engine
from hsdjax.core.drafters import ARDrafter
from hsdjax.core.drafters.checkpoint import bind
from hsdjax.core.drafters.eagle import EagleDrafter
from hsdjax.core.drafters.feature import FeatureConfig, init_net
from hsdjax.core.drafters.hsd import HSDDrafter
from hsdjax.core.drafters.pld import PromptLookupDrafter
from hsdjax.core.drafters.sps import DraftLMDrafter
from hsdjax.core.sampling import SamplingParams
from hsdjax.runtime.model import init_params
from tests.conftest import TINY_QWEN

TRITON = "__gpu$xla.gpu.triton"  # exported only with its stability check disabled (tests/test_tree_attention.py)
KERNEL_CALLS = {"tpu": re.compile(r"stablehlo\.custom_call @tpu_custom_call\("),
                "cuda": re.compile(r"stablehlo\.custom_call @" + re.escape(TRITON) + r"\(")}
TPU_KIND = "TPU v5 lite"  # the abstract TPU the decode loops are lowered for
B, P, S = 2, 32, 256  # rows, prompt bucket, cache slots


def _drafter(method, cfg, params):
    """A small drafter of ``method`` with the target's backend, and the shapes of its params."""
    if method in ("hsd", "eagle"):
        fc = FeatureConfig(method=method, hidden=cfg.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=32, vocab=40)
        dparams = jax.eval_shape(lambda: bind(init_net(fc, 0), np.arange(40, dtype=np.int32), init_params(cfg), cfg))
        cls = HSDDrafter if method == "hsd" else EagleDrafter
        return cls(cfg=fc, layers=(0, 1, 2), depth=3, width=2, budget=4, lookup=3, backend=cfg.backend), dparams
    return {"ar": (ARDrafter(), ()), "pld": (PromptLookupDrafter(width=2, depth=3), ()),
            "sps": (DraftLMDrafter(draft_cfg=cfg, depth=3), params)}[method]


def _prefill_args(params):
    return (params, jnp.zeros((B, P), jnp.int32), jnp.full((B,), 5, jnp.int32), jnp.full((B,), 9, jnp.int32),
            SamplingParams.make(B, 0.7, 10, 0.9), jax.random.split(jax.random.PRNGKey(0), B), engine.stop_array([1]))


def _decode_state(cfg, drafter, dparams, args, top_logprobs=None):
    """The shapes of the decoding state after a prefill."""
    def prefill(*a):
        return engine.prefill(*a, cfg=cfg, cache_size=S, spare=drafter.spare, keep_layers=drafter.prompt_layers,
                              top_logprobs=top_logprobs)

    gen, fwd = jax.eval_shape(prefill, *args)
    return jax.eval_shape(lambda dp, g, f: engine.start_decoding(dp, g, f, drafter=drafter), dparams, gen, fwd)


@pytest.mark.parametrize("scan_layers,method,top_logprobs", [(True, "ar", None), (False, "ar", None),
                                                            (True, "pld", None), (True, "sps", None), (True, "pld", 20)])
def test_engine_exports_for_tpu_and_cuda(scan_layers, method, top_logprobs):
    """The backend a CPU host resolves (the jnp reference), for both platforms at once."""
    cfg = TINY_QWEN.replace(dtype="bfloat16", scan_layers=scan_layers)
    params = jax.eval_shape(lambda: init_params(cfg))
    drafter, dparams = _drafter(method, cfg, params)
    prefill_args = _prefill_args(params)
    platforms = ["tpu", "cuda"]

    def prefill(*a):
        return engine.prefill(*a, cfg=cfg, cache_size=S, spare=drafter.spare, top_logprobs=top_logprobs)

    exp = export.export(jax.jit(prefill), platforms=platforms)(*prefill_args)
    assert exp.platforms == tuple(platforms)
    state = _decode_state(cfg, drafter, dparams, prefill_args, top_logprobs)
    exp = export.export(
        jax.jit(lambda pr, dp, st, n: engine.decode(pr, dp, st, n, cfg=cfg, drafter=drafter)), platforms=platforms,
    )(params, dparams, state, jnp.int32(4))
    assert "while" in exp.mlir_module()
    assert not any(calls.search(exp.mlir_module()) for calls in KERNEL_CALLS.values())  # the reference here


def abstract_tpu(kind: str = TPU_KIND):
    """A context in which lowering sees an abstract TPU of ``kind`` (a one-device mesh), not this host."""
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device))


def export_for(platform: str, fn, *args, tpu_kind: str = TPU_KIND) -> str:
    """``fn`` exported for one platform (Triton's stability check disabled; TPU under an abstract device):
    its StableHLO text. ``args`` are shapes (nothing concrete may be built under the abstract mesh)."""
    with abstract_tpu(tpu_kind) if platform == "tpu" else contextlib.nullcontext():
        exp = export.export(jax.jit(fn), platforms=[platform],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    assert exp.platforms == (platform,)
    return exp.mlir_module()


def kernel_calls(module: str) -> dict[str, int]:
    """How many tree-attention kernel calls of each platform the module holds."""
    return {platform: len(calls.findall(module)) for platform, calls in KERNEL_CALLS.items()}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("method", ["ar", "pld", "sps", "hsd", "eagle"])
def test_decode_exports_with_the_pallas_kernels(method, platform):
    """Every method's decode loop with the Pallas backend forced holds the platform's kernel at each of
    the target's verification passes (one call per pass: the layers run under one scan), more where the
    drafter attends too (sps's draft model, hsd / eagle's network), and none of the other platform's.
    Counts measured with jax 0.10.2: ar 1, pld 3, sps 4, hsd 6, eagle 6, the same on both platforms."""
    cfg = TINY_QWEN.replace(dtype="bfloat16", backend="pallas")
    params = jax.eval_shape(lambda: init_params(cfg))
    drafter, dparams = _drafter(method, cfg, params)
    state = _decode_state(cfg, drafter, dparams, _prefill_args(params))
    module = export_for(platform, lambda pr, dp, st, n: engine.decode(pr, dp, st, n, cfg=cfg, drafter=drafter),
                        params, dparams, state, jax.ShapeDtypeStruct((), jnp.int32))
    calls = kernel_calls(module)
    other = "cuda" if platform == "tpu" else "tpu"
    passes = len(engine.verify_sizes(drafter))  # the target's pass sizes (a switch over them)
    assert calls[other] == 0, calls
    assert calls[platform] >= passes, calls
    if method in ("sps", "hsd", "eagle"):  # the drafter's own attention reaches the kernel too
        assert calls[platform] > passes, calls


@pytest.mark.parametrize("platform,tpu_kind", [("cuda", None), ("tpu", "TPU v4"), ("tpu", TPU_KIND),
                                               ("tpu", "TPU v6 lite")])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_chunked_prefill_exports_with_the_pallas_kernels(platform, tpu_kind, scan_layers):
    """A prompt piece over an already-filled prefix (the server's chunked prefill) attends to the cache
    through the platform's kernel: once under the layer scan, once per layer unrolled (TPU: for several
    generations). A fresh prompt's own pass has no cache and stays on the jnp reference."""
    cfg = TINY_QWEN.replace(dtype="bfloat16", backend="pallas", scan_layers=scan_layers)
    params = jax.eval_shape(lambda: init_params(cfg))
    fill = jax.eval_shape(lambda: engine.empty_fill(cfg, B, P, S))
    piece = (jax.ShapeDtypeStruct((B, 32), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    other = "cuda" if platform == "tpu" else "tpu"
    kind = {"tpu_kind": tpu_kind} if tpu_kind else {}
    module = export_for(platform, lambda pr, f, pc, n: engine.fill_piece(pr, f, pc, n, cfg=cfg), params, fill, *piece,
                        **kind)
    assert kernel_calls(module) == {platform: 1 if scan_layers else cfg.num_layers, other: 0}
    fresh = export_for(platform, lambda pr, f, pc, n: engine.fill_piece(pr, f, pc, n, cfg=cfg, fresh=True), params,
                       fill, *piece, **kind)
    assert kernel_calls(fresh) == {platform: 0, other: 0}


def test_the_abstract_tpu_device_reaches_mosaic():
    """Mosaic lowers some primitives by TPU generation (``sign`` of bfloat16 stays 16-bit from v4 on):
    outside an abstract TPU device the lowering asks this host, which is no TPU, and fails; under one it
    lowers for the generation named."""
    from jax.experimental import pallas as pl

    def sign(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.sign(x_ref[...])
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    x = jax.ShapeDtypeStruct((16, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="TPU device kind"):
        export.export(jax.jit(sign), platforms=["tpu"])(x)
    v3, v5e = (export_for("tpu", sign, x, tpu_kind=kind) for kind in ("TPU v3", TPU_KIND))
    assert kernel_calls(v3)["tpu"] == kernel_calls(v5e)["tpu"] == 1 and v3 != v5e
