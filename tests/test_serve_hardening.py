"""`hsdjax serve` hardening: body limits and pace, range checks, API key, Host header, shutdown drain.

One scheduler over the real default model (loaded in this process) serves every test; each app runs
in a real uvicorn server on 127.0.0.1 (``hsdjax.frontends.serve.make_server``, in a thread) and is driven with
the official `openai` client, httpx, and raw sockets where a client has to misbehave. The shutdown
test comes last: it closes the scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")

from hsdjax.core import engine  # noqa: E402
from hsdjax.frontends import serve  # noqa: E402
from hsdjax.frontends.serving.app import create_app, host_name  # noqa: E402
from hsdjax.frontends.serving.metrics import Metrics  # noqa: E402
from hsdjax.frontends.serving.scheduler import GenRequest, Scheduler  # noqa: E402

MODEL = "smollm2-135m"
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 4 << 20  # bytes; large enough that tokenizing an allowed body takes seconds
BODY_TIMEOUT_S = 1.0
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Overrides conftest's: this module's scheduler thread keeps using its compiled programs."""
    yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """``serve.make_server`` on a free loopback port, in a thread."""

    def __init__(self, app, sched, grace: float = 60.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = serve.make_server(app, sched, host="127.0.0.1", port=self.port, shutdown_grace_s=grace,
                                        log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def running_scheduler(model, method, **options):
    """A started scheduler with its own metrics, compiled and ready (the caller closes it)."""
    s = Scheduler(model, method, metrics=Metrics(), **options)
    s.start()
    assert s.ready.wait(900) and s.failure is None, s.failure
    return s


@pytest.fixture(scope="module")
def sched(smollm):
    s = running_scheduler(smollm, "pld", max_batch=2, max_queue=4, max_context=512)
    yield s
    s.close()


@pytest.fixture(scope="module")
def srv(sched):
    """The server under test: an API key, the default allowed hosts for 127.0.0.1, a 4 MiB body limit."""
    app = create_app(sched, MODEL, api_key=KEY, allowed_hosts=serve.allowed_hosts_setting("127.0.0.1", None),
                     max_body_bytes=LIMIT, body_timeout_s=BODY_TIMEOUT_S)
    running = Running(app, sched)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as client:
        yield client


def _openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def _raw_http(port: int, head: str, chunks: list[bytes], wait_s: float = 30.0) -> tuple[int, dict, float]:
    """Send a request head and some body bytes over a raw socket, then read the answer until the
    server closes; (status, JSON body, seconds from just before connecting to the answer: no server
    timer for this request can have started earlier). ``wait_s`` only guards against a hang."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            sock.sendall(chunk)
        data = b""
        while piece := sock.recv(65536):
            data += piece
        elapsed = time.monotonic() - t0
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head_bytes.lower():  # a one-chunk body
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, json.loads(body), elapsed


def _metric(text: str, line_prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------------------------------ no compile after ready
def _words(word: str, n: int) -> str:
    return " ".join([word] * n)


def test_no_request_waits_for_a_compile_once_ready(srv, http, sched):
    """Warm-up compiles every program a request can need (first in this module, so no earlier request
    compiled anything for it): prompts in every prompt bucket up to the context, alone and while a
    stream decodes (pieces interleaved with its decode calls), make the scheduler thread compile
    nothing. Counted from JAX's compile events, not timed."""
    compiled: list[str] = []

    def listener(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and \
                threading.current_thread().name == "hsdjax-scheduler":
            compiled.append(str(kw.get("fun_name")))

    lengths = (20, 50, 100, 200, 400)  # prompt tokens: one prompt in every bucket up to 512
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for phase in (0, 1):  # alone, then while a stream decodes (pieces between its decode calls)
            if phase == 1:
                busy = threading.Event()
                streamer = threading.Thread(target=_stream, args=(srv.url, {
                    "model": MODEL, "max_tokens": 400, "stream": True,
                    "messages": [{"role": "user", "content": "Count from one to one hundred."}]}, [], busy))
                streamer.start()
                assert busy.wait(120)
            for i, n in enumerate(lengths):  # token ids no earlier prompt starts with (no prefix reuse)
                ids = [(1000 + 7919 * (phase * 10 + i) + 13 * j) % 40000 + 100 for j in range(n)]
                resp = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "prompt": ids})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["prompt_tokens"] == n
        streamer.join(300)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    buckets = {engine.pick_bucket(n, engine.PROMPT_BUCKETS, "a prompt") for n in lengths}
    assert buckets == {b for b in engine.PROMPT_BUCKETS if b <= sched.cache_size}, sched.cache_size
    assert compiled == [], compiled


# ------------------------------------------------------------------------------------------ body size and pace
def test_body_over_the_limit_is_refused_before_it_is_read(srv, http):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {LIMIT + 1}\r\n\r\n")
    # 11 of LIMIT + 1 bytes sent: a server waiting for the rest would answer 408 after BODY_TIMEOUT_S of silence
    status, body, _ = _raw_http(srv.port, head, [b'{"model": "'])
    assert status == 413 and body["error"]["code"] == "request_too_large", body  # not 408: never waited for the rest
    # chunked: counted while it arrives, refused once past the limit (the client never finishes)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (256 << 10)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (LIMIT // len(piece) + 1)
    status, body, _ = _raw_http(srv.port, head, chunks)  # the body never ends: waiting for its end would be a 408
    assert status == 413 and body["error"]["code"] == "request_too_large", body  # not 408: never waited for the rest
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = http.get("/metrics").text
    assert _metric(metrics, 'hsdjax_requests_total{endpoint="/v1/chat/completions",status="413"}') >= 2


def _health_times(http, n: int) -> list[float]:
    """``n`` /health round trips one after another; when each answer came."""
    out = []
    for _ in range(n):
        assert http.get("/health").status_code == 200
        out.append(time.monotonic())
    return out


def test_large_allowed_body_does_not_stall_the_server(srv, http, monkeypatch):
    """A body just under the limit is templated and tokenized in a worker thread, the tokenizer releasing
    the GIL: /health keeps answering while the tokenizer runs. No wall-clock bound: the tokenizer's call
    is timed as it runs, a /health round trip is timed beforehand in this test, and answers must land
    inside the call at no less than a fortieth of the rate the round trip allows. This client shares the
    server's GIL, so a tokenizer that held it (or a blocked event loop) lets almost none land: on the
    loaded EPYC, ``encode`` in place of ``encode_batch`` let 1 land where 256 were required; the real
    one let 1,400-1,800 land where 130-210 were (the call lasting 5,000-8,000 round trips)."""
    from hsdjax.runtime import tokenizer as tokenizer_module

    real, calls = tokenizer_module._encode_texts, []

    def timed(backend, texts):
        start = time.monotonic()
        try:
            return real(backend, texts)
        finally:
            calls.append((sum(map(len, texts)), start, time.monotonic()))

    monkeypatch.setattr(tokenizer_module, "_encode_texts", timed)
    baseline = _health_times(http, 21)
    round_trip = sorted(b - a for a, b in zip(baseline, baseline[1:]))[10]  # the median
    text = "The quick brown fox jumps over the lazy dog, 1234 times. " * (LIMIT // 60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("resp", httpx.post(
        f"{srv.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)))
    thread.start()
    answered = []
    while thread.is_alive():
        answered += _health_times(http, 1)
        time.sleep(round_trip)  # at most half the rate a round trip allows: the tokenizer keeps its core
    thread.join()
    _openai_error(result["resp"], 400, "context_length_exceeded")
    size, start, end = max(calls)  # the 4 MiB prompt's call
    assert size > LIMIT // 2, calls
    inside = sum(start < t < end for t in answered)
    assert end - start > 400 * round_trip, (end - start, round_trip)  # long enough to tell (a ratio: any machine)
    assert inside >= (end - start) / (40 * round_trip), (inside, end - start, round_trip)


def test_a_client_that_stops_sending_its_body_gets_408(srv, http):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    status, body, elapsed = _raw_http(srv.port, head, [b'{"model": '])
    assert status == 408 and body["error"]["code"] == "request_timeout", body
    assert elapsed >= BODY_TIMEOUT_S  # it waited out the silence (an answer at all: it did not wait forever)
    assert http.get("/health").status_code == 200


# ------------------------------------------------------------------------------------------ ranges
INT32_MAX = 2**31 - 1
CHAT_OUT_OF_RANGE = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2**31), ("max_tokens", 10**10), ("max_tokens", 2**63),
    ("max_tokens", INT32_MAX),  # in range, but beyond the context: 400 context_length_exceeded
    ("max_completion_tokens", 0), ("max_completion_tokens", 2**63),
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0), ("top_p", 1.01), ("top_p", float("nan")),
    ("top_k", -1), ("top_k", 2**31), ("top_k", 10**10), ("top_k", 2**63),
    ("seed", 2**31), ("seed", -(2**31) - 1), ("seed", 2**63), ("seed", 2**64), ("seed", -(2**63)),
    ("n", 0), ("n", 129), ("n", 10**10),
    ("top_logprobs", -1), ("top_logprobs", 21), ("top_logprobs", 2**63),
    ("presence_penalty", 2.5), ("presence_penalty", -3), ("presence_penalty", float("inf")),
    ("frequency_penalty", -2.5), ("frequency_penalty", 1e308 * 10),
    ("logit_bias", {"42": 101}),
]
COMPLETION_OUT_OF_RANGE = [
    ("max_tokens", 2**63), ("top_k", 10**10), ("seed", 2**63), ("logprobs", 6), ("logprobs", -1),
    ("best_of", 0), ("best_of", 21), ("prompt", [1, 2**63]), ("prompt", [-1]),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "field", "value"),
                         [("/v1/chat/completions", f, v) for f, v in CHAT_OUT_OF_RANGE]
                         + [("/v1/completions", f, v) for f, v in COMPLETION_OUT_OF_RANGE])
