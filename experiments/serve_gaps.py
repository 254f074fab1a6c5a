"""Where a running stream's long gaps come from when a new prompt arrives (issue #51, "streams keep
their p99 gap within 2x their median").

In-process: the serving scheduler (no HTTP) decodes ``--streams`` streams; after ``--settle`` seconds a
long prompt arrives. Every scheduler step that can stall the streams is timed (blocking on its result,
so the time lands on the step that caused it): prompt pieces, the prefill's finish (first token, drafter
start), placing the rows (insert / growing the batch), decode calls, shrinking. Prints the streams' gap
p50 / p99 / max, and for each gap above 1.5x the median what ran inside it.

    python experiments/serve_gaps.py --method pld --max-context 2048 --prompt-tokens 1000
"""

from __future__ import annotations

import argparse
import threading
import time
import types
from typing import Any

import jax
import numpy as np


class Sink:
    """Stands in for the HTTP side's event loop: records when each event of a request was sent."""

    def __init__(self) -> None:
        self.events: list[tuple[float, Any]] = []
        self.done = threading.Event()

    def call_soon_threadsafe(self, _put: Any, event: tuple[str, Any]) -> None:
        self.events.append((time.perf_counter(), event))
        if event[0] in ("done", "error"):
            self.done.set()


def instrument(sched: Any, log: list[tuple[str, float, float]]) -> None:
    """Wrap the scheduler's steps so each blocks on its result and logs (name, start, end)."""

    def timed(name: str, fn: Any, result: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            jax.block_until_ready(result(out, a))
            log.append((name, t0, time.perf_counter()))
            return out
        return run

    sched._fill_step = timed("piece", sched._fill_step, lambda out, a: a[0].fill)
    sched._prefill_done = timed("finish", sched._prefill_done, lambda out, a: out)
    sched._place = timed("place", sched._place, lambda out, a: sched.rows.state)
    sched._step = timed("decode", sched._step, lambda out, a: sched.rows.state)
    sched._resize = timed("resize", sched._resize, lambda out, a: sched.rows.state)


def request(sched: Any, ids: list[int], max_new: int) -> tuple[Any, Sink]:
    from hsdjax.frontends.serving.scheduler import GenRequest

    sink = Sink()
    r = GenRequest(id=f"r{time.perf_counter_ns()}", prompt_ids=ids, max_new=max_new, temperature=0.0, top_p=1.0,
                   top_k=0, seed=0, stops=[], loop=sink, queue=types.SimpleNamespace(put_nowait=None))
    sched.submit(r)
    return r, sink


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="pld")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=9)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--spec-max-active", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--row-pool", choices=("auto", "off"), default="auto",
                   help="off: the running batch's cache grows by copying (no row pool), for an A/B")
    args = p.parse_args()

    from hsdjax.frontends.api import enable_compilation_cache, load_model
    from hsdjax.frontends.serving.scheduler import Scheduler

    enable_compilation_cache()
    model = load_model(args.model)
    sched = Scheduler(model, args.method, max_batch=args.max_batch, max_context=args.max_context,
                      spec_max_active=args.spec_max_active, prefill_chunk=args.prefill_chunk, prefix_cache_mb=0)
    if args.row_pool == "off":
        sched.rows.pooled = False
    print(f"row pool: {'on' if sched.rows.pooled else 'off'}")
    t0 = time.perf_counter()
    sched.start()
    sched.ready.wait()
    print(f"ready after {time.perf_counter() - t0:.1f} s")
    events: list[str] = []  # traces and compiles after ready: each is a missing warm-up
    jax.config.update("jax_log_compiles", True)  # which ones (logged as warnings)
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, _secs, **_kw: events.append(name) if name in (
            "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration") else None)
    log: list[tuple[str, float, float]] = []
    instrument(sched, log)
    rng = np.random.default_rng(0)
    chat = model.tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    for round_ in ("cold", "warm"):
        log.clear()
        streams = [request(sched, chat, args.stream_tokens) for _ in range(args.streams)]
        time.sleep(args.settle)
        long_ids = [int(t) for t in rng.integers(100, 20000, args.prompt_tokens)]
        sent = time.perf_counter()
        _, long_sink = request(sched, long_ids, 4)
        for _, s in streams:
            s.done.wait()
        long_sink.done.wait()
        first = next(t for t, e in long_sink.events if e[0] == "delta")
        gaps = []
        for _, s in streams:
            times = [t for t, e in s.events if e[0] == "delta"]
            gaps += [(a, b) for a, b in zip(times[1:], times[2:])]  # from the second token: all admitted
        lengths = np.array([b - a for a, b in gaps])
        med = float(np.median(lengths))
        print(f"{round_}: long prompt {args.prompt_tokens} tokens, first token after {first - sent:.2f} s; "
              f"streams' gaps p50 {med * 1e3:.1f} ms, p99 {np.percentile(lengths, 99) * 1e3:.1f} ms "
              f"({np.percentile(lengths, 99) / med:.2f}x), max {lengths.max() * 1e3:.1f} ms")
        seen = set()
        for a, b in sorted(gaps, key=lambda g: g[1] - g[0], reverse=True):
            if b - a < 1.5 * med or (a, b) in seen or len(seen) >= 8:
                continue
            seen.add((a, b))
            inside = [f"{n} {1e3 * (e - s):.0f}" for n, s, e in log if s < b and e > a]
            rel = "arrival" if a <= sent <= b else ("first token" if a <= first <= b else "")
            print(f"  gap {1e3 * (b - a):7.1f} ms {rel:>11}: {', '.join(inside)}")
        by = {}
        for n, s, e in log:
            by.setdefault(n, []).append(e - s)
        print("  steps (median ms, count): " + ", ".join(
            f"{n} {1e3 * float(np.median(v)):.1f} x{len(v)}" for n, v in by.items()))
    print(f"after ready: {events.count('/jax/core/compile/jaxpr_trace_duration')} traces, "
          f"{events.count('/jax/core/compile/backend_compile_duration')} compiles")
    sched.close()


if __name__ == "__main__":
    main()
