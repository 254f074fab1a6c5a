"""The sort-free sampling paths equal the full-sort definition (issue #12 item 5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsdjax import sampling
from hsdjax.sampling import (CANDIDATES, SamplingParams, adjust_logits, adjust_logits_reference, target_probs,
                             top_k_blocked)

VOCABS = [1, 2, 7, 255, 256, 257, 600, 1000, 4099]  # below, at and above CANDIDATES; not block multiples
MODES = ["greedy", "off", "top_k", "top_p", "both"]
TOP_KS = [1, 2, 10, CANDIDATES - 1, CANDIDATES, CANDIDATES + 1, 1000, 5000]
TOP_PS = [0.0, 0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 0.99999, 1.0]
TEMPS = [0.3, 0.7, 1.0, 1.5, 4.0]
FAST = jax.jit(adjust_logits)
REFERENCE = jax.jit(adjust_logits_reference)


def _logits(rng: np.random.RandomState, b: int, v: int, style: str) -> np.ndarray:
    """Random logits: smooth, flat (wide nucleus), integer-valued (many ties), or with -inf entries."""
    if style == "ties":
        x = rng.randint(-3, 3, size=(b, v)).astype(np.float32)
    else:
        x = (rng.randn(b, v) * {"smooth": 3.0, "flat": 0.3, "neg_inf": 2.0}[style]).astype(np.float32)
    if style in ("neg_inf", "ties"):
        x[rng.rand(b, v) < 0.3] = -np.inf
        x[:, 0] = np.maximum(x[:, 0], 0.0)  # at least one finite entry per row
    return x


@st.composite
def _rows(draw, b: int) -> SamplingParams:
    """Per-row settings mixing greedy, off, top-k only, top-p only and both."""
    temp, top_k, top_p = [], [], []
    for _ in range(b):
        mode = draw(st.sampled_from(MODES))
        temp.append(0.0 if mode == "greedy" else draw(st.sampled_from(TEMPS)))
        top_k.append(draw(st.sampled_from(TOP_KS)) if mode in ("top_k", "both", "greedy") else 0)
        top_p.append(draw(st.sampled_from(TOP_PS[:-1])) if mode in ("top_p", "both", "greedy") else 1.0)
    return SamplingParams(temperature=jnp.array(temp, jnp.float32), top_k=jnp.array(top_k, jnp.int32),
                          top_p=jnp.array(top_p, jnp.float32))


def _ambiguous(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Rows where some cumulative probability is within float rounding of top_p: there the kept set
    depends on summation order, which no two implementations need share."""
    temp = np.where(np.asarray(sp.temperature) > 0, np.asarray(sp.temperature), 1.0).astype(np.float32)
    scaled = logits / temp[:, None]
    out = np.zeros(len(logits), bool)
    for r, row in enumerate(scaled):
        ordered = -np.sort(-row.astype(np.float64))
        k = int(sp.top_k[r]) if int(sp.top_k[r]) > 0 else len(row)
        ordered[min(k, len(row)):] = -np.inf
        w = np.exp(ordered - ordered[0])
        before = np.cumsum(w / w.sum()) - w / w.sum()
        top_p = float(sp.top_p[r])
        out[r] = top_p < 1 and bool(np.any(np.abs(before[1:k] - top_p) < 2e-6))  # 0 and past k: fixed
    return out


def _assert_same(fast: np.ndarray, ref: np.ndarray, skip: np.ndarray) -> None:
    np.testing.assert_array_equal(np.asarray(fast)[~skip], np.asarray(ref)[~skip])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), v=st.sampled_from(VOCABS), style=st.sampled_from(["smooth", "flat", "ties", "neg_inf"]),
       seed=st.integers(0, 2**31 - 1))
def test_adjust_logits_equals_full_sort(data, v, style, seed):
    """Fast path, fallback and sort-free path all keep exactly the reference's tokens."""
    logits = _logits(np.random.RandomState(seed), 4, v, style)
    sp = data.draw(_rows(4))
    skip = _ambiguous(logits, sp)
    _assert_same(FAST(jnp.array(logits), sp), REFERENCE(jnp.array(logits), sp), skip)


@jax.jit
def _candidate_rows(logits, sp):
    """The candidate path's adjusted logits for every row, and which rows it claims to fit."""
    scaled = sampling._scaled(logits, sp)
    vals, _ = top_k_blocked(scaled, min(CANDIDATES, scaled.shape[-1]))
    threshold, fits = sampling._candidate_threshold(scaled, vals, sp)
    return sampling._keep(scaled, threshold), fits


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), v=st.sampled_from(VOCABS), style=st.sampled_from(["smooth", "flat", "ties", "neg_inf"]),
       seed=st.integers(0, 2**31 - 1))
def test_candidate_rows_that_fit_equal_full_sort(data, v, style, seed):
    """Row by row, wherever the candidate path claims a fit, its threshold keeps the reference's set
    (the batch-level test alone would hide a wrong fast row behind a fallback)."""
    logits = jnp.array(_logits(np.random.RandomState(seed), 4, v, style))
    sp = data.draw(_rows(4))
    fast, fits = _candidate_rows(logits, sp)
    skip = _ambiguous(np.asarray(logits), sp) | ~np.asarray(fits)
    _assert_same(fast, REFERENCE(logits, sp), skip)


