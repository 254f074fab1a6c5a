"""Log-probabilities recorded by the decoding loop (``prefill(..., top_logprobs=K)``) and the n-choice
fork (``engine.fork_rows``).

The recorded values must equal a teacher-forced computation (one uncached pass over prompt + generated
tokens, then ``sampling.log_probs``) and must not depend on the method: the pass that verified a token
records it, whether the token came from plain decoding or an accepted draft.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsdjax.core import engine
from hsdjax.core.drafters import ARDrafter
from hsdjax.core.drafters.pld import PromptLookupDrafter
from hsdjax.core.drafters.sps import DraftLMDrafter
from hsdjax.core.sampling import SamplingParams
from hsdjax.runtime.model import init_params
from tests.conftest import TINY_LLAMA, run_engine, teacher_forced

K = 5
SAMPLED = {"temperature": 0.8, "top_k": 10, "top_p": 0.9}


def recorded(state, row=0):
    """(tokens, logprob per token, top ids [T, K], top values [T, K]) of one row of a decoded state."""
    g = state.gen
    a, b = int(g.prompt_len[row]), int(g.seq_len[row])
    lp = g.logprobs
    return (np.asarray(g.seq[row, a:b]), np.asarray(lp.token[row, a:b]), np.asarray(lp.top_ids[row, a:b]),
            np.asarray(lp.top[row, a:b]))


def assert_matches_teacher_forced(cfg, params, prompt, state, sampling, row=0, atol=1e-4):
    tokens, lp, top_ids, top = recorded(state, row)
    want = teacher_forced(cfg, params, prompt, tokens, **sampling)
    np.testing.assert_allclose(lp, want[np.arange(len(tokens)), tokens], atol=atol)
    np.testing.assert_allclose(top, -np.sort(-want, axis=-1)[:, :K], atol=atol)
    np.testing.assert_allclose(np.take_along_axis(want, top_ids, axis=1), top, atol=atol)  # the ids hold them
    assert (np.diff(top, axis=1) <= 0).all()


@pytest.fixture(scope="module")
def tiny_llama():
    return TINY_LLAMA, init_params(TINY_LLAMA, seed=1)


PROMPT = [int(t) for t in np.random.RandomState(7).randint(0, TINY_LLAMA.vocab_size, 9)] + [3, 4, 5, 3, 4]


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "pld", "sps"])
def test_recorded_logprobs_equal_teacher_forced(tiny_llama, method, sampling):
    cfg, params = tiny_llama
    drafter, dparams = {"ar": (ARDrafter(), ()), "pld": (PromptLookupDrafter(width=2, depth=3), ()),
                        "sps": (DraftLMDrafter(draft_cfg=cfg, depth=3), params)}[method]
    _, state = run_engine(cfg, params, [PROMPT], 20, drafter=drafter, dparams=dparams, chunks=[3, 50],
                          return_state=True, top_logprobs=K, **sampling)
    assert_matches_teacher_forced(cfg, params, PROMPT, state, sampling)
    if not sampling:  # greedy: the first alternative is the token itself, and every method emits the same
        tokens, lp, top_ids, top = recorded(state)
        assert (top_ids[:, 0] == tokens).all() and np.allclose(lp, top[:, 0])
        ar_tokens, ar_state = run_engine(cfg, params, [PROMPT], 20, return_state=True, top_logprobs=K)
        assert tokens.tolist() == ar_tokens[0]
        np.testing.assert_allclose(lp, recorded(ar_state)[1], atol=1e-5)


def test_recording_changes_no_token_and_is_off_by_default(tiny_llama):
    cfg, params = tiny_llama
    drafter = PromptLookupDrafter(width=2, depth=3)
    plain, state = run_engine(cfg, params, [PROMPT], 16, drafter=drafter, return_state=True, **SAMPLED)
    assert state.gen.logprobs is None
    assert run_engine(cfg, params, [PROMPT], 16, drafter=drafter, top_logprobs=0, **SAMPLED) == plain


def test_fork_rows_equals_prefilling_copies(tiny_llama):
    """One prefill forked into 4 rows with the keys of rows 0..3 decodes like a batch of 4 copies."""
    cfg, params = tiny_llama
    seed, budget, sampling = 5, 12, {"temperature": 1.0}
    want, want_state = run_engine(cfg, params, [PROMPT] * 4, budget, seed=seed, return_state=True,
                                  top_logprobs=K, **sampling)
    size = want_state.gen.seq.shape[1]
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(4))
    gen, fwd = engine.prefill(params, jnp.array([PROMPT + [0] * (32 - len(PROMPT))]), jnp.array([len(PROMPT)]),
                              jnp.array([budget]), SamplingParams.make(1, **sampling), keys[:1],
                              engine.stop_array(()), cfg=cfg, cache_size=size, spare=1, top_logprobs=K)
    gen, fwd = engine.fork_rows(params, gen, fwd, keys, cfg=cfg, spare=1)
    state = engine.decode(params, (), engine.start_decoding((), gen, fwd, drafter=ARDrafter()), jnp.int32(budget),
                          cfg=cfg, drafter=ARDrafter())
    assert len({tuple(r) for r in want}) > 1  # the copies drew differently
    for i in range(4):
        assert recorded(state, i)[0].tolist() == want[i]
        np.testing.assert_allclose(recorded(state, i)[1], recorded(want_state, i)[1], atol=1e-5)


@pytest.mark.slow  # real-model logprobs (70 s); test_serve checks them through the server
def test_smollm2_logprobs_same_with_and_without_speculation(smollm):
    """The real model, greedy: ar, pld and hsd (the shipped drafter) emit the same tokens with the same
    log-probabilities (within 1e-4), equal to the teacher-forced ones; pld really speculated."""
    from hsdjax.frontends.api import Generator

    prompt = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat"
    results = {m: Generator(smollm, method=m).generate(prompt, max_new_tokens=24, chat=False, top_logprobs=K)[0]
               for m in ("ar", "pld", "hsd")}
    ar = results["ar"]
    assert results["pld"].stats["target_passes"] < ar.new_tokens - 1
    ids = Generator(smollm).encode_prompt(prompt, chat=False)
    want = teacher_forced(smollm.cfg, smollm.params, ids, ar.tokens)
    np.testing.assert_allclose([e.logprob for e in ar.logprobs], want[np.arange(len(ar.tokens)), ar.tokens], atol=1e-4)
    for method, res in results.items():
        assert res.tokens == ar.tokens, method
        assert [e.token for e in res.logprobs] == res.tokens
        for e, a in zip(res.logprobs, ar.logprobs):
            assert e.top[0][0] == e.token and abs(e.logprob - a.logprob) < 1e-4, method
            np.testing.assert_allclose([v for _, v in e.top], [v for _, v in a.top], atol=1e-4)
