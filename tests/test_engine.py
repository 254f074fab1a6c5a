"""The jitted `ar` engine: greedy equals a naive loop, batching, chunked decoding, stops, sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsdjax.core import engine
from hsdjax.core.sampling import SamplingParams, adjust_logits, select_tokens, target_probs
from hsdjax.runtime.model import Transformer, causal_mask, init_params
from tests.conftest import TINY_LLAMA, chi2_pvalue, run_engine

TINY_LLAMA_LONG = TINY_LLAMA.replace(max_context=8192)


def naive_greedy(cfg, params, prompt, n):
    """Recompute the whole sequence for every token (no cache): the most obviously right decoder."""
    model = Transformer(cfg)
    total = len(prompt) + n

    @jax.jit
    def next_token(tokens, length):
        out = model.apply({"params": params}, tokens[None], jnp.arange(total)[None], causal_mask(length[None], total))
        logits = model.apply({"params": params}, out["hidden"][0, length - 1], method=Transformer.logits)
        return jnp.argmax(logits)

    seq = np.zeros(total, np.int32)
    seq[: len(prompt)] = prompt
    for t in range(len(prompt), total):
        seq[t] = int(next_token(jnp.asarray(seq), jnp.int32(t)))
    return seq[len(prompt):].tolist()


run = run_engine


def test_greedy_equals_naive_loop(tiny):
    cfg, params = tiny
    prompt = list(np.random.RandomState(0).randint(0, cfg.vocab_size, 9))
    assert run(cfg, params, [prompt], 12)[0] == naive_greedy(cfg, params, prompt, 12)


def test_batch_equals_single_rows(tiny):
    cfg, params = tiny
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(0, cfg.vocab_size, n)) for n in (3, 11, 6)]
    together = run(cfg, params, prompts, 10)
    for p, got in zip(prompts, together):
        assert got == run(cfg, params, [p], 10)[0]


def test_chunked_decoding_equals_one_call(tiny):
    """Streaming calls the same program with a few steps at a time; the output must not change."""
    cfg, params = tiny
    prompt = list(np.random.RandomState(2).randint(0, cfg.vocab_size, 5))
    whole = run(cfg, params, [prompt], 15)[0]
    assert run(cfg, params, [prompt], 15, chunks=[1, 4, 3, 20])[0] == whole
    assert len(whole) == 15


def test_stop_token_ends_row(tiny):
    cfg, params = tiny
    prompt = list(np.random.RandomState(3).randint(0, cfg.vocab_size, 5))
    free = run(cfg, params, [prompt], 12)[0]
    stop = free[4]
    stopped = run(cfg, params, [prompt], 12, stop=(stop,))[0]
    assert stopped == free[: free.index(stop) + 1]


def test_sampling_is_seeded_and_varies(tiny):
    cfg, params = tiny
    prompt = list(np.random.RandomState(4).randint(0, cfg.vocab_size, 5))
    a = run(cfg, params, [prompt], 10, temperature=1.0, seed=7)[0]
    assert a == run(cfg, params, [prompt], 10, temperature=1.0, seed=7)[0]
    assert any(run(cfg, params, [prompt], 10, temperature=1.0, seed=s)[0] != a for s in range(1, 4))


def test_plan_shapes_rejects_bad_budgets(tiny):
    from hsdjax.errors import HsdjaxError

    cfg, _ = tiny
    with pytest.raises(HsdjaxError, match="context"):
        engine.plan_shapes(cfg, 400, 200)
    with pytest.raises(HsdjaxError, match="at least 1"):
        engine.plan_shapes(cfg, 10, 0)
    with pytest.raises(HsdjaxError, match="empty"):
        engine.plan_shapes(cfg, 0, 10)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 20, 0.6)])
def test_adjust_logits_matches_transformers_warpers(temperature, top_k, top_p):
    """Temperature -> top-k -> top-p define the same distribution as transformers' logits processors."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.random.RandomState(5).randn(4, 300).astype(np.float32) * 3
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    ref = torch.softmax(procs(None, torch.tensor(logits)), dim=-1).numpy()
    ours = np.asarray(target_probs(jnp.array(logits), SamplingParams.make(4, temperature, top_k, top_p)))
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_select_tokens_samples_target_distribution():
    """10k draws from select_tokens follow target_probs (chi-square)."""
    logits = jnp.array(np.random.RandomState(6).randn(1, 12).astype(np.float32))
    sp = SamplingParams.make(1, 0.8, 8, 0.9)
    n = 10_000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draws = jax.vmap(lambda k: select_tokens(logits, sp, k[None])[0])(keys)
    counts = np.bincount(np.asarray(draws), minlength=12)
    assert chi2_pvalue(counts, np.asarray(target_probs(logits, sp))[0]) > 1e-3


