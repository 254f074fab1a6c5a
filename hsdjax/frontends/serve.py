"""``hsdjax serve``: an OpenAI-compatible HTTP server with continuous batching and speculative decoding.

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (raw text, no chat template),
``POST /v1/chat/completions`` (the model's chat template), both non-streaming and streaming (SSE in
OpenAI's chunk format, ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a final
usage chunk), ``GET``/``HEAD /health`` (200 once compiled, 503 while loading) and ``GET /metrics``
(Prometheus text). Responses carry an extra top-level ``hsdjax`` object with the speculative
statistics of the request (method, mean accepted length, target passes, queue/first-token/total
seconds); OpenAI clients ignore it. Errors use the OpenAI error body with a 4xx/5xx status.

- **n** (1..``--max-batch``): a request's choices are rows of the running batch generating from one
  prefill side by side (``engine.fork_rows``); choice i draws with the RNG key of row i of
  ``Generator.generate(seed=seed)`` (choice 0: the key a single request gets), so greedy choices are
  identical and seeded sampled ones distinct and reproducible. Streamed chunks carry their choice's
  ``index``; ``usage.completion_tokens`` sums the choices. A first n > 1 request of a batch bucket
  compiles the fork for it (seconds).
- **Logprobs** (chat ``logprobs``/``top_logprobs`` 0..20, completions ``logprobs`` 0..5): every row
  records, inside the jitted loop, each emitted token's log-probability and the 20 most likely tokens
  (``prefill(top_logprobs=20)``, ``engine.TokenLogprobs``), taken from the target pass that verified the
  token, so speculation does not change them (ar, pld and hsd agree within float error, ~1e-5 in
  float32) and no second forward pass runs. The distribution is the one the token was drawn from: the
  log-softmax of the temperature / top-k / top-p adjusted logits for sampled requests (tokens outside
  top-k / top-p: -inf, reported as -9999.0), of the plain logits for greedy ones (temperature 0). For
  sampled chains verified by speculative sampling (``sps``) a token drawn from the residual after a
  rejection is still reported under the adjusted target distribution. Recording costs ~1-2% of a
  decode step on CPU (SmolLM2-135M) and 164 bytes per cache slot per row; stop tokens get no entry.

Scheduling policy (``hsdjax.frontends.serving.scheduler``):

- One background thread owns the model and the running ``DecodeState``; HTTP handlers only tokenize,
  validate and wait on per-request asyncio queues. Nothing else touches JAX.
- **Batch**: at most ``--max-batch`` B rows (default 8) generate at once. The running state has one
  fixed cache size (the cache bucket holding ``--max-context``, default 2048) so rows can move between
  states; its batch size is the smallest bucket (1, 2, 4, 8, ... B) holding the busy rows. It grows
  (``engine.grow_rows``) when requests arrive and shrinks after the busy rows have fitted a smaller
  bucket for two consecutive steps with nothing waiting, so a lone request runs at batch 1. With the
  CPU kernels' stacked cache its KV cache holds B rows from the first request on (a row pool:
  ``RowPool(pooled=True)``), so growing copies no cache and shrinking moves only the rows that move.
- **Admission** (continuous batching): waiting requests (FIFO) take free rows (a request of n choices
  waits until n rows are free). Each newcomer's prompt is filled into a batch-1 ``engine.PromptFill``:
  first the longest prefix the prefix cache holds (below), then the rest in pieces
  (``engine.prefill_piece``, powers of two from 32 tokens, so a few compiled programs serve every
  prompt). When it is complete, ``engine.prefill_done`` draws its first token (+ ``engine.fork_rows``
  into n rows) + ``start_decoding``, the batch bucket grows if needed and ``engine.insert_rows`` writes
  it into free rows of the running state; its first token is sent at once.
- **Chunked prefill**: while rows are decoding, at most ``--prefill-chunk`` prompt tokens run between
  two decode calls, so a long prompt delays the running streams by one piece per call rather than by
  its whole prefill. ``auto`` (default): the largest power of two (32..512) whose measured cost (a
  moving average per prompt token) is at most 3/4 of a decode call (also measured), so a running
  stream waits at most about twice its usual time between two chunks, on any hardware. With nothing
  decoding, a prompt runs in pieces as large as it is (up to 2,048 tokens).
- **Prefix reuse** (``hsdjax.frontends.serving.prefix_cache``): a prompt's whole 32-token blocks are kept in a
  device pool of ``--prefix-cache-mb`` (default 256; 0: off) after its prefill, keyed by a chained hash
  of the tokens up to each block's end, with least-recently-used eviction. A later prompt that starts
  with stored blocks (the next turn of a chat, a shared system prompt) copies their keys/values and the
  drafter's target states instead of running them; ``usage.prompt_tokens_details.cached_tokens`` says
  how many. Output is unchanged (greedy answers equal those without reuse).
- **Decode**: ``engine.decode`` advances every row by up to K rounds per call (``--rounds``, default
  4); rows finish independently (stop token, budget). Between calls the scheduler reads each busy
  row's new tokens, turns them into text (whole UTF-8 characters; text that could start a stop string
  is held back; a stop string ends the request and is not sent), pushes the delta to the request's
  queue, and frees rows that finished, hit a stop string, or whose client disconnected (such rows are
  also marked done in the state so they stop computing).
- **Queue**: at most ``--max-queue`` requests wait beyond the B rows; more get 429 with
  ``Retry-After: 1`` at once (never a hang).
- **Speculation**: a decode call uses the server's method (``--method``, default ``pld``) while at most
  ``--spec-max-active`` N rows are busy, and plain decoding (``ar``, the same state and statistics
  shapes) above N, because verifying a draft tree for every row of a batch costs more than acceptance
  gains once the batch itself fills the hardware. ``auto`` (default): N = 1 on CPU, no limit on GPU/TPU
  (not measured there yet); ``none``: always speculate. Only stateless drafters (``pld``) can switch;
  ``sps`` always speculates. Measured with ``benchmarks/serve_load.py`` (2 CPU cores, SmolLM2-135M,
  --max-batch 8, --max-context 1024, 64-token greedy chat answers, completion tokens/s at 1 / 4 / 16
  clients): ``ar`` 29.9 / 49.1 / 63.6; ``pld`` always speculating 15.4 / 19.9 / 22.0; ``pld`` with
  ``auto`` 21.9 / 47.2 / 59.2. So adapting is 2.7x the throughput of always speculating at 16 clients;
  on this CPU a ``pld`` pass over a 13-node tree costs about 3x a plain step, more than its 1.2-1.4
  tokens per pass on these prompts return, so even a lone request is faster with ``ar`` here.
- **Determinism**: greedy requests (temperature 0) return exactly what ``hsdjax generate`` returns for
  the same prompt (chat template for chat completions, raw text for completions), whatever else is in
  the batch (every choice of an n > 1 request too). A request's RNG key is that of row 0 of
  ``Generator.generate(seed=seed)`` (choice i: row i) and each step's key depends only on the row's own
  position, so a seeded sampled request is reproducible under the same conditions; its draws are always exact samples of the target distribution, but whether a round
  speculated (which depends on the load, see above) changes which individual tokens are drawn.

Hardening (``add_arguments``; details in docs/serving.md):

- ``--api-key`` (or ``HSDJAX_API_KEY``): every endpoint but ``/health`` wants ``Authorization: Bearer
  KEY`` (401 otherwise; ``/metrics`` included). Listening beyond loopback without a key logs a warning.
- ``--allowed-hosts``: Host headers accepted (400 otherwise, against DNS rebinding). Default: localhost,
  127.0.0.1, ::1 and ``--host``; any Host when ``--host`` is a wildcard address (0.0.0.0, ::).
- ``--max-body-bytes`` (1 MiB): larger bodies get 413 before they are read (Content-Length) or as soon
  as the count passes the limit (chunked). ``--body-timeout-s`` (30 s): a client that stops sending
  mid-body gets 408. uvicorn has no timeout for a client that never finishes its headers: put a
  reverse proxy in front of a server exposed to untrusted networks.
- Every numeric parameter is range-checked (400 naming it) before generation starts; prompts are
  templated and tokenized in a worker thread, so a long one does not stall other requests.
- Shutdown (SIGTERM, SIGINT): stop accepting connections, let running requests finish for
  ``--shutdown-grace-s`` (10 s), then end the rest with an error (streams: an error event, then
  ``data: [DONE]``).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
import time
from typing import Any

from hsdjax.errors import HsdjaxError
from hsdjax.frontends.argtypes import float_in, int_at_least
from hsdjax.frontends.serving import BODY_TIMEOUT_S, MAX_BODY_BYTES

log = logging.getLogger("hsdjax.frontends.serve")
SHUTDOWN_GRACE_S = 10.0
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The serve options about access, limits and shutdown (the CLI's ``serve`` parser adds them)."""
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $HSDJAX_API_KEY; none when unset)")
    s.add_argument("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
                   help="Host header names accepted, '*' for any (default: localhost, 127.0.0.1, ::1 and "
                        "--host; any when --host is 0.0.0.0 or ::)")
    s.add_argument("--max-body-bytes", type=int_at_least(1024, 1 << 40), default=MAX_BODY_BYTES,
                   help=f"largest request body; larger ones get 413 (default {MAX_BODY_BYTES})")
    s.add_argument("--body-timeout-s", type=float_in(0.1, float('inf')), default=BODY_TIMEOUT_S,
                   help=f"408 for a client that stops sending its body this long (default {BODY_TIMEOUT_S:g})")
    s.add_argument("--shutdown-grace-s", type=float_in(0.0, float('inf')), default=SHUTDOWN_GRACE_S,
                   help="on SIGTERM/SIGINT, let running requests finish this long, then end them with an "
                        f"error (default {SHUTDOWN_GRACE_S:g})")


