"""`hsdjax serve` end to end: the real server (a subprocess on 127.0.0.1) with the real default model,
driven with the official `openai` client and with raw HTTP (httpx) for malformed input.

Two servers: the main one (pld, --max-batch 8) for the API, determinism, disconnect and concurrency
tests, and a small one (--max-batch 2 --max-queue 2) for the burst beyond the queue.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[1]
CHAT_PROMPTS = [
    "Write a haiku about JAX.",
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain recursion in one sentence.",
    "Give me a synonym for happy.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "List two planets.",
]
RAW_PROMPT = "Once upon a time"
REPEAT_PROMPT = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat"  # pld accepts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "hsdjax.frontends.cli", "serve", "--model", MODEL, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"), "--max-batch", "8", "--max-context", "512", "--rounds", "4")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(smollm):
    """Plain decoding through the Python API: what `hsdjax generate` returns."""
    from hsdjax.frontends.api import Generator

    return Generator(smollm, method="ar")


@pytest.fixture(scope="module")
def sequential(client):
    """Each chat prompt's greedy 16-token answer, one request at a time."""
    return [_chat(client, p, max_tokens=16) for p in CHAT_PROMPTS]


def _chat(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)
    return resp.choices[0].message.content


def _stream_chat(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None = "?", code: str | None = "?"):
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "?":
        assert err["param"] == param, err
    if code != "?":
        assert err["code"] == code, err


# ------------------------------------------------------------------------------------------ text stream
def test_text_stream_holds_back_stop_prefixes_and_split_characters(smollm):
    from hsdjax.frontends.serving.text import TextStream

    tok = smollm.tokenizer
    text = "Hé said 日本語 twice: 日本語 🎉 done"
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=True)

    stream = TextStream(tok, tok.stop_ids, [])
    deltas = [stream.push(t) for t in ids] + [stream.finish("length")]
    assert "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)

    stream = TextStream(tok, tok.stop_ids, ["本語 tw", "zzz"])
    deltas = []
    for t in ids:
        deltas.append(stream.push(t))
        if stream.finished:
            break
    deltas.append(stream.finish("length"))
    assert stream.finish_reason == "stop"
    assert "".join(deltas) == full[: full.index("本語 tw")]
    assert stream.tokens < len(ids)
    for i in range(len(deltas)):  # nothing past the cut point was ever sent
        assert "本" not in "".join(deltas[: i + 1])

    stream = TextStream(tok, tok.stop_ids, ["done"])  # the stop token ends it too
    abc = tok.encode("abc")
    deltas = [stream.push(t) for t in abc] + [stream.push(tok.stop_ids[0])]
    assert "".join(deltas) == "abc" and stream.finish_reason == "stop" and stream.tokens == len(abc) + 1


# ------------------------------------------------------------------------------------------ engine rows
@pytest.mark.parametrize("limit, max_batch, spec_bucket", [(1, 8, 1), (2, 8, 2), (3, 8, 4), (0, 8, 0), (8, 8, 8),
                                                          (None, 8, 8)])
def test_speculative_programs_only_where_rows_speculate(smollm, limit, max_batch, spec_bucket):
    """With a plain variant (``pld``), the speculative decode (several forward passes: the largest
    program) is compiled and run only in the batch buckets that hold at most ``spec_max_active`` rows;
    plain decoding wherever more rows can be busy."""
    from hsdjax.frontends.serving.scheduler import Scheduler

    sched = Scheduler(smollm, "pld", max_batch=max_batch, spec_max_active=limit, warmup=False, prefix_cache_mb=0)
    assert sched.spec_bucket == spec_bucket
    for b in sched.buckets:
        want = ([sched.drafter] if b <= spec_bucket else []) + ([sched.plain] if limit is not None and b > limit else [])
        assert sched._decoders_at(b) == want, b
    if limit == 1:  # one busy row in a bucket of 4: plain rounds until the resize, which shrinks at once
        sched.rows.slots = [object(), None, None, None]
        assert not sched._speculates()
        sched.rows.slots = [object()]
        assert sched._speculates()