def test_fast_path_and_fallback_both_run():
    """A peaked top-p row fits among the candidates; a flat one, or top_k > CANDIDATES, does not."""
    rng = np.random.RandomState(0)
    peaked, flat = rng.randn(1, 5000).astype(np.float32) * 4, rng.randn(1, 5000).astype(np.float32) * 0.3
    logits = jnp.array(np.concatenate([peaked, flat, peaked]))
    sp = SamplingParams(temperature=jnp.full(3, 0.7), top_k=jnp.array([0, 0, CANDIDATES + 1]),
                        top_p=jnp.array([0.9, 0.9, 1.0]))
    scaled = sampling._scaled(logits, sp)
    _, fits = sampling._candidate_threshold(scaled, top_k_blocked(scaled, CANDIDATES)[0], sp)
    assert np.asarray(fits).tolist() == [True, False, False]
    np.testing.assert_array_equal(FAST(logits, sp), REFERENCE(logits, sp))


def _primitives(jaxpr) -> set[str]:
    """Every primitive in a jaxpr, nested jaxprs (jit, cond branches, ...) included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= _primitives(sub)
    return names


def test_all_off_settings_never_sort():
    """Outside the conds nothing sorts, and one branch of the top-level cond (the all-off one) has
    no sort or top-k anywhere inside it. (The old adjust_logits sorted unconditionally.)"""
    ranking = {"sort", "top_k"}
    logits = jnp.zeros((3, 4099))
    jaxpr = jax.make_jaxpr(adjust_logits)(logits, SamplingParams.make(3, 0.7)).jaxpr
    top_level = {e.primitive.name for e in jaxpr.eqns}
    assert not top_level & ranking and "cond" in top_level
    branches = [b.jaxpr for e in jaxpr.eqns if e.primitive.name == "cond" for b in e.params["branches"]]
    assert any(not _primitives(b) & ranking for b in branches)
    assert "sort" in _primitives(jaxpr)  # the walker does see the fallback's sort


def test_all_off_compiles_to_scaling_only():
    """With all-off settings as constants the compiled program has no sort at all."""
    sp = SamplingParams.make(2, 0.7)
    text = jax.jit(lambda x: adjust_logits(x, sp)).lower(jnp.zeros((2, 4099))).compile().as_text()
    assert "sort" not in text.lower()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("v,k,block", [(4099, 256, None), (1000, 7, 3), (50, 5, 16), (600, 256, 2), (97, 1, 1)])
def test_top_k_blocked_equals_lax_top_k(dtype, v, k, block):
    """Same values and the same indices (lowest index first among ties) as lax.top_k."""
    rng = np.random.RandomState(v + k)
    x = rng.randint(-20, 20, size=(2, 3, v)).astype(np.float32)  # plenty of ties
    if dtype != jnp.int32:
        x[rng.rand(*x.shape) < 0.2] = -np.inf
    x = jnp.array(x).astype(dtype) if dtype != jnp.int32 else jnp.array(x.astype(np.int32))
    vals, ids = top_k_blocked(x, k, block)
    want_vals, want_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(vals, np.float32), np.asarray(want_vals, np.float32))
    np.testing.assert_array_equal(ids, want_ids)


def test_greedy_rows_with_filters_do_not_change_target_probs():
    """target_probs switches greedy rows' filters off (unused there): sampled rows match the reference."""
    logits = jnp.array(np.random.RandomState(3).randn(3, 700).astype(np.float32) * 2)
    sp = SamplingParams(temperature=jnp.array([0.0, 0.8, 1.2]), top_k=jnp.array([5, 40, 0]),
                        top_p=jnp.array([0.5, 1.0, 0.9]))
    probs = np.asarray(target_probs(logits, sp))
    want = np.asarray(jax.nn.softmax(adjust_logits_reference(logits, sp), axis=-1))
    np.testing.assert_allclose(probs[1:], want[1:], atol=1e-7)
    np.testing.assert_array_equal(probs[0], np.eye(700)[int(jnp.argmax(logits[0]))])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's TopK rewrite")
def test_candidate_path_ranks_no_float_sort_on_cpu():
    """On CPU the candidate path stays on XLA's TopK call: no f32 sort (slicing top_k's values
    next to other uses turned the second stage into a full sort of the candidates)."""
    sp = SamplingParams.make(4, 0.7, 50, 0.9)

    def candidate_path(x):
        return sampling._candidate_threshold(x, top_k_blocked(x, CANDIDATES)[0], sp)

    text = jax.jit(candidate_path).lower(jnp.zeros((4, 49152))).compile().as_text()
    assert not [line for line in text.splitlines() if " sort(" in line and "f32[" in line.split("=")[1][:12]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), v=st.sampled_from(VOCABS), style=st.sampled_from(["smooth", "ties", "neg_inf", "nan", "all_neg_inf"]),
       seed=st.integers(0, 2**31 - 1))
def test_argmax_last_equals_jnp_argmax(data, v, style, seed):
    """The two-reduction argmax picks what ``jnp.argmax`` picks: the first maximum, ties, -inf rows and
    NaNs (the first NaN) included, for 1-3 leading dimensions."""
    rng = np.random.RandomState(seed)
    lead = data.draw(st.sampled_from([(3,), (2, 5), (1, 2, 3)]))
    b = int(np.prod(lead))
    if style == "nan":
        x = _logits(rng, b, v, "smooth")
        x[rng.rand(b, v) < 0.05] = np.nan
    elif style == "all_neg_inf":
        x = np.full((b, v), -np.inf, np.float32)
    else:
        x = _logits(rng, b, v, style)
    x = jnp.asarray(x.reshape(*lead, v))
    got = jax.jit(sampling.argmax_last)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
