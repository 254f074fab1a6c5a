"""`hsd` and `eagle`: lossless (greedy = `ar` token for token, sampling keeps the distribution), reuse
really happens, counters add up, checkpoints bind only to their target, training learns."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsdjax.core.drafters.checkpoint import bind
from hsdjax.core.drafters.eagle import EagleDrafter
from hsdjax.core.drafters.feature import OUTPUT_SIDE, FeatureConfig, FeatureDrafterNet, init_net
from hsdjax.core.drafters.hsd import HSDDrafter
from hsdjax.errors import HsdjaxError
from hsdjax.runtime.model import init_params
from hsdjax.train.datagen import fused_layer_indices
from tests.conftest import TINY_LLAMA, TINY_QWEN, run_engine
from tests.test_spec import SMALL, exact_joint, pooled_pvalue, sample_joint, sharp_params


def feature_drafter(cfg, params, method, seed=0, vocab=None, sharpen=4.0, **opts):
    """A random (untrained) drafter of ``method`` for a tiny target; weights scaled so its
    proposals vary (a random drafter is still a drafter: losslessness must not depend on quality)."""
    vocab = vocab or min(cfg.vocab_size, 40)
    fc = FeatureConfig(method=method, hidden=cfg.hidden_size, heads=2, kv_heads=1, head_dim=8, mlp=32,
                       vocab=vocab, rope_theta=cfg.rope_theta, injection=opts.pop("injection", "mlp"),
                       root_token=opts.pop("root_token", False), chain_layer=opts.pop("chain_layer", False),
                       chain_g=opts.pop("chain_g", False))
    net = jax.tree_util.tree_map(lambda a: a * sharpen if a.ndim == 2 else a, init_net(fc, seed))
    ids = np.sort(np.random.RandomState(seed).choice(cfg.vocab_size, vocab, replace=False)).astype(np.int32)
    layers = fused_layer_indices(cfg.num_layers)[:3]
    cls = HSDDrafter if method == "hsd" else EagleDrafter
    return cls(cfg=fc, layers=layers, backend=cfg.backend, **opts), bind(net, ids, params, cfg)


def tiny_target(name):
    cfg = TINY_LLAMA if name == "llama" else TINY_QWEN
    return cfg, init_params(cfg, seed=1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def both_targets(request):
    return tiny_target(request.param)


# the drafters' logic does not depend on the target's architecture: the default run checks it on llama
# (plus the lossless check on both), the slow run on qwen2 as well
@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def target(request):
    return tiny_target(request.param)


def prompts_of(seed, vocab, n):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(0, vocab, rng.randint(2, 30))) for _ in range(n)]


TREES = [dict(depth=1, width=1, budget=1), dict(depth=5, width=3, budget=8)]


@pytest.mark.parametrize("tree", TREES, ids=["1x1", "5x3"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), max_new=st.integers(1, 40))
def test_hsd_and_eagle_greedy_equal_ar(both_targets, tree, seed, max_new):
    """Batched rows of different lengths, generation split over two decode calls (state carried)."""
    cfg, params = both_targets
    prompts = prompts_of(seed, cfg.vocab_size, 3)
    want = run_engine(cfg, params, prompts, max_new)
    for method in ("hsd", "eagle"):
        drafter, dparams = feature_drafter(cfg, params, method, seed=seed % 7, **tree)
        got = run_engine(cfg, params, prompts, max_new, drafter=drafter, dparams=dparams, chunks=[3, max_new])
        assert got == want, method


@pytest.mark.parametrize("method", ["hsd", "eagle"])
def test_lookup_graft_is_lossless_and_used(target, method):
    """Prompt lookup's continuation grafted onto the trees: output equal to `ar`, the larger pass runs in
    rounds with a match, and on repetitive text (a tiny random model's greedy output loops) the graft
    raises the accepted drafts over the same drafter without it."""
    cfg, params = target
    rng = np.random.RandomState(4)
    prompts = [list(rng.randint(0, cfg.vocab_size, 6)) * 4, list(rng.randint(0, cfg.vocab_size, 9))]
    want = run_engine(cfg, params, prompts, 48)
    accepted = {}
    for lookup in (0, 5):
        drafter, dparams = feature_drafter(cfg, params, method, depth=2, width=2, budget=2, lookup=lookup)
        got, state = run_engine(cfg, params, prompts, 48, drafter=drafter, dparams=dparams, chunks=[5, 48],
                                return_state=True)
        assert got == want, (method, lookup)
        s = jax.tree_util.tree_map(np.asarray, state.stats)
        accepted[lookup] = int(s.accepted_drafts.sum())
        assert np.all(s.lookup_drafts <= s.accepted_drafts)
        if lookup:
            assert drafter.tiers == (3, 8) and drafter.max_depth == 5
            assert np.all(s.verified_nodes > s.target_passes * 3)  # some rounds ran the 8-node pass
            assert int(s.lookup_drafts.sum()) > 0  # drafts lookup supplied are told apart
        else:
            assert int(s.lookup_drafts.sum()) == 0
    assert accepted[5] > accepted[0], accepted
    # a graft as long as its match earns: passes of 3 + 0 / 1 / 5 nodes, still `ar`'s output
    drafter, dparams = feature_drafter(cfg, params, method, depth=2, width=2, budget=2, lookup_lengths=(0, 1, 5))
    assert drafter.tiers == (3, 4, 8) and drafter.lookup == 5
    got, state = run_engine(cfg, params, prompts, 48, drafter=drafter, dparams=dparams, chunks=[5, 48],
                            return_state=True)
    assert got == want
    assert int(state.stats.lookup_drafts.sum()) > 0


def test_prompt_bucket_as_long_as_the_cache(target):
    """A 200-token prompt pads to 256, and 200 + 16 new tokens (+ tree slots) also fit a 256 cache: the
    prompt bucket fills the whole buffer (a real MT-bench turn 2 hit this in `eagle`'s prompt ingest)."""
    from hsdjax.core import engine

    cfg, params = target
    prompts = [list(np.random.RandomState(3).randint(0, cfg.vocab_size, 200))]
    want = run_engine(cfg, params, prompts, 16)
    for method in ("hsd", "eagle"):
        drafter, dparams = feature_drafter(cfg, params, method, depth=3, width=2, budget=4)
        assert engine.plan_shapes(cfg, 200, 16, spare=drafter.spare) == (256, 256)
        assert run_engine(cfg, params, prompts, 16, drafter=drafter, dparams=dparams) == want, method


def test_hsd_chain_ahead_is_lossless_and_keeps_states_for_later_rounds(target):
    """A depth-2 tree reads chain states 0 and 1; after any acceptance state 1 is gone, so nothing is
    reused. Drafting 2 states ahead keeps guesses for the next rounds (read there, not redrafted); the
    output stays `ar`'s either way."""
    cfg, params = target
    prompts = prompts_of(8, cfg.vocab_size, 2)
    want = run_engine(cfg, params, prompts, 40)
    reused = {}
    for ahead in (0, 2):
        drafter, dparams = feature_drafter(cfg, params, "hsd", policy="reuse", depth=2, width=2, budget=3,
                                           ahead=ahead)
        assert drafter.chain_size == 3 + ahead
        got, state = run_engine(cfg, params, prompts, 40, drafter=drafter, dparams=dparams, chunks=[7, 40],
                                return_state=True)
        assert got == want, ahead
        s = jax.tree_util.tree_map(np.asarray, state.stats)
        reused[ahead] = int(s.reused_states.sum())
        assert np.all(s.drafter_states <= s.target_passes * (1 + ahead + 1))  # ingest + at most the chain's steps
    assert reused[0] == 0 and reused[2] > 0, reused


def test_hsd_shortlist_is_lossless_and_scores_fewer_rows(target):
    """``shortlist``: below depth 1 a node's children are scored among its chain state's S likeliest
    tokens only. Greedy output stays `ar`'s; from one state, the whole draft vocabulary as the shortlist
    drafts the full head's tree and a short list another one, at fewer multiply-adds. ``attn`` injection is refused."""
    cfg, params = target
    prompts = prompts_of(9, cfg.vocab_size, 3)
    want = run_engine(cfg, params, prompts, 30)
    trees, macs, state = {}, {}, None
    for s in (0, 4, 40):  # 40: the tiny drafter's whole vocabulary
        drafter, dparams = feature_drafter(cfg, params, "hsd", depth=4, width=3, budget=5, shortlist=s)
        dparams = dict(dparams, head_rows=dparams["head"])  # the head's rows (unpacked off the CPU kernel)
        _, st = run_engine(cfg, params, prompts, 30, drafter=drafter, dparams=dparams, return_state=True, chunks=[5])
        state = state or st  # every drafter proposes from the first run's state
        tree, _, cost = drafter.propose(dparams, state.draft, state.gen)
        trees[s], macs[s] = jax.tree_util.tree_map(np.asarray, tree), float(np.sum(cost.macs))
    assert np.array_equal(trees[40].tokens, trees[0].tokens) and np.array_equal(trees[40].parents, trees[0].parents)
    assert not np.array_equal(trees[4].tokens, trees[0].tokens)
    assert macs[4] < macs[0], macs
    for s in (0, 4):  # and the runs to the end are lossless
        drafter, dparams = feature_drafter(cfg, params, "hsd", depth=4, width=3, budget=5, shortlist=s)
        got = run_engine(cfg, params, prompts, 30, drafter=drafter, dparams=dict(dparams, head_rows=dparams["head"]))
        assert got == want, s
    with pytest.raises(HsdjaxError, match="shortlist"):
        feature_drafter(cfg, params, "hsd", injection="attn", shortlist=4)


@pytest.mark.parametrize("tree", TREES, ids=["1x1", "5x3"])
def test_hsd_with_a_context_read_in_g_is_lossless(both_targets, tree):
    """``attn`` injection (g also attends to the verified context) keeps greedy output equal to `ar`,
    over two decode calls, with reuse (the chain stays token-free) and a lookup graft."""
    cfg, params = both_targets
    prompts = prompts_of(11, cfg.vocab_size, 3)
    want = run_engine(cfg, params, prompts, 30)
    drafter, dparams = feature_drafter(cfg, params, "hsd", seed=3, injection="attn", policy="reuse", lookup=3, **tree)
    assert {"g_q", "g_o"} <= set(dparams["net"])
    got, state = run_engine(cfg, params, prompts, 30, drafter=drafter, dparams=dparams, chunks=[4, 30],
                            return_state=True)
    assert got == want
    assert np.all(np.asarray(state.stats.drafter_macs) > 0)


@pytest.mark.parametrize("tree", TREES, ids=["1x1", "5x3"])
def test_hsd_with_the_root_token_is_lossless_and_reads_the_token(both_targets, tree):
    """``root_token``: verified positions carry their next token into the layer input (the new root
    included), the chain's own steps stay token-free; greedy output equals `ar` over two decode calls,
    with reuse and a lookup graft, and the input really depends on the token."""
    cfg, params = both_targets
    prompts = prompts_of(12, cfg.vocab_size, 3)
    want = run_engine(cfg, params, prompts, 30)
    drafter, dparams = feature_drafter(cfg, params, "hsd", seed=4, root_token=True, policy="reuse", lookup=3, **tree)
    assert "fc" in dparams["net"]
    assert run_engine(cfg, params, prompts, 30, drafter=drafter, dparams=dparams, chunks=[4, 30]) == want
    fused = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 3, cfg.hidden_size))
    inputs = [drafter.verified_inputs(dparams, fused, jnp.array([[1, t]])) for t in (2, 3)]
    assert np.allclose(inputs[0][:, 0], inputs[1][:, 0]) and not np.allclose(inputs[0][:, 1], inputs[1][:, 1])
    plain, plain_params = feature_drafter(cfg, params, "hsd", seed=4, policy="reuse", lookup=3, **tree)
    same = [plain.verified_inputs(plain_params, fused, jnp.array([[1, t]])) for t in (2, 3)]
    assert np.array_equal(same[0], same[1])


