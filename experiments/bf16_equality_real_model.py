"""How often greedy speculative output differs from `ar`'s in bfloat16, and where the first difference falls.

    python experiments/bf16_equality_real_model.py                       # 1 question per dev set, 64 new tokens
    python experiments/bf16_equality_real_model.py --limit 4 --max-new-tokens 128 --methods pld,hsd,eagle,sps --json

In float32 every method's greedy output equals `ar`'s token for token (the test suite asserts it). In
bfloat16 it need not: a tree pass computes the same logits as `ar`'s one-token step through matmuls of
another shape, whose bfloat16 rounding differs, so where the two best tokens are nearly tied the
argmax can flip, and the outputs part from there on. This script counts it on the dev prompts
(``hsdjax.frontends.bench.questions.DEV_SETS``: mt_bench turns 1 and 2, gsm8k, humaneval, alpaca; the first
``--limit`` questions of each), batch 1, greedy: per method and dtype, how many prompts' outputs differ
from the same dtype's `ar`, the index of the first differing new token (0-based) of each, and the share
of all new tokens generated before the first difference. float32 is the control: any difference there
is a bug, and the exit status is 1.

The prompts are built once (mt_bench turn 2 holds float32 `ar`'s answer to turn 1), so every dtype and
method sees the same token ids. XLA's CPU backend is slow in bfloat16, and each prompt length compiles
its own programs: the default run (5 prompts, 64 tokens, pld and hsd) took 20 minutes on a shared 2-core
EPYC, most of it compiling (a second run reads the programs from JAX's persistent cache).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

DEV = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval"  # beside the checkout


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(base: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Per-prompt first differences of ``other`` from ``base`` and their summary."""
    firsts = [first_difference(b, o) for b, o in zip(base, other)]
    hit = [f for f in firsts if f is not None]
    total = sum(len(b) for b in base)
    before = sum(len(b) if f is None else f for b, f in zip(base, firsts))
    return {"prompts": len(base), "differ": len(hit), "first_difference": firsts,
            "median_first_difference": statistics.median(hit) if hit else None,
            "tokens_before_first_difference": round(before / total, 4) if total else None}


def run_dtype(model_name: str, dtype: str, methods: list[str], prompts: list[tuple[str, list[int]]],
              max_new: int, cpu_matmul: str | None) -> dict[str, Any]:
    """Greedy outputs of `ar` and ``methods`` in ``dtype`` (batch 1, one prompt at a time), compared."""
    from hsdjax.frontends.api import Generator, load_model

    model = load_model(model_name, dtype=dtype, cpu_matmul=cpu_matmul)
    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for method in ["ar", *methods]:
        gen = Generator(model, method)
        t0 = time.perf_counter()
        outputs[method] = [gen.generate(ids, max_new_tokens=max_new)[0].tokens for _, ids in prompts]
        seconds[method] = round(time.perf_counter() - t0, 1)
        print(f"  {dtype} {method}: {seconds[method]} s", file=sys.stderr, flush=True)
    return {"seconds": seconds, "methods": {m: compare(outputs["ar"], outputs[m]) for m in methods}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="registered model name or path (default: the default model)")
    ap.add_argument("--methods", default="pld,hsd", help="speculative methods, comma-separated (default pld,hsd)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="float32 is the control (must not differ)")
    ap.add_argument("--limit", type=int, default=1, help="questions per dev set and turn (default 1: 5 prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--questions-dir", default=str(DEV), help="folder of the Spec-Bench question files")
    ap.add_argument("--cpu-matmul", default=None, help="for the float32 run (see load_model); default: auto")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if "ar" in methods:
        ap.error("--methods: `ar` is the baseline, name only speculative methods")

    from hsdjax.frontends.api import Generator, load_model
    from hsdjax.frontends.bench.questions import dev_set_prompts

    t0 = time.perf_counter()
    prompts = dev_set_prompts(Generator(load_model(args.model), "ar"), args.questions_dir, args.limit,
                              args.max_new_tokens)
    out: dict[str, Any] = {
        "command": " ".join(["python", "experiments/bf16_equality_real_model.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": platform.processor() or platform.machine(), "max_new_tokens": args.max_new_tokens,
        "prompts": [label for label, _ in prompts], "dtypes": {}}
    for dtype in args.dtypes.split(","):
        out["dtypes"][dtype] = run_dtype(args.model, dtype, methods, prompts, args.max_new_tokens,
                                         args.cpu_matmul if dtype == "float32" else "off")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    control = out["dtypes"].get("float32", {}).get("methods", {})
    failed = [m for m, r in control.items() if r["differ"]]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{len(prompts)} dev prompts, {args.max_new_tokens} new tokens, greedy, batch 1 ({out['seconds']} s)")
        print(f"{'dtype':9s} {'method':7s} {'differ':>8s}  {'median first':>12s}  {'before 1st':>10s}  "
              "first difference")
        for dtype, res in out["dtypes"].items():
            for m, r in res["methods"].items():
                firsts = ", ".join("-" if f is None else str(f) for f in r["first_difference"])
                med = "-" if r["median_first_difference"] is None else f"{r['median_first_difference']:g}"
                print(f"{dtype:9s} {m:7s} {r['differ']:>3d} / {r['prompts']:<2d}  {med:>12s}  "
                      f"{r['tokens_before_first_difference']:>10.1%}  [{firsts}]")
    if failed:
        print(f"float32 control FAILED: {', '.join(failed)} differ from `ar`", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
