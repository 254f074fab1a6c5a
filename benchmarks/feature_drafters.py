"""`hsd` against `eagle` and `ar` on the dev sets: speed, acceptance and drafter work, side by side.

    python benchmarks/feature_drafters.py --limit 3 --max-new-tokens 256 \\
        --methods ar,eagle,hsd,hsd:refresh,hsd:min2

Greedy. Questions are taken from each dev set (mt_bench turns 1 and 2, gsm8k, humaneval, alpaca);
methods are compiled first, then interleaved question by question in a rotating order. Printed per
method: decode tokens/s and its ratio to `ar` (ratio of means, and median of per-question ratios),
mean accepted length, acceptance per depth, drafter passes and drafter states per generated token,
draft utilisation (accepted drafts / drafter states), reused states, and token-identity to `ar`.
A step-time split (target verification pass vs drafter) comes from the measured cost of a target
pass at the verified tree size. ``hsd:POLICY`` selects the chain refresh policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from methods import build_prompts  # noqa: E402

DEV = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval"
SETS = [("mt_bench", 1), ("mt_bench", 2), ("gsm8k", 1), ("humaneval", 1), ("alpaca", 1)]


def make_generator(model: Any, spec: str, opts: dict[str, Any]) -> Any:
    from hsdjax.api import Generator

    method, _, policy = spec.partition(":")
    extra = dict(opts) if method in ("hsd", "eagle") else {}
    if policy:
        extra["policy"] = policy
    gen = Generator(model, method, **extra)
    gen.method = spec
    return gen


def per_depth(hist: list[int]) -> list[float]:
    """P(a round accepts >= d drafts | it accepted >= d-1), d = 1, 2, ..."""
    out = []
    for d in range(1, len(hist) - 1):
        reach = sum(hist[d:])
        more = sum(hist[d + 1:])
        out.append(round(more / reach, 3) if reach else 0.0)
    return out


def by_set(rs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Accepted length and decode speed vs ``ar`` (ratio of summed times) per dev set (turns apart)."""
    out = {}
    for name in dict.fromkeys(r["set"] for r in rs):
        pairs = [(r, b) for r, b in zip(rs, base) if r["set"] == name]
        toks = sum(len(r["tokens"]) - 1 for r, _ in pairs)
        passes = sum(r["target_passes"] for r, _ in pairs)
        speed = toks / max(sum(r["decode_s"] for r, _ in pairs), 1e-9)
        base_speed = sum(len(b["tokens"]) - 1 for _, b in pairs) / max(sum(b["decode_s"] for _, b in pairs), 1e-9)
        out[name] = {"accepted_length": toks / max(passes, 1), "speedup": speed / base_speed}
    return out


def vocab_coverage(folder: Path, base: list[dict[str, Any]], sizes: tuple[int, ...], vocab_size: int
                   ) -> dict[int, dict[str, float]]:
    """Per dev set: the share of ``ar``'s greedy tokens inside a draft vocabulary of each size, built as
    training builds it (the target's most frequent top-1 tokens over the drafter data in ``folder``)."""
    import numpy as np

    from hsdjax.train.train import draft_vocab

    man = json.loads((folder / "manifest.json").read_text())
    top1 = []
    for shard in man["shards"]:
        with np.load(folder / shard["file"]) as z:
            top1.append(z["top_ids"][:, :1])
    top = np.concatenate(top1)
    out = {}
    for size in sizes:
        vocab = draft_vocab(top, size, vocab_size)
        out[size] = {}
        for name in dict.fromkeys(r["set"] for r in base):
            toks = np.concatenate([np.asarray(r["tokens"]) for r in base if r["set"] == name])
            out[size][name] = float(np.isin(toks, vocab).mean())
    return out