def test_numbers_out_of_range_are_400_naming_the_parameter(http, path, field, value, stream):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": MSG} if "chat" in path else {"prompt": "hi"})
    # json.dumps writes NaN and Infinity as Python's json module (and FastAPI's parser) accept them
    resp = http.post(path, content=json.dumps({**base, field: value, "stream": stream}),
                     headers={"Content-Type": "application/json"})
    err = _openai_error(resp, 400)
    assert err["param"] == field or err["param"].startswith(f"{field}."), err
    assert "Traceback" not in err["message"] and "int32" not in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_numbers_at_the_limits_are_accepted(http, stream):
    for extra in ({"seed": -(2**31), "top_k": INT32_MAX, "temperature": 2.0},
                  {"seed": INT32_MAX, "top_p": 1e-9, "n": 1, "presence_penalty": 0, "top_logprobs": None}):
        resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 2,
                                                       "stream": stream, **extra})
        assert resp.status_code == 200, resp.text
        if stream:
            events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events


# ------------------------------------------------------------------------------------------ any input: never a 5xx
def _strict_json(text: str):
    """``text`` parsed as JSON proper: NaN / Infinity are not JSON."""
    def refuse(name: str):
        raise AssertionError(f"not JSON: {name} in {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def _check_answer(resp: httpx.Response, body: dict) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], body)
    raw = resp.content.decode("utf-8")  # valid UTF-8
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", raw[-300:]
        for e in events[:-1]:
            _strict_json(e)
    else:
        _strict_json(raw)


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates included
EXTREME_NUMBERS = st.sampled_from([0, -0.0, 1, -1, 5e-324, -5e-324, 1e-45, 1.2e-38, 2e-38, 5e-38, 1e-30, 1e308,
                                   -1e308, 2**31, 2**63, -(2**63), 2**64, 10**30, 0.5, 1.999999])
CHAT_FIELDS = ("model", "content", "role", "stop", "user", "logit_bias", "temperature", "top_p", "top_k",
               "max_tokens", "seed", "n", "top_logprobs", "presence_penalty", "frequency_penalty", "stream",
               "logprobs", "response_format", "tools", "stream_options", "name")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(CHAT_FIELDS), value=st.one_of(ANY_TEXT, EXTREME_NUMBERS, st.lists(ANY_TEXT, max_size=3)),
       stream=st.booleans())
