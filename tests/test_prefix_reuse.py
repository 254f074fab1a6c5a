"""Prefill in pieces, prefix reuse and the server's chunked prefill.

Engine level (tiny random models, both families, stacked and unrolled layers): a prompt prefilled in
pieces, or from a reused prefix plus pieces, gives the cache, drafter states and first token of the
one-piece prefill. ``PrefixCache`` on its own: longest-prefix match, LRU eviction within its budget.
Scheduler level (the real default model, the ``hsd`` drafter whose start reads the prompt's target
states): a second chat turn reuses the first turn's blocks (``usage.prompt_tokens_details.
cached_tokens`` through the real ``openai`` client) and answers exactly what plain decoding of the
whole conversation answers; a long prompt arriving while another request streams is prefilled in
pieces of at most ``prefill_chunk`` tokens with a decode call between every two.
"""

from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdjax.core import engine
from hsdjax.core.sampling import SamplingParams
from hsdjax.frontends.serving.prefix_cache import BLOCK, PrefixCache
from hsdjax.runtime.model import init_params
from tests.conftest import TINY_LLAMA, TINY_QWEN

MODEL = "smollm2-135m"


# ------------------------------------------------------------------------------------------ pieces
@given(start_blocks=st.integers(0, 40), extra=st.integers(1, 1500), limit=st.sampled_from([32, 64, 256, 2048]))
@settings(max_examples=300, deadline=None)
def test_piece_plan_covers_the_prompt_within_its_bucket(start_blocks, extra, limit):
    start = start_blocks * 32
    end = start + extra
    bucket = engine.pick_bucket(end, engine.PROMPT_BUCKETS, "a prompt")
    sizes = engine.piece_sizes(start, end, limit)
    at = start
    for i, size in enumerate(sizes):
        assert size >= 32 and size & (size - 1) == 0 and size <= max(limit, 32)
        assert size == 32 or size <= end - at  # pads at most 31 positions
        assert at % size == 0  # aligned: a piece never runs past the prompt bucket
        assert at + size <= bucket
        if i < len(sizes) - 1:
            assert at + size < end
        at += size
    assert at >= end


@pytest.mark.parametrize("longest", [250, 510, 2040])
def test_warm_up_pieces_are_exactly_the_ones_prompts_use(longest):
    """``piece_programs`` (what the server compiles ahead) holds every piece size a prompt of at most
    ``longest`` tokens can run, from any reused prefix and under any budget, and nothing else."""
    largest = 2048
    used = set()
    for start in range(0, longest, 32):
        for end in range(start + 1, longest + 1):
            for limit in (32, 64, 128, 256, 512, largest):
                used.update(engine.piece_sizes(start, end, limit))
    assert used == set(engine.piece_programs(longest, largest))


def _prefill_pieces(cfg, params, prompt, fill, start, limit, keep):
    for size in engine.piece_sizes(start, len(prompt), limit):
        n = min(size, len(prompt) - start)
        piece = np.zeros((1, size), np.int32)
        piece[0, :n] = prompt[start: start + n]
        fill = engine.prefill_piece(params, fill, jnp.asarray(piece), jnp.asarray([n]), cfg=cfg, keep_layers=keep,
                                    fresh=start == 0)
        start += n
    return fill


def _kv(gen, n):
    k = np.stack(gen.cache.k) if isinstance(gen.cache.k, tuple) else np.asarray(gen.cache.k)
    v = np.stack(gen.cache.v) if isinstance(gen.cache.v, tuple) else np.asarray(gen.cache.v)
    return k[..., :n, :], v[..., :n, :]


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN, TINY_LLAMA.replace(scan_layers=False)],
                         ids=["llama", "qwen2", "llama-unrolled"])
def test_pieces_and_reused_prefix_equal_one_prefill(cfg):
    params = init_params(cfg, seed=1)
    length, p_bucket, size = 150, 256, 256
    prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, length).tolist()
    arr = np.zeros((1, p_bucket), np.int32)
    arr[0, :length] = prompt
    keep = (0, cfg.num_layers)
    sp, keys, stops = SamplingParams.make(1, 0.0, 0, 1.0), jax.random.PRNGKey(0)[None], engine.stop_array([])
    whole, whole_fwd = engine.prefill(params, jnp.asarray(arr), jnp.asarray([length]), jnp.asarray([8]), sp, keys,
                                      stops, cfg=cfg, cache_size=size, keep_layers=keep)

    def finish(fill):
        return engine.prefill_done(params, fill, jnp.asarray(arr), jnp.asarray([8]), sp, keys, stops, cfg=cfg)

    def same(gen, fwd):
        assert int(gen.cache.length[0]) == length and int(gen.seq_len[0]) == length + 1
        for got, want in zip(_kv(gen, length), _kv(whole, length)):
            np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(np.asarray(fwd.layers)[:, :, :length], np.asarray(whole_fwd.layers)[:, :, :length],
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(fwd.hidden)[:, :length], np.asarray(whole_fwd.hidden)[:, :length],
                                   atol=1e-5)
        assert int(gen.seq[0, length]) == int(whole.seq[0, length])

    pieces = _prefill_pieces(cfg, params, prompt, engine.start_fill(cfg, 1, size, size, keep), 0, 32, keep)
    same(*finish(pieces))

    cache = PrefixCache(cfg, capacity=8, layers=len(keep))
    assert cache.store(prompt, pieces, length) == length // BLOCK
    slots = cache.match(prompt + [3, 4])
    assert len(slots) == length // BLOCK
    reused = cache.load(engine.start_fill(cfg, 1, size, size, keep), slots)
    assert int(reused.cache.length[0]) == len(slots) * BLOCK
    same(*finish(_prefill_pieces(cfg, params, prompt, reused, len(slots) * BLOCK, 64, keep)))


