"""The batching scheduler: one background thread owns the model and a running batch of decode rows.

See ``hsdjax.serve`` for the policy (batch buckets, rounds per call, when speculation is used).
HTTP handlers hand requests over with ``submit`` and read events from the request's asyncio queue:
``("delta", text)``, then ``("done", info)`` or ``("error", APIError)`` (the HTTP side counts the error
in ``hsdjax_errors_total`` when it answers with it, so the scheduler does not). Setting
``request.cancelled`` (client gone) makes the scheduler drop the request and free its row before the
next decode call.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hsdjax import engine
from hsdjax.api import BATCH_BUCKETS, Generator, LoadedModel
from hsdjax.drafters.base import ARDrafter, Drafter
from hsdjax.sampling import SamplingParams
from hsdjax.serving.metrics import Metrics
from hsdjax.serving.protocol import APIError
from hsdjax.serving.text import TextStream

log = logging.getLogger("hsdjax.serve")

WARM_PROMPT_BUCKETS = (32, 64, 128)  # prompt buckets compiled at start-up (chat prompts are mostly here)


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
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # owned by the scheduler thread
    seen: int = 0  # sequence positions already read
    stream: TextStream | None = None
    t_admitted: float | None = None
    t_first: float | None = None
    counted: int = 0  # completion tokens already added to the metrics

    def cancel(self) -> None:
        self.cancelled.set()

    def send(self, event: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


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
    """Continuous batching over ``engine.decode`` (see ``hsdjax.serve`` for the policy)."""

    def __init__(self, model: LoadedModel, method: str = "pld", *, max_batch: int = 8, max_queue: int = 64,
                 max_context: int = 2048, rounds: int = 4, spec_max_active: int | None = None,
                 method_options: dict[str, Any] | None = None, metrics: Metrics | None = None,
                 warmup: bool = True, shrink_after: int = 2):
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
        self.metrics = metrics or Metrics()
        self.stop_ids = engine.stop_array(self.tokenizer.stop_ids)
        self._warmup_on, self._shrink_after = warmup, shrink_after
        self._cond = threading.Condition()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._occupied = 0  # rows in use, plus requests taken off the queue and being prefilled
        self._stopping = False
        self._state: engine.DecodeState | None = None
        self._slots: list[GenRequest | None] = []
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
            if len(self._waiting) + self._occupied >= self.max_batch + self.max_queue:
                raise QueueFull()
            self._waiting.append(req)
            self._cond.notify()

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            waiting = sum(1 for r in self._waiting if not r.cancelled.is_set())
            return {"active": self._occupied, "waiting": waiting, "slots": len(self._slots)}

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
            self.ready.set()
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and self._occupied == 0:
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                self._admit()
                if self._slots and any(r is not None for r in self._slots):
                    self._step()
                self._resize()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                log.error("scheduler error:\n%s", traceback.format_exc())
                self._fail_all(exc)
        self._fail_all(None)

    def _warmup(self) -> None:
        """Compile what the first requests need: decode at every batch bucket (and its plain variant),
        prefill for short prompts (``WARM_PROMPT_BUCKETS``), and the row insert/resize functions."""
        t0 = time.perf_counter()
        bos = self.tokenizer.encode("Hi", add_special_tokens=True) or [0]
        new = None
        for p_bucket in WARM_PROMPT_BUCKETS:
            if p_bucket <= self.cache_size:
                new = self._prefill([((bos * p_bucket)[: p_bucket // 2 + 1], 0, 0.0, 1.0, 0, 0)])
        assert new is not None
        for b in self.buckets:
            rows = jnp.asarray([0] + [-1] * (b - 1), jnp.int32)
            state = engine.take_rows(new, rows)
            for drafter in (self.drafter, self.plain):
                if drafter is not None and (drafter is self.drafter or b > (self.spec_max_active or 0)):
                    state = engine.decode(self.params, self.dparams, state, jnp.int32(1), cfg=self.cfg,
                                          drafter=drafter)
            state = engine.insert_rows(state, new, jnp.asarray([b], jnp.int32))
            jax.block_until_ready(state)
        log.info("warm-up (compilation) took %.1fs", time.perf_counter() - t0)

    def _prefill(self, rows: list[tuple[list[int], int, float, float, int, int]]) -> engine.DecodeState:
        """Prefill rows (ids, max_new, temperature, top_p, top_k, seed) into a fresh state of the
        smallest batch bucket; padding rows start done."""
        n = len(rows)
        nb = engine.pick_bucket(n, self.buckets, "a batch")
        longest = max(len(r[0]) for r in rows)
        p_bucket = min(engine.pick_bucket(longest, engine.PROMPT_BUCKETS, "a prompt"), self.cache_size)
        prompt = np.zeros((nb, p_bucket), np.int32)
        lengths = np.ones((nb,), np.int32)
        budget = np.zeros((nb,), np.int32)
        temp = np.zeros((nb,), np.float32)
        top_p = np.ones((nb,), np.float32)
        top_k = np.zeros((nb,), np.int32)
        keys = []
        for i, (ids, max_new, t, p, k, seed) in enumerate(rows):
            prompt[i, : len(ids)] = ids
            lengths[i], budget[i], temp[i], top_p[i], top_k[i] = len(ids), max_new, t, p, k
            # row 0 of `Generator.generate(..., seed=seed)`: the same draws as `hsdjax generate`
            keys.append(jax.random.fold_in(jax.random.PRNGKey(seed), 0))
        keys += [keys[0]] * (nb - n)
        sampling = SamplingParams(temperature=jnp.asarray(temp), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p))
        gen, fwd = engine.prefill(self.params, jnp.asarray(prompt), jnp.asarray(lengths), jnp.asarray(budget),
                                  sampling, jnp.stack(keys), self.stop_ids, cfg=self.cfg,
                                  cache_size=self.cache_size, spare=self.drafter.spare,
                                  keep_layers=self.drafter.prompt_layers)
        return engine.start_decoding(self.dparams, gen, fwd, drafter=self.drafter)

    def _admit(self) -> None:
        """Move waiting requests into free rows (growing the batch bucket first when needed): a
        batch-1 prefill per request (one compiled program per prompt bucket), then ``insert_rows``."""
        batch: list[GenRequest] = []
        with self._cond:
            gone = [r for r in self._waiting if r.cancelled.is_set()]
            if gone:  # clients that left while queued stop holding queue places
                self._waiting = collections.deque(r for r in self._waiting if not r.cancelled.is_set())
                for r in gone:
                    self._finish(r, "cancelled", 0, 0)
            room = self.max_batch - self._occupied
            while self._waiting and len(batch) < room:
                r = self._waiting.popleft()
                if r.cancelled.is_set():
                    self._finish(r, "cancelled", 0, 0)
                    continue
                batch.append(r)
            self._occupied += len(batch)
        if not batch:
            return
        target = engine.pick_bucket(sum(r is not None for r in self._slots) + len(batch), self.buckets, "a batch")
        if self._state is not None and target > len(self._slots):  # grow the running batch first
            b = len(self._slots)
            grow = np.arange(target, dtype=np.int32)
            grow[b:] = -1
            self._state = engine.take_rows(self._state, jnp.asarray(grow))
            self._slots += [None] * (target - b)
        for r in batch:
            try:
                new = self._prefill([(r.prompt_ids, r.max_new, r.temperature, r.top_p, r.top_k, r.seed)])
            except Exception:  # noqa: BLE001 - only this request fails
                log.error("prefill failed:\n%s", traceback.format_exc())
                with self._cond:
                    self._occupied -= 1
                self.metrics.request_done("error", len(r.prompt_ids), 0, 0)
                r.send(("error", APIError(500, "the prefill failed; see the server log", type="server_error")))
                continue
            if self._state is None:
                rows = jnp.asarray([0] + [-1] * (target - 1), jnp.int32)
                self._state = new if target == 1 else engine.take_rows(new, rows)
                self._slots = [r] + [None] * (target - 1)
            else:
                free = self._slots.index(None)
                self._state = engine.insert_rows(self._state, new, jnp.asarray([free], jnp.int32))
                self._slots[free] = r
            r.seen = len(r.prompt_ids)
            r.stream = TextStream(self.tokenizer, self.tokenizer.stop_ids, r.stops)
            r.t_admitted = time.perf_counter()
        self._small_for = 0
        if self._state is not None:
            self._collect()  # the first token comes from the prefill

    def _step(self) -> None:
        active = sum(r is not None for r in self._slots)
        drafter = self.drafter
        if self.plain is not None and active > self.spec_max_active:
            drafter = self.plain
        self._state = engine.decode(self.params, self.dparams, self._state, jnp.int32(self.rounds), cfg=self.cfg,
                                    drafter=drafter)
        self.metrics.decode_call(drafter.name)
        self._collect()

    def _collect(self) -> None:
        """Hand each row's new tokens to its request; free rows that finished or were cancelled."""
        gen = self._state.gen
        seq_len = np.asarray(gen.seq_len)
        done = np.asarray(gen.done)
        seq = None
        stop_rows = []
        now = time.perf_counter()
        for i, r in enumerate(self._slots):
            if r is None:
                continue
            if r.cancelled.is_set():
                stop_rows.append(i)
                self._release(i, "cancelled")
                continue
            end = int(seq_len[i])
            delta = []
            if end > r.seen:
                if seq is None:
                    seq = np.asarray(gen.seq)
                for t in seq[i, r.seen: end].tolist():
                    delta.append(r.stream.push(t))
                    if r.stream.finished:
                        break
                r.seen = end
            if not r.stream.finished and done[i]:
                delta.append(r.stream.finish("length"))
            if r.stream.tokens > r.counted:
                self.metrics.tokens(r.stream.tokens - r.counted)
                r.counted = r.stream.tokens
                if r.t_first is None:
                    r.t_first = now
                    self.metrics.first_token(now - r.t_arrival)
            text = "".join(delta)
            if text:
                r.send(("delta", text))
            if r.stream.finished:
                if not done[i]:
                    stop_rows.append(i)
                self._release(i, r.stream.finish_reason)
        if stop_rows:  # rows freed early (stop string, client gone) stop computing
            mask = np.zeros(done.shape, bool)
            mask[stop_rows] = True
            self._state = self._state.replace(gen=gen.replace(done=gen.done | jnp.asarray(mask)))

    def _release(self, i: int, reason: str) -> None:
        r = self._slots[i]
        self._slots[i] = None
        stats = jax.tree_util.tree_map(lambda a: a[i], self._stats_np())
        decoded = int(np.asarray(self._state.gen.seq_len)[i]) - len(r.prompt_ids) - 1
        self._finish(r, reason, decoded, int(stats.target_passes), stats)
        with self._cond:
            self._occupied -= 1

    def _stats_np(self) -> Any:
        return jax.tree_util.tree_map(np.asarray, self._state.stats)

    def _finish(self, r: GenRequest, reason: str, decoded: int, passes: int, stats: Any = None) -> None:
        self.metrics.request_done(reason, len(r.prompt_ids), decoded, passes)
        if reason == "cancelled":
            r.send(("error", APIError(499, "the client closed the request", type="cancelled")))
            return
        now = time.perf_counter()
        info = {
            "finish_reason": reason,
            "text": r.stream.text if r.stream else "",
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": r.stream.tokens if r.stream else 0,
            "hsdjax": {
                "method": self.method,
                "mean_accepted_length": round(decoded / passes, 4) if passes else None,
                "target_passes": passes,
                "draft_steps": int(stats.draft_passes) if stats is not None else 0,
                "queue_s": round((r.t_admitted or now) - r.t_arrival, 4),
                "ttft_s": round((r.t_first or now) - r.t_arrival, 4),
                "total_s": round(now - r.t_arrival, 4),
            },
        }
        r.send(("done", info))

    def _resize(self) -> None:
        """Drop the state when no row is busy; shrink to a smaller batch bucket once the busy rows
        have fitted in it for ``shrink_after`` consecutive steps and nothing waits."""
        busy = [i for i, r in enumerate(self._slots) if r is not None]
        if not busy:
            self._state, self._slots, self._small_for = None, [], 0
            return
        target = engine.pick_bucket(len(busy), self.buckets, "a batch")
        with self._cond:
            waiting = bool(self._waiting)
        if target >= len(self._slots) or waiting:
            self._small_for = 0
            return
        self._small_for += 1
        if self._small_for < self._shrink_after:
            return
        rows = np.full((target,), -1, np.int32)
        rows[: len(busy)] = busy
        self._state = engine.take_rows(self._state, jnp.asarray(rows))
        self._slots = [self._slots[i] for i in busy] + [None] * (target - len(busy))
        self._small_for = 0

    def _fail_all(self, exc: Exception | None) -> None:
        err = (APIError(500, "generation failed; see the server log", type="server_error") if exc is not None
               else APIError(503, "the server is shutting down", type="server_error"))
        for i, r in enumerate(self._slots):
            if r is not None:
                self.metrics.request_done("error", len(r.prompt_ids), 0, 0)
                r.send(("error", err))
        with self._cond:
            self._occupied = 0
        self._state, self._slots = None, []
