"""``hsdjax tune``: choose the draft tree size for this device from measured costs and acceptance.

Two measurements, then a small search (the automatic tree-size setting EAGLE-2 does by hand):

1. the cost of one verification pass against the number of tree nodes N (a target forward over N new
   tokens after a cached prefix, LM head and argmax included), jitted per N, median of repeats;
2. the method's acceptance: it decodes a few questions with a deep tree (depth ``max_depth``) at each
   candidate width; the per-depth acceptance P(at least d drafts accepted) of a deep tree also holds
   for the same tree cut at depth d.

Expected tokens per pass for (width, depth) is 1 + sum_{d <= depth} P(>= d); expected tokens/s divides
it by the pass cost at N = 1 + width * depth (plus ``depth`` draft-model steps for ``sps``). The best
setting is printed and, with ``--write``, stored where ``make_drafter`` picks it up for this model,
method and device when no explicit --depth / --width is given.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from hsdjax.errors import HsdjaxError
from hsdjax.paths import cache_dir

NODE_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def tuned_path(fingerprint: str, method: str) -> Path:
    return cache_dir("tuned") / f"{fingerprint[:16]}-{method}-{jax.default_backend()}.json"


def load_tuned(fingerprint: str, method: str) -> dict[str, int]:
    path = tuned_path(fingerprint, method)
    try:
        data = json.loads(path.read_text())
        return {k: int(data[k]) for k in ("depth", "width") if k in data}
    except (OSError, ValueError, KeyError):
        return {}


def pass_cost(model: Any, nodes: Sequence[int] = NODE_COUNTS, context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Seconds of one verification pass over N tree nodes after ``context`` cached tokens."""
    from hsdjax.model import Transformer, init_cache

    cfg, params = model.cfg, model.params
    cache = init_cache(cfg, 1, 1024).replace(length=jnp.array([context], jnp.int32))
    net = Transformer(cfg)

    @jax.jit
    def verify_pass(params, cache, tokens, positions, mask):
        out = net.apply({"params": params}, tokens, positions, mask, cache)
        return jnp.argmax(net.apply({"params": params}, out["hidden"], method=Transformer.logits), axis=-1)

    costs = {}
    for n in nodes:
        tokens = jnp.zeros((1, n), jnp.int32)
        positions = context + jnp.arange(n, dtype=jnp.int32)[None]
        mask = jnp.tril(jnp.ones((n, n), bool))[None]
        verify_pass(params, cache, tokens, positions, mask).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            verify_pass(params, cache, tokens, positions, mask).block_until_ready()
            times.append(time.perf_counter() - t0)
        costs[n] = statistics.median(times)
    return costs


def interpolate(costs: dict[int, float], n: int) -> float:
    xs = sorted(costs)
    if n <= xs[0]:
        return costs[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)
    return costs[xs[-1]] * n / xs[-1]


def measure_acceptance(model: Any, method: str, prompts: Sequence[Any], width: int, max_depth: int,
                       max_new_tokens: int, draft_model: str | None) -> list[float]:
    """P(at least d drafts accepted per pass), d = 1..max_depth, over the prompts."""
    from hsdjax.api import Generator

    opts: dict[str, Any] = {"depth": max_depth}
    if method == "pld":
        opts["width"] = width
    if draft_model:
        opts["draft_model"] = draft_model
    gen = Generator(model, method, **opts)
    rounds: list[int] = []
    for p in prompts:
        rounds += gen.generate(p, max_new_tokens=max_new_tokens)[0].stats["accept_lengths"]
    if not rounds:
        raise HsdjaxError("no decoding rounds to measure acceptance on")
    return [sum(a >= d + 1 for a in rounds) / len(rounds) for d in range(1, max_depth + 1)]


def tune(model_name: str | None, method: str, question_files: Sequence[str], *, limit: int = 4,
         max_new_tokens: int = 128, max_depth: int = 8, widths: Sequence[int] = (1, 2, 3),
         draft_model: str | None = None, write: bool = False) -> dict[str, Any]:
    from hsdjax.api import load_model
    from hsdjax.bench import read_questions

    if method not in ("pld", "sps"):
        raise HsdjaxError(f"tune supports the tree methods pld and sps (got {method!r})")
    model = load_model(model_name)
    prompts = [q.turns[0] for f in question_files for q in read_questions(f)[:limit]]
    costs = pass_cost(model)
    draft_step = 0.0
    if method == "sps":
        name = draft_model or (model.source.spec.draft_model if model.source.spec else None)
        if not name:
            raise HsdjaxError(f"{model.name} has no draft model; pass --draft-model")
        draft_step = pass_cost(load_model(name), nodes=(1,))[1]
        widths = (1,)
    candidates = []
    for w in widths:
        accept = measure_acceptance(model, method, prompts, w, max_depth, max_new_tokens, draft_model)
        for depth in range(1, max_depth + 1):
            tokens = 1 + sum(accept[:depth])
            seconds = interpolate(costs, 1 + w * depth) + draft_step * depth
            candidates.append({"width": w, "depth": depth, "nodes": 1 + w * depth, "tokens_per_pass": tokens,
                               "pass_s": seconds, "tokens_per_s": tokens / seconds,
                               "accept_at_depth": accept[depth - 1]})
    best = max(candidates, key=lambda c: c["tokens_per_s"])
    result = {"model": model.name, "method": method, "backend": jax.default_backend(),
              "pass_cost_s": costs, "draft_step_s": draft_step or None, "candidates": candidates,
              "best": best, "plain_tokens_per_s": 1 / costs[1]}
    if write:
        path = tuned_path(model.fingerprint, method)
        setting = {"depth": best["depth"]} | ({"width": best["width"]} if method == "pld" else {})
        path.write_text(json.dumps(setting | {"source": "hsdjax tune", "expected": best}, indent=2))
        result["written"] = str(path)
    return result