# ------------------------------------------------------------------------------------------ the cache
def test_prefix_cache_matches_whole_blocks_and_evicts_least_recently_used():
    cfg = TINY_LLAMA
    fill = engine.start_fill(cfg, 1, 256, 256, ())
    cache = PrefixCache(cfg, capacity=4)
    a = list(range(1, 100))  # 3 whole blocks and 3 tokens
    assert cache.store(a, fill, len(a)) == 3 and cache.used == 3
    assert cache.match(a) == cache.match(a[:97])  # whole blocks, always leaving the last token to run
    assert len(cache.match(a[:96])) == 2 and len(cache.match(a[:97])) == 3
    assert cache.match([7] + a) == []  # a different first block: nothing
    b = a[:32] + [5] * 64  # shares a's first block
    assert cache.store(b, fill, len(b)) == 2  # one free slot, then a's least recently used block goes
    assert cache.used == 4 <= cache.capacity
    assert len(cache.match(b + [1])) == 3
    assert len(cache.match(a)) == 2  # a's third block was the least recently used one
    c = [9] * 320  # ten blocks: more than the budget
    assert cache.store(c, fill, len(c)) <= cache.capacity
    assert cache.used <= cache.capacity
    assert len(cache.match(c)) >= 1  # its first blocks are kept, not its last ones
    cache.clear()
    assert cache.used == 0 and cache.match(a) == []


