"""Speculative decoding end to end: greedy output identical to `ar`, sampling distribution preserved."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsdjax.core import engine
from hsdjax.core.drafters.pld import PromptLookupDrafter
from hsdjax.core.drafters.sps import DraftLMDrafter
from hsdjax.runtime.config import ModelConfig
from hsdjax.runtime.model import Transformer, causal_mask, init_params
from tests.conftest import TINY_LLAMA, chi2_pvalue, run_engine


def repetitive_prompt(rng, vocab, n):
    motif = list(rng.randint(0, vocab, rng.randint(2, 6)))
    noise = list(rng.randint(0, vocab, n))
    return (motif * 6 + noise + motif * 2)[: max(n, 3)]


@pytest.fixture(scope="module")
def llama():
    return TINY_LLAMA, init_params(TINY_LLAMA, seed=1)


@pytest.fixture(scope="module")
def other_draft():
    return init_params(TINY_LLAMA, seed=2)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(3, 40), max_new=st.integers(1, 30))
def test_pld_greedy_equals_ar(llama, seed, n, max_new):
    cfg, params = llama
    prompt = repetitive_prompt(np.random.RandomState(seed), cfg.vocab_size, n)
    ar = run_engine(cfg, params, [prompt], max_new)
    for drafter in (PromptLookupDrafter(width=3, depth=4), PromptLookupDrafter(width=1, depth=1),
                    PromptLookupDrafter(width=2, lengths=(0, 1, 2, 4))):
        assert run_engine(cfg, params, [prompt], max_new, drafter=drafter) == ar


def test_lookup_chains_are_as_long_as_their_match_earns():
    """``lookup_by_match``: the chain of a match of n tokens is cut to ``lengths[n - 1]`` (and to what the
    context holds); with one length from ``min_ngram`` on it is ``lookup_continuations`` itself."""
    from hsdjax.core.drafters.pld import fixed_lengths, lookup_by_match, lookup_continuations

    #                  0  1  2  3  4  5  6  7  8  9 10 11 12 13
    seq = jnp.array([[5, 6, 7, 8, 9, 1, 2, 3, 4, 9, 6, 7, 8, 0],    # ends 6 7 8: a 3-token match at 1..3
                     [5, 6, 7, 8, 9, 1, 2, 3, 4, 9, 2, 7, 8, 0],    # ends 2 7 8: 2 tokens (7 8 at 2..3)
                     [5, 6, 7, 8, 9, 1, 2, 3, 4, 9, 2, 3, 0, 0],    # ends 2 3 (length 12): 2 tokens at 6..7
                     [5, 6, 7, 8, 9, 1, 2, 3, 4, 9, 2, 4, 0, 0]])   # ends 2 4: 1 token (4 at 8)
    length = jnp.array([13, 13, 12, 12])
    chains, avail, ngram = lookup_continuations(seq, length, 1, 6, 4, 1, with_ngram=True)
    assert ngram[:, 0].tolist() == [3, 2, 2, 1]
    assert chains[0, 0, :3].tolist() == [9, 1, 2] and chains[2, 0, :2].tolist() == [4, 9]
    _, cut = lookup_by_match(seq, length, 1, (0, 2, 5, 6))
    assert cut[:, 0].tolist() == [5, 2, 2, 0]  # 1-token matches earn nothing, 3-token ones 5
    _, cut = lookup_by_match(seq, length, 1, (0, 2, 12, 12))
    assert cut[0, 0] == 9 and cut[2, 0] == 2  # never past the context: row 0 has 9 tokens after its match
    want = lookup_continuations(seq, length, 2, 4, 3, 2)
    got = lookup_by_match(seq, length, 2, fixed_lengths(4, 2, 3))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert PromptLookupDrafter(width=1, lengths=(0, 1, 1, 3)).tiers == (1, 2, 4)
    with pytest.raises(ValueError):
        PromptLookupDrafter(lengths=(0, 0))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 12), max_ngram=st.integers(1, 4))
def test_one_lookup_continuation_is_the_best_of_several(seed, vocab, max_ngram):
    """Width 1 takes the first maximum by argmax (XLA's CPU top_k sorts the row); it must be the first
    of what top_k gives at width 2: the same chain, length and n-gram, also for rows without a match."""
    from hsdjax.core.drafters.pld import lookup_continuations

    rng = np.random.RandomState(seed)
    seq = jnp.asarray(rng.randint(0, vocab, (4, 24)), jnp.int32)
    length = jnp.asarray(rng.randint(1, 25, 4), jnp.int32)
    one = lookup_continuations(seq, length, 1, 5, max_ngram, 1, with_ngram=True)
    two = lookup_continuations(seq, length, 2, 5, max_ngram, 1, with_ngram=True)
    for a, b in zip(one, two):
        assert np.array_equal(np.asarray(a)[:, 0], np.asarray(b)[:, 0])


def test_lookup_policy_replay_counts_rounds_as_the_engine_would():
    """``experiments/lookup_policy.py``'s replay: a chain is cut to what its match earns and accepted up to
    its first wrong token; every round emits one more token than it accepted."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "lookup_policy.py"
    spec = importlib.util.spec_from_file_location("lookup_policy_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    answer = [3, 4, 5, 6, 9, 9, 9]  # copies the prompt for 4 tokens, then leaves it
    avail, ngram, accepted = bench.lookup_table(prompt, answer, depth=6, max_ngram=3, min_ngram=2)
    # context ... 1 2 3 matches the prompt's 1 2 3 (3 tokens): 4 5 6 7 8 1 proposed, 4 5 6 right
    assert ngram.tolist() == [3, 3, 3, 3, 0, 0] and accepted.tolist() == [3, 2, 1, 0, 0, 0]
    cost = {n: float(n) for n in range(1, 8)}
    table = [(avail, ngram, accepted)]
    long_ = bench.replay(table, {(g, p): 6 for g in (2, 3) for p in (1, 2, 3)}, (1, 7), cost)
    short = bench.replay(table, {(g, p): 2 for g in (2, 3) for p in (1, 2, 3)}, (1, 3, 7), cost)
    assert long_["tokens"] == short["tokens"] == len(answer) - 1  # the first answer token came from the prefill
    assert (long_["rounds"], long_["nodes"]) == (3, 7 + 1 + 1)  # 4 tokens from a 7-node pass, then 2 plain steps
    assert (short["rounds"], short["nodes"]) == (4, 3 + 3 + 1 + 1)  # 3 tokens, then a miss: 1, then 2 steps


def test_pld_accepts_on_a_copying_model(llama):
    """A model that has fallen into a loop is what prompt lookup is for: many tokens per pass."""
    cfg, params = llama
    prompt = repetitive_prompt(np.random.RandomState(0), cfg.vocab_size, 10)
    ar = run_engine(cfg, params, [prompt], 40)
    rows, state = run_engine(cfg, params, [prompt], 40, drafter=PromptLookupDrafter(width=2, depth=5),
                             return_state=True)
    assert rows == ar
    # greedy tiny models loop quickly; the loop is then copied several tokens per pass
    assert int(state.stats.target_passes[0]) < 39


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"])
@pytest.mark.parametrize("same_model", [True, False])
def test_sps_greedy_equals_ar_batched(llama, other_draft, same_model, draft_length):
    """Batched rows with different lengths; the draft is the target itself (everything accepted) or
    another model (rejections): output identical to `ar` either way, also when decoded in chunks.
    An adaptive draft length grows to its maximum when everything is accepted and falls when not."""
    cfg, params = llama
    dparams = params if same_model else other_draft
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(0, cfg.vocab_size, n)) for n in (4, 13, 7)]
    ar = run_engine(cfg, params, prompts, 25)
    drafter = DraftLMDrafter(draft_cfg=cfg, depth=4, draft_length=draft_length)
    rows, state = run_engine(cfg, params, prompts, 25, drafter=drafter, dparams=dparams, return_state=True)
    assert rows == ar
    assert run_engine(cfg, params, prompts, 25, drafter=drafter, dparams=dparams, chunks=[1, 2, 3, 30]) == ar
    passes = np.asarray(state.stats.target_passes)
    lengths = np.asarray(state.draft.length)
    if draft_length == "fixed":
        assert (lengths == 4).all()
        if same_model:  # every draft accepted: depth + 1 tokens per pass
            assert all(p <= -(-24 // 5) for p in passes)
    elif same_model:  # 2 -> 4: the first round drafts 2, then 4 a round
        assert (lengths == 4).all() and all(p <= 1 + -(-21 // 5) for p in passes)
        assert drafter.tiers == (2, 3) and engine.verify_sizes(drafter) == (2, 3, 5)
    else:  # rejections shrank some rounds' drafts below the maximum
        drafted, rounds = np.asarray(state.stats.draft_passes), np.asarray(state.stats.target_passes)
        assert (drafted < 4 * rounds).any() and (lengths >= 1).all()


def test_stop_token_inside_accepted_run(llama):
    cfg, params = llama
    prompt = repetitive_prompt(np.random.RandomState(5), cfg.vocab_size, 8)
    free = run_engine(cfg, params, [prompt], 30)[0]
    stop = free[6]
    want = free[: free.index(stop) + 1]
    drafter = DraftLMDrafter(draft_cfg=cfg, depth=4)
    assert run_engine(cfg, params, [prompt], 30, drafter=drafter, dparams=params, stop=(stop,))[0] == want
    assert run_engine(cfg, params, [prompt], 30, drafter=PromptLookupDrafter(), stop=(stop,))[0] == want


# ----------------------------------------------------------------------------- sampling is lossless

SMALL = ModelConfig(family="llama", vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8, max_context=256)


def exact_joint(cfg, params, prompt, temperature, top_p, top_k=0):
    """Exact distribution of the first three sampled tokens under the adjusted target."""
    from hsdjax.core.sampling import SamplingParams, target_probs

    v = cfg.vocab_size
    seqs = np.array([prompt + list(c) for c in itertools.product(range(v), repeat=3)], np.int32)
    t = seqs.shape[1]
    model = Transformer(cfg)
    out = model.apply({"params": params}, jnp.array(seqs), jnp.broadcast_to(jnp.arange(t), seqs.shape),
                      causal_mask(jnp.full((len(seqs),), t), t))
    logits = model.apply({"params": params}, out["hidden"], method=Transformer.logits)  # [N, T, V]
    sp = SamplingParams.make(len(seqs), temperature, top_k, top_p)
    p = len(prompt)
    probs = [np.asarray(target_probs(logits[:, p - 1 + i], sp)) for i in range(3)]
    joint = np.ones(len(seqs))
    for i in range(3):
        joint *= probs[i][np.arange(len(seqs)), seqs[:, p + i]]
    return joint.reshape(v, v, v)


def sample_joint(cfg, params, prompt, drafter, dparams, temperature, top_p, top_k=0, n_batches=30, batch=64):
    counts = np.zeros((cfg.vocab_size,) * 3)
    for s in range(n_batches):
        rows = run_engine(cfg, params, [prompt] * batch, 3, drafter=drafter, dparams=dparams,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=1000 + s)
        for r in rows:
            counts[tuple(r[:3])] += 1
    return counts


def pooled_pvalue(counts, probs, min_expected=5.0):
    """Chi-square over cells, pooling those with a small expected count into one cell."""
    counts, probs = counts.ravel(), probs.ravel() / probs.sum()
    expected = probs * counts.sum()
    small = expected < min_expected
    return chi2_pvalue(np.append(counts[~small], counts[small].sum()), np.append(probs[~small], probs[small].sum()))


def sharp_params(seed):
    """Random tiny weights with logits scaled up so distributions are neither flat nor one-hot (a
    flat target makes p ~ q and hides a wrong residual)."""
    params = init_params(SMALL, seed=seed)
    return dict(params, embed=params["embed"] * 6.0)


def sampling_pvalue(method, temperature, top_p, top_k=0):
    params = sharp_params(3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    if method.startswith("sps"):
        length = "adaptive" if method == "sps-adaptive" else "fixed"
        drafter, dparams = DraftLMDrafter(draft_cfg=SMALL, depth=3, draft_length=length), sharp_params(4)
    else:
        drafter, dparams = PromptLookupDrafter(width=2, depth=3), ()
    counts = sample_joint(SMALL, params, prompt, drafter, dparams, temperature, top_p, top_k)
    joint = exact_joint(SMALL, params, prompt, temperature, top_p, top_k)
    if top_k:  # the truncation really bites: sequences through a token outside the top k cannot occur
        assert (joint == 0).any()
    return pooled_pvalue(counts, joint)


@pytest.mark.parametrize("method,temperature,top_p,top_k", [
    ("sps", 1.0, 1.0, 0), ("sps", 0.7, 0.9, 0), ("sps-adaptive", 1.0, 1.0, 0), ("pld", 1.0, 1.0, 0),
    ("sps", 0.8, 0.95, 3), ("pld", 1.0, 1.0, 2)])
def test_speculative_sampling_matches_plain_sampling(method, temperature, top_p, top_k):
    """Joint distribution of the first three tokens (one from the prefill, then speculative chain
    rounds) against the exact distribution computed from the model, with top-k / top-p truncation too
    (the tree methods' top-k / top-p statistics are in tests/test_sampling.py)."""
    assert sampling_pvalue(method, temperature, top_p, top_k) > 1e-3


def test_engine_sampling_test_catches_a_wrong_residual(monkeypatch):
    """The same statistic, with the engine's residual step broken, must fail."""
    import functools

    from hsdjax.core import engine, verify

    broken = functools.partial(verify.verify_chain_sampled, residual=lambda p, q: p)
    monkeypatch.setattr(engine, "verify_chain_sampled", broken)
    jax.clear_caches()
    try:
        assert sampling_pvalue("sps", 1.0, 1.0) < 1e-6
    finally:
        jax.clear_caches()


@pytest.mark.slow  # real-model pld (33 s); test_cpu_matmul runs hsd == ar, test_bench pld
def test_smollm2_pld_greedy_equals_ar_on_real_prompts(smollm):
    from hsdjax.frontends.api import Generator

    ar, pld = Generator(smollm, "ar"), Generator(smollm, "pld")
    prompts = ["Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
               "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
               "Rewrite this function with a loop."]
    want = ar.generate(prompts, max_new_tokens=48)
    got = pld.generate(prompts, max_new_tokens=48)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        assert g.stats["target_passes"] <= w.stats["target_passes"]
    assert sum(g.stats["target_passes"] for g in got) < sum(w.stats["target_passes"] for w in want)
