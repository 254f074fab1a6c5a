"""The sort-free sampling paths equal the full-sort definition (issue #12 item 5)."""

from __future__ import annotations

import copy
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsdjax.core import sampling
from hsdjax.core.sampling import (
    CANDIDATES,
    SamplingParams,
    adjust_logits,
    adjust_logits_reference,
    target_probs,
    top_k_blocked,
)

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


# ----------------------------------------------------------------------------- tree verification, top-k and top-p on
# The first three tokens of 6-token random-model rows (one from the prefill, then tree rounds) against their exact
# joint; the filters are the sampler's own (temperature -> top-k -> top-p), recomputed in float64. The sharpened
# weights make the distributions neither flat nor one-hot, and at these settings top-k cuts every row (6 -> 4)
# while top-p cuts further in some (``test_tree_statistics_exercise_both_filters``).
TREE_TEMPERATURE, TREE_TOP_K, TREE_TOP_P = 1.0, 4, 0.9
TREE_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
# 8,192 rows per method in calls of 64 rows: the programs test_spec's and test_feature_drafters' sampling tests
# compile (same model, prompt, drafters and batch; the filters are arrays), so the suite compiles nothing more
TREE_BATCH, TREE_CALLS = 64, 128


def filtered_probs64(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The sampler's target distribution of each row in float64: ``adjust_logits_reference``'s rule
    (top-k over the temperature-scaled logits, then the smallest prefix of the top-k-renormalised
    distribution whose mass before each kept token is < top_p; every token tied with the cut-off kept)."""
    scaled = np.asarray(logits, np.float64) / temperature
    out = np.zeros_like(scaled)
    for r, row in enumerate(scaled):
        ordered = np.sort(row)[::-1]
        k = min(top_k, len(row)) if top_k > 0 else len(row)
        ordered[k:] = -np.inf
        w = np.exp(ordered - ordered[0])
        w /= w.sum()
        before = np.cumsum(w) - w
        n_keep = int(np.sum((before < top_p) | (np.arange(len(row)) == 0))) if top_p < 1 else k
        kept = np.where(row >= ordered[min(n_keep, k) - 1], row, -np.inf)
        e = np.exp(kept - kept.max())
        out[r] = e / e.sum()
    return out


@functools.cache
def _tree_target():
    """(every 2-token continuation of the prompt [V*V, 2], the logits after 0, 1 and 2 of its tokens
    [V*V, 3, V]) from one uncached pass of the 6-token model."""
    from hsdjax.runtime.model import Transformer, causal_mask
    from tests.test_spec import SMALL, sharp_params

    v, p = SMALL.vocab_size, len(TREE_PROMPT)
    seqs = np.array([TREE_PROMPT + list(c) for c in itertools.product(range(v), repeat=2)], np.int32)
    model = Transformer(SMALL)

    @jax.jit
    def logits_of(params, seqs):
        t = seqs.shape[1]
        out = model.apply({"params": params}, seqs, jnp.broadcast_to(jnp.arange(t), seqs.shape),
                          causal_mask(jnp.full((seqs.shape[0],), t), t))
        return model.apply({"params": params}, out["hidden"], method=Transformer.logits)

    return seqs[:, p:], np.asarray(logits_of(sharp_params(3), jnp.asarray(seqs)))[:, p - 1:]


def exact_tree_joint() -> np.ndarray:
    """The exact float64 joint [V, V, V] of the first three sampled tokens (the sampler's filters on)."""
    conts, logits = _tree_target()
    v = logits.shape[-1]
    probs = filtered_probs64(logits.reshape(-1, v), TREE_TEMPERATURE, TREE_TOP_K, TREE_TOP_P).reshape(logits.shape)
    # the float32 sampler must keep the same tokens (no cumulative mass within rounding of top_p here)
    sp = SamplingParams.make(logits.shape[0] * 3, TREE_TEMPERATURE, TREE_TOP_K, TREE_TOP_P)
    np.testing.assert_array_equal(np.asarray(target_probs(jnp.asarray(logits.reshape(-1, v)), sp)) > 0,
                                  probs.reshape(-1, v) > 0)
    joint = np.zeros((v, v, v))
    for (a, b), pr in zip(conts, probs):
        joint[a, b] = pr[0, a] * pr[1, b] * pr[2]
    return joint


def sample_tree_joint(drafter, dparams, n_calls: int = TREE_CALLS) -> np.ndarray:
    """Counts [V, V, V] of the first three tokens of ``n_calls`` x ``TREE_BATCH`` rows through the engine."""
    from tests.conftest import run_engine
    from tests.test_spec import SMALL, sharp_params

    params = sharp_params(3)
    v = SMALL.vocab_size
    counts = np.zeros(v ** 3, np.int64)
    for s in range(n_calls):
        rows = np.array(run_engine(SMALL, params, [TREE_PROMPT] * TREE_BATCH, 3, drafter=drafter, dparams=dparams,
                                   temperature=TREE_TEMPERATURE, top_k=TREE_TOP_K, top_p=TREE_TOP_P,
                                   seed=5000 + s))[:, :3]
        counts += np.bincount(np.ravel_multi_index(rows.T, (v, v, v)), minlength=v ** 3)
    return counts.reshape(v, v, v)


def tree_pvalue(counts: np.ndarray, joint: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square of ``counts`` against ``joint``, cells expecting fewer than ``min_expected`` pooled; 0
    when a draw fell where the target has probability 0 (impossible under the target)."""
    from tests.conftest import chi2_pvalue

    counts, probs = counts.ravel().astype(np.float64), joint.ravel() / joint.sum()
    if counts[probs <= 0].sum():
        return 0.0
    small = probs * counts.sum() < min_expected
    return chi2_pvalue(np.append(counts[~small], counts[small].sum()), np.append(probs[~small], probs[small].sum()))


def tree_drafter(method: str):
    """The method's drafter over the 6-token model: pld (a 2-wide, 3-deep lookup trie; it has drafts when
    the first token is 3), and random hsd / eagle drafters (a tree of 4 nodes, depth 2, every round)."""
    from hsdjax.core.drafters import PromptLookupDrafter

    if method == "pld":
        return PromptLookupDrafter(width=2, depth=3), ()
    from tests.test_feature_drafters import feature_drafter
    from tests.test_spec import SMALL, sharp_params

    return feature_drafter(SMALL, sharp_params(3), method, seed=2, vocab=6, depth=2, width=2, budget=4, lookup=0)


@pytest.fixture(scope="module")
def tree_joint():
    return exact_tree_joint()


def test_tree_statistics_exercise_both_filters():
    """At the test's settings top-k removes tokens from every row and top-p removes more from some: a
    sampler that ignored either filter would draw tokens the exact joint gives probability 0."""
    _, logits = _tree_target()
    rows = logits.reshape(-1, logits.shape[-1])
    kept_k = (filtered_probs64(rows, TREE_TEMPERATURE, TREE_TOP_K, 1.0) > 0).sum(1)
    kept_both = (filtered_probs64(rows, TREE_TEMPERATURE, TREE_TOP_K, TREE_TOP_P) > 0).sum(1)
    assert (kept_k < rows.shape[1]).all()
    assert (kept_both < kept_k).mean() > 0.2


@pytest.mark.parametrize("method", ["pld", "hsd", "eagle"])
def test_tree_sampling_with_top_k_and_top_p_matches_the_target(method, tree_joint):
    """The tree rule (``verify.draw_node_tokens`` + ``accept_tree``, what pld, hsd and eagle verify with)
    through the engine, with temperature, top-k and top-p on: the first three tokens follow the exact
    joint (fixed seeds: the p-value is the same every run)."""
    drafter, dparams = tree_drafter(method)
    assert tree_pvalue(sample_tree_joint(drafter, dparams), tree_joint) > 1e-3


def _shared_node_keys(keys, n):
    """Broken: every node draws with its row's one key, so the draws along a path are correlated (each
    node's own draw still follows its target: only the joint shows it)."""
    return jnp.broadcast_to(keys[:, None, :], (keys.shape[0], n, keys.shape[-1]))


def _accept_without_ancestors(y, tree, max_depth):
    """Broken ``verify.accept_tree``: a node whose token equals its parent's draw is accepted even when
    the parent itself was rejected."""
    from hsdjax.core.verify import Verdict, _path_to

    parent = jnp.maximum(tree.parents, 0)
    match = tree.valid & (tree.parents >= 0) & (tree.tokens == jnp.take_along_axis(y, parent, axis=1))
    accepted = (jnp.arange(y.shape[1])[None, :] == 0) | match
    deepest = jnp.argmax(jnp.where(accepted, tree.depth, -1), axis=1)
    depth = jnp.take_along_axis(tree.depth, deepest[:, None], axis=1)[:, 0]
    return Verdict(path=_path_to(tree, deepest, max_depth), n_path=depth + 1,
                   bonus=jnp.take_along_axis(y, deepest[:, None], axis=1)[:, 0])


@pytest.mark.parametrize("bug", ["shared_node_keys", "accept_without_ancestors"])
def test_tree_statistics_catch_a_broken_tree_rule(bug, tree_joint, monkeypatch):
    """Negative controls: the engine's tree rule broken in place (hsd's trees, the same settings, 1,024
    rows, fixed seeds) must fail the same statistic with p < 1e-6 (measured: 6e-45 and 0; the real rule
    gives 0.23 / 0.40 / 0.18 for pld / hsd / eagle on 8,192 rows). Power: the shared-key bug moves the
    joint by Cohen's w^2 ~ 0.28 (measured on 8,192 rows), a noncentrality of ~290 at 1,024 rows over 30
    pooled cells, whose p = 1e-6 cut-off is a chi-square of 80: the chance of a miss is ~5e-20 (7e-6 at
    half the effect). The ancestor bug emits paths the target cannot produce (probability-0 cells)."""
    from hsdjax.core import engine, verify

    if bug == "shared_node_keys":
        monkeypatch.setattr(verify, "node_keys", _shared_node_keys)
    else:
        monkeypatch.setattr(engine, "accept_tree", _accept_without_ancestors)
    drafter, dparams = tree_drafter("hsd")
    # the same drafter as an instance of a subclass: a static argument no compiled program has seen, so the
    # decode loop is traced afresh with the broken function, and no program traced without it is dropped or reused
    broken = copy.copy(drafter)
    object.__setattr__(broken, "__class__", type(f"HSDDrafterWith_{bug}", (type(drafter),), {}))
    assert tree_pvalue(sample_tree_joint(broken, dparams, n_calls=16), tree_joint) < 1e-6


# ----------------------------------------------------------------------------- the real model's first tokens
REAL_PROMPT = "My favourite fruit is"
REAL_TEMPERATURE, REAL_TOP_K, REAL_TOP_P = 0.8, 8, 0.85
REAL_TRIALS, REAL_CHUNK = 1024, 256  # each chunk draws 256 x 3 x 49,152 Gumbel numbers


def test_real_model_tree_draws_follow_its_filtered_distribution(smollm):
    """SmolLM2-135M's own logits (the whole 49,152-token vocabulary) at a draft tree of the root and the
    two likeliest next tokens; ``verify.verify_tree`` (the engine's tree rule) with top-k and top-p on,
    1,024 times with fresh keys. The first emitted token must follow the filtered distribution after the
    prompt, the second (emitted exactly when the first is a draft) the one after the prompt and that
    draft, both computed in float64 from the same logits. At these settings the kept set of every node
    is smaller than top-k alone or top-p alone keeps, so a sampler without either filter fails."""
    from hsdjax.core.tree import DraftTree
    from hsdjax.core.verify import verify_tree
    from hsdjax.runtime.model import Transformer, causal_mask

    cfg, params = smollm.cfg, smollm.params
    prompt = smollm.tokenizer.encode(REAL_PROMPT, add_special_tokens=False)
    model = Transformer(cfg)

    def logits_of(last):  # rows prompt + [t] for t in ``last``: the logits after the prompt and after t
        seqs = jnp.array([prompt + [t] for t in last], jnp.int32)
        t = seqs.shape[1]
        out = model.apply({"params": params}, seqs, jnp.broadcast_to(jnp.arange(t), seqs.shape),
                          causal_mask(jnp.full((len(seqs),), t), t))
        return np.asarray(model.apply({"params": params}, out["hidden"][:, -2:], method=Transformer.logits),
                          np.float32)

    root = logits_of([0, 0])[0, 0]
    drafts = [int(i) for i in np.argsort(-root, kind="stable")[:2]]
    logits = logits_of(drafts)  # the same shapes: the second eager pass reuses the first's programs
    logits = np.stack([logits[0, 0], logits[0, 1], logits[1, 1]])  # at the root, after draft 1, after draft 2
    probs = filtered_probs64(logits, REAL_TEMPERATURE, REAL_TOP_K, REAL_TOP_P)
    kept = (probs > 0).sum(1)
    assert (kept > 1).all()
    assert (kept < (filtered_probs64(logits, REAL_TEMPERATURE, REAL_TOP_K, 1.0) > 0).sum(1)).all()
    assert (kept < (filtered_probs64(logits, REAL_TEMPERATURE, 0, REAL_TOP_P) > 0).sum(1)).all()
    tree = DraftTree(tokens=jnp.array([[prompt[-1], *drafts]], jnp.int32), parents=jnp.array([[-1, 0, 0]], jnp.int32),
                     depth=jnp.array([[0, 1, 1]], jnp.int32), valid=jnp.ones((1, 3), bool))

    @jax.jit
    def emitted(keys):
        b = keys.shape[0]
        rows = jax.tree_util.tree_map(lambda a: jnp.repeat(a, b, axis=0), tree)
        sp = SamplingParams.make(b, REAL_TEMPERATURE, REAL_TOP_K, REAL_TOP_P)
        verdict = verify_tree(jnp.broadcast_to(jnp.asarray(logits), (b, *logits.shape)), rows, sp, keys, 1)
        return verdict.emitted(rows)[:, :2], verdict.n_path

    keys = jax.random.split(jax.random.PRNGKey(7), REAL_TRIALS)
    out = [emitted(keys[i: i + REAL_CHUNK]) for i in range(0, REAL_TRIALS, REAL_CHUNK)]
    tokens, n_path = np.concatenate([np.asarray(o[0]) for o in out]), np.concatenate([np.asarray(o[1]) for o in out])
    first = tokens[:, 0]
    np.testing.assert_array_equal(n_path == 2, np.isin(first, drafts))  # a second token exactly after a draft
    assert tree_pvalue(np.bincount(first, minlength=cfg.vocab_size), probs[0]) > 1e-3
    for i, d in enumerate(drafts):
        second = tokens[first == d, 1]
        assert len(second) > 60
        assert tree_pvalue(np.bincount(second, minlength=cfg.vocab_size), probs[1 + i]) > 1e-3
