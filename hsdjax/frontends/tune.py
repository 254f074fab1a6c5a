"""``hsdjax tune``: choose the draft tree size for this device from measured costs and acceptance.

Two measurements, then a small search (the automatic tree-size setting EAGLE-2 does by hand):

1. the cost of one verification pass against the number of tree nodes N (a target forward over N new
   tokens after a cached prefix, LM head and argmax included), jitted per N, median of repeats;
2. the method's acceptance: it decodes a few questions with a deep tree (depth ``max_depth``) at each
   candidate width; the per-depth acceptance P(at least d drafts accepted) of a deep tree also holds
   for the same tree cut at depth d.

Expected tokens per pass for (width, depth) is 1 + sum_{d <= depth} P(>= d); expected tokens/s divides
it by the pass cost at N = 1 + width * depth (plus ``depth`` draft-model steps for ``sps``), for the
share of passes that verify the whole tree: ``pld`` verifies the root alone when the lookup finds
nothing (its tiers), so its expected pass cost mixes the two by the measured share.

The feature drafters (``hsd``, ``eagle``) grow dynamic trees whose verified size is the ``budget``
(fewer nodes when ``--min-prob`` drops unlikely ones) plus the grafted prompt-lookup continuation
(``lookup`` tokens when the lookup finds a match), so a deep run cannot stand in for a smaller budget.
Each (depth, budget, lookup) on a small grid (``--lookups``: default the method's own length) decodes
the questions for real; expected tokens/s is the
measured tokens per pass over the pass cost at the measured mean number of verified nodes (the tier the
engine really ran) plus the drafter's time per round at that depth (measured round time minus that pass
cost, median over the budgets of one depth, so one noisy run does not decide). Standalone pass costs
are scaled to plain decoding's measured step inside the loop (``ar`` on the same prompts, which also
gives the measured speed-up printed beside each prediction).

The best setting is printed and, with ``--write``, stored (``hsdjax.core.methods.write_tuned``) where
``make_drafter`` picks it up for this model, method and kind of device (``device_kinds``: through the
CPU kernels, their instruction set) when no explicit --depth / --width / --budget is given.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from hsdjax.core.methods import FEATURE_METHODS, REGISTRY, TREE_METHODS, device_kinds, draft_model_of, write_tuned
from hsdjax.errors import HsdjaxError
from hsdjax.frontends.api import Generator, load_model
from hsdjax.frontends.bench.questions import read_questions
from hsdjax.runtime.model import Transformer, init_cache

NODE_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def pass_cost(model: Any, nodes: Sequence[int] = NODE_COUNTS, context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Seconds of one verification pass over N tree nodes after ``context`` cached tokens."""
    cfg, params = model.cfg, model.params
    cache = init_cache(cfg, 1, 1024).replace(length=jnp.array([context], jnp.int32))
    net = Transformer(cfg)

    @jax.jit
    def verify_pass(params, cache, tokens, positions, mask):
        out = net.apply({"params": params}, tokens, positions, mask, cache)
        return net.apply({"params": params}, out["hidden"], method=Transformer.greedy_tokens)

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
                       max_new_tokens: int, draft_model: str | None) -> tuple[list[float], float]:
    """P(at least d drafts accepted per pass), d = 1..max_depth, over the prompts; and the share of
    passes that verified the whole tree (``pld`` verifies the root alone when nothing matches: its
    tiers; from the mean verified nodes; 1 for ``sps``)."""
    opts: dict[str, Any] = {"depth": max_depth}
    if method == "pld":
        opts["width"] = width
    if draft_model:
        opts["draft_model"] = draft_model
    gen = Generator(model, method, **opts)
    rounds: list[int] = []
    nodes = 0.0
    for p in prompts:
        stats = gen.generate(p, max_new_tokens=max_new_tokens)[0].stats
        rounds += stats["accept_lengths"]
        nodes += (stats["mean_verified_nodes"] or 0) * stats["target_passes"]
    if not rounds:
        raise HsdjaxError("no decoding rounds to measure acceptance on")
    accept = [sum(a >= d + 1 for a in rounds) / len(rounds) for d in range(1, max_depth + 1)]
    full = 1 + (width if method == "pld" else 1) * max_depth
    whole_tree = 1.0 if method != "pld" else min(max((nodes / len(rounds) - 1) / (full - 1), 0.0), 1.0)
    return accept, whole_tree


FEATURE_DEPTHS = (3, 4, 6)
FEATURE_BUDGETS = (3, 5, 8, 12)


def measure_decoding(model: Any, method: str, prompts: Sequence[Any], max_new_tokens: int,
                     **options: Any) -> dict[str, float]:
    """Decode the prompts with one method and setting (compiled first, outside the timing): tokens per
    pass, verified nodes per pass, seconds per pass inside the decoding loop, tokens/s."""
    gen = Generator(model, method, **options)
    compile_s = gen.generate(prompts[0], max_new_tokens=4)[0].compile_s
    decoded = passes = 0
    nodes = seconds = 0.0
    for p in prompts:
        r = gen.generate(p, max_new_tokens=max_new_tokens)[0]
        n = r.stats["target_passes"]
        decoded, passes = decoded + len(r.tokens) - 1, passes + n
        nodes += (r.stats["mean_verified_nodes"] or 0) * n  # the tier really run, not just the valid nodes
        seconds += r.decode_s
    if not passes or not seconds:
        raise HsdjaxError("no decoding rounds to measure: give longer --max-new-tokens or other questions")
    return {"tokens_per_pass": decoded / passes, "mean_nodes": nodes / passes, "round_s": seconds / passes,
            "measured_tokens_per_s": decoded / seconds, "compile_s": compile_s}


