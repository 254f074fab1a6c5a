"""The batching scheduler: one background thread owns the model and a running batch of decode rows.

See ``hsdjax.frontends.serve`` for the policy (batch buckets, rounds per call, when speculation is used).
HTTP handlers hand requests over with ``submit`` and read events from the request's asyncio queue:
``("delta", {index, text, logprobs})`` for a choice's new text (and, when asked for, its new tokens'
``(TokenLogprob, text offset)`` pairs), ``("finish", {index, finish_reason})`` when one of several
choices ends, then ``("done", info)`` or ``("error", APIError)`` (the HTTP side counts the error in
``hsdjax_errors_total`` when it answers with it, so the scheduler does not). Setting
``request.cancelled`` (client gone) makes the scheduler drop the request and free its rows before the
next decode call.

A request with ``n`` choices takes n rows: its prompt is prefilled once and forked
(``engine.fork_rows``); choice i draws with the key of row i of ``Generator.generate(seed=seed)``.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import dataclasses
import functools
import logging
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hsdjax.core import engine
from hsdjax.core.batch import RowPool, pooled_cache
from hsdjax.core.drafters.base import ARDrafter, Drafter
from hsdjax.core.sampling import SamplingParams, effective_temperature
from hsdjax.frontends.api import BATCH_BUCKETS, Generator, LoadedModel, token_logprobs
from hsdjax.frontends.serving.metrics import Metrics
from hsdjax.frontends.serving.prefix_cache import BLOCK, PrefixCache, block_bytes
from hsdjax.frontends.serving.protocol import APIError
from hsdjax.frontends.serving.text import TextStream

log = logging.getLogger("hsdjax.frontends.serve")

WHOLE_PIECE = 2048  # the largest prompt piece run while no row decodes (nothing to interleave with)
AUTO_CHUNK_MAX = 512  # the largest piece the automatic prefill budget runs while rows decode
AUTO_CHUNK_SHARE = 0.5  # its pieces cost at most this share of a decode call (margin: costs grow as it fills)


def _average(old: float | None, new: float, weight: float = 0.2) -> float:
    """An exponential moving average (the first value as is)."""
    return new if old is None else (1 - weight) * old + weight * new
MAX_TOP_LOGPROBS = 20  # most likely tokens recorded per generated token (OpenAI's top_logprobs limit)


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).
    XLA's compiler frees most of what it allocates while compiling, but the allocator keeps it: after
    warm-up the server held about 3 GB of free heap (RSS 5.8 GB against 2.8 GB trimmed)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class QueueFull(Exception):
    """Every row is busy and the waiting queue is full."""


@dataclasses.dataclass(eq=False)
class GenRequest:
    """One generation: what the HTTP side asked for, and the scheduler's bookkeeping."""

    id: str
    prompt_ids: list[int]
    max_new: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop | None
    queue: asyncio.Queue | None
    n: int = 1  # choices: rows generating from the same prompt
    top_logprobs: int | None = None  # record logprobs (with this many alternatives); None: none
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # owned by the scheduler thread
    choices: list[Choice] = dataclasses.field(default_factory=list)
    t_admitted: float | None = None
    t_first: float | None = None
    counted: int = 0  # completion tokens already added to the metrics
    cached: int = 0  # prompt tokens reused from the prefix cache

    def cancel(self) -> None:
        self.cancelled.set()

    def send(self, event: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


@dataclasses.dataclass(eq=False)
class Choice:
    """One of a request's ``n`` generations: a row of the running batch until it finishes."""

    req: GenRequest
    index: int
    stream: TextStream
    seen: int  # sequence positions already read
    logprobs: list[tuple[Any, int]] = dataclasses.field(default_factory=list)  # (TokenLogprob, text offset)
    finish_reason: str | None = None
    decoded: int = 0  # tokens after the first, target passes and drafter passes, set when it finishes
    passes: int = 0
    draft_passes: int = 0

    def result(self) -> dict[str, Any]:
        return {"index": self.index, "text": self.stream.text, "finish_reason": self.finish_reason,
                "logprobs": self.logprobs if self.req.top_logprobs is not None else None}


@dataclasses.dataclass(eq=False)
class Filling:
    """A request whose prompt is being prefilled, piece by piece, between decode calls."""

    req: GenRequest
    fill: engine.PromptFill
    filled: int  # prompt positions in the cache (reused ones included)


@dataclasses.dataclass
class _HostView:
    """The running state's arrays copied to the host on first use (once per ``_collect``)."""

    gen: engine.GenState

    @functools.cached_property
    def seq(self) -> np.ndarray:
        return np.asarray(self.gen.seq)

    @functools.cached_property
    def logprobs(self) -> Any:
        return jax.tree_util.tree_map(np.asarray, self.gen.logprobs)


def choice_keys(seed: int, n: int) -> jax.Array:
    """The RNG keys of choices 0..n-1: those of rows 0..n-1 of ``Generator.generate(..., seed=seed)``."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(n))


def speculation_off_variant(drafter: Any) -> Any | None:
    """A plain-decoding drafter whose loop state matches ``drafter``'s (same statistics shapes), so a
    running batch can switch between them from one decode call to the next; None when the drafter
    keeps its own per-row state (a draft model's cache would go stale)."""
    if drafter.name == "ar":
        return None
    cls = type(drafter)
    if cls.init_state is not Drafter.init_state or cls.observe is not Drafter.observe:
        return None  # the drafter keeps per-row state: it must see every round
    return dataclasses.replace(ARDrafter(), max_depth=drafter.max_depth)


class Scheduler:
    """Continuous batching over ``engine.decode`` (see ``hsdjax.frontends.serve`` for the policy)."""

    def __init__(self, model: LoadedModel, method: str = "pld", *, max_batch: int = 8, max_queue: int = 64,
                 max_context: int = 2048, rounds: int = 4, spec_max_active: int | None = None,
                 method_options: dict[str, Any] | None = None, metrics: Metrics | None = None,
                 warmup: bool = True, shrink_after: int = 2, top_logprobs: int | None = MAX_TOP_LOGPROBS,
                 prefill_chunk: int | None = None, prefix_cache_mb: float = 256.0):
        self.generator = Generator(model, method=method, **(method_options or {}))
        self.model, self.method = model, method
        self.cfg, self.params = model.cfg, model.params
        self.tokenizer = model.tokenizer
        self.drafter, self.dparams = self.generator.drafter, self.generator.dparams
        self.max_batch, self.max_queue, self.rounds = max_batch, max_queue, rounds
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.cache_size = engine.pick_bucket(min(max_context, self.cfg.max_context), engine.CACHE_BUCKETS,
                                             "--max-context")
        # prompt + completion tokens per row; a round may touch `spare` slots beyond the row's length
        self.context_limit = min(max_context, self.cfg.max_context, self.cache_size - self.drafter.spare - 1)
        self.spec_max_active = spec_max_active
        self.plain = speculation_off_variant(self.drafter) if spec_max_active is not None else None
        # the largest batch bucket that runs speculative rounds: with a plain variant, the one that holds
        # ``spec_max_active`` rows (a speculating batch in a larger bucket shrinks to it at once), so only
        # those buckets compile the speculative program (its tiers make it several times the plain one's
        # size in memory: SmolLM2's pld decode ~270 MB against ~70 MB)
        self.spec_bucket = max_batch
        if self.plain is not None and spec_max_active < max_batch:
            self.spec_bucket = engine.pick_bucket(spec_max_active, self.buckets, "a batch") if spec_max_active else 0
        self.metrics = metrics or Metrics()
        self.stop_ids = engine.stop_array(self.tokenizer.stop_ids)
        self._stop_set = frozenset(self.tokenizer.stop_ids)
        self.top_logprobs = top_logprobs  # K recorded per token by every row (None: logprobs unavailable)
        self._warmup_on, self._shrink_after = warmup, shrink_after
        if prefill_chunk is not None and prefill_chunk < 32:
            raise ValueError(f"the prefill chunk must be at least 32 tokens (got {prefill_chunk})")
        # prompt tokens run between two decode calls of a busy batch; None: as many as take about as
        # long as a decode call (measured as it runs, see ``_prefill_budget``)
        self.prefill_chunk = prefill_chunk
        self._decode_s: float | None = None  # moving averages: seconds of a decode call (with its collect)
        self._token_s: float | None = None  # and of a prompt token in a piece run while rows decode
        layers = len(self.drafter.prompt_layers)
        blocks = int(prefix_cache_mb * 2**20) // block_bytes(self.cfg, layers)
        self.prefix = PrefixCache(self.cfg, blocks, layers) if blocks > 0 else None
        self._filling: collections.deque[Filling] = collections.deque()
        # fills finished while rows decode, waiting for the next call to be inserted (with their first token)
        self._to_place: collections.deque[tuple[Filling, engine.DecodeState]] = collections.deque()
        self._cond = threading.Condition()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._occupied = 0  # rows in use, plus requests taken off the queue and being prefilled
        self._stopping = False
        # the running batch: each row's choice or None (its cache at the largest bucket where that pays)
        self.rows: RowPool[Choice] = RowPool(self.buckets, pooled=pooled_cache(self.cfg))
        self._small_for = 0
        self.ready = threading.Event()
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._main, name="hsdjax-scheduler", daemon=True)

    # ------------------------------------------------------------------ HTTP side
    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cond.notify_all()
        for r in waiting:
            r.send(("error", APIError(503, "the server is shutting down", type="server_error")))
        self._thread.join(timeout)

    def submit(self, req: GenRequest) -> None:
        """Queue a request; ``QueueFull`` when ``max_batch + max_queue`` requests are already in."""
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", type="server_error")
            if req.n > self.max_batch:  # it would never fit (the app answers 400 before this)
                raise APIError(400, f"n must be at most {self.max_batch} here", param="n", code="invalid_value")
            if len(self._waiting) + self._occupied >= self.max_batch + self.max_queue:
                raise QueueFull()
            self._waiting.append(req)
            self._cond.notify()

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            waiting = sum(1 for r in self._waiting if not r.cancelled.is_set())
            return {"active": self._occupied, "waiting": waiting, "slots": self.rows.size}

    # ------------------------------------------------------------------ the thread
    def _main(self) -> None:
        try:
            if self._warmup_on:
                self._warmup()
        except Exception:  # noqa: BLE001 - reported through /health
            self.failure = traceback.format_exc()
            log.error("warm-up failed:\n%s", self.failure)
            return
        finally:
            release_free_heap()
            self.ready.set()
        while True:
            with self._cond:
                idle = not self._stopping and not self._waiting and self._occupied == 0
            if idle:  # whatever the last requests grew is given back (outside the lock: submit goes on)
                release_free_heap()
            with self._cond:
                while not self._stopping and not self._waiting and self._occupied == 0:
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                self._admit()
                self._fill_some()
                if self.rows.any_busy():
                    self._step()
                self._resize()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                log.error("scheduler error:\n%s", traceback.format_exc())
                self._fail_all(exc)
        self._fail_all(None)

    def _warmup(self) -> None:
        """Compile everything a request can need, so that none waits for a compile and no running stream
        stalls behind one: every prompt piece size (whole prompts while idle, and the pieces a busy
        batch interleaves), the prefill's end and drafter start for every prompt bucket up to the cache,
        decode at every batch bucket (and its plain variant), the row insert/resize functions, and the
        prefix cache's copies. Programs come from JAX's persistent cache after the first start."""
        t0 = time.perf_counter()
        bos = self.tokenizer.encode("Hi", add_special_tokens=True) or [0]
        new = None
        for p_bucket in engine.PROMPT_BUCKETS:
            if p_bucket <= self.cache_size and p_bucket // 2 + 1 < self.context_limit:
                r = GenRequest(id="warm-up", prompt_ids=(bos * p_bucket)[: p_bucket // 2 + 1], max_new=0,
                               temperature=0.0, top_p=1.0, top_k=0, seed=0, stops=[], loop=None, queue=None)
                new = self._prefill_now(r)
        assert new is not None
        largest = min(max(WHOLE_PIECE, self.prefill_chunk or 0), self.cache_size)
        for size in engine.piece_programs(self.context_limit, largest):
            self._run_piece(self._empty_fill(), [0] * size, 0, size)
        if self.prefix is not None:  # its copies, for every padded number of blocks (small programs)
            blocks, fill = 1, self._empty_fill()
            while blocks * BLOCK <= self.cache_size:
                fill = self.prefix.load(fill, [0] * blocks)
                self.prefix.store(list(range(blocks * BLOCK)), fill, blocks * BLOCK)
                self.prefix.clear()  # the warm-up prompts are not worth keeping
                blocks *= 2
        for b in self.buckets:
            state = self._warm_state(new, b)
            for drafter in self._decoders_at(b):
                state = engine.decode(self.params, self.dparams, state, jnp.int32(1), cfg=self.cfg, drafter=drafter)
            state = engine.insert_rows(state, new, jnp.asarray([engine.DROP_ROW], jnp.int32))
            for other in self.buckets:  # growing or shrinking the running batch to any other bucket
                rows = jnp.asarray([0] + [-1] * (other - 1), jnp.int32)
                if other > b:
                    jax.block_until_ready(engine.grow_rows(state, other))
                elif other < b and self.rows.pooled:  # compact_rows consumes its state: a fresh one
                    jax.block_until_ready(engine.compact_rows(self._warm_state(new, b), rows))
                elif other < b:
                    jax.block_until_ready(engine.take_rows(state, rows))
            jax.block_until_ready(state)
        log.info("warm-up (compilation) took %.1fs", time.perf_counter() - t0)

    def _warm_state(self, new: engine.DecodeState, b: int) -> engine.DecodeState:
        """A running state of ``b`` rows shaped as ``RowPool.place`` makes it (row 0 from ``new``)."""
        state = engine.take_rows(new, jnp.asarray([0] + [-1] * (b - 1), jnp.int32))
        return engine.with_capacity(state, self.buckets[-1]) if self.rows.pooled else state

    def _empty_fill(self) -> engine.PromptFill:
        """A one-row prompt fill whose buffers are as long as the cache (so piece programs do not depend
        on the prompt's bucket)."""
        return engine.start_fill(self.cfg, 1, self.cache_size, self.cache_size, self.drafter.prompt_layers)

    def _run_piece(self, fill: engine.PromptFill, prompt_ids: list[int], start: int, size: int) -> engine.PromptFill:
        """Prompt positions ``start`` .. ``start + size`` (fewer at the prompt's end) into ``fill``: one
        program per size, a prompt's first piece included (``engine.piece_programs``)."""
        n = min(size, len(prompt_ids) - start)
        piece = np.zeros((1, size), np.int32)
        piece[0, :n] = prompt_ids[start: start + n]
        return engine.prefill_piece(self.params, fill, jnp.asarray(piece), jnp.asarray([n], jnp.int32),
                                    cfg=self.cfg, keep_layers=self.drafter.prompt_layers)

    def _start_filling(self, r: GenRequest) -> Filling:
        """A request's prompt fill, starting from the longest prefix the prefix cache holds."""
        fill = self._empty_fill()
        if self.prefix is not None:
            slots = self.prefix.match(r.prompt_ids)
            fill = self.prefix.load(fill, slots)
            r.cached = len(slots) * BLOCK
        return Filling(req=r, fill=fill, filled=r.cached)

    def _fill_step(self, f: Filling, limit: int) -> int:
        """Run the next piece of ``f``'s prompt (at most ``limit`` tokens, padded); returns its size."""
        size = engine.piece_sizes(f.filled, len(f.req.prompt_ids), limit)[0]
        f.fill = self._run_piece(f.fill, f.req.prompt_ids, f.filled, size)
        f.filled = min(f.filled + size, len(f.req.prompt_ids))
        return size

    def _prefill_done(self, f: Filling) -> engine.DecodeState:
        """The filled prompt's rows, ready to decode: draw the first token, fork into ``n`` rows (the smallest batch bucket holding them; rows beyond n are
        spare copies that ``_place`` drops; row i draws with ``choice_keys``' i), start the drafter."""
        r = f.req
        nb = engine.pick_bucket(r.n, self.buckets, "a batch")
        p_bucket = min(engine.pick_bucket(len(r.prompt_ids), engine.PROMPT_BUCKETS, "a prompt"), self.cache_size)
        prompt, _, _ = engine.pack_rows([r.prompt_ids], p_bucket)
        sampling = SamplingParams(temperature=jnp.asarray(np.array([effective_temperature(r.temperature)], np.float32)),
                                  top_k=jnp.asarray(np.array([r.top_k], np.int32)),
                                  top_p=jnp.asarray(np.array([r.top_p], np.float32)))
        keys = choice_keys(r.seed, nb)
        gen, fwd = engine.prefill_done(self.params, f.fill, jnp.asarray(prompt), jnp.asarray([r.max_new], jnp.int32),
                                       sampling, keys[:1], self.stop_ids, cfg=self.cfg, spare=self.drafter.spare,
                                       top_logprobs=self.top_logprobs)
        fwd = fwd.first_positions(p_bucket)  # the drafter reads the prompt bucket
        if nb > 1:
            gen, fwd = engine.fork_rows(self.params, gen, fwd, keys, cfg=self.cfg, spare=self.drafter.spare)
        return engine.start_decoding(self.dparams, gen, fwd, drafter=self.drafter)

    def _prefill_now(self, r: GenRequest) -> engine.DecodeState:
        """``r``'s whole prefill at once (warm-up)."""
        f = self._start_filling(r)
        while f.filled < len(r.prompt_ids):
            self._fill_step(f, WHOLE_PIECE)
        new = self._prefill_done(f)
        self._store_prefix(f)
        return new

    def _take_waiting(self) -> list[GenRequest]:
        """Waiting requests (FIFO) whose rows fit in the free rows; clients gone while queued are dropped."""
        batch: list[GenRequest] = []
        with self._cond:
            gone = [r for r in self._waiting if r.cancelled.is_set()]
            if gone:  # clients that left while queued stop holding queue places
                self._waiting = collections.deque(r for r in self._waiting if not r.cancelled.is_set())
                for r in gone:
                    self._finish(r, "cancelled")
            room = self.max_batch - self._occupied
            while self._waiting and self._waiting[0].n <= room:
                r = self._waiting.popleft()
                batch.append(r)
                room -= r.n
            self._occupied += sum(r.n for r in batch)
        return batch

    def _admit(self) -> None:
        """Start the prefill of waiting requests that fit in the free rows (a reused prefix is loaded
        at once; the rest of the prompt runs in pieces, see ``_fill_some``)."""
        for r in self._take_waiting():
            try:
                self._filling.append(self._start_filling(r))
            except Exception:  # noqa: BLE001 - only this request fails
                self._prefill_failed(r)

    def _fill_some(self) -> None:
        """Advance the prompt fills, oldest first: while rows decode, at most ``prefill_chunk`` prompt
        tokens per call (so a long prompt never stalls the running streams for more than one piece);
        with nothing decoding, whole prompts. A finished fill's rows join the running batch and its
        first token is sent. While rows decode, finishing a fill (its first token, the drafter's start,
        inserting its rows) is a call's whole share: it runs at the next call after the last piece, and
        one per call, so a stream waits for one of them between two decode calls, never both. The end
        itself is two shares: the first token and the drafter's start, then, at the next call, the
        insert and the first token sent (the insert makes the next decode call a row larger, so with the
        end in the same gap it was a running stream's longest wait)."""
        budget = self._prefill_budget() if self.rows.any_busy() else None
        placed: list[Filling] = []
        if self._to_place:  # a fill that ended at the last call: its insert is this call's share
            f, new = self._to_place.popleft()
            if f.req.cancelled.is_set():
                with self._cond:
                    self._occupied -= f.req.n
                self._finish(f.req, "cancelled")
            else:
                self._place(f.req, new)
                placed.append(f)
            budget = 0
        while self._filling and (budget is None or budget > 0):
            f = self._filling[0]
            r = f.req
            if r.cancelled.is_set():
                self._filling.popleft()
                with self._cond:
                    self._occupied -= r.n
                self._finish(r, "cancelled")
                continue
            try:
                if f.filled < len(r.prompt_ids):
                    t0 = time.perf_counter()
                    spent = self._fill_step(f, WHOLE_PIECE if budget is None else budget)
                    if budget is not None:
                        budget -= spent
                        if self.prefill_chunk is None:  # time the piece (the next decode call waits for it anyway)
                            jax.block_until_ready(f.fill.cache.length)
                            self._token_s = _average(self._token_s, (time.perf_counter() - t0) / spent)
                    if f.filled < len(r.prompt_ids):
                        continue
                    if budget is not None:
                        break  # rows decode: the finish waits for the next call
                self._filling.popleft()
                new = self._prefill_done(f)
            except Exception:  # noqa: BLE001 - only this request fails
                if self._filling and self._filling[0] is f:
                    self._filling.popleft()
                self._prefill_failed(r)
                continue
            if budget is not None:  # rows decode: the insert waits for the next call
                self._to_place.append((f, new))
                break
            self._place(r, new)
            placed.append(f)
            if budget is not None:
                break  # one finish per call while rows decode
        if placed:
            self._small_for = 0
            self._collect()  # the first token comes from the prefill
        for f in placed:  # after the first tokens went out; before any decode call (it may reuse the buffers)
            self._store_prefix(f)

    def _store_prefix(self, f: Filling) -> None:
        """Keep the prompt's whole blocks for later prompts that start the same way."""
        if self.prefix is not None:
            self.prefix.store(f.req.prompt_ids, f.fill, f.filled)

    def _prefill_budget(self) -> int:
        """Prompt tokens to prefill before the next decode call while rows decode: ``prefill_chunk``,
        or (auto) the largest power of two whose measured cost is at most ``AUTO_CHUNK_SHARE`` of a
        decode call, so a running stream waits less than twice its usual time between two chunks
        (32 .. ``AUTO_CHUNK_MAX``)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        if self._decode_s is None or self._token_s is None:
            return 32
        size = 32
        while size * 2 <= AUTO_CHUNK_MAX and size * 2 * self._token_s <= AUTO_CHUNK_SHARE * self._decode_s:
            size *= 2
        return size

    def _prefill_failed(self, r: GenRequest) -> None:
        log.error("prefill failed:\n%s", traceback.format_exc())
        with self._cond:
            self._occupied -= r.n
        self.metrics.request_done("error", len(r.prompt_ids), 0, 0)
        r.send(("error", APIError(500, "the prefill failed; see the server log", type="server_error")))

    def _place(self, r: GenRequest, new: engine.DecodeState) -> None:
        """Write ``r``'s prefilled rows into free rows of the running batch (creating it, or growing
        its batch bucket, when there is no room; spare copies beyond ``r.n`` are dropped), each with its
        ``Choice``."""
        r.choices = [Choice(req=r, index=i, stream=TextStream(self.tokenizer, self.tokenizer.stop_ids, r.stops),
                            seen=len(r.prompt_ids)) for i in range(r.n)]
        self.rows.place(new, r.choices)
        r.t_admitted = time.perf_counter()

    def _step(self) -> None:
        drafter = self.drafter if self._speculates() else self.plain
        t0 = time.perf_counter()
        self.rows.state = engine.decode(self.params, self.dparams, self.rows.state, jnp.int32(self.rounds), cfg=self.cfg,
                                    drafter=drafter)
        self.metrics.decode_call(drafter.name)
        self._collect()  # reads the new tokens: waits for the call
        self._decode_s = _average(self._decode_s, time.perf_counter() - t0)

    def _decoders_at(self, bucket: int) -> list[Any]:
        """The drafters a decode call can run with at batch bucket ``bucket`` (what warm-up compiles)."""
        out = [self.drafter] if bucket <= self.spec_bucket else []
        if self.plain is not None and bucket > self.spec_max_active:
            out.append(self.plain)
        return out

    def _speculates(self, busy: int | None = None, bucket: int | None = None) -> bool:
        """Whether a decode call with ``busy`` busy rows in batch bucket ``bucket`` (default: the running
        batch's) runs speculative rounds: always without a plain variant; otherwise while at most
        ``spec_max_active`` rows are busy and the bucket compiled the speculative program."""
        if self.plain is None:
            return True
        busy = len(self.rows.busy()) if busy is None else busy
        bucket = self.rows.size if bucket is None else bucket
        return busy <= self.spec_max_active and bucket <= self.spec_bucket

    def _collect(self) -> None:
        """Hand each row's new tokens to its choice; free rows that finished or were cancelled."""
        gen = self.rows.state.gen
        seq_len = np.asarray(gen.seq_len)
        done = np.asarray(gen.done)
        host = _HostView(gen)
        stop_rows = []
        now = time.perf_counter()
        for i, c in enumerate(self.rows.slots):
            if c is None:
                continue
            r = c.req
            if r.cancelled.is_set():
                stop_rows.append(i)
                self._release(i, "cancelled")
                continue
            text, scored = self._advance(c, i, int(seq_len[i]), bool(done[i]), host)
            self._count_tokens(r, now)
            if text or scored:
                r.send(("delta", {"index": c.index, "text": text,
                                  "logprobs": scored if r.top_logprobs is not None else None}))
            if c.stream.finished:
                if not done[i]:
                    stop_rows.append(i)
                self._release(i, c.stream.finish_reason)
        if stop_rows:  # rows freed early (stop string, client gone) stop computing
            mask = np.zeros(done.shape, bool)
            mask[stop_rows] = True
            self.rows.state = self.rows.state.replace(gen=gen.replace(done=jax.device_put(done | mask)))  # no program

    def _advance(self, c: Choice, row: int, end: int, row_done: bool, host: _HostView
                 ) -> tuple[str, list[tuple[Any, int]]]:
        """Push the row's new tokens through the choice's text stream: the text that may be sent and,
        when asked for, the consumed tokens' (logprobs, text offset) (stop tokens have none)."""
        delta, scored = [], []
        if end > c.seen:
            entries = None
            if c.req.top_logprobs is not None:
                entries = token_logprobs(host.seq, host.logprobs, row, c.seen, end)
            for j, t in enumerate(host.seq[row, c.seen: end].tolist()):
                offset = len(c.stream.text)
                delta.append(c.stream.push(t))
                if entries is not None and t not in self._stop_set:
                    scored.append((entries[j], offset))
                if c.stream.finished:
                    break
            c.seen = end
        if not c.stream.finished and row_done:
            delta.append(c.stream.finish("length"))
        c.logprobs += scored
        return "".join(delta), scored

    def _count_tokens(self, r: GenRequest, now: float) -> None:
        """Add the request's newly consumed completion tokens to the metrics (and note its first token)."""
        tokens = sum(c.stream.tokens for c in r.choices)
        if tokens > r.counted:
            self.metrics.tokens(tokens - r.counted)
            r.counted = tokens
            if r.t_first is None:
                r.t_first = now
                self.metrics.first_token(now - r.t_arrival)

    def _release(self, i: int, reason: str) -> None:
        """Free row ``i``; its choice ends with ``reason``, the request once its last choice has."""
        c = self.rows.release(i)
        stats = jax.tree_util.tree_map(lambda a: a[i], self._stats_np())
        c.decoded = int(np.asarray(self.rows.state.gen.seq_len)[i]) - len(c.req.prompt_ids) - 1
        c.passes, c.draft_passes = int(stats.target_passes), int(stats.draft_passes)
        c.finish_reason = reason
        with self._cond:
            self._occupied -= 1
        r = c.req
        if any(x.finish_reason is None for x in r.choices):
            if reason != "cancelled":
                r.send(("finish", {"index": c.index, "finish_reason": reason}))
            return
        self._finish(r, "cancelled" if r.cancelled.is_set() else r.choices[0].finish_reason)

    def _stats_np(self) -> Any:
        return jax.tree_util.tree_map(np.asarray, self.rows.state.stats)

    def _finish(self, r: GenRequest, reason: str) -> None:
        """The request is over: count it and send ``done`` (its choices, usage summed over them)."""
        decoded, passes = sum(c.decoded for c in r.choices), sum(c.passes for c in r.choices)
        self.metrics.request_done(reason, len(r.prompt_ids), decoded, passes)
        if reason == "cancelled":
            r.send(("error", APIError(499, "the client closed the request", type="cancelled")))
            return
        now = time.perf_counter()
        info = {
            "choices": [c.result() for c in r.choices],
            "prompt_tokens": len(r.prompt_ids),
            "cached_tokens": r.cached,
            "completion_tokens": sum(c.stream.tokens for c in r.choices),
            "hsdjax": {
                "method": self.method,
                "mean_accepted_length": round(decoded / passes, 4) if passes else None,
                "target_passes": passes,
                "draft_passes": sum(c.draft_passes for c in r.choices),
                "queue_s": round((r.t_admitted or now) - r.t_arrival, 4),
                "ttft_s": round((r.t_first or now) - r.t_arrival, 4),
                "total_s": round(now - r.t_arrival, 4),
            },
        }
        r.send(("done", info))

    def _resize(self) -> None:
        """Drop the state when no row is busy; shrink to a smaller batch bucket once the busy rows
        have fitted in it for ``shrink_after`` consecutive steps and nothing waits."""
        busy = len(self.rows.busy())
        if not busy:
            self.rows.clear()
            self._small_for = 0
            return
        target = self.rows.size_for(busy)
        with self._cond:
            waiting = bool(self._waiting) or bool(self._to_place)
        if target >= self.rows.size or waiting:
            self._small_for = 0
            return
        self._small_for += 1
        # rows that would speculate in a smaller bucket go there at once (larger ones run plain rounds)
        to_speculate = self.plain is not None and self._speculates(busy, target)
        if self._small_for < self._shrink_after and not to_speculate:
            return
        self.rows.shrink(target)
        self._small_for = 0

    def _fail_all(self, exc: Exception | None) -> None:
        err = (APIError(500, "generation failed; see the server log", type="server_error") if exc is not None
               else APIError(503, "the server is shutting down", type="server_error"))
        running = ([c.req for c in self.rows.slots if c is not None] + [f.req for f in self._filling]
                   + [f.req for f, _ in self._to_place])
        for r in dict.fromkeys(running):
            self.metrics.request_done("error", len(r.prompt_ids), 0, 0)
            r.send(("error", err))
        with self._cond:
            self._occupied = 0
        self.rows.clear()
        self._filling = collections.deque()
        self._to_place = collections.deque()