@pytest.mark.parametrize("method", ["pld", "sps"])
def test_insert_and_take_rows_keep_each_row_exact(method):
    """Continuous batching at the engine level: rows prefilled separately, inserted into a running
    state mid-generation, the batch grown and shrunk: every row's tokens equal its own run."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hsdjax.core import engine
    from hsdjax.core.drafters import ARDrafter
    from hsdjax.core.drafters.pld import PromptLookupDrafter
    from hsdjax.core.drafters.sps import DraftLMDrafter
    from hsdjax.core.sampling import SamplingParams
    from hsdjax.runtime.model import init_params
    from tests.conftest import TINY_LLAMA, run_engine

    cfg = TINY_LLAMA
    params = init_params(cfg, seed=1)
    drafter, dparams = {"ar": (ARDrafter(), ()), "pld": (PromptLookupDrafter(width=2, depth=3), ()),
                        "sps": (DraftLMDrafter(draft_cfg=cfg, depth=3), params)}[method]
    rng = np.random.RandomState(7)
    prompts = [list(rng.randint(0, cfg.vocab_size, n)) + [3, 4, 5, 3, 4] for n in (3, 9, 5)]
    budget = 20
    want = [run_engine(cfg, params, [p], budget, drafter=drafter, dparams=dparams)[0] for p in prompts]
    size = engine.plan_shapes(cfg, max(map(len, prompts)), budget, spare=drafter.spare)[1]  # as run_engine

    def prefill(p):
        gen, fwd = engine.prefill(params, jnp.array([p + [0] * (32 - len(p))]), jnp.array([len(p)]),
                                  jnp.array([budget]), SamplingParams.make(1), jnp.zeros((1, 2), jnp.uint32),
                                  engine.stop_array(()), cfg=cfg, cache_size=size, spare=drafter.spare)
        return engine.start_decoding(dparams, gen, fwd, drafter=drafter)

    def step(state, n):
        return engine.decode(params, dparams, state, jnp.int32(n), cfg=cfg, drafter=drafter)

    state = step(prefill(prompts[0]), 2)  # row 0 runs alone
    state = engine.take_rows(state, jnp.array([-1, 0, -1, -1]))  # grow to 4 rows; it moves to row 1
    assert np.asarray(state.gen.done).tolist() == [True, False, True, True]
    state = engine.insert_rows(state, prefill(prompts[1]), jnp.array([3]))
    state = step(state, 3)
    grown = engine.grow_rows(state, 6)  # growing by concatenation: take_rows' rows -1 appended
    for a, b in zip(jax.tree_util.tree_leaves(grown), jax.tree_util.tree_leaves(
            engine.take_rows(state, jnp.array([0, 1, 2, 3, -1, -1])))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state = engine.insert_rows(state, prefill(prompts[2]), jnp.array([0]))
    state = step(state, 2)
    state = engine.take_rows(state, jnp.array([3, 0, 1, -1]))  # reorder, drop the empty row
    state = step(state, 100)
    seq, start, end = (np.asarray(a) for a in (state.gen.seq, state.gen.prompt_len, state.gen.seq_len))
    got = {k: seq[i, start[i]: end[i]].tolist() for i, k in enumerate((1, 2, 0))}
    state = engine.take_rows(state, jnp.array([2]))  # shrink to the one row
    assert np.asarray(state.gen.seq)[0, start[2]: end[2]].tolist() == want[0]
    assert [got[k] for k in range(3)] == want
    assert np.asarray(state.gen.done).all()


# ------------------------------------------------------------------------------------------ the API
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    head = httpx.head(f"{server.url}/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    health = server.health()
    assert health["status"] == "ok" and health["method"] == "pld" and health["max_batch"] == 8
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("hsdjax_requests_total", "hsdjax_generation_tokens_total", "hsdjax_generation_tokens_per_second",
                 "hsdjax_mean_accepted_length", "hsdjax_queue_depth", "hsdjax_errors_total", "hsdjax_active_rows"):
        assert f"# TYPE {name} " in metrics


def test_chat_greedy_equals_generate(client, reference):
    for prompt, n in ((CHAT_PROMPTS[0], 40), (CHAT_PROMPTS[3], 24)):
        want = reference.generate(prompt, max_new_tokens=n, temperature=0.0)[0]
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=n, temperature=0, seed=3)
        choice = resp.choices[0]
        assert choice.message.content == want.text
        assert choice.finish_reason == want.finish_reason
        assert resp.usage.prompt_tokens == want.prompt_tokens
        assert resp.usage.completion_tokens == want.new_tokens
        assert resp.usage.total_tokens == want.prompt_tokens + want.new_tokens
        extra = resp.model_extra["hsdjax"]
        assert extra["method"] == "pld" and extra["target_passes"] >= 1
        assert extra["mean_accepted_length"] >= 1.0


def test_chat_stream_with_usage(client):
    want = _chat(client, CHAT_PROMPTS[0], max_tokens=40)
    text, chunks = _stream_chat(client, CHAT_PROMPTS[0], max_tokens=40, stream_options={"include_usage": True})
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["hsdjax"]["method"] == "pld"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 40
    assert last.usage.total_tokens == last.usage.prompt_tokens + 40
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_raw_text(client, reference):
    want = reference.generate(RAW_PROMPT, max_new_tokens=24, temperature=0.0, chat=False)[0]
    resp = client.completions.create(model=MODEL, prompt=RAW_PROMPT, max_tokens=24, temperature=0, seed=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == want.text
    assert resp.usage.prompt_tokens == want.prompt_tokens and resp.usage.completion_tokens == 24
    assert resp.model_extra["hsdjax"]["target_passes"] >= 1
    chunks = list(client.completions.create(model=MODEL, prompt=RAW_PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 24
    default = client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0)
    assert default.usage.completion_tokens == 16  # the completions API's default max_tokens


def test_stop_strings(client):
    full = _chat(client, CHAT_PROMPTS[0], max_tokens=40)
    assert len(full) > 30
    stop = full[12:19]  # spans several tokens, starts mid-text
    cut = full[: full.index(stop)]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[0]}],
                                          max_tokens=40, temperature=0, stop=["zzzz", stop])
    assert resp.choices[0].message.content == cut
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 40
    text, chunks = _stream_chat(client, CHAT_PROMPTS[0], max_tokens=40, stop=stop)
    assert text == cut
    sent = ""
    for c in chunks:  # no chunk ever carried any part of the stop string beyond the cut
        if c.choices:
            sent += c.choices[0].delta.content or ""
            assert full.startswith(sent) and len(sent) <= len(cut)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_seeded_sampling_is_reproducible(client):
    a = _chat(client, CHAT_PROMPTS[1], max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    b = _chat(client, CHAT_PROMPTS[1], max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    assert a == b


# ------------------------------------------------------------------------------------------ logprobs
@pytest.fixture(scope="module")
def token_ids(smollm):
    """Token bytes -> id (the server reports tokens by text and bytes)."""
    tok = smollm.tokenizer
    return {tok.token_bytes(i): i for i in reversed(range(tok.vocab_size))}


def _close(a, b, atol=1e-4):
    assert len(a) == len(b) and all(abs(x - y) <= atol for x, y in zip(a, b)), (a, b)


def test_chat_logprobs_equal_plain_decoding_and_teacher_forced(client, reference, smollm, token_ids):
    """A lone greedy request speculates (pld); its logprobs equal plain decoding's (Generator, ar) and a
    teacher-forced pass of the model over the answer, within 1e-4."""
    from tests.conftest import teacher_forced

    prompt, n = CHAT_PROMPTS[0], 24
    want = reference.generate(prompt, max_new_tokens=n, temperature=0.0, top_logprobs=5)[0]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=n,
                                          temperature=0, logprobs=True, top_logprobs=5)
    choice = resp.choices[0]
    assert resp.model_extra["hsdjax"]["method"] == "pld" and choice.message.content == want.text
    content = choice.logprobs.content
    tokens = [token_ids[bytes(c.bytes)] for c in content]
    assert tokens == [t for t in want.tokens if t not in smollm.tokenizer.stop_ids]
    assert b"".join(bytes(c.bytes) for c in content).decode() == choice.message.content
    _close([c.logprob for c in content], [w.logprob for w in want.logprobs[: len(content)]])
    forced = teacher_forced(smollm.cfg, smollm.params, reference.encode_prompt(prompt), want.tokens)
    _close([c.logprob for c in content], forced[np.arange(len(tokens)), tokens].tolist())
    for c, w in zip(content, want.logprobs):
        top = [t.logprob for t in c.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy
        _close(top, [v for _, v in w.top])


def test_sampled_logprobs_are_of_the_adjusted_distribution(client, reference, smollm, token_ids):
    """Sampled tokens' logprobs are those of the temperature / top-k / top-p adjusted distribution
    (tokens it excludes: -9999.0, OpenAI's floor)."""
    from tests.conftest import teacher_forced

    sampling = {"temperature": 0.7, "top_p": 0.9}
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[3]}],
                                          max_tokens=16, seed=11, logprobs=True, top_logprobs=20,
                                          extra_body={"top_k": 40}, **sampling)
    content = resp.choices[0].logprobs.content
    tokens = [token_ids[bytes(c.bytes)] for c in content]
    forced = teacher_forced(smollm.cfg, smollm.params, reference.encode_prompt(CHAT_PROMPTS[3]), tokens,
                            top_k=40, **sampling)
    _close([c.logprob for c in content], forced[np.arange(len(tokens)), tokens].tolist())
    for c, row in zip(content, forced):
        want = np.maximum(-np.sort(-row)[:20], -9999.0)
        _close([t.logprob for t in c.top_logprobs], want.tolist())
    assert any(t.logprob == -9999.0 for c in content for t in c.top_logprobs)  # top-p kept fewer than 20