def test_any_value_in_any_field_gets_no_5xx_and_valid_json(http, field, value, stream):
    """Random Unicode (lone surrogates included, sent as JSON escapes) and extreme numbers in every
    field of a chat request: a 200 or a 4xx, always valid JSON (and UTF-8), never a 5xx."""
    message = {"role": "user", "content": "Say hi."}
    body = {"model": MODEL, "messages": [message], "max_tokens": 1, "stream": stream}
    if field in ("content", "role", "name"):
        message[field] = value
    elif field == "logit_bias":
        body[field] = {value if isinstance(value, str) else str(value): 1}
    else:
        body[field] = value
    resp = http.post("/v1/chat/completions", content=json.dumps(body, ensure_ascii=True),
                     headers={"Content-Type": "application/json"})
    _check_answer(resp, body)


@pytest.mark.parametrize("path", ["/v1/models/%ED%A0%80x", "/v1/nowhere/%ED%BF%BF", "/v1/models/%FF%FE"])
def test_surrogates_in_the_model_name_and_path(http, path):
    """The 404 echoes the name it could not find: a lone surrogate must not make it a 500 (nor close the
    connection, so the next pooled request still works)."""
    body = {"model": "\ud800", "messages": [{"role": "user", "content": "x"}]}
    resp = http.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    err = _openai_error(resp, 404, "model_not_found")
    assert "\ufffd" in err["message"]
    assert http.get(path).status_code == 404
    assert http.get("/v1/models").status_code == 200  # the connection survived