# ------------------------------------------------------------------------------------------ the scheduler
@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Overrides conftest's: the module's scheduler thread keeps using its compiled programs."""
    yield


SYSTEM = (
    "You are the assistant of the Riverside Community Library. The library opens at nine in the morning "
    "and closes at six in the evening on weekdays; on Saturdays it closes at two, and it is closed on "
    "Sundays and public holidays. Members may borrow up to eight books, four magazines and two films at a "
    "time. Books are lent for three weeks, magazines for one week and films for four days. A loan can be "
    "renewed twice, online or at the desk, unless another member has reserved the item. Late returns cost "
    "twenty cents a day for books and fifty cents a day for films, up to the price of the item. Children "
    "under twelve pay no fines. The reading room on the first floor is quiet; the study rooms on the second "
    "floor can be booked for two hours at a time, at most twice a week. Printing costs ten cents a page in "
    "black and white and forty cents in colour. The library runs a story hour for young children every "
    "Wednesday at ten, a book club on the last Thursday of each month, and free computer lessons for adults "
    "on Tuesday evenings. Lost cards are replaced for two dollars. Answer the member's questions briefly and "
    "politely, using only these facts."
)


@pytest.fixture(scope="module")
def sched(smollm):
    from tests.test_serve_hardening import running_scheduler

    # no warm-up: these tests order events, not times, and compile only the shapes they use (the full
    # warm-up of every piece and bucket is tested in tests/test_serve.py)
    s = running_scheduler(smollm, "hsd", max_batch=2, max_queue=4, max_context=1024, prefill_chunk=64,
                          prefix_cache_mb=64, spec_max_active=None, warmup=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(smollm):
    from hsdjax.frontends.api import Generator

    return Generator(smollm, method="ar")


@pytest.fixture(scope="module")
def srv(sched):
    from hsdjax.frontends.serving.app import create_app
    from tests.test_serve_hardening import Running

    running = Running(create_app(sched, MODEL), sched)
    yield running
    running.stop()


@pytest.mark.slow  # its own server (85 s); the scheduler tests below reuse prefixes by default
def test_second_turn_reuses_the_first_and_answers_the_same(srv, sched, reference, smollm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When does the library close on Saturdays?"}]
    first = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=24, temperature=0)
    prompt1 = smollm.tokenizer.encode_chat(turn1)
    assert first.usage.prompt_tokens == len(prompt1) > 256
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And how much does printing in colour cost?"}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=24, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % BLOCK == 0 and cached >= (len(prompt1) // BLOCK) * BLOCK - BLOCK  # turn 1's whole blocks
    assert cached < second.usage.prompt_tokens
    for messages, resp in ((turn1, first), (turn2, second)):
        want = reference.generate(smollm.tokenizer.encode_chat(messages), max_new_tokens=24, temperature=0.0)[0]
        assert resp.choices[0].message.content == want.text
    again = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == second.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= cached  # the whole prompt's blocks now


def _collect_request(sched, name, prompt_ids, max_new):
    """Submit a greedy request from a background event loop; returns (request, future of its text)."""
    from hsdjax.frontends.serving.scheduler import GenRequest

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def make():
        return GenRequest(id=name, prompt_ids=prompt_ids, max_new=max_new, temperature=0.0, top_p=1.0, top_k=0,
                          seed=0, stops=[], loop=loop, queue=asyncio.Queue())

    req = asyncio.run_coroutine_threadsafe(make(), loop).result()

    async def read():
        text = ""
        while True:
            kind, payload = await req.queue.get()
            if kind == "delta":
                text += payload["text"]
            elif kind == "done":
                return text
            else:
                raise AssertionError(payload)

    sched.submit(req)
    return req, asyncio.run_coroutine_threadsafe(read(), loop)


def test_a_long_prompt_is_prefilled_in_pieces_between_decode_calls(sched, reference, smollm):
    """Ordered by events, not by speed: after the short stream's first decode call the scheduler waits
    until the long request is queued, so the short one (200 tokens) is still decoding when the long
    prompt's pieces run, however fast this machine decodes."""
    events: list[tuple[str, int, str]] = []
    step, fill_step, prefill_done = sched._step, sched._fill_step, sched._prefill_done
    queued = threading.Event()

    def logged_step():
        events.append(("decode", 0, ""))
        step()
        assert queued.wait(120)  # (a hang guard) the first call waits for the long request; later ones pass

    def logged_fill_step(f, limit):
        size = fill_step(f, limit)
        events.append(("piece", size, f.req.id))
        return size

    def logged_prefill_done(f):
        events.append(("finish", int(sched.rows.any_busy()), f.req.id))  # whether rows were decoding
        return prefill_done(f)

    sched._step, sched._fill_step, sched._prefill_done = logged_step, logged_fill_step, logged_prefill_done
    try:
        short = smollm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story about a dragon."}])
        long = smollm.tokenizer.encode_chat([{"role": "system", "content": "Be brief. " + SYSTEM},
                                             {"role": "user", "content": "Can children pay fines?"}])
        _, short_text = _collect_request(sched, "short", short, 200)
        while not any(kind == "decode" for kind, _, _ in events):
            threading.Event().wait(0.01)
        _, long_text = _collect_request(sched, "long", long, 16)
        queued.set()
        texts = short_text.result(600), long_text.result(600)
    finally:
        queued.set()
        del sched._step, sched._fill_step, sched._prefill_done
    long_pieces = [i for i, (kind, _, name) in enumerate(events) if kind == "piece" and name == "long"]
    assert len(long_pieces) >= 4  # ~300 prompt tokens, none of them stored before
    assert all(events[i][1] <= 64 for i in long_pieces)
    for a, b in zip(long_pieces, long_pieces[1:]):
        assert any(kind == "decode" for kind, _, _ in events[a + 1: b]), events  # the short stream kept going
    # while the short stream decodes, finishing the fill (first token, drafter start, insert) waits for
    # the next call after the last piece
    [finish] = [i for i, (kind, _, name) in enumerate(events) if kind == "finish" and name == "long"]
    assert events[finish][1] == 1, events  # the short stream (a 200-token story) was still decoding
    assert finish > long_pieces[-1] and any(kind == "decode" for kind, _, _ in events[long_pieces[-1] + 1: finish])
    for ids, max_new, got in ((short, 200, texts[0]), (long, 16, texts[1])):
        assert got == reference.generate(ids, max_new_tokens=max_new, temperature=0.0)[0].text


def test_automatic_prefill_budget_costs_about_one_decode_call(smollm):
    from hsdjax.frontends.serving.scheduler import AUTO_CHUNK_MAX, Scheduler

    s = Scheduler(smollm, "ar", max_batch=2, max_context=512, warmup=False, prefix_cache_mb=0)
    assert s.prefix is None
    assert s._prefill_budget() == 32  # nothing measured yet: the smallest piece
    s._decode_s, s._token_s = 0.4, 0.4 / 100  # a decode call costs as much as 100 prompt tokens
    assert s._prefill_budget() == 32  # 32 tokens: 0.32 of a call (64: 0.64, over AUTO_CHUNK_SHARE)
    s._token_s = 0.4 / 200
    assert s._prefill_budget() == 64  # 64 tokens: 0.32 of a call (128: 0.64)
    s._token_s = 0.4 / 10_000
    assert s._prefill_budget() == AUTO_CHUNK_MAX
    s._token_s = 1.0
    assert s._prefill_budget() == 32
    fixed = Scheduler(smollm, "ar", max_batch=2, max_context=512, warmup=False, prefill_chunk=128, prefix_cache_mb=1)
    fixed._decode_s, fixed._token_s = 0.4, 1.0
    assert fixed._prefill_budget() == 128 and fixed.prefix is None  # 1 MB holds no 1.6 MB block
