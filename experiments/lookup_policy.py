"""How long a prompt-lookup chain should be: a replay of lookup drafting over greedy answers.

    python experiments/lookup_policy.py --per-source 3 --max-new-tokens 256 --costs /tmp/rc.json

Greedy answers are generated once with `ar` (training prompts from ``../shared/data/train``, a few per
source, none from the dev sets; ``--dev`` adds the dev sets' answers as a separate, held-out group).
Because greedy speculative decoding emits exactly those answers, a round of lookup drafting can be
replayed without the model: the chain the engine's own matcher (``lookup_continuations``) proposes at
that context is accepted up to its first token that differs from the answer. Each policy (chain length
by the n-gram length of the match and by how many tokens the previous round emitted) is replayed round
by round, and its rounds are priced with the measured cost of a target pass at the verified tier
(``benchmarks/round_cost.py --json-out``: ms per round of ``ar`` and of N-node passes). Printed per
policy: tokens per round, verified nodes per round, and the modelled speed against `ar`. The replay
is exact for acceptance; speed is a model (pass costs only, no drafting), for choosing the policy that
is then measured end to end with ``benchmarks/feature_drafters.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SKIP_SOURCES = {"codealpaca", "opus_newstest_deen"}


def training_prompts(per_source: int, seed: int) -> list[tuple[str, str]]:
    """(source, prompt) pairs: ``per_source`` single-turn prompts of each licensed training source."""
    by_source: dict[str, list[str]] = {}
    for name in ("prompts.jsonl", "prompts_more.jsonl"):
        for line in (ROOT / "train" / name).read_text().splitlines():
            rec = json.loads(line)
            source = rec["source"].split(":")[0]
            if source not in SKIP_SOURCES and "turns" not in rec and len(rec["prompt"]) < 1500:
                by_source.setdefault(source, []).append(rec["prompt"])
    rng = random.Random(seed)
    return [(s, p) for s in sorted(by_source) for p in rng.sample(by_source[s], min(per_source, len(by_source[s])))]


def greedy_answers(model: Any, prompts: list[list[int]], max_new: int, batch: int) -> list[list[int]]:
    """Each prompt's greedy answer (token ids, generated with `ar` in batches)."""
    from hsdjax.frontends.api import Generator

    gen = Generator(model, "ar")
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        res = gen.generate(prompts[i:i + batch], max_new_tokens=max_new)
        out.extend(list(r.tokens) for r in res)
        print(f"answers {len(out)}/{len(prompts)}", file=sys.stderr, flush=True)
    return out


