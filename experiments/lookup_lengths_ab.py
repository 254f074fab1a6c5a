"""Lookup chain lengths per instruction set, end to end: the shipped table against a candidate, interleaved.

    python experiments/lookup_lengths_ab.py --method pld --a 0,1,1,3 --b 0,1,1,2 [--limit 2 --max-new-tokens 192]

The dev-set prompts (``hsdjax.frontends.bench.questions.dev_set_prompts``: the first ``--limit`` questions of each
set and turn), decoded greedily with `ar`, with ``--method`` at lookup lengths ``--a`` and at ``--b``.
Each program is compiled first; then ``--repeats`` passes over the prompts, the three runs of one prompt
back to back in a rotated order, so the drift of a shared machine hits them alike. Printed: decode tokens/s
over all prompts per pass (median of the passes) and per-pass ratios to `ar`, tokens per round, and whether
every output equals `ar`'s token for token. The replay that proposed the candidate:
``experiments/lookup_policy.py`` with this machine's ``benchmarks/round_cost.py`` costs.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from hsdjax.frontends.api import Generator, load_model
from hsdjax.frontends.bench.questions import dev_set_prompts
from hsdjax.kernels import cpu_matmul

EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="pld", choices=("pld", "hsd", "eagle"))
    ap.add_argument("--a", required=True, help="lookup lengths A (e.g. the shipped table)")
    ap.add_argument("--b", required=True, help="lookup lengths B (the candidate)")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    model = load_model(args.model)
    print(f"model {model.name}; CPU {cpu_matmul.cpu_summary()}; {model.backend_line()}", flush=True)
    gens = {"ar": Generator(model, "ar"),
            "A": Generator(model, args.method, lookup_lengths=args.a),
            "B": Generator(model, args.method, lookup_lengths=args.b)}
    prompts = dev_set_prompts(gens["ar"], EVAL, args.limit, args.max_new_tokens)
    for gen in gens.values():
        gen.generate(prompts[0][1], max_new_tokens=8)  # compile
    want: dict[int, list[int]] = {}
    identical = {k: True for k in gens}
    per_pass = {k: [] for k in gens}
    rounds = {k: [0, 0] for k in gens}  # tokens, passes
    order = list(gens)
    for rep in range(args.repeats):
        tokens = {k: 0 for k in gens}
        seconds = {k: 0.0 for k in gens}
        for i, (_, ids) in enumerate(prompts):
            turn = order[(rep + i) % 3:] + order[:(rep + i) % 3]
            for k in turn:
                r = gens[k].generate(ids, max_new_tokens=args.max_new_tokens)[0]
                tokens[k] += len(r.tokens)
                seconds[k] += r.decode_s
                if rep == 0:
                    rounds[k][0] += len(r.tokens) - 1
                    rounds[k][1] += r.stats.get("target_passes") or len(r.tokens)
                if k == "ar":
                    want.setdefault(i, list(r.tokens))
        for k in gens:
            per_pass[k].append(tokens[k] / seconds[k])
        print(f"pass {rep + 1}: " + ", ".join(f"{k} {per_pass[k][-1]:.1f} tok/s" for k in gens), flush=True)
    for k in ("A", "B"):  # equality, checked on one more run of each prompt
        for i, (_, ids) in enumerate(prompts):
            identical[k] &= list(gens[k].generate(ids, max_new_tokens=args.max_new_tokens)[0].tokens) == want[i]
    print(f"\n{args.method}, dev sets ({len(prompts)} prompts, {args.max_new_tokens} new tokens), "
          f"median of {args.repeats} interleaved passes:")
    print("setting  lookup lengths  decode tok/s  x ar (median of per-pass ratios)  tokens/round  identical to ar")
    for k, label in (("ar", "-"), ("A", args.a), ("B", args.b)):
        ratio = statistics.median(p / a for p, a in zip(per_pass[k], per_pass["ar"]))
        print(f"{k:>7}  {label:>14}  {statistics.median(per_pass[k]):12.1f}  {ratio:5.3f}x  "
              f"{rounds[k][0] / max(rounds[k][1], 1):12.2f}  {'yes' if identical[k] else 'NO'}")
    b_vs_a = statistics.median(b / a for b, a in zip(per_pass["B"], per_pass["A"]))
    print(f"B vs A: {b_vs_a:.3f}x (median of per-pass ratios)")
    return 0 if identical["A"] and identical["B"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