def main() -> int:
    from hsdjax.api import enable_compilation_cache, load_model
    from hsdjax.tune import interpolate, pass_cost

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="ar,eagle,hsd")
    p.add_argument("--limit", type=int, default=2, help="questions per dev set")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--min-prob", type=float, default=None)
    p.add_argument("--hsd-drafter", default=None)
    p.add_argument("--eagle-drafter", default=None)
    p.add_argument("--json-out", default=None)
    p.add_argument("--coverage-data", default=None, help="drafter data folder: report how much of ar's output "
                   "draft vocabularies of 4,096 and 8,192 tokens built from it cover, per dev set")
    args = p.parse_args()
    enable_compilation_cache()
    model = load_model(args.model)
    opts = {k: getattr(args, k) for k in ("depth", "width", "budget", "min_prob")
            if getattr(args, k) is not None}
    specs = args.methods.split(",")
    gens = []
    for spec in specs:
        o = dict(opts)
        path = args.hsd_drafter if spec.startswith("hsd") else args.eagle_drafter if spec == "eagle" else None
        if path:
            o["drafter"] = path
        gens.append(make_generator(model, spec, o))
    ar = next(g for g in gens if g.method == "ar")
    prompts = []
    for name, turn in SETS:
        qs = [json.loads(line) for line in (DEV / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        prompts += [(f"{name}/t{turn}", ids) for ids in build_prompts(ar, qs[: args.limit], turn, args.max_new_tokens)]
    for g in gens:  # compile every shape first
        g.generate(prompts[0][1], max_new_tokens=args.max_new_tokens)
    rows: dict[str, list[dict[str, Any]]] = {g.method: [] for g in gens}
    for i, (label, ids) in enumerate(prompts):
        order = gens[i % len(gens):] + gens[: i % len(gens)]
        for g in order:
            r = g.generate(ids, max_new_tokens=args.max_new_tokens)[0]
            rows[g.method].append({"set": label, "tokens": r.tokens, "decode_s": r.decode_s, **r.stats})
        print(f"[{i + 1}/{len(prompts)}] {label}", file=sys.stderr, flush=True)
    costs = pass_cost(model, nodes=(1, 2, 4, 8, 12, 16, 24))
    base = rows["ar"]
    summary = {}
    for g in gens:
        rs = rows[g.method]
        toks = sum(len(r["tokens"]) - 1 for r in rs)
        dec = [(len(r["tokens"]) - 1) / r["decode_s"] for r in rs]
        bdec = [(len(b["tokens"]) - 1) / b["decode_s"] for b in base]
        passes = sum(r["target_passes"] for r in rs)
        hist = [sum(h) for h in zip(*[r["accept_hist"] + [0] * (12 - len(r["accept_hist"])) for r in rs])]
        states = sum(r.get("drafter_states", 0) for r in rs)
        accepted = sum(len(r["tokens"]) - 1 - r["target_passes"] for r in rs)
        round_s = sum(r["decode_s"] for r in rs) / max(passes, 1)
        verify_s = interpolate(costs, int(round(statistics.mean(r["mean_tree_nodes"] for r in rs))))
        summary[g.method] = {
            "decode_tok_s": statistics.mean(dec), "ratio_of_means": statistics.mean(dec) / statistics.mean(bdec),
            "median_ratio": statistics.median(a / b for a, b in zip(dec, bdec)),
            "accepted_length": toks / max(passes, 1), "per_depth": per_depth(hist),
            "drafter_passes_per_token": sum(r.get("drafter_passes", 0) for r in rs) / max(toks, 1),
            "drafter_states_per_token": states / max(toks, 1),
            "utilisation": (accepted / states) if states else None,
            "reused_states": sum(r.get("reused_states", 0) for r in rs),
            "drafter_mmacs_per_accepted": (sum(r.get("drafter_macs", 0.0) for r in rs) / 1e6 / accepted
                                           if accepted else None),
            "by_set": by_set(rs, base),
            "identical": sum(r["tokens"] == b["tokens"] for r, b in zip(rs, base)), "questions": len(rs),
            "round_ms": round_s * 1e3, "verify_pass_ms": verify_s * 1e3,
            "drafter_ms": max(round_s - verify_s, 0.0) * 1e3, "ar_pass_ms": costs[1] * 1e3,
        }
    print(f"{'method':<12} {'dec tok/s':>9} {'x ar':>6} {'median':>6} {'acc.len':>7} {'pass/tok':>8} "
          f"{'states/tok':>10} {'util':>6} {'reused':>6} {'round ms':>8} {'verify':>6} {'drafter':>7} {'== ar':>6}")
    for name, s in summary.items():
        util = f"{s['utilisation']:.3f}" if s["utilisation"] is not None else "-"
        print(f"{name:<12} {s['decode_tok_s']:>9.1f} {s['ratio_of_means']:>5.2f}x {s['median_ratio']:>5.2f}x "
              f"{s['accepted_length']:>7.2f} {s['drafter_passes_per_token']:>8.3f} {s['drafter_states_per_token']:>10.3f} "
              f"{util:>6} {s['reused_states']:>6} {s['round_ms']:>8.1f} {s['verify_pass_ms']:>6.1f} "
              f"{s['drafter_ms']:>7.1f} {s['identical']:>3}/{s['questions']}")
    for name, s in summary.items():
        if name != "ar":
            macs = s["drafter_mmacs_per_accepted"]
            print(f"{name}: acceptance per depth {s['per_depth']}; drafter M multiply-adds per accepted draft "
                  f"{macs:.2f}" if macs else f"{name}: acceptance per depth {s['per_depth']}")
            print("    by set (accepted length / decode speed vs ar): " + ", ".join(
                f"{k} {v['accepted_length']:.2f} / {v['speedup']:.2f}x" for k, v in s["by_set"].items()))
    coverage = None
    if args.coverage_data:
        coverage = vocab_coverage(Path(args.coverage_data), base, (4096, 8192), model.cfg.vocab_size)
        for size, per_set in coverage.items():
            print(f"draft vocabulary {size}: covers " + ", ".join(f"{k} {v:.3f}" for k, v in per_set.items())
                  + " of ar's tokens")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary, "rows": rows, "coverage": coverage},
                                                  indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
