"""How often greedy speculative output differs from plain decoding in bfloat16 (what is guaranteed).

In float32 the engine's speculative methods reproduce `ar` token for token (the test suites check it).
In bfloat16 a T-token verification pass and a one-token decoding step may round differently (other
matmul shapes, other summation orders), so at a near-tie the argmax can flip and the two outputs then
diverge. This script measures how often that happens on tiny random models of both families: for N
random prompts it decodes greedily with `ar` and with each method in bfloat16 (and, as a control, in
float32) and prints the share of outputs that differ and the mean position of the first difference.

    python experiments/bf16_equality.py [--prompts 64] [--max-new-tokens 48] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(family: str, dtype: str, n_prompts: int, max_new: int, seed: int = 0) -> dict[str, dict[str, float]]:
    from hsdjax.core.drafters.pld import PromptLookupDrafter
    from hsdjax.runtime.model import init_params
    from tests.conftest import TINY_LLAMA, TINY_QWEN, run_engine
    from tests.test_feature_drafters import feature_drafter

    cfg = (TINY_LLAMA if family == "llama" else TINY_QWEN).replace(dtype=dtype)
    params = init_params(cfg, seed=1)
    rng = np.random.RandomState(seed)
    prompts = [list(rng.randint(0, cfg.vocab_size, rng.randint(4, 40))) for _ in range(n_prompts)]
    want = run_engine(cfg, params, prompts, max_new)
    drafters = {"pld": (PromptLookupDrafter(), ())}
    for method in ("hsd", "eagle"):
        drafters[method] = feature_drafter(cfg, params, method, depth=4, width=3, budget=5)
    out = {}
    for name, (drafter, dparams) in drafters.items():
        got = run_engine(cfg, params, prompts, max_new, drafter=drafter, dparams=dparams)
        diffs = [first_difference(a, b) for a, b in zip(want, got)]
        where = [d for d in diffs if d is not None]
        out[name] = {"differ": round(len(where) / len(prompts), 4),
                     "mean_first_difference": round(float(np.mean(where)), 1) if where else None}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = {}
    for family in ("llama", "qwen2"):
        for dtype in ("float32", "bfloat16"):
            results[f"{family}/{dtype}"] = r = measure(family, dtype, args.prompts, args.max_new_tokens)
            cells = ", ".join(f"{m}: {v['differ']:.0%} differ" + (f" (first at token {v['mean_first_difference']})"
                                                                   if v["mean_first_difference"] is not None else "")
                              for m, v in r.items())
            print(f"{family:6s} {dtype:9s} {cells}", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
