"""The FastAPI application: OpenAI-compatible endpoints in front of the ``Scheduler``.

``create_app`` builds a ``ServerState`` (the scheduler and what is derived from it once) and stores it
on ``app.state``; the routes are module-level functions on ``router`` that fetch it with ``server``.
Every error leaves as the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``:
FastAPI's validation handler (422 with its own body) and Starlette's HTTP errors are overridden.
``RequestGuard`` checks the Host header, the API key and the body's size and pace before the app
reads anything; tokenizing runs in a worker thread, so a long prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from hsdjax.errors import HsdjaxError
from hsdjax.frontends.serving import BODY_TIMEOUT_S, MAX_BODY_BYTES
from hsdjax.frontends.serving.metrics import Metrics
from hsdjax.frontends.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    new_id,
    usage,
)
from hsdjax.frontends.serving.scheduler import GenRequest, QueueFull, Scheduler
from hsdjax.frontends.serving.text import TokenPieces

log = logging.getLogger("hsdjax.frontends.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as the OpenAI completions API; chat defaults to the rest of the context
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers' health checks)


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status (pure ASGI: streaming passes through)."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.request(scope.get("path", ""), status["code"])


def host_name(host: str) -> str:
    """The name in a Host header, without the port (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


LINGER_S = 0.5  # how long a refused body's remaining pieces are read and dropped (``RequestGuard.drain``)
DRAIN_BYTES = 64 << 20  # the most of a refused body that is read and dropped before the connection closes


class RequestGuard:
    """Pure ASGI checks before the app sees a request (streams pass through untouched): the Host
    header (``allowed_hosts``; None allows any), the API key (``Authorization: Bearer``; not for
    ``OPEN_PATHS``), the body size (a ``Content-Length`` over ``max_body_bytes`` is refused without
    handing a byte of the body to the app; a chunked body is counted as it arrives) and the body's pace
    (a client that stops sending for ``body_timeout_s`` mid-body gets 408). Refusals close the
    connection; an oversized body is read and dropped first (``drain``) so that every client reads
    the 413."""

    def __init__(self, app: Any, *, metrics: Metrics, api_key: str | None, allowed_hosts: list[str] | None,
                 max_body_bytes: int, body_timeout_s: float):
        self.app, self.metrics = app, metrics
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    def too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than this server's limit of {self.max_body_bytes} "
                             "bytes.", code="request_too_large", headers={"Connection": "close"})

    @staticmethod
    async def drain(receive: Any) -> None:
        """Read and drop what a client is still sending of a refused body (up to ``DRAIN_BYTES``, while
        pieces keep coming within ``LINGER_S``). A client that writes its whole body before reading
        (httpx's and openai's async clients) would otherwise see a connection reset, not the 413:
        closing a socket with unread bytes sends a TCP reset, which destroys the answer in flight."""
        dropped = 0
        while dropped <= DRAIN_BYTES:
            try:
                message = await asyncio.wait_for(receive(), LINGER_S)
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))

    def refusal(self, scope: dict) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.allowed_hosts is not None and host_name(host) not in self.allowed_hosts:
            return APIError(400, f"Host {host!r} is not allowed by this server (--allowed-hosts).",
                            code="invalid_host", headers={"Connection": "close"})
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode("latin-1"), self.api_key):
                return APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self.too_large()
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self.refusal(scope)
        if err is not None:
            self.metrics.error(err.type)
            headers = Headers(scope=scope)
            if err.status == 413 and "100-continue" not in headers.get("expect", "").lower():
                await self.drain(receive)  # a client waiting for "100 Continue" has sent nothing yet
            await JSONBody(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
            return
        received, done = 0, False

        async def receive_body() -> dict:
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                raise APIError(408, f"The client sent no request data for {self.body_timeout_s:g} s.",
                               code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if message.get("more_body", False):
                        await self.drain(receive)
                    raise self.too_large()
                done = not message.get("more_body", False)
            return message

        await self.app(scope, receive_body, send)


def _common_loc(errors: list[dict[str, Any]]) -> list[str]:
    """Where a validation error is: the first error's field, narrowed to the common prefix of the
    errors on that field (a union reports one error per member, with the member's name appended)."""
    if not errors:
        return []
    locs = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    first = locs[0]
    same = [loc for loc in locs if loc[:1] == first[:1]]
    prefix = []
    for parts in zip(*same):
        if any(p != parts[0] for p in parts):
            break
        prefix.append(parts[0])
    return prefix


def _finite_numbers(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_numbers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_numbers(v) for v in obj]
    return obj


def json_text(obj: Any) -> str:
    """``obj`` as JSON text that is valid whatever it holds: non-finite floats become null and lone
    surrogates (which JSON's ``\\ud800`` escapes can carry in, and UTF-8 cannot encode) U+FFFD."""
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_finite_numbers(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # pairs stay pairs, lone halves become U+FFFD
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class JSONBody(JSONResponse):
    """The app's JSON responses, rendered by ``json_text`` (never a 500 from encoding the answer)."""

    def render(self, content: Any) -> bytes:
        return json_text(content).encode("utf-8")


def _sse(obj: Any) -> str:
    return f"data: {json_text(obj)}\n\n"


@dataclass(frozen=True)
class ServerState:
    """What the routes share: the scheduler and what the app derives from it once (on ``app.state``)."""

    scheduler: Scheduler
    model_name: str
    metrics: Metrics
    pieces: TokenPieces  # token id -> text, for logprobs
    created: int  # the model card's creation time
    fingerprint: str  # responses' system_fingerprint

    @classmethod
    def build(cls, sched: Scheduler, model_name: str) -> ServerState:
        """The state for serving ``sched`` as ``model_name``, created now."""
        return cls(sched, model_name, sched.metrics, TokenPieces(sched.tokenizer), int(time.time()),
                   f"hsdjax-{sched.method}-{sched.model.fingerprint[:8]}")


def server(request: Request) -> ServerState:
    """The ``ServerState`` of the app answering ``request``."""
    return request.app.state.server


def gauges(sched: Scheduler) -> dict[str, tuple[int, str]]:
    """The scheduler's gauges for ``/metrics``: name -> (value, help)."""
    snap = sched.snapshot()
    return {
        "queue_depth": (snap["waiting"], "Requests waiting for a row."),
        "active_rows": (snap["active"], "Rows generating (or being prefilled)."),
        "batch_slots": (snap["slots"], "Rows of the running batch (its batch bucket)."),
        "max_batch": (sched.max_batch, "Largest running batch (--max-batch)."),
        "max_queue": (sched.max_queue, "Waiting requests allowed beyond the batch (--max-queue)."),
        "ready": (int(sched.ready.is_set() and sched.failure is None), "1 when the server takes requests."),
    }


# ---------------------------------------------------------------------- errors
def error_response(state: ServerState, err: APIError) -> JSONResponse:
    """``err`` as the OpenAI error body, counted in the metrics."""
    state.metrics.error(err.type if err.status != 429 else "rate_limit_exceeded")
    return JSONBody(err.body(), status_code=err.status, headers=err.headers)


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    """An ``APIError`` raised anywhere in the app."""
    return error_response(server(request), exc)


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body FastAPI could not parse or validate: 400 naming the parameter (not FastAPI's 422)."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "invalid", "loc": (), "msg": "invalid request"}
    loc = _common_loc(errors)
    param = ".".join(loc) or None
    state = server(request)
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(state, APIError(400, f"We could not parse the JSON body of your request ({detail}).",
                                              code="invalid_json"))
    if not loc:  # the body as a whole: empty, not an object, or not sent as JSON
        ctype = request.headers.get("content-type", "")
        hint = "" if "json" in ctype else f" (Content-Type is {ctype or 'missing'}; use application/json)"
        what = "empty" if first["type"] == "missing" else "not a JSON object"
        return error_response(state, APIError(400, f"The request body is {what}; expected a JSON object{hint}.",
                                              code="invalid_json"))
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    where = param or "body"
    msg = f"Invalid value for '{where}': {first['msg']}"
    if first["type"] == "missing":
        msg = f"Missing required parameter: '{where}'."
    return error_response(state, APIError(400, msg, param=param, code=code))


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's HTTP errors (unknown endpoint, wrong method) as OpenAI error bodies."""
    codes = {404: "not_found", 405: "method_not_allowed"}
    msg = exc.detail if isinstance(exc.detail, str) else "error"
    if exc.status_code == 404:
        msg = f"Unknown endpoint: {request.method} {request.url.path}"
    return error_response(server(request), APIError(exc.status_code, msg, code=codes.get(exc.status_code),
                                                    headers=getattr(exc, "headers", None)))


async def crash(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception: logged, answered with a 500 that names only its type."""
    log.exception("unhandled error")
    return error_response(server(request), APIError(500, f"internal error: {type(exc).__name__}",
                                                    type="server_error"))


# ---------------------------------------------------------------------- plain endpoints
# The routes carry comments, not docstrings: FastAPI would publish a docstring in /openapi.json.
router = APIRouter()


# Readiness (503 while loading or after a failed start) and the scheduler's occupancy.
@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    state = server(request)
    sched = state.scheduler
    snap = sched.snapshot()
    if sched.failure:
        status, code = "error", 503
    elif not sched.ready.is_set():
        status, code = "loading", 503
    else:
        status, code = "ok", 200
    return JSONBody({"status": status, "model": state.model_name, "method": sched.method, **snap,
                         "max_batch": sched.max_batch, "max_queue": sched.max_queue,
                         "context": sched.context_limit,
                         "spec_max_active": sched.spec_max_active if sched.plain is not None else None},
                        status_code=code)


# The metrics in Prometheus' text format.
@router.get("/metrics")
async def prometheus(request: Request) -> PlainTextResponse:
    return PlainTextResponse(server(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def model_card(state: ServerState) -> dict[str, Any]:
    """The served model as an OpenAI model object."""
    sched = state.scheduler
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "hsdjax",
            "hsdjax": {"method": sched.method, "context": sched.context_limit, "max_batch": sched.max_batch}}


# The list of served models (one).
@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(server(request))]}


# One model's card, 404 for any other name.
@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    state = server(request)
    if model_id != state.model_name:
        raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return model_card(state)


# ---------------------------------------------------------------------- generation
def check_capacity(sched: Scheduler, body: ChatCompletionRequest | CompletionRequest) -> None:
    """``n`` within the batch (a request's choices generate side by side) and logprobs recorded."""
    if body.choices() > sched.max_batch:
        raise APIError(400, f"n={body.choices()} exceeds this server's largest batch ({sched.max_batch} rows; "
                            "--max-batch): its choices generate side by side", param="n", code="invalid_value")
    wanted = body.top_logprobs_wanted()
    if wanted is not None and (sched.top_logprobs is None or wanted > sched.top_logprobs):
        param = "top_logprobs" if isinstance(body, ChatCompletionRequest) and body.top_logprobs else "logprobs"
        what = "does not record logprobs" if sched.top_logprobs is None else \
            f"records at most {sched.top_logprobs} top logprobs per token"
        raise APIError(400, f"this server {what}", param=param, code="unsupported_parameter")


def check_ready(sched: Scheduler) -> None:
    """503 while the model loads or after it failed to start."""
    if sched.failure:
        raise APIError(503, "the model failed to start; see the server log", type="server_error")
    if not sched.ready.is_set():
        raise APIError(503, "the model is still loading", type="server_error", code="model_loading",
                       headers={"Retry-After": "5"})


async def encode(sched: Scheduler, body: ChatCompletionRequest | CompletionRequest, chat: bool) -> list[int]:
    """The prompt's token ids, templated and tokenized in a worker thread (a long prompt must not
    stall the event loop); a prompt that cannot be built is a 400."""
    where = "messages" if chat else "prompt"
    prompt = body.conversation() if chat else body.single_prompt()
    try:
        return await asyncio.to_thread(sched.generator.encode_prompt, prompt, chat=chat)
    except HsdjaxError as exc:
        raise APIError(400, str(exc), param=where, code="invalid_value") from None
    except Exception as exc:  # noqa: BLE001 - e.g. the chat template rejects the conversation
        raise APIError(400, f"could not build the prompt: {type(exc).__name__}: {exc}", param=where,
                       code="invalid_value") from None


def completion_budget(body: ChatCompletionRequest | CompletionRequest, prompt_len: int, limit: int,
                      chat: bool) -> int:
    """The completion's token budget: the one asked for, else the rest of the context (chat) or
    ``COMPLETIONS_DEFAULT_MAX_TOKENS``; a prompt and budget beyond the context ``limit`` are a 400."""
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                            f"is {prompt_len} tokens long, which leaves no room for a completion.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    budget = body.budget()
    if budget is None:
        return (limit - prompt_len) if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, limit - prompt_len)
    if prompt_len + budget > limit:
        param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{prompt_len + budget} tokens ({prompt_len} in the prompt, {budget} for the "
                            "completion). Please reduce the prompt or the completion length.",
                       param=param, code="context_length_exceeded")
    return budget


async def prepare(state: ServerState, body: ChatCompletionRequest | CompletionRequest, chat: bool) -> GenRequest:
    """The scheduler request for ``body``, or the ``APIError`` that refuses it."""
    sched = state.scheduler
    if body.model != state.model_name:
        raise APIError(404, f"The model '{body.model}' does not exist (this server serves '{state.model_name}')",
                       param="model", code="model_not_found")
    body.check_supported()
    check_capacity(sched, body)
    check_ready(sched)
    ids = await encode(sched, body, chat)
    budget = completion_budget(body, len(ids), sched.context_limit, chat)
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    return GenRequest(
        id=new_id("req"), prompt_ids=ids, max_new=budget,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p), top_k=body.top_k or 0, seed=seed,
        stops=body.stop_list(), loop=asyncio.get_running_loop(), queue=asyncio.Queue(), n=body.choices(),
        top_logprobs=body.top_logprobs_wanted())


def submit(sched: Scheduler, req: GenRequest) -> None:
    """Queue ``req``; a full queue is a 429."""
    try:
        sched.submit(req)
    except QueueFull:
        raise APIError(429, f"The server is busy: {sched.max_batch} requests are generating and "
                            f"{sched.max_queue} are waiting. Retry later.",
                       type="rate_limit_exceeded", code="rate_limit_exceeded", headers={"Retry-After": "1"}
                       ) from None


async def generate(state: ServerState, body: ChatCompletionRequest | CompletionRequest, request: Request,
                   chat: bool) -> Any:
    """Run ``body`` and answer it whole or as a stream of server-sent events."""
    req = await prepare(state, body, chat)
    submit(state.scheduler, req)
    builder = ResponseBuilder(chat, state.model_name, state.fingerprint, state.pieces, req.top_logprobs)
    if body.stream:
        return StreamingResponse(stream(state, req, builder, body.include_usage()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await complete(state, req, builder, request)


async def cancel_on_disconnect(req: GenRequest, request: Request) -> None:
    """Cancel ``req`` once the client is gone (the scheduler answers with a "cancelled" error event
    and frees the row)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)
    req.cancel()


async def complete(state: ServerState, req: GenRequest, builder: ResponseBuilder, request: Request) -> JSONResponse:
    """The whole response once ``req`` is done (or its error)."""
    watcher = asyncio.create_task(cancel_on_disconnect(req, request))
    try:
        while True:
            kind, payload = await req.queue.get()
            if kind == "done":
                use = usage(payload["prompt_tokens"], payload["completion_tokens"], payload["cached_tokens"])
                return JSONBody(builder.full(payload["choices"], use, payload["hsdjax"]))
            if kind == "error":
                return error_response(state, payload)
    finally:
        watcher.cancel()
        req.cancel()  # a no-op once finished; frees the row if this handler is cancelled


async def stream(state: ServerState, req: GenRequest, builder: ResponseBuilder,
                 include_usage: bool) -> AsyncIterator[str]:
    """``req``'s events as server-sent chunks, ending with ``data: [DONE]``."""
    ended: set[int] = set()  # choices whose final chunk was sent
    try:
        if builder.chat:
            for i in range(req.n):
                yield _sse(builder.chunk("", index=i, first=True, include_usage=include_usage))
        while True:
            kind, payload = await req.queue.get()
            if kind == "delta":
                yield _sse(builder.chunk(payload["text"], index=payload["index"], logprobs=payload["logprobs"],
                                         include_usage=include_usage))
            elif kind == "finish":
                ended.add(payload["index"])
                yield _sse(builder.chunk(None, payload["finish_reason"], index=payload["index"],
                                         include_usage=include_usage))
            elif kind == "done":
                last = [c for c in payload["choices"] if c["index"] not in ended]
                for c in last:  # the hsdjax statistics travel with the very last final chunk
                    extra = payload["hsdjax"] if c is last[-1] else None
                    yield _sse(builder.chunk(None, c["finish_reason"], index=c["index"],
                                             include_usage=include_usage, extra=extra))
                if include_usage:
                    use = usage(payload["prompt_tokens"], payload["completion_tokens"], payload["cached_tokens"])
                    yield _sse(builder.usage_chunk(use, payload["hsdjax"]))
                break
            else:  # an error after the stream started: an error event, then the end
                state.metrics.error(payload.type)
                yield _sse(payload.body())
                break
        yield "data: [DONE]\n\n"
    finally:
        req.cancel()  # client gone (the task is cancelled) or finished: frees the row either way


# The two generation endpoints (FastAPI validates the body against its model).
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    return await generate(server(request), body, request, chat=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    return await generate(server(request), body, request, chat=False)


# ---------------------------------------------------------------------- the app
def create_app(sched: Scheduler, model_name: str, *, api_key: str | None = None,
               allowed_hosts: list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app serving ``sched`` (see ``RequestGuard`` for the keyword arguments)."""
    state = ServerState.build(sched, model_name)
    app = FastAPI(title="hsdjax", description="OpenAI-compatible server with lossless speculative decoding",
                  docs_url=None, redoc_url=None, default_response_class=JSONBody)
    app.state.server, app.state.scheduler = state, sched
    app.add_middleware(RequestGuard, metrics=state.metrics, api_key=api_key, allowed_hosts=allowed_hosts,
                       max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)  # outermost: counts the guard's refusals too
    state.metrics.gauges = functools.partial(gauges, sched)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crash)
    app.include_router(router)
    return app
