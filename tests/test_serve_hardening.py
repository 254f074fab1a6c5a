"""`hsdjax serve` hardening: body limits and pace, range checks, API key, Host header, shutdown drain.

One scheduler over the real default model (loaded in this process) serves every test; each app runs
in a real uvicorn server on 127.0.0.1 (``hsdjax.serve.make_server``, in a thread) and is driven with
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
import pytest

openai = pytest.importorskip("openai")

from hsdjax import serve  # noqa: E402
from hsdjax.serving.app import create_app, host_name  # noqa: E402
from hsdjax.serving.metrics import Metrics  # noqa: E402
from hsdjax.serving.scheduler import GenRequest, Scheduler  # noqa: E402

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
    server closes; (status, JSON body, seconds from the last byte sent to the answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            sock.sendall(chunk)
        t0 = time.monotonic()
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


# ------------------------------------------------------------------------------------------ body size and pace
def test_body_over_the_limit_is_refused_before_it_is_read(srv, http):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {LIMIT + 1}\r\n\r\n")
    status, body, elapsed = _raw_http(srv.port, head, [b'{"model": "'])  # 11 of LIMIT + 1 bytes sent
    assert status == 413 and body["error"]["code"] == "request_too_large", body  # not 408: never waited for the rest
    assert elapsed < 10.0  # no hang (a loaded machine can delay the answer by seconds)
    # chunked: counted while it arrives, refused once past the limit (the client never finishes)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (256 << 10)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (LIMIT // len(piece) + 1)
    status, body, elapsed = _raw_http(srv.port, head, chunks)
    assert status == 413 and body["error"]["code"] == "request_too_large", body  # not 408: never waited for the rest
    assert elapsed < 10.0  # no hang (a loaded machine can delay the answer by seconds)
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = http.get("/metrics").text
    assert _metric(metrics, 'hsdjax_requests_total{endpoint="/v1/chat/completions",status="413"}') >= 2


def test_large_allowed_body_does_not_stall_the_server(srv, http):
    """A body just under the limit is templated and tokenized in a worker thread (releasing the GIL):
    /health keeps answering meanwhile."""
    text = "The quick brown fox jumps over the lazy dog, 1234 times. " * (LIMIT // 60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    result: dict = {}

    def post() -> None:
        t0 = time.monotonic()
        result["resp"] = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=post)
    answered = [time.monotonic()]  # when each /health answer came (this client shares the server's GIL)
    thread.start()
    while thread.is_alive():
        assert http.get("/health").status_code == 200
        answered.append(time.monotonic())
        time.sleep(0.05)
    thread.join()
    _openai_error(result["resp"], 400, "context_length_exceeded")
    gaps = [b - a for a, b in zip(answered, answered[1:])]
    assert result["seconds"] > 1.0, result["seconds"]
    assert max(gaps) < 0.75, (result["seconds"], gaps)


def test_a_client_that_stops_sending_its_body_gets_408(srv, http):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    status, body, elapsed = _raw_http(srv.port, head, [b'{"model": '])
    assert status == 408 and body["error"]["code"] == "request_timeout", body
    assert BODY_TIMEOUT_S * 0.8 < elapsed < BODY_TIMEOUT_S + 3
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
    from hsdjax.cli import build_parser

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


def test_shutdown_drains_then_ends_streams_with_an_error_event(sched):
    """Last test: it closes the module's scheduler. A short stream finishes during the grace period;
    the long one ends at its end with an error event and ``data: [DONE]``, counted once."""
    grace = 1.0  # the long stream (450 tokens) must outlast it: ~3 s at this CPU's ~150 tokens/s
    running = Running(create_app(sched, MODEL, api_key=KEY), sched, grace=grace)
    metrics_before = httpx.get(f"{running.url}/metrics", headers=AUTH).text
    story = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    bodies = {"long": {"model": MODEL, "messages": story, "max_tokens": 450, "temperature": 0, "stream": True},
              "short": {"model": MODEL, "messages": MSG, "max_tokens": 3, "temperature": 0, "stream": True}}
    events = {name: [] for name in bodies}
    threads = {}
    for name, body in bodies.items():
        first = threading.Event()
        threads[name] = threading.Thread(target=_stream, args=(running.url, body, events[name], first))
        threads[name].start()
        assert first.wait(120)
    t0 = time.monotonic()
    running.server.should_exit = True  # what uvicorn's SIGTERM handler does
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no new connections while draining
        httpx.get(f"{running.url}/health", timeout=5)
    for thread in threads.values():
        thread.join(60)
    running.thread.join(30)
    assert not running.thread.is_alive()

    short = [e for _, e in events["short"]]
    assert short[-1] == "[DONE]"
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert events["short"][-1][0] < t0 + grace
    long = [e for _, e in events["long"]]
    assert long[-1] == "[DONE]"
    err = json.loads(long[-2])["error"]
    assert err["type"] == "server_error" and "shutting down" in err["message"]
    assert len(long) > 5  # it was generating until the end of the grace period
    assert t0 + grace - 0.5 < events["long"][-1][0] < t0 + grace + 30
    metrics_after = sched.metrics.render()
    key = 'hsdjax_errors_total{type="server_error"}'
    assert _metric(metrics_after, key) == _metric(metrics_before, key) + 1
