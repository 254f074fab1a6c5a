"""Draft trees (tries, masks) and both verification rules, against brute force and statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdjax.core.sampling import SamplingParams
from hsdjax.core.tree import DraftTree, ancestor_mask, chain, chains_to_tree
from hsdjax.core.verify import residual_probs, verify_chain_sampled, verify_tree
from tests.conftest import chi2_pvalue

chains_strategy = st.integers(1, 4).flatmap(lambda w: st.integers(1, 4).flatmap(lambda d: st.tuples(
    st.lists(st.lists(st.integers(0, 2), min_size=d, max_size=d), min_size=w, max_size=w),
    st.lists(st.integers(0, d), min_size=w, max_size=w))))


def paths_of(tree: DraftTree, row: int = 0) -> set[tuple[int, ...]]:
    """Token paths (after the root) of every valid node."""
    toks, par, valid = (np.asarray(a[row]) for a in (tree.tokens, tree.parents, tree.valid))
    out = set()
    for i in range(1, len(toks)):
        if valid[i]:
            path, node = [], i
            while node > 0:
                path.append(int(toks[node]))
                node = int(par[node])
            out.add(tuple(path[::-1]))
    return out


@settings(max_examples=40, deadline=None)
@given(chains_strategy)
def test_chains_to_tree_is_the_trie_of_all_prefixes(data):
    chains, lengths = data
    tree = chains_to_tree(jnp.array([5]), jnp.array([chains]), jnp.array([lengths]))
    want = {tuple(c[:k]) for c, n in zip(chains, lengths) for k in range(1, n + 1)}
    assert paths_of(tree) == want
    assert int(jnp.sum(tree.valid)) == len(want) + 1  # no duplicates
    par = np.asarray(tree.parents[0])
    assert all(par[i] < i for i in range(1, len(par)) if tree.valid[0, i])
    depth, valid = np.asarray(tree.depth[0]), np.asarray(tree.valid[0])
    assert all(depth[i] == depth[par[i]] + 1 for i in range(1, len(par)) if valid[i])


@settings(max_examples=25, deadline=None)
@given(chains_strategy)
def test_ancestor_mask_matches_parent_walk(data):
    chains, lengths = data
    tree = chains_to_tree(jnp.array([0]), jnp.array([chains]), jnp.array([lengths]))
    mask = np.asarray(ancestor_mask(tree, max_depth=len(chains[0]))[0])
    par, valid = np.asarray(tree.parents[0]), np.asarray(tree.valid[0])
    for i in range(len(par)):
        want = {i}
        node = i
        while valid[i] and par[node] >= 0:
            node = int(par[node])
            want.add(node)
        assert set(np.flatnonzero(mask[i])) == want


def brute_force_greedy(tree, logits, row=0):
    """Walk from the root choosing the child whose token is the argmax; return (path, bonus)."""
    toks, par, valid = (np.asarray(a[row]) for a in (tree.tokens, tree.parents, tree.valid))
    node, path = 0, [0]
    while True:
        want = int(np.argmax(logits[row, node]))
        kids = [i for i in range(len(toks)) if valid[i] and par[i] == node and toks[i] == want]
        if not kids:
            return path, want
        node = kids[0]
        path.append(node)


@settings(max_examples=30, deadline=None)
@given(chains_strategy, st.integers(0, 2**31 - 1))
def test_greedy_verify_equals_brute_force(data, seed):
    chains, lengths = data
    tree = chains_to_tree(jnp.array([1]), jnp.array([chains]), jnp.array([lengths]))
    rng = np.random.RandomState(seed % 2**32)
    logits = rng.randn(1, tree.num_nodes, 3).astype(np.float32)
    # make some drafts right: bias each node's argmax towards a child's token
    for i in range(1, tree.num_nodes):
        if tree.valid[0, i] and rng.rand() < 0.7:
            logits[0, int(tree.parents[0, i]), int(tree.tokens[0, i])] += 5
    verdict = verify_tree(jnp.array(logits), tree, SamplingParams.make(1), jax.random.PRNGKey(0)[None], 4)
    path, bonus = brute_force_greedy(tree, logits)
    assert int(verdict.n_path[0]) == len(path)
    assert np.asarray(verdict.path[0, : len(path)]).tolist() == path
    assert int(verdict.bonus[0]) == bonus
    emitted = np.asarray(verdict.emitted(tree)[0, : len(path)]).tolist()
    assert emitted == [int(tree.tokens[0, n]) for n in path[1:]] + [bonus]


def _chain_trials(residual, n_trials=20000, seed=0):
    """Run the sampled-chain rule on a 2-draft chain with drafts drawn from q; return emitted tokens."""
    v = 5
    rng = np.random.RandomState(seed)
    p0 = rng.dirichlet(np.ones(v)).astype(np.float32)
    p1_table = rng.dirichlet(np.ones(v), size=v).astype(np.float32)  # target after x1
    p2_table = rng.dirichlet(np.ones(v), size=v).astype(np.float32)  # target after x2 (ignores x1)
    q0 = rng.dirichlet(np.ones(v)).astype(np.float32)
    q1 = rng.dirichlet(np.ones(v)).astype(np.float32)
    sp = SamplingParams.make(1, 1.0)

    def trial(key):
        k0, k1, kv = jax.random.split(key, 3)
        x1 = jax.random.categorical(k0, jnp.log(q0))
        x2 = jax.random.categorical(k1, jnp.log(q1))
        logits = jnp.log(jnp.stack([jnp.array(p0), jnp.array(p1_table)[x1], jnp.array(p2_table)[x2]]))[None]
        tree = chain(jnp.array([0]), jnp.stack([x1, x2])[None].astype(jnp.int32),
                     q_probs=jnp.stack([jnp.array(q0), jnp.array(q1)])[None])
        verdict = verify_chain_sampled(logits, tree, sp, kv[None], 2, residual=residual)
        return verdict.emitted(tree)[0], verdict.n_path[0]

    emitted, n_path = jax.jit(jax.vmap(trial))(jax.random.split(jax.random.PRNGKey(seed), n_trials))
    return np.asarray(emitted), np.asarray(n_path), p0, p1_table


def _chain_sampling_p_values(residual):
    emitted, n_path, p0, p1_table = _chain_trials(residual)
    first = emitted[:, 0]
    p_first = chi2_pvalue(np.bincount(first, minlength=len(p0)), p0)
    # second token, where emitted, given the first: must follow p1_table[first]
    p_second = []
    for t in range(len(p0)):
        sel = (first == t) & (n_path >= 2)
        if sel.sum() > 200:
            counts = np.bincount(emitted[sel, 1], minlength=len(p0))
            p_second.append(chi2_pvalue(counts, p1_table[t]))
    return p_first, min(p_second)


def test_sampled_chain_rule_preserves_target_distribution():
    p_first, p_second = _chain_sampling_p_values(residual_probs)
    assert p_first > 1e-3 and p_second > 1e-3


def test_broken_residual_is_detected():
    """Resampling from p instead of the residual after a rejection biases the output: the same test
    must reject it, which shows the test has teeth."""
    p_first, _ = _chain_sampling_p_values(lambda p, q: p)
    assert p_first < 1e-6


def test_sampled_chain_greedy_rows_reduce_to_argmax_matching():
    logits = jnp.array(np.random.RandomState(3).randn(1, 4, 7).astype(np.float32))
    greedy = np.argmax(np.asarray(logits[0]), axis=-1)
    drafts = jnp.array([[greedy[0], greedy[1], (greedy[2] + 1) % 7]], jnp.int32)
    q = jax.nn.one_hot(drafts, 7)
    tree = chain(jnp.array([0]), drafts, q_probs=q)
    verdict = verify_chain_sampled(logits, tree, SamplingParams.make(1), jax.random.PRNGKey(0)[None], 3)
    assert int(verdict.n_path[0]) == 3
    assert int(verdict.bonus[0]) == greedy[2]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 0.9)])
def test_tree_rule_first_tokens_follow_target(temperature, top_p):
    """Under sampling, the deterministic-tree rule emits root tokens distributed as the adjusted target,
    and the bonus is drawn from *adjusted* logits (a known bug elsewhere: unadjusted bonus)."""
    from hsdjax.core.sampling import target_probs

    v = 6
    rng = np.random.RandomState(4)
    logits = jnp.array(rng.randn(1, 3, v).astype(np.float32) * 2)
    tree = chain(jnp.array([0]), jnp.array([[1, 2]], jnp.int32))
    sp = SamplingParams.make(1, temperature, 0, top_p)
    n = 20000
    verdicts = jax.jit(jax.vmap(lambda k: verify_tree(logits, tree, sp, k[None], 2).emitted(tree)[0, 0]))(
        jax.random.split(jax.random.PRNGKey(1), n))
    probs = np.asarray(target_probs(logits[:, 0], sp))[0]
    assert chi2_pvalue(np.bincount(np.asarray(verdicts), minlength=v), probs) > 1e-3


@settings(max_examples=30, deadline=None)
@given(chains_strategy)
def test_compact_keeps_the_tree(data):
    from hsdjax.core.tree import compact

    chains, lengths = data
    tree = chains_to_tree(jnp.array([3]), jnp.array([chains]), jnp.array([lengths]))
    count = int(jnp.sum(tree.valid))
    small = compact(tree, count)
    assert small.num_nodes == count and bool(jnp.all(small.valid))
    assert paths_of(small) == paths_of(tree)


@settings(max_examples=40, deadline=None)
@given(chains_strategy, st.lists(st.integers(0, 2), min_size=1, max_size=5), st.integers(0, 5))
def test_graft_chain_adds_the_chain_once(data, extra, length):
    """A grafted chain adds exactly its prefixes (a first token the tree already has at depth 1 is
    shared, not repeated); parents stay earlier slots, depths consistent, the old nodes untouched."""
    from hsdjax.core.tree import graft_chain

    chains, lengths = data
    tree = chains_to_tree(jnp.array([7]), jnp.array([chains]), jnp.array([lengths]))
    length = min(length, len(extra))
    grafted = graft_chain(tree, jnp.array([extra]), jnp.array([length]))
    assert grafted.num_nodes == tree.num_nodes + len(extra)
    new = {tuple(extra[:k]) for k in range(1, length + 1)}
    assert paths_of(grafted) == paths_of(tree) | new
    shared = length > 0 and (extra[0],) in paths_of(tree)
    assert int(jnp.sum(grafted.valid)) == int(jnp.sum(tree.valid)) + length - int(shared)
    par, depth, valid = (np.asarray(a[0]) for a in (grafted.parents, grafted.depth, grafted.valid))
    assert all(par[i] < i and depth[i] == depth[par[i]] + 1 for i in range(1, len(par)) if valid[i])
    for name in ("tokens", "parents", "depth", "valid"):
        old, new = np.asarray(getattr(tree, name)), np.asarray(getattr(grafted, name))
        assert np.array_equal(new[:, : tree.num_nodes], old)