def test_sampling_at_every_tiny_temperature_is_defined():
    """Temperatures down to the smallest positive float give finite log-probabilities and the greedy
    token (below float32's smallest normal they are greedy by rule; above it the logits are shifted
    by their maximum before the division, so nothing overflows)."""
    import jax.numpy as jnp
    import numpy as np

    from hsdjax.core.sampling import GREEDY_BELOW, SamplingParams, effective_temperature, log_probs, select_tokens

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 30, (3, 1000)).astype(np.float32))
    best = np.argmax(np.asarray(logits), axis=-1)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(3))
    for t in (5e-324, 1e-45, 1e-40, GREEDY_BELOW / 2, GREEDY_BELOW, 2e-38, 3e-38, 5e-38, 1e-37, 1e-30, 1e-10):
        assert (effective_temperature(t) == 0.0) == (t < GREEDY_BELOW), t
        for top_k, top_p in ((0, 1.0), (5, 0.9)):
            sp = SamplingParams.make(3, t, top_k, top_p)
            lp = np.asarray(log_probs(logits, sp))
            assert not np.isnan(lp).any() and (lp <= 0).all(), t
            assert np.array_equal(np.asarray(select_tokens(logits, sp, keys)), best), t
            assert (lp[np.arange(3), best] == 0).all() or t < GREEDY_BELOW, t


@pytest.mark.parametrize("stream", [False, True])
def test_tiny_temperatures_through_the_server(http, stream):
    """The sweep of the issue: temperatures from 1e-45 to 1e-30 answer as greedy does, logprobs finite."""
    def ask(temperature: float) -> tuple[str, list[float]]:
        resp = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12, "seed": 1,
            "temperature": temperature, "logprobs": True, "top_logprobs": 2, "stream": stream})
        _check_answer(resp, {"temperature": temperature})
        assert resp.status_code == 200, resp.text
        if not stream:
            choice = resp.json()["choices"][0]
            content = choice["logprobs"]["content"]
            return choice["message"]["content"], [x["logprob"] for x in content] + \
                [y["logprob"] for x in content for y in x["top_logprobs"]]
        text, lps = "", []
        for line in resp.text.splitlines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text += choice[0]["delta"].get("content") or ""
                    for x in (choice[0].get("logprobs") or {}).get("content") or []:
                        lps += [x["logprob"]] + [y["logprob"] for y in x["top_logprobs"]]
        return text, lps

    greedy, _ = ask(0.0)
    for t in (1e-45, 1e-40, 2e-38, 3e-38, 5e-38, 1e-37, 1e-30):
        text, lps = ask(t)
        assert text == greedy, (t, text, greedy)
        assert lps and all(-9999.0 <= x <= 0 for x in lps), (t, lps)


