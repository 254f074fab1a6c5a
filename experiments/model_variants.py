"""Two variants of the same model, ms per round inside the jitted loop: ``--compare fused`` (q/k/v and
gate/up as one matmul each against separate ones: ``load_model(fused_projections=True/False)``) or
``--compare screened`` (the LM head's greedy tokens through the int8 screen, ``cpu_matmul.screened_argmax``,
against the argmax of the full float32 logits: the same params, ``cfg.screened_head`` on / off).

Builds the same `ar` and fixed-tree programs for both with ``benchmarks/round_cost.py``'s machinery
and times them interleaved (each repeat calls every program once, the order rotated), so both
variants see the same machine state. Prints ms per round (median) and the ratio per program, and
checks that both variants emitted the same tokens.

    python experiments/model_variants.py --compare screened --model smollm2-135m [--sizes 2,4,8,16] [--methods pld,hsd]
        [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # round_cost / feature_drafters


def tokens_per_round(p) -> float:
    """Tokens per round of a program's last call."""
    st0, st = p.state0, p.last
    return float(st.gen.seq_len[0] - st0.gen.seq_len[0]) / max(int(st.stats.target_passes[0]), 1)


VARIANTS = {"fused": ("fused", "separate"), "screened": ("screened", "full")}  # (new, old) labels


def main(argv: list[str] | None = None) -> int:
    import dataclasses

    import numpy as np
    import round_cost as rc

    from hsdjax.core.drafters import ARDrafter
    from hsdjax.frontends.api import enable_compilation_cache, load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=sorted(VARIANTS), default="fused")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="2,8,16", help="fixed tree sizes (nodes, root included)")
    ap.add_argument("--methods", default="", help="also real rounds of these shipped methods (pld, hsd, eagle): "
                    "ms per round, tokens per round in the last column")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--bucket", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    enable_compilation_cache()
    opts = argparse.Namespace(seed=0, repeats=args.repeats, shape="tree")
    benches, programs = {}, {}
    new_name, old_name = VARIANTS[args.compare]
    base = load_model(args.model) if args.compare == "screened" else None
    if base is not None and not base.cfg.screened_head:
        raise SystemExit(f"{args.model} has no int8-screened head here (8-bit head and AVX512-VNNI needed)")
    for fused in (True, False):
        if base is not None:
            model = base if fused else dataclasses.replace(base, cfg=base.cfg.replace(screened_head=False))
        else:
            model = load_model(args.model, fused_projections=fused)
        target = rc.Target(model.name, model.cfg, model.params, False, model, model.fingerprint)
        bench = rc.Bench(target, opts)
        benches[fused] = bench
        token = int(target.prompt(1)[0])
        progs = {"ar": bench.program("ar", ARDrafter(), (), args.context, args.bucket, args.rounds)}
        for n in (int(s) for s in args.sizes.split(",") if s):
            progs[f"N={n}"] = bench.program(f"N={n}", rc.fixed_tree(n, token, "tree"), (), args.context, args.bucket,
                                            args.rounds)
        for m in (m for m in args.methods.split(",") if m):  # the shipped drafters' real rounds
            d, dp = rc.pld_drafter(target) if m == "pld" else rc.feature_drafter(target, m)
            progs[m] = bench.program(m, d, dp, args.context, args.bucket, args.rounds, d.prompt_layers)
        programs[fused] = progs
    names = list(programs[True])
    for fused in (True, False):  # warm-up
        for name in names:
            benches[fused].call(programs[fused][name])
    times = {(f, n): [] for f in (True, False) for n in names}
    for r in range(args.repeats):  # the order rotated, and which variant goes first alternates (the program
        # run right after a switch pays for it: measured up to 6% on `ar` when one variant always went first)
        pairs = [(f, n) for n in names for f in ((True, False) if r % 2 else (False, True))]
        for f, n in pairs[r % len(pairs):] + pairs[: r % len(pairs)]:
            times[(f, n)].append(benches[f].call(programs[f][n]))
    same = all(np.array_equal(np.asarray(programs[True][n].last.gen.seq), np.asarray(programs[False][n].last.gen.seq))
               for n in names)
    rows = {}
    for n in names:
        fused_ms, sep_ms = (1e3 * statistics.median(times[(f, n)]) for f in (True, False))
        rows[n] = {f"{new_name}_ms": round(fused_ms, 2), f"{old_name}_ms": round(sep_ms, 2),
                   "ratio": round(fused_ms / sep_ms, 3)}
    print(f"{args.model}, {args.context} cached tokens in a {args.bucket}-slot cache, medians of {args.repeats}")
    print(f"| program | {old_name} ms/round | {new_name} ms/round | {new_name} / {old_name} | "
          f"vs ar ({old_name} -> {new_name}) |")
    print("| --- | --- | --- | --- | --- |")
    for n, r in rows.items():
        old, new, ar = r[f"{old_name}_ms"], r[f"{new_name}_ms"], rows["ar"]
        vs = f"{old / ar[f'{old_name}_ms']:.2f}x -> {new / ar[f'{new_name}_ms']:.2f}x"
        if not (n == "ar" or n.startswith("N=")):  # a method's rounds: x ar per token, and tokens per round
            tpr = tokens_per_round(programs[True][n])
            vs = (f"{ar[f'{old_name}_ms'] * tpr / old:.2f}x -> {ar[f'{new_name}_ms'] * tpr / new:.2f}x `ar` per token "
                  f"({tpr:.2f} tokens per round)")
        print(f"| {n} | {old:.1f} | {new:.1f} | {r['ratio']:.3f} | {vs} |")
    print(f"same tokens: {'yes' if same else 'NO'}")
    if args.json:
        print(json.dumps({"rows": rows, "same_tokens": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