def test_greedy_rows_ignore_sampling_path():
    logits = jnp.array(np.random.RandomState(7).randn(2, 50).astype(np.float32))
    sp = SamplingParams(temperature=jnp.array([0.0, 1.0]), top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2))
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    assert int(select_tokens(logits, sp, keys)[0]) == int(jnp.argmax(logits[0]))
    adjusted = adjust_logits(logits, sp)
    assert bool(jnp.all(jnp.isfinite(adjusted[1])))


def test_long_prompt_over_2000_tokens():
    """A 2,100-token prompt lands in the 4,096 buckets and decodes like the uncached reference."""
    cfg = TINY_LLAMA_LONG
    params = init_params(cfg, seed=5)
    prompt = list(np.random.RandomState(8).randint(0, cfg.vocab_size, 2100))
    assert engine.plan_shapes(cfg, len(prompt), 6) == (4096, 4096)
    assert run(cfg, params, [prompt], 6)[0] == naive_greedy(cfg, params, prompt, 6)


def test_pack_rows_pads_prompts_and_gives_padding_rows_no_budget():
    prompt, lengths, budget = engine.pack_rows([[5, 6, 7], [9]], 4, batch=4, max_new=10)
    assert prompt.tolist() == [[5, 6, 7, 0], [9, 0, 0, 0], [0] * 4, [0] * 4]
    assert lengths.tolist() == [3, 1, 1, 1] and budget.tolist() == [10, 10, 0, 0]
    with pytest.raises(engine.HsdjaxError, match="prompt 1 has 5 tokens"):
        engine.pack_rows([[1], [1] * 5], 4)
    with pytest.raises(engine.HsdjaxError, match="do not fit a batch of 1"):
        engine.pack_rows([[1], [2]], 4, batch=1)


def test_row_keys_fold_the_row_index_into_the_seed():
    keys = np.asarray(engine.row_keys(3, 2))
    assert np.array_equal(keys[1], np.asarray(jax.random.fold_in(jax.random.PRNGKey(3), 1)))
    assert not np.array_equal(keys[0], keys[1])


def test_row_pool_places_grows_releases_and_shrinks_without_changing_rows(tiny):
    """The running batch both continuous batchers share (``hsdjax.core.batch.RowPool``): rows placed while
    others decode (the state grows through its sizes), a row released and the busy ones compacted into a
    smaller size, another placed after: every kept row decodes exactly as its prompt alone."""
    from hsdjax.core.batch import RowPool
    from hsdjax.core.drafters import ARDrafter

    cfg, params = tiny
    rng = np.random.RandomState(4)
    prompts = [list(rng.randint(0, cfg.vocab_size, n)) for n in (3, 7, 5, 2)]
    want = [run(cfg, params, [p], 12)[0] for p in prompts]
    p_bucket, s_bucket = engine.plan_shapes(cfg, max(map(len, prompts)), 12, spare=0)
    drafter = ARDrafter()

    def prefilled(i, copies=1):  # prompt i in `copies` rows (the server's spare copies beyond n)
        arr, lengths, budget = engine.pack_rows([prompts[i]] * copies, p_bucket, copies, 12)
        gen, fwd = engine.prefill(params, jnp.array(arr), jnp.array(lengths), jnp.array(budget),
                                  SamplingParams.make(copies, 0.0, 0, 1.0), engine.row_keys(0, copies),
                                  engine.stop_array(()), cfg=cfg, cache_size=s_bucket, spare=0, keep_layers=())
        return engine.start_decoding((), gen, fwd, drafter=drafter)

    def decode(pool, steps):
        pool.state = engine.decode(params, (), pool.state, jnp.int32(steps), cfg=cfg, drafter=drafter)

    pool = RowPool((1, 2, 4))
    assert pool.place(prefilled(0), [0]) == [0] and pool.size == 1
    decode(pool, 3)
    assert pool.place(prefilled(1, copies=2), [1]) == [1] and pool.size == 2  # grown; the spare copy dropped
    decode(pool, 2)
    assert pool.place(prefilled(2), [2]) == [2] and pool.size == 4
    decode(pool, 4)
    assert pool.release(1) == 1 and pool.busy() == [0, 2]
    pool.shrink()
    assert pool.size == 2 and pool.slots == [0, 2]  # busy rows moved, in order
    assert pool.place(prefilled(3), [3]) == [2] and pool.size == 4
    decode(pool, 20)
    g = pool.state.gen
    seq, start, end = (np.asarray(a) for a in (g.seq, g.prompt_len, g.seq_len))
    for row, i in enumerate(pool.slots):
        if i is not None:
            assert seq[row, start[row]: end[row]].tolist() == want[i], i
    with pytest.raises(ValueError, match="do not fit"):
        pool.shrink(2)
    for row in pool.busy():
        pool.release(row)
    pool.shrink()
    assert pool.state is None and pool.size == 0