def test_async_clients_read_the_413(srv):
    """A client that writes its whole body before reading (httpx's and openai's async clients) reads
    the 413, not a connection reset: the server drains the refused body before it closes."""
    async def main() -> list:
        out = []
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=120) as client:
            for mb in (10, 50):
                body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (mb << 20)}]})
                resp = await client.post("/v1/chat/completions", content=body,
                                         headers={"Content-Type": "application/json"})
                out.append((resp.status_code, resp.json()))
            assert (await client.get("/health")).status_code == 200
        aclient = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
        try:
            await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * (10 << 20)}])
        except openai.APIStatusError as exc:
            out.append((exc.status_code, exc.body))
        finally:
            await aclient.close()
        return out

    results = asyncio.run(main())
    assert len(results) == 3, results
    for status, body in results:
        assert status == 413, (status, body)
        err = body["error"] if "error" in body else body
        assert err["code"] == "request_too_large", body


def test_scheduler_leaves_error_counting_to_the_http_side(sched):
    """A failed prefill (impossible through the API now: top_k is range-checked) reaches the request
    as one error event; the scheduler counts the finished request but not the error, which the app
    counts once when it answers with it (an error response or an error event)."""
    async def submit() -> tuple[str, object]:
        req = GenRequest(id="bad", prompt_ids=[1, 2, 3], max_new=4, temperature=1.0, top_p=1.0, top_k=2**40,
                         seed=0, stops=[], loop=asyncio.get_running_loop(), queue=asyncio.Queue())
        sched.submit(req)
        return await asyncio.wait_for(req.queue.get(), 120)

    errors = dict(sched.metrics.errors)
    failed = sched.metrics.finished["error"]
    kind, err = asyncio.run(submit())
    assert kind == "error" and err.status == 500 and err.message == "the prefill failed; see the server log"
    assert dict(sched.metrics.errors) == errors
    assert sched.metrics.finished["error"] == failed + 1
    assert sched.snapshot()["active"] == 0


# ------------------------------------------------------------------------------------------ access
def test_api_key(srv):
    good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    resp = good.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0)
    assert resp.usage.completion_tokens >= 1
    assert [m.id for m in good.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    assert exc.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with httpx.Client(base_url=srv.url, timeout=30) as anon:
        resp = anon.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG})
        _openai_error(resp, 401, "invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
        _openai_error(anon.get("/metrics"), 401, "invalid_api_key")
        _openai_error(anon.get("/v1/nothing"), 401, "invalid_api_key")
        _openai_error(anon.get("/metrics", headers={"Authorization": f"Basic {KEY}"}), 401)
        assert anon.get("/health").json()["status"] == "ok"  # exempt, GET and HEAD
        head = anon.head("/health")
        assert head.status_code == 200 and head.content == b""
        assert anon.get("/metrics", headers=AUTH).status_code == 200


def test_host_header(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as http:
        for host in ("evil.example", "evil.example:80", "127.0.0.2"):
            _openai_error(http.get("/health", headers={"Host": host}), 400, "invalid_host")
        for host in (f"localhost:{srv.port}", "127.0.0.1", f"[::1]:{srv.port}"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_settings():
    assert serve.allowed_hosts_setting("127.0.0.1", None) == ["localhost", "127.0.0.1", "::1", "127.0.0.1"]
    assert serve.allowed_hosts_setting("10.1.2.3", None)[-1] == "10.1.2.3"
    assert serve.allowed_hosts_setting("0.0.0.0", None) is None
    assert serve.allowed_hosts_setting("::", None) is None
    assert serve.allowed_hosts_setting("0.0.0.0", "api.example.com, 10.0.0.1") == ["api.example.com", "10.0.0.1"]
    assert serve.allowed_hosts_setting("127.0.0.1", "*") is None
    assert [host_name(h) for h in ("Example.COM:8000", "[::1]:80", "::1", "a")] == ["example.com", "::1", "::1", "a"]
    assert serve.is_loopback("127.0.0.5") and serve.is_loopback("::1") and serve.is_loopback("localhost")
    assert not serve.is_loopback("0.0.0.0") and not serve.is_loopback("10.0.0.1") and not serve.is_loopback("a.b")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--api-key", "k", "--allowed-hosts", "a,b", "--max-body-bytes", "2048",
                              "--body-timeout-s", "5", "--shutdown-grace-s", "0"])
    assert (args.api_key, args.allowed_hosts, args.max_body_bytes, args.body_timeout_s, args.shutdown_grace_s) == \
        ("k", "a,b", 2048, 5.0, 0.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-body-bytes", "10"])
    bare = parser.parse_args([])
    assert bare.max_body_bytes == serve.MAX_BODY_BYTES and bare.api_key is None
    assert bare.shutdown_grace_s == serve.SHUTDOWN_GRACE_S


def test_cli_serve_parser():
    """The CLI's serve parser has the hardening flags and names its real default method."""
    from hsdjax.frontends.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--api-key", "k", "--shutdown-grace-s", "3", "--max-body-bytes", "4096"])
    assert (args.api_key, args.shutdown_grace_s, args.max_body_bytes, args.method) == ("k", 3.0, 4096, "pld")
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]
    help_text = serve_parser.format_help()
    assert "--api-key" in help_text and "(default: ar)" not in help_text


# ------------------------------------------------------------------------------------------ shutdown (last)
def _stream(url: str, body: dict, events: list, first: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line[6:]))
                if '"content":"' in line and '"content":""' not in line:
                    first.set()
    first.set()