def test_completions_logprobs_speculative_equals_plain(client, reference):
    want = reference.generate(REPEAT_PROMPT, max_new_tokens=24, temperature=0.0, chat=False, top_logprobs=3)[0]
    resp = client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=24, temperature=0, logprobs=3)
    assert resp.model_extra["hsdjax"]["mean_accepted_length"] > 1.2  # drafts were accepted
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text == want.text and "".join(lp.tokens) == choice.text
    _close(lp.token_logprobs, [w.logprob for w in want.logprobs])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, top, w in zip(lp.tokens, lp.top_logprobs, want.logprobs):
        assert token in top and len(top) <= 4
        _close(sorted(top.values(), reverse=True)[:3], [v for _, v in w.top])
    chunks = list(client.completions.create(model=MODEL, prompt=REPEAT_PROMPT, max_tokens=24, temperature=0,
                                            logprobs=3, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    _close(sum((s.token_logprobs for s in streamed), []), lp.token_logprobs)


def test_chat_logprobs_stream(client):
    kw = {"max_tokens": 20, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[4]}],
                                           temperature=0, **kw).choices[0]
    text, chunks = _stream_chat(client, CHAT_PROMPTS[4], **kw)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert text == whole.message.content
    assert [e.token for e in entries] == [e.token for e in whole.logprobs.content]
    _close([e.logprob for e in entries], [e.logprob for e in whole.logprobs.content])
    assert all(len(e.top_logprobs) == 2 for e in entries)