def tune_feature(model: Any, method: str, prompts: Sequence[Any], costs: dict[int, float], *,
                 depths: Sequence[int] = FEATURE_DEPTHS, budgets: Sequence[int] = FEATURE_BUDGETS, width: int = 3,
                 lookups: Sequence[int] | None = None, max_new_tokens: int = 128, min_prob: float | None = None,
                 progress: bool = True) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Measure every feasible (depth, budget, lookup) and model its tokens/s (see the module docstring);
    ``lookups``: lengths of the grafted prompt-lookup continuation tried (default: the method's own).

    The standalone pass costs carry a dispatch per call that a pass inside the decoding loop does not,
    so they are scaled to plain decoding's measured in-loop step (``ar`` on the same prompts)."""
    from tqdm.auto import tqdm

    lookups = tuple(lookups) if lookups else (REGISTRY[method].defaults["lookup"],)
    if min(lookups) < 0:
        raise HsdjaxError(f"lookup lengths must be at least 0 (got {min(lookups)})")
    grid = [(d, b, look) for d in depths for b in budgets if b <= d * width for look in lookups]
    if not grid:
        raise HsdjaxError(f"no feasible setting: every budget exceeds depth x width ({width})")
    ar = measure_decoding(model, "ar", prompts, max_new_tokens)
    plain = {"round_s": ar["round_s"], "tokens_per_s": ar["measured_tokens_per_s"]}
    scale = plain["round_s"] / costs[1]
    rows = []
    for d, b, look in tqdm(grid, desc=f"tune {method}", unit="setting", disable=not progress):
        m = measure_decoding(model, method, prompts, max_new_tokens, depth=d, width=width, budget=b,
                             min_prob=min_prob, lookup=look)
        verify_s = interpolate(costs, max(1, round(m["mean_nodes"]))) * scale
        rows.append({"width": width, "depth": d, "budget": b, "lookup": look, "nodes": m["mean_nodes"],
                     "verify_s": verify_s, "drafter_s": max(m["round_s"] - verify_s, 0.0), **m})
    for d in {r["depth"] for r in rows}:
        drafter_s = statistics.median(r["drafter_s"] for r in rows if r["depth"] == d)
        for r in rows:
            if r["depth"] == d:
                r["pass_s"] = r["verify_s"] + drafter_s
                r["tokens_per_s"] = r["tokens_per_pass"] / r["pass_s"]
    return rows, plain


def tune(model_name: str | None, method: str, question_files: Sequence[str], *, limit: int = 4,
         max_new_tokens: int = 128, max_depth: int = 8, widths: Sequence[int] = (1, 2, 3),
         draft_model: str | None = None, write: bool = False, depths: Sequence[int] = FEATURE_DEPTHS,
         budgets: Sequence[int] = FEATURE_BUDGETS, min_prob: float | None = None,
         node_counts: Sequence[int] = NODE_COUNTS, progress: bool = True,
         lookups: Sequence[int] | None = None) -> dict[str, Any]:
    """Measure ``method`` on the model and choose its tree setting (see the module docstring); ``write``
    stores the best one as this device's default."""
    if method not in TREE_METHODS:
        raise HsdjaxError(f"tune supports the tree methods {', '.join(TREE_METHODS[:-1])} and {TREE_METHODS[-1]} "
                          f"(got {method!r})")
    model = load_model(model_name)
    prompts = [q.turns[0] for f in question_files for q in read_questions(f)[:limit]]
    costs = pass_cost(model, nodes=node_counts)
    draft_step = 0.0
    plain = {"round_s": costs[1], "tokens_per_s": 1 / costs[1]}  # pld / sps: the standalone pass is the unit
    if method in FEATURE_METHODS:
        candidates, plain = tune_feature(model, method, prompts, costs, depths=depths, budgets=budgets,
                                         width=max(widths), lookups=lookups, max_new_tokens=max_new_tokens,
                                         min_prob=min_prob, progress=progress)
    else:
        if method == "sps":
            name = draft_model_of(model, draft_model)
            if not name:
                raise HsdjaxError(f"{model.name} has no draft model; pass --draft-model")
            draft_step = pass_cost(load_model(name), nodes=(1,))[1]
            widths = (1,)
        candidates = []
        for w in widths:
            accept, whole = measure_acceptance(model, method, prompts, w, max_depth, max_new_tokens, draft_model)
            for depth in range(1, max_depth + 1):
                tokens = 1 + sum(accept[:depth])
                # tier-aware: a pass without a match (pld) verifies the root alone
                seconds = (whole * interpolate(costs, 1 + w * depth) + (1 - whole) * costs[1]
                           + draft_step * depth)
                candidates.append({"width": w, "depth": depth, "nodes": 1 + w * depth, "tokens_per_pass": tokens,
                                   "pass_s": seconds, "tokens_per_s": tokens / seconds,
                                   "accept_at_depth": accept[depth - 1], "whole_tree_share": whole})
    best = max(candidates, key=lambda c: c["tokens_per_s"])
    kind = device_kinds(model)[0]  # through the CPU kernels: the instruction set they run
    result = {"model": model.name, "method": method, "backend": kind,
              "pass_cost_s": costs, "draft_step_s": draft_step or None, "candidates": candidates,
              "best": best, "plain_tokens_per_s": plain["tokens_per_s"], "plain_round_s": plain["round_s"]}
    if write:
        result["written"] = str(write_tuned(model.fingerprint, method, best, min_prob, kind))
    return result