def allowed_hosts_setting(host: str, value: str | None) -> list[str] | None:
    """``--allowed-hosts``: the Host header names accepted, None for any."""
    if value is None:
        return None if host in ("0.0.0.0", "::", "") else [*LOOPBACK_NAMES, host]
    names = [h.strip() for h in value.split(",") if h.strip()]
    return None if "*" in names else names


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def spec_max_active_setting(value: int | str | None) -> int | None:
    """``--spec-max-active``: a number of busy rows, ``none`` (always speculate) or ``auto`` (1 on CPU,
    where verifying a tree for every row of a batch costs more than it gains; no limit on GPU/TPU)."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        import jax

        return 1 if jax.default_backend() == "cpu" else None
    if text in ("none", "off", "never"):
        return None
    try:
        n = int(text)
    except ValueError:
        raise HsdjaxError(f"--spec-max-active must be a whole number, auto or none (got {value!r})") from None
    if n < 0:
        raise HsdjaxError(f"--spec-max-active must be at least 0 (got {n})")
    return n


def build(model_name: str | None = None, method: str = "pld", *, dtype: str | None = None,
          max_batch: int = 8, max_queue: int = 64, max_context: int = 2048, rounds: int = 4,
          spec_max_active: int | str | None = "auto", method_options: dict[str, Any] | None = None,
          warmup: bool = True, mesh: Any = None, prefill_chunk: int | None = None, prefix_cache_mb: float = 256.0,
          cpu_matmul: str | None = None, cache_dtype: str | None = None, **app_options: Any) -> tuple[Any, Any]:
    """Load the model (sharded over ``mesh`` when given), create the scheduler (not started) and the
    FastAPI app (``app_options``: ``create_app``'s keyword arguments)."""
    from hsdjax.frontends.api import load_model
    from hsdjax.frontends.serving.app import create_app
    from hsdjax.frontends.serving.metrics import Metrics
    from hsdjax.frontends.serving.scheduler import Scheduler

    if max_batch < 1 or max_batch > 64:
        raise HsdjaxError(f"--max-batch must be between 1 and 64 (got {max_batch})")
    if max_context < 64:
        raise HsdjaxError(f"--max-context must be at least 64 (got {max_context})")
    spec_max_active = spec_max_active_setting(spec_max_active)
    model = load_model(model_name, dtype=dtype, mesh=mesh, cpu_matmul=cpu_matmul, cache_dtype=cache_dtype)
    sched = Scheduler(model, method, max_batch=max_batch, max_queue=max_queue, max_context=max_context,
                      rounds=rounds, spec_max_active=spec_max_active, method_options=method_options,
                      metrics=Metrics(), warmup=warmup, prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb)
    return create_app(sched, model.name, **app_options), sched


def make_server(app: Any, sched: Any, *, host: str, port: int, shutdown_grace_s: float = SHUTDOWN_GRACE_S,
                **config: Any) -> Any:
    """A uvicorn server for ``app`` that drains on shutdown: it stops accepting connections, lets
    running requests finish for ``shutdown_grace_s``, then closes the scheduler, which ends what still
    runs with an error (a stream: an error event, then ``data: [DONE]``). ``config``: uvicorn.Config's."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            async def end_the_rest() -> None:
                await asyncio.sleep(shutdown_grace_s)
                log.warning("ending the requests still running after %gs of shutdown", shutdown_grace_s)
                await asyncio.to_thread(sched.close, 5)

            deadline = asyncio.create_task(end_the_rest())
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

    return DrainingServer(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_grace_s + 5,
                                         **config))


def run(args: argparse.Namespace) -> int:
    """The ``serve`` command: load, start the scheduler (it compiles in the background; /health says
    when it is ready), serve until interrupted."""
    import jax

    from hsdjax.core.methods import options_from_args
    from hsdjax.runtime.sharding import mesh_from_args

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    api_key = args.api_key or os.environ.get("HSDJAX_API_KEY") or None
    if api_key is None and not is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who reaches it can use it "
                    "(set --api-key or HSDJAX_API_KEY)", args.host)
    t0 = time.perf_counter()
    options = options_from_args(args)
    mesh = mesh_from_args(args)
    if jax.process_count() > 1:  # every process would have to make the scheduler's calls in lockstep
        raise HsdjaxError("serve runs on one host; --distributed / HSDJAX_COORDINATOR are for generate and bench")
    app, sched = build(args.model, args.method, dtype=args.dtype, cpu_matmul=getattr(args, "cpu_matmul", None),
                       cache_dtype=getattr(args, "cache_dtype", None), max_batch=args.max_batch,
                       max_queue=args.max_queue, max_context=args.max_context, rounds=args.rounds,
                       spec_max_active=args.spec_max_active, method_options=options, warmup=not args.no_warmup,
                       mesh=mesh, prefill_chunk=args.prefill_chunk, prefix_cache_mb=args.prefix_cache_mb, api_key=api_key, max_body_bytes=args.max_body_bytes,
                       allowed_hosts=allowed_hosts_setting(args.host, args.allowed_hosts),
                       body_timeout_s=args.body_timeout_s)
    log.info("loaded %s in %.1fs; method %s, batch <= %d, queue <= %d, context %d tokens; compiling",
             app.title and sched.model.name, time.perf_counter() - t0, sched.method, sched.max_batch,
             sched.max_queue, sched.context_limit)
    sched.start()
    server = make_server(app, sched, host=args.host, port=args.port, shutdown_grace_s=args.shutdown_grace_s,
                         log_level=args.log_level, access_log=args.access_log)
    try:
        server.run()
    finally:
        sched.close(timeout=5)
    return 0 if server.started else 2