# ------------------------------------------------------------------------------------------ n > 1
def test_n_greedy_choices_equal_one_request(client):
    one = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[2]}],
                                         max_tokens=16, temperature=0)
    four = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[2]}],
                                          max_tokens=16, temperature=0, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.message.content for c in four.choices] == [one.choices[0].message.content] * 4
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens
    assert four.usage.prompt_tokens == one.usage.prompt_tokens


def test_n_sampled_choices_are_distinct_and_reproducible(client, server):
    def texts(seed):
        resp = client.completions.create(model=MODEL, prompt=RAW_PROMPT, max_tokens=16, temperature=1.0, n=3,
                                         seed=seed)
        assert [c.index for c in resp.choices] == [0, 1, 2]
        return [c.text for c in resp.choices]

    first = texts(77)
    assert len(set(first)) == 3
    assert texts(77) == first
    assert texts(78) != first
    assert server.health()["active"] == 0


def test_n_stream_with_logprobs(client):
    kw = {"max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 2, "logprobs": True}
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPTS[6]}], **kw)
    _, chunks = _stream_chat(client, CHAT_PROMPTS[6], stream_options={"include_usage": True}, **kw)
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        entries = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [e.token for e in entries] == [e.token for e in choice.logprobs.content]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for c in chunks if c.model_extra.get("hsdjax") and c.choices) == 1  # with the last final chunk


