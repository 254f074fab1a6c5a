"""Where a round's time goes: an XLA profile of the jitted decoding loop, summed per kind of op.

    python experiments/profile_round.py [--model smollm2-135m] [--nodes 8] [--calls 3]
    HSDJAX_CPU_MATMUL=int8x python experiments/profile_round.py     # another matmul mode

Builds ``ar`` and a fixed tree of ``--nodes`` nodes with ``round_cost.py``'s machinery (200 cached
tokens, 1,024 bucket), traces ``--calls`` decode calls of each with ``jax.profiler`` (a perfetto trace
under ``--out``) and prints, per round, the time of each kind of XLA op (fusion kinds with their
numbers stripped, custom calls) and the custom calls of one layer by their place in it (for SmolLM2:
q, k, v, attention, o, gate, up, down), then the LM head. Profiling slows everything a little and the
split between threads is not shown: read shares and differences between the two programs, not times.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # round_cost / feature_drafters


def op_totals(trace_dir: str) -> tuple[collections.Counter, collections.Counter, list[tuple[str, float]]]:
    """(microseconds per op kind, calls per op kind, custom calls in first-seen order with their totals)."""
    path = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, calls, ffi = collections.Counter(), collections.Counter(), {}
    for e in sorted((e for e in events if e.get("ph") == "X" and "dur" in e), key=lambda e: e["ts"]):
        name = e["name"]
        if name.startswith(("$", "end:", "ThunkExecutor", "PjitFunction", "Common", "Handle", "while")):
            continue
        if e.get("args", {}).get("hlo_module", "").startswith("jit_copy"):  # the fresh state each call starts from
            continue
        kind = re.sub(r"\.\d+$", "", name)
        total[kind] += e["dur"]
        calls[kind] += 1
        if kind == "ffi_call":
            ffi[name] = ffi.get(name, 0.0) + e["dur"]
    return total, calls, list(ffi.items())


def main(argv: list[str] | None = None) -> int:
    import jax
    import round_cost as rc

    from hsdjax.core.drafters import ARDrafter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nodes", type=int, default=8, help="tree size (root included)")
    ap.add_argument("--calls", type=int, default=3, help="traced decode calls per program (32 rounds each)")
    ap.add_argument("--top", type=int, default=16, help="op kinds shown")
    ap.add_argument("--out", default="/tmp/hsdjax-profile", help="trace folder (replaced)")
    args = ap.parse_args(argv)
    rargs = rc.parse_args(["--model", args.model, "--rounds", "32"])
    target = rc.make_target(rargs)
    bench = rc.Bench(target, rargs)
    progs = [bench.program("ar", ARDrafter(), (), 200, 1024, 32),
             bench.program(f"N={args.nodes}", rc.fixed_tree(args.nodes, target.cfg.vocab_size - 1), (), 200, 1024, 32)]
    layers = target.cfg.num_layers
    for p in progs:
        bench.call(p)
        folder = Path(args.out) / p.label.replace("=", "")
        shutil.rmtree(folder, ignore_errors=True)
        with jax.profiler.trace(str(folder), create_perfetto_trace=True):
            for _ in range(args.calls):
                bench.call(p)
        rounds = args.calls * int(p.last.stats.target_passes[0])
        total, calls, ffi = op_totals(str(folder))
        print(f"== {p.label}: microseconds per round (calls per round), {rounds} rounds traced")
        for kind, us in total.most_common(args.top):
            print(f"{us / rounds:10.1f} ({calls[kind] / rounds:5.1f})  {kind}")
        per_layer = len(ffi) // layers if layers else 0
        if per_layer:
            places = [sum(us for _, us in ffi[i:layers * per_layer:per_layer]) / rounds for i in range(per_layer)]
            rest = sum(us for _, us in ffi[layers * per_layer:]) / rounds
            print("   custom calls by place in a layer: " + ", ".join(f"{i}: {t:.0f}" for i, t in enumerate(places))
                  + f"; after the layers (LM head): {rest:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