def lookup_table(prompt: list[int], answer: list[int], depth: int, max_ngram: int, min_ngram: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every context length L = len(prompt) + 1 .. len(prompt) + len(answer) - 1: the chain the
    engine's matcher proposes (``depth`` tokens), how many are available, the n-gram length matched
    (0: none), and how many of the chain equal the answer's continuation (``accepted``)."""
    import jax.numpy as jnp

    from hsdjax.core.drafters.pld import lookup_continuations

    seq = np.array(prompt + answer, np.int32)
    lengths = np.arange(len(prompt) + 1, len(seq), dtype=np.int32)
    rows = np.broadcast_to(seq, (len(lengths), len(seq)))
    chains, avail, ngram = lookup_continuations(jnp.asarray(rows), jnp.asarray(lengths), 1, depth, max_ngram,
                                                min_ngram, with_ngram=True)
    chains, avail, ngram = np.asarray(chains[:, 0]), np.asarray(avail[:, 0]), np.asarray(ngram[:, 0])
    truth = np.stack([np.pad(seq[n:n + depth], (0, max(0, n + depth - len(seq))), constant_values=-1)
                      for n in lengths])
    ok = (chains == truth) & (np.arange(depth)[None, :] < avail[:, None])
    accepted = np.sum(np.cumprod(ok, axis=1), axis=1)
    return avail, ngram, accepted


def replay(tables: list[tuple[np.ndarray, np.ndarray, np.ndarray]], policy: dict[tuple[int, int], int],
           tiers: tuple[int, ...], cost: dict[int, float], drafter_accept: float = 0.0, drafter_ms: float = 0.0,
           seed: int = 0) -> dict[str, float]:
    """Rounds of lookup drafting under ``policy`` ((n-gram, previous emitted capped at 3) -> chain length):
    tokens, rounds, verified nodes and modelled time (ms) summed over the answers. With
    ``drafter_accept`` > 0 the chain is a graft beside a one-draft tree (`hsd` / `eagle` at depth 1),
    whose draft is right with that probability, independently (a model: the replay has no drafter)."""
    rng = np.random.default_rng(seed)
    base = 2 if drafter_accept > 0 else 1
    tokens = rounds = nodes = 0
    ms = 0.0
    for avail, ngram, accepted in tables:
        i, prev, n = 0, 1, len(avail)
        while i < n:
            want = policy.get((int(ngram[i]), min(prev, 3)), 0) if ngram[i] else 0
            length = min(want, int(avail[i]))
            tier = min(t for t in tiers if t >= base + length)
            a = min(int(accepted[i]), length)
            if drafter_accept > 0:
                a = max(a, int(rng.random() < drafter_accept))
                ms += drafter_ms
            emitted = min(a + 1, n - i + 1)
            tokens += emitted
            rounds += 1
            nodes += tier
            ms += cost[tier]
            i += emitted
            prev = emitted
    return {"tokens": tokens, "rounds": rounds, "nodes": nodes, "ms": ms}


def measured_costs(path: str | None, max_nodes: int) -> dict[int, float]:
    """ms per round of an N-node pass from round_cost.py's JSON (N = 1 is `ar`); a linear fit beyond."""
    if path is None:  # this machine, 2026-12-05: ar 6.5 ms, ~1.8 ms per further node
        return {n: 6.5 + 1.8 * (n - 1) for n in range(1, max_nodes + 1)}
    data = json.loads(Path(path).read_text())
    table = {1: float(data["ar_ms"])}
    for key, ratio in data.get("ratios", {}).items():
        table[int(key)] = float(ratio) * table[1]
    known = sorted(table)
    slope = (table[known[-1]] - table[1]) / max(known[-1] - 1, 1)
    for n in range(1, max_nodes + 1):
        table.setdefault(n, table[1] + slope * (n - 1))
    return table


def policies(depth: int, max_ngram: int, min_ngram: int) -> dict[str, dict[tuple[int, int], int]]:
    """Named policies: fixed lengths, then lengths by n-gram match and by the previous round."""
    grams = range(min_ngram, max_ngram + 1)
    out = {f"fixed {d}": {(g, p): d for g in grams for p in (1, 2, 3)} for d in range(1, depth + 1)}
    for short, long_ in itertools.product(range(0, 4), range(2, depth + 1)):
        out[f"prev>=2: {long_}, else {short}"] = {(g, p): (long_ if p >= 2 else short) for g in grams for p in (1, 2, 3)}
        out[f"prev>=3: {long_}, else {short}"] = {(g, p): (long_ if p >= 3 else short) for g in grams for p in (1, 2, 3)}
        out[f"ngram>={max_ngram}: {long_}, else {short}"] = {(g, p): (long_ if g >= max_ngram else short)
                                                           for g in grams for p in (1, 2, 3)}
    for lengths in itertools.product(range(0, depth + 1), repeat=len(grams)):
        if list(lengths) == sorted(lengths) and lengths[-1] > 0:  # longer matches get at least as long a chain
            name = "by ngram " + "/".join(map(str, lengths))
            out[name] = {(g, p): lengths[g - min_ngram] for g in grams for p in (1, 2, 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-source", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--depth", type=int, default=6, help="longest chain considered")
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--min-ngram", type=int, default=2)
    ap.add_argument("--tiers", default="1,2,4,7", help="verification pass sizes (nodes, root included)")
    ap.add_argument("--costs", help="round_cost.py --json-out file (default: a linear model of this machine)")
    ap.add_argument("--answers", help="cache of the generated answers (JSON; written when missing)")
    ap.add_argument("--dev", action="store_true", help="also replay the dev sets' answers (held out)")
    ap.add_argument("--drafter-accept", type=float, default=0.0,
                    help="model a one-draft tree beside the chain, right with this probability (hsd graft)")
    ap.add_argument("--drafter-ms", type=float, default=1.0, help="drafting time per round with --drafter-accept")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tiers = tuple(sorted({int(t) for t in args.tiers.split(",")} | {1 + args.depth}))
    cost = measured_costs(args.costs, max(tiers))
    groups = load_or_generate(args)
    tables = {name: [lookup_table(p, a, args.depth, args.max_ngram, args.min_ngram) for p, a in pairs]
              for name, pairs in groups.items()}
    named = policies(args.depth, args.max_ngram, args.min_ngram)
    results = {name: {g: replay(t, pol, tiers, cost, args.drafter_accept, args.drafter_ms, args.seed)
                      for g, t in tables.items()} for name, pol in named.items()}
    print(f"pass costs (ms): {', '.join(f'{n}: {cost[n]:.2f}' for n in sorted(cost))}; tiers {tiers}")
    ar_ms = cost[1]
    speed = {k: {g: r["tokens"] * ar_ms / r["ms"] for g, r in per.items()} for k, per in results.items()}
    chosen = max(speed, key=lambda k: speed[k]["train"])
    for g in tables:
        ranked = sorted(results, key=lambda k: -speed[k][g])
        print(f"\n{g} ({len(tables[g])} replies): policy, tokens/round, nodes/round, modelled x ar")
        shown = ranked[:args.top] + [k for k in ("fixed 3", "fixed 6", chosen) if k not in ranked[:args.top]]
        for k in dict.fromkeys(shown):
            r = results[k][g]
            print(f"  {k:28s} {r['tokens'] / r['rounds']:.3f} {r['nodes'] / r['rounds']:.2f} "
                  f"{speed[k][g]:.3f}x{'  <- best on train' if k == chosen else ''}")
    return 0


def load_or_generate(args: Any) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{"train": [(prompt ids, answer ids)], "dev": [...]} from the cache file or generated now."""
    if args.answers and Path(args.answers).exists():
        return {k: [tuple(x) for x in v] for k, v in json.loads(Path(args.answers).read_text()).items()}
    from hsdjax.frontends.api import Generator, load_model

    model = load_model(args.model)
    enc = Generator(model, "ar")
    train = [enc.encode_prompt(p) for _, p in training_prompts(args.per_source, args.seed)]
    groups = {"train": list(zip(train, greedy_answers(model, train, args.max_new_tokens, args.batch)))}
    if args.dev:
        from hsdjax.frontends.bench.questions import dev_set_prompts

        folder = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval"  # beside the checkout
        dev = [ids for _, ids in dev_set_prompts(enc, folder, 2, args.max_new_tokens)]
        groups["dev"] = list(zip(dev, greedy_answers(model, dev, args.max_new_tokens, 1)))
    if args.answers:
        Path(args.answers).write_text(json.dumps(groups))
    return groups


if __name__ == "__main__":
    sys.exit(main())
