"""Fused q/k/v and gate/up projections against separate ones: ms per round inside the jitted loop.

Loads the model twice (``load_model(fused_projections=True/False)``), builds the same `ar` and fixed-
tree programs for both with ``benchmarks/round_cost.py``'s machinery, and times them interleaved
(each repeat calls every program once, the order rotated), so both variants see the same machine
state. Prints ms per round (median) and the fused/separate ratio per program, and checks that both
variants emitted the same tokens.

    python benchmarks/fused_projections.py --model smollm2-135m [--sizes 2,4,8,16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    import round_cost as rc
    from hsdjax.api import enable_compilation_cache, load_model
    from hsdjax.drafters import ARDrafter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="2,8,16", help="fixed tree sizes (nodes, root included)")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--bucket", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    enable_compilation_cache()
    opts = argparse.Namespace(seed=0, repeats=args.repeats, shape="tree")
    benches, programs = {}, {}
    for fused in (True, False):
        model = load_model(args.model, fused_projections=fused)
        target = rc.Target(model.name, model.cfg, model.params, False, model, model.fingerprint)
        bench = rc.Bench(target, opts)
        benches[fused] = bench
        token = int(target.prompt(1)[0])
        progs = {"ar": bench.program("ar", ARDrafter(), (), args.context, args.bucket, args.rounds)}
        for n in (int(s) for s in args.sizes.split(",")):
            progs[f"N={n}"] = bench.program(f"N={n}", rc.fixed_tree(n, token, "tree"), (), args.context, args.bucket,
                                            args.rounds)
        programs[fused] = progs
    names = list(programs[True])
    for fused in (True, False):  # warm-up
        for name in names:
            benches[fused].call(programs[fused][name])
    times = {(f, n): [] for f in (True, False) for n in names}
    pairs = [(f, n) for n in names for f in (True, False)]
    for r in range(args.repeats):
        for f, n in pairs[r % len(pairs):] + pairs[: r % len(pairs)]:
            times[(f, n)].append(benches[f].call(programs[f][n]))
    same = all(np.array_equal(np.asarray(programs[True][n].last.gen.seq), np.asarray(programs[False][n].last.gen.seq))
               for n in names)
    rows = {}
    for n in names:
        fused_ms, sep_ms = (1e3 * statistics.median(times[(f, n)]) for f in (True, False))
        rows[n] = {"fused_ms": round(fused_ms, 2), "separate_ms": round(sep_ms, 2), "ratio": round(fused_ms / sep_ms, 3)}
    print(f"{args.model}, {args.context} cached tokens in a {args.bucket}-slot cache, medians of {args.repeats}")
    print("| program | separate ms/round | fused ms/round | fused / separate | vs ar (separate -> fused) |")
    print("| --- | --- | --- | --- | --- |")
    for n, r in rows.items():
        vs = f"{r['separate_ms'] / rows['ar']['separate_ms']:.2f}x -> {r['fused_ms'] / rows['ar']['fused_ms']:.2f}x"
        print(f"| {n} | {r['separate_ms']:.1f} | {r['fused_ms']:.1f} | {r['ratio']:.3f} | {vs} |")
    print(f"same tokens: {'yes' if same else 'NO'}")
    if args.json:
        print(json.dumps({"rows": rows, "same_tokens": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