# ------------------------------------------------------------------------------------------ errors
def _error_cases():
    chat, comp = "/v1/chat/completions", "/v1/completions"
    msg = [{"role": "user", "content": "hi"}]
    ok = {"model": MODEL, "messages": msg}
    return [
        # (path, body (dict, or raw str), status, param, code)
        (chat, "{not json", 400, None, "invalid_json"),
        (chat, "[1, 2]", 400, None, "invalid_json"),
        (chat, "", 400, None, "invalid_json"),
        (chat, {"model": MODEL}, 400, "messages", "missing_required_parameter"),
        (chat, {"model": MODEL, "messages": []}, 400, "messages", "?"),
        (chat, {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", "?"),
        (chat, {**ok, "temperature": "hot"}, 400, "temperature", "?"),
        (chat, {**ok, "temperature": 2.5}, 400, "temperature", "?"),
        (chat, {**ok, "temperature": -0.1}, 400, "temperature", "?"),
        (chat, {**ok, "top_p": 0}, 400, "top_p", "?"),
        (chat, {**ok, "top_p": 1.5}, 400, "top_p", "?"),
        (chat, {**ok, "max_tokens": 0}, 400, "max_tokens", "?"),
        (chat, {**ok, "max_tokens": "ten"}, 400, "max_tokens", "?"),
        (chat, {**ok, "max_tokens": 100_000}, 400, "max_tokens", "context_length_exceeded"),
        (chat, {**ok, "max_completion_tokens": 100_000}, 400, "max_completion_tokens", "context_length_exceeded"),
        (chat, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}]}, 400, "messages",
         "context_length_exceeded"),
        (chat, {**ok, "model": "gpt-17"}, 404, "model", "model_not_found"),
        (chat, {**ok, "n": 9}, 400, "n", "invalid_value"),  # more choices than --max-batch rows
        (chat, {**ok, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),  # without logprobs: true
        (chat, {**ok, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "?"),
        (chat, {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "?"),
        (chat, {**ok, "stream": "yes"}, 400, "stream", "?"),
        (chat, {**ok, "seed": 1.5}, 400, "seed", "?"),
        (comp, {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs", "?"),
        (comp, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
        (comp, {"model": MODEL, "prompt": "hi", "n": 129}, 400, "n", "?"),
        (comp, {"model": MODEL, "prompt": "word " * 2000}, 400, "prompt", "context_length_exceeded"),
        (comp, {"model": MODEL, "prompt": 5}, 400, "prompt", "?"),
        (comp, {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ]


def test_bad_requests_get_openai_errors(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, param, code in _error_cases():
            if isinstance(body, str):
                resp = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                resp = http.post(path, json=body)
            try:
                _assert_openai_error(resp, status, param, code)
            except AssertionError as exc:
                raise AssertionError(f"{path} {str(body)[:80]!r}: {exc}") from None
        _assert_openai_error(http.get("/v1/nothing"), 404)
        _assert_openai_error(http.get("/v1/chat/completions"), 405)
        _assert_openai_error(http.post("/v1/completions", content=b'{"model": "x"', headers={}), 400)
        # the server is unharmed and still answers
        assert http.get("/health").json()["status"] == "ok"
        metrics = http.get("/metrics").text
    assert 'hsdjax_requests_total{endpoint="/v1/chat/completions",status="400"}' in metrics
    assert 'hsdjax_errors_total{type="invalid_request_error"}' in metrics


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=9)
    assert exc.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------------------------ disconnect
def _metric(text: str, line_prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# Eight sampled stories in one request (seeded): the request ends only when all eight have, after at least
# 400 decode steps unless every one of them stops early (this seed: 6 of 8 run to the limit, ~11 s in all).
# Greedy stories loop, and prompt lookup then writes a whole answer in well under a second.
LONG_STORIES = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
                "max_tokens": 400, "temperature": 1.0, "seed": 3, "n": 8}


def test_disconnect_frees_the_rows(server):
    before = httpx.get(f"{server.url}/metrics", timeout=10).text
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions", json={**LONG_STORIES, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():  # the first chunk with text: the rows are admitted and decoding
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
            assert server.health()["active"] == 8
    deadline = time.monotonic() + 120  # a hang guard: the rows go at the next decode call
    while server.health()["active"] != 0:
        assert time.monotonic() < deadline, "the rows were not freed after the client disconnected"
        time.sleep(0.2)
    after = httpx.get(f"{server.url}/metrics", timeout=10).text
    key = 'hsdjax_requests_finished_total{reason="cancelled"}'
    assert _metric(after, key) == _metric(before, key) + 1
    assert _metric(after, "hsdjax_active_rows ") == 0
    assert _metric(after, "hsdjax_generation_tokens_total ") - _metric(before, "hsdjax_generation_tokens_total ") < 8 * 400


def test_disconnect_without_streaming_frees_the_rows(server):
    """A client that sent a whole (non-streaming) request goes away before the answer: its rows are freed.
    It leaves once /health shows the request's eight rows admitted (an event; a read timeout would race
    the generation, which a fast machine could finish first)."""
    before = httpx.get(f"{server.url}/metrics", timeout=10).text
    body = json.dumps(LONG_STORIES).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 120  # a hang guard
        while server.health()["active"] != 8:
            assert time.monotonic() < deadline, "the request's rows were never admitted"
            time.sleep(0.05)
    deadline = time.monotonic() + 120  # a hang guard: the rows go at the next decode call
    while server.health()["active"] != 0:
        assert time.monotonic() < deadline, "the rows were not freed after the client went away"
        time.sleep(0.2)
    after = httpx.get(f"{server.url}/metrics", timeout=10).text
    key = 'hsdjax_requests_finished_total{reason="cancelled"}'
    assert _metric(after, key) == _metric(before, key) + 1


# ------------------------------------------------------------------------------------------ concurrency
def test_concurrent_streams_equal_sequential(server, client, sequential):
    prompts = CHAT_PROMPTS * 2  # 16 concurrent streams over the 8 rows

    def one(i):
        return i, _stream_chat(client, prompts[i], max_tokens=16)[0]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = dict(f.result(timeout=300) for f in [pool.submit(one, i) for i in range(len(prompts))])
    for i, prompt in enumerate(prompts):
        assert results[i] == sequential[i % len(CHAT_PROMPTS)], prompt
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert _metric(metrics, 'hsdjax_decode_calls_total{drafter="pld"}') > 0
    if server.health()["spec_max_active"] is not None:  # busy batches decoded without speculation
        assert _metric(metrics, 'hsdjax_decode_calls_total{drafter="ar"}') > 0


def test_burst_beyond_the_queue(tmp_path_factory, sequential):
    """With both rows generating and both queue places taken, more requests get 429 at once instead of
    waiting. Ordered by the server's state, not by its speed: four long requests fill the rows and the
    queue (/health says so), then a burst of eight goes out while they run. Every burst answer that came
    before the first long request ended must be a 429 (the first of them always does); a later one may
    be served, and then answers exactly; the four long ones answer alike."""
    srv = Server(tmp_path_factory.mktemp("serve-small"), "--max-batch", "2", "--max-queue", "2",
                 "--max-context", "512")
    try:
        srv.wait_ready()
        story = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
                 "max_tokens": 200, "temperature": 0, "stream": True}
        ended: list[float] = []

        def hold(_):  # one of the four long requests: its text; when it ended goes to ``ended``
            with httpx.Client(timeout=300) as http:
                with http.stream("POST", f"{srv.url}/v1/chat/completions", json=story) as resp:
                    assert resp.status_code == 200
                    events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
            ended.append(time.monotonic())
            assert events[-1] == "[DONE]"
            return "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                           for e in events[:-1] if json.loads(e)["choices"])

        n = 8
        body = lambda i: {"model": MODEL, "messages": [{"role": "user", "content": CHAT_PROMPTS[i % 8]}],  # noqa: E731
                          "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0}

        def one(i):  # (i, the text or None for a 429, when the answer came)
            with httpx.Client(timeout=300) as http:
                resp = http.post(f"{srv.url}/v1/chat/completions", json=body(i))
                at = time.monotonic()
                if resp.status_code == 429:
                    _assert_openai_error(resp, 429, code="rate_limit_exceeded")
                    assert resp.headers["retry-after"] == "1"
                    return i, None, at
                assert resp.status_code == 200, resp.text
                if body(i)["stream"]:
                    events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
                    assert events[-1] == "[DONE]"
                    return i, "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                                      for e in events[:-1] if json.loads(e)["choices"]), at
                return i, resp.json()["choices"][0]["message"]["content"], at

        with concurrent.futures.ThreadPoolExecutor(4 + n) as pool:
            holders = [pool.submit(hold, j) for j in range(4)]
            deadline = time.monotonic() + 300  # a hang guard
            while (full := srv.health())["active"] + full["waiting"] < 4:
                assert time.monotonic() < deadline and not any(f.done() for f in holders), full
                time.sleep(0.02)
            burst = [f.result(timeout=300) for f in [pool.submit(one, i) for i in range(n)]]
            long_texts = [f.result(timeout=600) for f in holders]
        assert full["active"] + full["waiting"] == 4, full  # every place taken: the next submit is refused
        assert len(set(long_texts)) == 1 and long_texts[0], long_texts
        first_end = min(ended)
        early = [(i, text) for i, text, at in burst if at < first_end]
        assert early and all(text is None for _, text in early), (early, first_end)  # refused, not queued
        for i, text, _ in burst:
            assert text is None or text == sequential[i % 8]
        health = srv.health()
        assert health["active"] == 0 and health["waiting"] == 0
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------ shutdown (last)
def test_sigterm_drains_running_streams(server):
    """Last: it stops the module's server. After SIGTERM a running stream is not cut: it finishes
    within the grace period (--shutdown-grace-s, 10 s by default) or ends with an error event; either
    way with `data: [DONE]`, and the process exits."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
            "max_tokens": 450, "temperature": 0, "stream": True}
    events: list[str] = []
    first = threading.Event()

    def consume() -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert first.wait(60)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        assert "shutting down" in last["error"]["message"] and time.monotonic() - t0 > 9
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) is not None