def test_pooled_row_pool_grows_without_copying_the_cache_and_keeps_rows_exact(smollm_kernel):
    """A row pool (``RowPool(pooled=True)``, the server's batch over the CPU kernels' stacked cache) holds
    the largest size's cache rows from the start: growing the batch hands the same cache buffer on (no
    copy of any row), shrinking moves only the rows past the new size, and every row, speculating through
    tree passes that read a cache with more rows than the batch, decodes exactly as its prompt alone."""
    from hsdjax.core.batch import RowPool, pooled_cache
    from hsdjax.core.drafters.pld import PromptLookupDrafter

    model = smollm_kernel
    cfg, params = model.cfg, model.params
    assert pooled_cache(cfg)
    drafter = PromptLookupDrafter(width=2, depth=3)
    rng = np.random.RandomState(11)
    prompts = [[int(t) for t in rng.randint(5, 5000, n)] * 2 for n in (4, 9, 6, 3)]  # repeats: lookup drafts
    p_bucket, s_bucket = engine.plan_shapes(cfg, max(map(len, prompts)), 16, spare=drafter.spare)

    def prefilled(i):
        arr, lengths, budget = engine.pack_rows([prompts[i]], p_bucket, 1, 16)
        gen, fwd = engine.prefill(params, jnp.array(arr), jnp.array(lengths), jnp.array(budget),
                                  SamplingParams.make(1, 0.0, 0, 1.0), engine.row_keys(0, 1), engine.stop_array(()),
                                  cfg=cfg, cache_size=s_bucket, spare=drafter.spare, keep_layers=())
        return engine.start_decoding((), gen, fwd, drafter=drafter)

    def decode(state, steps):
        return engine.decode(params, (), state, jnp.int32(steps), cfg=cfg, drafter=drafter)

    def tokens(state, row):
        g = state.gen
        return np.asarray(g.seq)[row, int(g.prompt_len[row]): int(g.seq_len[row])].tolist()

    want = [tokens(decode(prefilled(i), 100), 0) for i in range(len(prompts))]
    pool = RowPool((1, 2, 4), pooled=True)
    pool.place(prefilled(0), [0])
    assert pool.state.gen.cache.k.shape[1] == 4 and pool.size == 1  # the cache at the largest size
    pool.state = decode(pool.state, 2)
    before = pool.state.gen.cache.k.unsafe_buffer_pointer()
    assert pool.place(prefilled(1), [1]) == [1] and pool.size == 2
    assert pool.state.gen.cache.k.unsafe_buffer_pointer() == before  # grown: the same cache, no copy
    pool.state = decode(pool.state, 2)
    assert pool.place(prefilled(2), [2]) == [2] and pool.size == 4
    pool.state = decode(pool.state, 3)
    pool.release(0)
    before = pool.state.gen.cache.k.unsafe_buffer_pointer()
    pool.shrink()
    assert pool.size == 2 and pool.slots == [1, 2] and pool.state.gen.cache.k.shape[1] == 4
    assert pool.state.gen.cache.k.unsafe_buffer_pointer() == before  # rows moved in place
    assert pool.place(prefilled(3), [3]) == [2] and pool.size == 4
    pool.state = decode(pool.state, 100)
    for row in pool.busy():
        assert tokens(pool.state, row) == want[pool.slots[row]], row