@pytest.mark.parametrize("tree", TREES, ids=["1x1", "5x3"])
def test_hsd_with_a_chain_layer_is_lossless_and_runs_the_chain_on_it(both_targets, tree):
    """``chain_layer``: the chain's own steps (and the kept root's keys) run a second layer, the
    verified positions the first. Greedy output equals `ar` over two decode calls, with reuse and a
    graft; against the same drafter without it, the context (the first layer's) is the same and the
    chain's states beyond the root (the second layer's) are not."""
    cfg, params = both_targets
    prompts = prompts_of(14, cfg.vocab_size, 3)
    want = run_engine(cfg, params, prompts, 30)
    opts = dict(seed=6, policy="reuse", lookup=3, **tree)
    plain, plain_params = feature_drafter(cfg, params, "hsd", **opts)
    chained = dataclasses.replace(plain, cfg=dataclasses.replace(plain.cfg, chain_layer=True))
    other = {k: v[::-1] if v.ndim == 2 else v for k, v in plain_params["net"]["layer"].items()}
    dparams = dict(plain_params, net={**plain_params["net"], "chain": other})
    runs = [run_engine(cfg, params, prompts, 30, drafter=d, dparams=p, chunks=[4, 30], return_state=True)
            for d, p in ((plain, plain_params), (chained, dparams))]
    assert runs[0][0] == want and runs[1][0] == want
    (_, a), (_, b) = runs
    n = int(np.min(np.asarray(a.draft.ctx["len"])))
    np.testing.assert_allclose(a.draft.ctx["k"][:, :, :n], b.draft.ctx["k"][:, :, :n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.draft.chain[:, 0], b.draft.chain[:, 0], rtol=1e-5, atol=1e-6)
    if plain.depth > 1:
        assert not np.allclose(a.draft.chain[:, 1:], b.draft.chain[:, 1:], atol=1e-3)


@pytest.mark.parametrize("tree", TREES, ids=["1x1", "5x3"])
def test_hsd_with_a_chain_g_is_lossless_and_drafts_below_depth_1_through_it(both_targets, tree):
    """``chain_g``: nodes below depth 1 (children of chain states) go through a ``g`` and output norms
    of their own, the first draft through the network's. Greedy output equals `ar` over two decode
    calls, with reuse and a graft; with different weights in the chain's copy, the same round's tree
    keeps its depth-1 drafts and changes below them."""
    cfg, params = both_targets
    prompts = prompts_of(15, cfg.vocab_size, 3)
    want = run_engine(cfg, params, prompts, 30)
    plain, plain_params = feature_drafter(cfg, params, "hsd", seed=7, policy="reuse", lookup=3, **tree)
    own = dataclasses.replace(plain, cfg=dataclasses.replace(plain.cfg, chain_g=True))
    net = plain_params["net"]
    side = {k: v[:, ::-1] if k == "g_out" else -v if k == "out_norm" else v for k, v in net.items() if k in OUTPUT_SIDE}
    dparams = dict(plain_params, net={**net, "chain_output": side})
    rows, state = run_engine(cfg, params, prompts, 30, drafter=own, dparams=dparams, chunks=[4, 30],
                             return_state=True)
    assert rows == want
    if plain.depth == 1:
        return
    fresh = state.draft.replace(n_chain=jnp.ones_like(state.draft.n_chain))  # every chain state drafted anew
    gen = state.gen.replace(done=jnp.zeros_like(state.gen.done))
    trees = [d.propose(p, fresh, gen)[0] for d, p in ((plain, plain_params), (own, dparams))]
    depth, valid = np.asarray(trees[0].depth), np.asarray(trees[0].valid)
    tokens = [np.asarray(t.tokens) for t in trees]
    first = (depth == 1) & valid
    assert first.any() and np.array_equal(tokens[0][first], tokens[1][first])
    assert not np.array_equal(tokens[0][depth > 1], tokens[1][depth > 1])


@pytest.mark.parametrize("added", ["root_token", "chain_layer", "chain_g"])
def test_a_grown_plain_hsd_drafts_what_it_drafted(target, added):
    """The warm starts that add ``root_token`` (``fc`` passes the feature through, the token weights
    start at zero), ``chain_layer`` (a copy of the layer) or ``chain_g`` (a copy of g and the norms) to
    a trained `hsd` propose exactly the trees of the drafter they start from."""
    from hsdjax.core.drafters.checkpoint import grow_plain_hsd

    cfg, params = target
    prompts = prompts_of(13, cfg.vocab_size, 3)
    tree = dict(depth=3, width=2, budget=4, policy="reuse")
    plain, plain_params = feature_drafter(cfg, params, "hsd", seed=5, **tree)
    grown = dataclasses.replace(plain, cfg=dataclasses.replace(plain.cfg, **{added: True}))
    net, differ = grow_plain_hsd(plain_params["net"], grown.cfg, {added: (False, True), "mlp": (64, 32)})
    assert differ == {"mlp": (64, 32)}  # what cannot be grown is left for the caller to refuse
    assert set(net) - set(plain_params["net"]) == {{"root_token": "fc", "chain_layer": "chain"}.get(added, "chain_output")}
    dparams = dict(plain_params, net=jax.tree_util.tree_map(jnp.asarray, net))
    runs = [run_engine(cfg, params, prompts, 24, drafter=d, dparams=p, return_state=True)
            for d, p in ((plain, plain_params), (grown, dparams))]
    assert runs[0][0] == runs[1][0]
    for name in ("accepted_drafts", "tree_nodes", "accept_hist", "round_log", "reused_states"):
        assert np.array_equal(getattr(runs[0][1].stats, name), getattr(runs[1][1].stats, name)), name
    (_, a), (_, b) = runs  # the drafters' own states after every round: the same chain, keys and context
    for name in ("chain", "chain_k", "chain_v"):
        np.testing.assert_allclose(getattr(a.draft, name), getattr(b.draft, name), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.draft.ctx["k"], b.draft.ctx["k"], rtol=1e-5, atol=1e-6)
    assert float(np.abs(np.asarray(a.draft.chain)).sum()) > 0


@pytest.mark.parametrize("policy", ["reuse", "refresh", "min2"])
def test_hsd_policies_are_lossless_and_reuse_counts(target, policy):
    cfg, params = target
    prompts = prompts_of(5, cfg.vocab_size, 2)
    want = run_engine(cfg, params, prompts, 40)
    drafter, dparams = feature_drafter(cfg, params, "hsd", policy=policy, depth=5, width=2, budget=6, injection="film")
    got, state = run_engine(cfg, params, prompts, 40, drafter=drafter, dparams=dparams, return_state=True)
    assert got == want
    s = jax.tree_util.tree_map(np.asarray, state.stats)
    rounds = s.target_passes
    # every round ingests once and computes its chain states; refresh recomputes depth-1 states per round
    assert np.all(s.draft_passes >= rounds)
    assert np.all(s.drafter_states == s.draft_passes)
    # accepted drafts made from kept states: some of the drafter's own, none where nothing was kept
    assert np.all(s.reused_drafts <= s.accepted_drafts - s.lookup_drafts)
    assert np.all((s.reused_drafts == 0) | (s.reused_states > 0))
    if policy == "refresh":
        assert np.all(s.reused_states == 0) and np.all(s.reused_drafts == 0)
        assert np.all(s.drafter_states == rounds * drafter.depth)
    if policy == "reuse":
        assert np.all(s.drafter_states < rounds * drafter.depth)  # kept states were not recomputed
        assert np.any(s.reused_states > 0)
    # the root of the kept chain carries the keys of the fresh state that replaced the old guess
    d = state.draft
    _, k0, v0 = drafter._net().apply({"params": dparams["net"]}, d.chain[:, :1], d.ctx["len"][:, None],
                                     method=FeatureDrafterNet.project)
    np.testing.assert_allclose(np.asarray(d.chain_k[:, 0]), np.asarray(k0[:, 0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(d.chain_v[:, 0]), np.asarray(v0[:, 0]), rtol=1e-5, atol=1e-6)


def test_eagle_counts_every_processed_node(target):
    cfg, params = target
    drafter, dparams = feature_drafter(cfg, params, "eagle", depth=4, width=3, budget=6)
    _, state = run_engine(cfg, params, prompts_of(1, cfg.vocab_size, 2), 30, drafter=drafter, dparams=dparams,
                          return_state=True)
    s = jax.tree_util.tree_map(np.asarray, state.stats)
    assert np.all(s.drafter_states == s.target_passes * (1 + 3 * 3))
    assert np.all(s.draft_passes == s.target_passes * 4)
    assert np.all(s.accepted_drafts <= s.drafter_states)


@pytest.mark.parametrize("method,lookup", [("hsd", 0), ("eagle", 0), ("hsd", 3)])
def test_feature_drafter_sampling_matches_plain_sampling(method, lookup):
    """Joint distribution of the first three sampled tokens with a feature drafter's trees (and with a
    grafted lookup chain: the repeating prompt always has a match)."""
    params = sharp_params(3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter, dparams = feature_drafter(SMALL, params, method, seed=2, vocab=6, depth=2, width=2, budget=4,
                                       lookup=lookup)
    counts = sample_joint(SMALL, params, prompt, drafter, dparams, 1.0, 1.0)
    assert pooled_pvalue(counts, exact_joint(SMALL, params, prompt, 1.0, 1.0)) > 1e-3


def test_tree_keeps_best_nodes_with_their_ancestors():
    from hsdjax.core.drafters.dynamic_tree import grow_tree

    v, depth, width, budget = 12, 3, 3, 5
    rng = np.random.RandomState(0)
    tables = jnp.asarray(jax.nn.log_softmax(rng.randn(depth, v) * 3, axis=-1))

    def children(d, tokens, slots, parent_idx, carry):
        return jnp.broadcast_to(tables[d], (1, width, v)), carry

    tree, cum, _ = grow_tree(jnp.array([0]), tables[0][None], children, None, jnp.arange(v), depth, width, budget)
    valid = np.asarray(tree.valid[0])
    parents = np.asarray(tree.parents[0])
    assert valid.sum() == 1 + budget
    for i in np.nonzero(valid)[0][1:]:
        assert valid[parents[i]]
    kept = np.asarray(cum[0])[valid][1:]
    dropped = np.asarray(cum[0])[~valid]
    assert kept.min() >= dropped.max()


def test_grow_prob_keeps_the_best_draft_and_only_sure_nodes_beyond_it():
    from hsdjax.core.drafters.dynamic_tree import frontiers_expanded, grow_tree

    v, depth, width, budget = 12, 3, 3, 6
    rng = np.random.RandomState(1)
    sharp = jnp.asarray(jax.nn.log_softmax(rng.randn(depth, v) * 4, axis=-1))

    def grow(first, tables, grow_prob):
        def children(d, tokens, slots, parent_idx, carry):
            return jnp.broadcast_to(tables[d], (1, width, v)), carry

        return grow_tree(jnp.array([0]), first[None], children, None, jnp.arange(v), depth, width, budget,
                         grow_prob=grow_prob)

    full, cum_full, _ = grow(sharp[0], sharp, 0.0)
    for p in (0.05, 0.2, 0.5):
        tree, cum, _ = grow(sharp[0], sharp, p)
        valid, c = np.asarray(tree.valid[0]), np.asarray(cum[0])
        best = 1 + int(np.argmax(c[1:]))
        assert valid[best]  # the most likely draft is always verified
        others = valid.copy()
        others[[0, best]] = False
        # beyond it: exactly the nodes of the unrestricted tree that are sure enough
        want = np.asarray(full.valid[0]) & (np.asarray(cum_full[0]) >= np.log(p))
        want[[0, best]] = False
        np.testing.assert_array_equal(others, want)
    # a flat first distribution (no node reaches 0.5): deeper depths are not drafted at all
    flat = jnp.full((v,), -np.log(v))
    tree, cum, _ = grow(flat, sharp, 0.5)
    assert np.asarray(tree.valid[0]).sum() == 2 and int(frontiers_expanded(cum, depth, width, 0.5)) == 0
    assert np.all(np.asarray(cum[0])[1 + width:] == -np.inf)
    assert int(frontiers_expanded(cum_full, depth, width)) == depth - 1


@pytest.mark.parametrize("method", ["hsd", "eagle"])
def test_grow_prob_trees_are_lossless_and_verified_at_smaller_tiers(target, method):
    """With ``grow_prob`` the tree grows past its first draft only where the drafter is sure: outputs
    stay `ar`'s, some rounds verify fewer nodes than the budget allows, and the drafter's counters
    count only the depths it drafted."""
    cfg, params = target
    prompts = prompts_of(13, cfg.vocab_size, 3)
    want = run_engine(cfg, params, prompts, 40)
    drafter, dparams = feature_drafter(cfg, params, method, seed=4, depth=3, width=2, budget=4, lookup=2,
                                       grow_prob=0.3)
    assert {2, 3, 4, 5} <= set(drafter.tiers)
    got, state = run_engine(cfg, params, prompts, 40, drafter=drafter, dparams=dparams, chunks=[9, 40],
                            return_state=True)
    assert got == want
    s = jax.tree_util.tree_map(np.asarray, state.stats)
    assert np.all(s.verified_nodes < s.target_passes * (1 + 4 + 2))  # not every round at the largest tier
    if method == "eagle":  # depth passes skipped where no frontier node was sure
        assert np.all(s.draft_passes <= s.target_passes * 3) and np.any(s.draft_passes < s.target_passes * 3)


def test_every_shipped_drafter_is_small_names_a_registered_target_and_its_method():
    """Each file under hsdjax/core/drafters/checkpoints is at most 32 MB (the repository's limit), is named
    ``<model>-<method>`` after the target and method its metadata records, and that target is registered
    (its weights are checked at load time, as the default model's are above)."""
    from hsdjax.core.drafters.checkpoint import SHIPPED_DIR, read_meta
    from hsdjax.runtime.registry import list_models

    files = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert files
    for path in files:
        meta = read_meta(path)
        assert path.stat().st_size <= 32_000_000, path
        method = meta["config"]["method"]
        assert path.stem == f"{meta['target']}-{method}", (path, meta["target"], method)
        assert meta["target"] in {m.name for m in list_models()} and len(meta["target_fingerprint"]) == 64


@pytest.mark.parametrize("method", ["hsd", "eagle"])
def test_shipped_drafters_load_for_the_default_model(smollm, method):
    """The committed checkpoints bind to the installed SmolLM2 (weights fingerprint) and are small."""
    from hsdjax.core.drafters.checkpoint import read_meta, shipped_path
    from hsdjax.core.methods import make_drafter

    path = shipped_path(smollm.name, method)
    assert path.stat().st_size <= 10_000_000
    meta = read_meta(path)
    assert meta["target_fingerprint"] == smollm.fingerprint
    assert "codealpaca" not in meta["info"]["sources"] and meta["info"]["sources"]
    drafter, dparams = make_drafter(method, smollm)
    assert drafter.name == method and drafter.cfg.method == method
    assert len(jax.tree_util.tree_leaves(dparams["net"])) >= 12  # every weight came back, nested as trained
    v, e = drafter.cfg.vocab, smollm.cfg.hidden_size
    assert drafter.backend == smollm.cfg.backend  # the drafter reads the target's one backend setting
    if smollm.cfg.backend == "cpu-kernel":  # the drafter runs on the target's CPU kernel: its matrices as panels
        from hsdjax.kernels.cpu_matmul import is_bf16, is_compressed
        head, wq = dparams["head"], dparams["net"]["layer"]["wq"]
        assert head.shape[0] == v // 32 and wq.ndim == 3 and dparams["net"]["fuse_norm"].ndim == 2
        if is_compressed(smollm.params["head_panels"]):  # lean: the head in the target's codes, the net bf16
            assert is_compressed(head) and is_bf16(wq)
        else:
            assert head.shape == (v // 32, e, 32) and head.dtype == jnp.float32
    else:
        assert dparams["head"].shape == (v, e)


def test_drafter_macs_count_what_xla_computes():
    """The multiply-add model behind ``drafter_macs`` (one layer over T tokens attending to L keys, the
    head, ``g``) agrees with XLA's own flop count of the same computation (elementwise work aside)."""
    from hsdjax.core.drafters.base import layer_macs
    from hsdjax.core.drafters.feature import FeatureDrafterNet

    fc = FeatureConfig(method="hsd", hidden=128, heads=4, kv_heads=2, head_dim=32, mlp=256, vocab=512)
    net = FeatureDrafterNet(fc)
    p = init_net(fc, 0)
    t, keys = 4, 96

    def layer(p, x, ctx_k, ctx_v):
        q, k, v = net.apply({"params": p}, x, jnp.zeros(x.shape[:2], jnp.int32), method=FeatureDrafterNet.project)
        q = q.reshape(1, t, fc.kv_heads, fc.heads // fc.kv_heads, fc.head_dim)
        s = jax.nn.softmax(jnp.einsum("btkgd,bskd->btkgs", q, ctx_k), axis=-1)  # (also keeps XLA from reassociating)
        attn = jnp.einsum("btkgs,bskd->btkgd", s, ctx_v).reshape(1, t, fc.heads, fc.head_dim)
        return net.apply({"params": p}, x, attn, method=FeatureDrafterNet.finish), k, v  # k, v: cached

    def flops(fn, *args):
        return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]

    x = jnp.ones((1, t, fc.hidden))
    kv = jnp.ones((1, keys, fc.kv_heads, fc.head_dim))
    want = 2 * t * layer_macs(fc.hidden, fc.heads, fc.kv_heads, fc.head_dim, fc.mlp, keys)
    assert 0.97 * want <= flops(layer, p, x, kv, kv) <= 1.1 * want
    for injection, g_hidden in (("mlp", 0), ("mlp", 384), ("attn", 0)):  # ``attn``: g's query, its read, its output
        fc_g = dataclasses.replace(fc, injection=injection, inject_hidden=g_hidden)
        net_g, p_g = FeatureDrafterNet(fc_g), init_net(fc_g, 0)

        def out_piece(p, x, embs, head, ctx_k, ctx_v):
            context = None
            if injection == "attn":
                q = net_g.apply({"params": p}, x, embs, jnp.zeros(x.shape[:2], jnp.int32),
                                method=FeatureDrafterNet.inject_query)
                q = q.reshape(1, t, fc.kv_heads, fc.heads // fc.kv_heads, fc.head_dim)
                s = jax.nn.softmax(jnp.einsum("btkgd,bskd->btkgs", q, ctx_k), axis=-1)
                context = jnp.einsum("btkgs,bskd->btkgd", s, ctx_v).reshape(1, t, fc.heads, fc.head_dim)
            g = net_g.apply({"params": p}, x, embs, context, method=FeatureDrafterNet.inject)
            return net_g.apply({"params": p}, g, head, method=FeatureDrafterNet.logits)

        drafter = HSDDrafter(cfg=fc_g, layers=(0, 1, 2))
        want = 2 * t * (drafter._inject_macs(keys) + drafter._head_macs())
        got = flops(out_piece, p_g, x, jnp.ones((1, t, fc.inject_tokens, fc.hidden)), jnp.ones((fc.vocab, fc.hidden)),
                    kv, kv)
        assert 0.97 * want <= got <= 1.1 * want, (injection, g_hidden)


def test_drafter_macs_accumulate_per_method(target):
    """``drafter_macs`` is zero without a drafter network, and `eagle`'s per-node passes cost more
    multiply-adds per round than `hsd`'s chain of the same tree shape."""
    cfg, params = target
    prompts = prompts_of(2, cfg.vocab_size, 2)
    per_round = {}
    for method in ("hsd", "eagle"):
        drafter, dparams = feature_drafter(cfg, params, method, depth=4, width=3, budget=6)
        _, state = run_engine(cfg, params, prompts, 20, drafter=drafter, dparams=dparams, return_state=True)
        s = jax.tree_util.tree_map(np.asarray, state.stats)
        assert np.all(s.drafter_macs > 0)
        per_round[method] = s.drafter_macs / s.target_passes
    assert np.all(per_round["eagle"] > per_round["hsd"])
    _, state = run_engine(cfg, params, prompts, 5, return_state=True)
    assert np.all(np.asarray(state.stats.drafter_macs) == 0)


def benchmark_module(name, folder="benchmarks"):
    """A script of ``benchmarks/`` (or ``experiments/``) imported as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@given(correct=st.lists(st.booleans(), min_size=1, max_size=40))
@settings(max_examples=50, deadline=None)
def test_the_training_metric_replayed_as_rounds_walks_the_depth_1_loop(correct):
    """``drafter_gap``'s replay of per-position first-draft hits as depth-1 rounds: each round reads the
    hit of the draft made just before its root, emits 2 tokens on a hit and 1 on a miss, and the rounds
    cover the positions; the split by the round before counts each round once."""
    gap = benchmark_module("drafter_gap", "experiments")
    emitted = gap.replayed_rounds(np.array(correct))
    roots = np.cumsum([1] + emitted[:-1])  # each round's root position
    assert [2 if correct[r - 1] else 1 for r in roots] == emitted
    assert roots[-1] - 1 < len(correct) <= roots[-1] - 1 + emitted[-1]
    hits, rounds = gap.split_by_previous(emitted)
    assert sum(rounds) == len(emitted) and sum(hits) == emitted.count(2)
    assert gap.replayed_rounds(np.array([True, False, True, True, False])) == [2, 2, 1]
    assert gap.split_by_previous([2, 2, 1]) == ([1, 1], [1, 2])


def test_the_lookup_split_and_the_graft_replay_follow_the_grafts_own_lookup():
    """``drafter_gap.lookup_drafts``: at position t the graft's lookup (longest match of the newest 2-4
    tokens of the context up to t + 1, then the most recent; 2, 2 or 6 tokens by match length) proposes
    the token at t + 2 right (2), wrong (1), or finds no match (0), and so many of its tokens are right
    in a row; ``replayed_graft_rounds`` emits one more than the longer right run of draft and graft."""
    gap = benchmark_module("drafter_gap", "experiments")
    rng = np.random.default_rng(0)
    for tokens in [[], [1], [1, 1], [1, 1, 1], *(rng.integers(0, 4, 40).tolist() for _ in range(20))]:
        classes, hits = gap.lookup_drafts(np.array(tokens, np.int32))
        assert (classes.tolist(), hits.tolist()) == graft_drafts(tokens)
    correct = np.array([True, False, False, True, False, False, True])
    assert gap.replayed_graft_rounds(correct, np.array([0, 0, 3, 0, 0, 0, 0])) == [2, 4, 2]
    assert gap.replayed_graft_rounds(correct, np.zeros(7, int)) == gap.replayed_rounds(correct)
    assert gap.replayed_graft_rounds(np.array([2, 0, 0, 0, 1]), np.zeros(5, int)) == [3, 1, 2]  # chains of drafts


def graft_drafts(tokens, lengths=(0, 2, 2, 6)):
    """The reference for ``lookup_drafts``, one position at a time."""
    classes, hits = [], []
    for t in range(len(tokens)):
        ctx, cls, hit = tokens[: t + 2], 0, 0
        for n in (4, 3, 2):
            ends = [e for e in range(n, len(ctx)) if ctx[e - n:e] == ctx[-n:]] if t + 2 < len(tokens) else []
            if len(ctx) >= n and ends:
                chain = ctx[max(ends):max(ends) + lengths[n - 1]]
                while hit < len(chain) and t + 2 + hit < len(tokens) and chain[hit] == tokens[t + 2 + hit]:
                    hit += 1
                cls = 2 if hit else 1
                break
        classes.append(cls)
        hits.append(hit)
    return classes, hits


def test_benchmark_variants_parse_and_refuse_bad_ones():
    bench = benchmark_module("feature_drafters")
    assert bench.parse_variant("a=hsd,depth=2,width=3,budget=2:-") == ("a", "hsd", {"depth": 2, "width": 3, "budget": 2})
    assert bench.parse_variant("s=sps,depth=8,draft_length=adaptive:-") == (
        "s", "sps", {"depth": 8, "draft_length": "adaptive"})
    assert bench.parse_variant("p=pld,lookup_lengths=0/1/1/3:-") == ("p", "pld", {"lookup_lengths": "0,1,1,3"})
    assert bench.parse_variant("f=ar,head=full:-") == ("f", "ar", {"head": "full"})  # the full-logits A/B
    for bad in ("nolabel", "x=rar:-", "x=hsd,depth=two:-", "x=hsd,colour=3:-", "x=hsd:/no/such/file", "x=ar,head=half:-"):
        with pytest.raises(SystemExit):
            bench.parse_variant(bad)


@pytest.mark.parametrize("method", ["hsd", "eagle"])
def test_drafter_on_cpu_panels_equals_plain_matrices(method, cpu_kernel):
    """``pack_for_cpu``: the network and head as float32 panels through the CPU kernel give the plain
    matrices' logits (up to the order of additions) on every piece the drafters call."""
    from hsdjax.core.drafters.feature import FeatureDrafterNet, init_net, pack_for_cpu
    from hsdjax.kernels import cpu_matmul

    fc = FeatureConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, vocab=128, fused=3, method=method)
    net = init_net(fc, seed=1)
    head = jax.random.normal(jax.random.PRNGKey(2), (fc.vocab, fc.hidden))
    pnet, phead = pack_for_cpu(net, head)
    assert phead.shape == (fc.vocab // 32, fc.hidden, 32) and pnet["layer"]["w_down"].ndim == 3
    states = jax.random.normal(jax.random.PRNGKey(3), (2, 5, fc.fused, fc.hidden))
    toks = jax.random.normal(jax.random.PRNGKey(4), (2, 5, fc.inject_tokens if method == "hsd" else 1, fc.hidden))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    models = {"reference": FeatureDrafterNet(fc), "cpu-kernel": FeatureDrafterNet(fc, "cpu-kernel")}

    def run(p, h, backend="cpu-kernel"):
        model = models[backend]
        out = model.apply({"params": p}, states, toks, pos)
        return model.apply({"params": p}, out, h, method=FeatureDrafterNet.logits)

    np.testing.assert_allclose(np.asarray(run(pnet, phead)), np.asarray(run(net, head, "reference")), rtol=2e-4,
                               atol=2e-4)

    # a checkpoint's values are bfloat16 and its head is rows of the target's (block-quantized) head:
    # beside a compressed target the matrices pack in bfloat16 and the head compressed like the
    # target's, with the float32 panels' bits
    rounded = jax.tree_util.tree_map(lambda v: v.astype(jnp.bfloat16).astype(jnp.float32), net)
    rng = np.random.default_rng(5)
    scale = rng.uniform(1e-3, 5e-2, (fc.hidden // 32, 1, 256)).astype(np.float16).astype(np.float32)
    codes = rng.integers(-127, 128, (fc.hidden // 32, 32, 256)).astype(np.float32)
    codes[:, 0] = 127  # a block's largest magnitude (what the scale search finds the scale from)
    target_head = (scale * codes).reshape(fc.hidden, 256).T  # [V, E] as a Q8_0 file dequantizes to
    ids = np.sort(rng.choice(256, fc.vocab, replace=False))
    rows = jnp.asarray(target_head[ids])
    lean_net, lean_head = pack_for_cpu(rounded, rows, cpu_matmul.compress_weight(jnp.asarray(target_head.T)), ids)
    wide_net, wide_head = pack_for_cpu(rounded, rows)
    assert lean_net["layer"]["w_down"].dtype == jnp.bfloat16 and cpu_matmul.is_compressed(lean_head)
    assert wide_head.dtype == wide_net["layer"]["w_down"].dtype == jnp.float32  # float32 target: float32 drafter
    assert np.array_equal(np.asarray(run(lean_net, lean_head)), np.asarray(run(wide_net, wide_head)))


def test_ingest_through_the_cpu_kernel_equals_the_reference_over_rounds(cpu_kernel):
    """An ingest with packed matrices reads the context through the C++ attention kernel, after the
    new keys were written: over a prompt and rounds of 0-6 new inputs per row (rows apart), the cache
    and the outputs equal a plain-matrix ingest's (reference attention) and one causal pass over each
    row's whole history, up to the order of additions; slots past each row's length are never read,
    whatever they hold. ``ingest_path`` (the rounds' ingest, computed at the smallest tier of 2, 4 or 6
    rows that holds the round's counts) gives the same as a full-size ingest at every tier."""
    from hsdjax.core.drafters.feature import ingest, ingest_path, init_context, pack_for_cpu
    from hsdjax.kernels import cpu_matmul
    from hsdjax.kernels.cpu_attention import tree_attention_cpu
    from hsdjax.kernels.tree_attention import tree_attention_reference
    from hsdjax.runtime.model import attention_for

    fc = FeatureConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, vocab=128, fused=3, method="hsd")
    net = init_net(fc, seed=1)
    pnet, _ = pack_for_cpu(net, jnp.zeros((fc.vocab, fc.hidden)))
    assert attention_for("cpu-kernel") is tree_attention_cpu  # the ingest's attention under each backend
    assert attention_for("reference") is tree_attention_reference
    model = {"reference": FeatureDrafterNet(fc), "cpu-kernel": FeatureDrafterNet(fc, "cpu-kernel")}
    runs = (("reference", net), ("cpu-kernel", pnet))  # plain matrices, and panels through the CPU kernels
    rng = np.random.default_rng(0)
    b, t = 2, 6
    ctxs = [init_context(fc, b, 128) for _ in range(4)]  # plain, packed; plain and packed through ingest_path
    prompt = jnp.asarray(rng.standard_normal((b, 9, fc.hidden)), jnp.float32)
    history = [list(np.asarray(prompt[0, :9])), list(np.asarray(prompt[1, :5]))]  # each row's ingested inputs
    for i, (backend, p) in enumerate(runs + runs):
        ctxs[i], _ = ingest(model[backend], p, ctxs[i], prompt, jnp.array([9, 5]), empty=True)
    path_round = jax.jit(lambda p, ctx, x, c, backend: ingest_path(model[backend], p, ctx, lambda n: x[:, :n], c, t),
                         static_argnums=4)
    full_round = jax.jit(lambda p, ctx, x, c, backend: ingest(model[backend], p, ctx, x, c), static_argnums=4)
    one_pass = jax.jit(lambda x, c: ingest(model["reference"], net, init_context(fc, 1, 128), x, c, empty=True)[1])
    for counts in ([1, 3], [0, 5], [6, 1], [2, 0], [4, 4], [1, 1], [0, 6]):
        x = jnp.asarray(rng.standard_normal((b, t, fc.hidden)), jnp.float32)
        c = jnp.array(counts, jnp.int32)
        outs = []
        for i, (backend, p) in enumerate(runs):
            ctxs[i], last = full_round(p, ctxs[i], x, c, backend)
            outs.append(np.asarray(last))
        for i, (backend, p) in ((2, runs[0]), (3, runs[1])):
            ctxs[i], last = path_round(p, ctxs[i], x, c, backend)
            for row in range(b):
                if counts[row]:
                    np.testing.assert_allclose(np.asarray(last[row]), outs[i - 2][row], rtol=1e-5, atol=1e-5)
            assert np.array_equal(np.asarray(ctxs[i]["len"]), np.asarray(ctxs[i - 2]["len"]))
            for row in range(b):
                for key in ("k", "v"):
                    filled = slice(0, int(ctxs[i]["len"][row]))
                    np.testing.assert_allclose(np.asarray(ctxs[i][key][row, :, filled]),
                                               np.asarray(ctxs[i - 2][key][row, :, filled]), rtol=1e-5, atol=1e-5)
        n = np.asarray(ctxs[0]["len"])
        assert np.array_equal(n, np.asarray(ctxs[1]["len"]))
        for row in range(b):
            history[row] += list(np.asarray(x[row, : counts[row]]))
            if counts[row]:  # the oracle: one causal pass over the row's whole history from an empty cache
                whole = np.zeros((1, 32, fc.hidden), np.float32)  # padded: the pass is causal
                whole[0, : len(history[row])] = np.stack(history[row])
                expect = one_pass(jnp.asarray(whole), jnp.array([len(history[row])]))
                np.testing.assert_allclose(outs[0][row], np.asarray(expect[0]), rtol=2e-4, atol=2e-4)
                np.testing.assert_allclose(outs[1][row], outs[0][row], rtol=2e-4, atol=2e-4)
            for key in ("k", "v"):
                np.testing.assert_allclose(np.asarray(ctxs[1][key][row, :, : n[row]]),
                                           np.asarray(ctxs[0][key][row, :, : n[row]]), rtol=2e-4, atol=2e-4)