def test_shutdown_drains_then_ends_streams_with_an_error_event(sched, http):
    """Last test: it closes the module's scheduler. A short stream finishes during the grace period;
    the long one ends at its end with an error event and ``data: [DONE]``, counted once.

    Ordered by events, not by the machine's speed: the scheduler's decode step is wrapped so that it
    pauses once both streams are mid-generation until the server refuses new connections (the drain has
    begun), and then holds the long stream, once it is alone, until the scheduler closes at the end of
    the grace period. The grace period is 20 of the scheduler's own measured decode calls (at least
    2 s); the short stream needs one or two."""
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200 and sched._decode_s is not None  # a decode call measured on this machine, now
    grace = max(2.0, 20 * sched._decode_s)
    running = Running(create_app(sched, MODEL, api_key=KEY), sched, grace=grace)
    metrics_before = httpx.get(f"{running.url}/metrics", headers=AUTH).text
    story = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    bodies = {"long": {"model": MODEL, "messages": story, "max_tokens": 450, "temperature": 0, "stream": True},
              "short": {"model": MODEL, "messages": MSG, "max_tokens": 3, "temperature": 0, "stream": True}}
    events = {name: [] for name in bodies}
    step, both, draining = sched._step, threading.Event(), threading.Event()

    def rows() -> int:
        return len(sched.rows.busy())

    def gated_step() -> None:
        if rows() == 2 and not draining.is_set():  # both streams admitted: wait for the drain to begin
            both.set()
            draining.wait(120)
        step()
        held = time.monotonic()
        while draining.is_set() and rows() == 1 and not sched._stopping and time.monotonic() < held + 300:
            time.sleep(0.01)  # the long stream, alone: held until the grace period ends and the scheduler closes

    sched._step = gated_step
    threads = {}
    try:
        for name, body in bodies.items():
            first = threading.Event()
            threads[name] = threading.Thread(target=_stream, args=(running.url, body, events[name], first))
            threads[name].start()
            assert (both if name == "short" else first).wait(120), name
        t0 = time.monotonic()
        running.server.should_exit = True  # what uvicorn's SIGTERM handler does
        while True:  # no new connections while draining
            try:
                httpx.get(f"{running.url}/health", timeout=30)
            except httpx.ConnectError:
                break
            assert time.monotonic() < t0 + 60, "the server kept accepting connections after shutdown began"
            time.sleep(0.01)
        refused = time.monotonic()
        draining.set()
        for thread in threads.values():
            thread.join(120)
        running.thread.join(60)
    finally:
        draining.set()
        del sched._step
    assert not running.thread.is_alive()

    short = [e for _, e in events["short"]]
    assert short[-1] == "[DONE]"
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    long = [e for _, e in events["long"]]
    assert long[-1] == "[DONE]"
    err = json.loads(long[-2])["error"]
    assert err["type"] == "server_error" and "shutting down" in err["message"]
    assert any('"content":"' in e and '"content":""' not in e for e in long[:-2])  # it was generating
    # the order of events: refused, the short stream's end, then (the grace period over) the long one's error
    assert refused < events["short"][-1][0] < events["long"][-2][0]
    assert events["long"][-2][0] >= t0 + grace  # the server waited out the grace period before ending it
    metrics_after = sched.metrics.render()
    key = 'hsdjax_errors_total{type="server_error"}'
    assert _metric(metrics_after, key) == _metric(metrics_before, key) + 1
