"""`hsd` against `eagle` and `ar` on the dev sets: speed, acceptance and drafter work, side by side.

    python benchmarks/feature_drafters.py --limit 3 --max-new-tokens 256 \\
        --methods ar,eagle,hsd,hsd:refresh,hsd:min2
    python benchmarks/feature_drafters.py --limit 4 --acceptance-only \\
        --variant hsd-8k=hsd:PATH/TO/hsd-8k.safetensors --variant hsd-4k=hsd:PATH/TO/hsd-4k.safetensors

Greedy. Questions are taken from each dev set (mt_bench turns 1 and 2, gsm8k, humaneval, alpaca);
methods are compiled first, then interleaved question by question in a rotating order. Printed per
method: decode tokens/s and its ratio to `ar` (ratio of means, and median of per-question ratios),
mean accepted length, acceptance per depth, drafter passes and drafter states per generated token,
draft utilisation (accepted drafts / drafter states), reused states, and token-identity to `ar`.
A step-time split (target verification pass vs drafter) comes from the measured cost of a target
pass at the verified tree size. ``hsd:POLICY`` selects the chain refresh policy. ``--variant
LABEL=METHOD[,depth=D,width=W,budget=B]:CHECKPOINT`` adds a method with another drafter checkpoint
(``-``: the shipped one) and tree under its own label (ablations side by side). ``--acceptance-only``
skips the pass-cost timing and leaves the speed figures out: acceptance and the identity check do not
depend on timing, so such a run may share the CPUs with other work. Question reading, the runners,
the interleaving and the arithmetic are ``hsdjax.frontends.bench``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

DEV = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval"
DEPTHS_SHOWN = 10  # acceptance per depth: at least this many depths


def make_runner(model: Any, spec: str, opts: dict[str, Any], label: str | None = None) -> Any:
    """A runner for ``METHOD[:POLICY]`` (named ``label`` if given: a variant, whose options reach any
    method); the shared options reach the feature drafters only."""
    from hsdjax.core.methods import FEATURE_METHODS, options_for
    from hsdjax.frontends.api import Generator
    from hsdjax.frontends.bench.runners import LocalMethod

    method, _, policy = spec.partition(":")
    opts = dict(opts)
    if opts.pop("head", "screened") == "full":  # the argmax of the full float32 logits, not the int8 screen
        model = dataclasses.replace(model, cfg=model.cfg.replace(screened_head=False))
    extra = options_for(method, opts) if method in FEATURE_METHODS or label else {}
    if policy:
        extra["policy"] = policy
    gen = Generator(model, method, **extra)
    gen.method = label or spec
    return LocalMethod(gen)


def parse_variant(text: str) -> tuple[str, str, dict[str, Any]]:
    """``LABEL=METHOD[,KEY=VALUE...]:CHECKPOINT`` -> (label, method, options); CHECKPOINT ``-`` is the
    shipped drafter (or none: ``ar``, ``sps``, ``pld``); KEY is depth, width, budget, lookup (integers), lookup_lengths
    (A/B/C: chain length by match length), min_prob, sps's draft_length (fixed / adaptive), or head
    (``full``: greedy tokens from the full float32 logits instead of the int8 screen, for an A/B)."""
    label, eq, rest = text.partition("=")
    head, colon, path = rest.partition(":")
    method, *pairs = head.split(",")
    usage = (f"--variant {text!r}: expected LABEL=METHOD[,depth=D,width=W,budget=B,lookup=N,lookup_lengths=A/B/C,"
             "min_prob=P,grow_prob=P,draft_length=L,ahead=A,policy=P,head=full]:CHECKPOINT|-")
    if not (eq and colon and label and method in ("ar", "hsd", "eagle", "sps", "pld") and path):
        raise SystemExit(usage)
    from hsdjax.core.methods import OPTION_BY_NAME

    opts: dict[str, Any] = {}
    for pair in pairs:  # converted by the option's kind; ranges are checked where the drafter is made
        key, _, value = pair.partition("=")
        option = OPTION_BY_NAME.get(key)
        if key == "head":
            if value not in ("full", "screened"):
                raise SystemExit(usage)
            opts[key] = value
            continue
        if option is None or key in ("drafter", "draft_model"):
            raise SystemExit(usage)
        try:
            opts[key] = (int(value) if option.kind == "int" else float(value) if option.kind == "prob"
                         else value.replace("/", ",") if key == "lookup_lengths" else value)
        except ValueError:
            raise SystemExit(usage) from None
    if path != "-":
        if not Path(path).is_file():
            raise SystemExit(f"--variant {text!r}: no such checkpoint {path}")
        opts["drafter"] = path
    return label, method, opts


def dev_prompts(ar: Any, limit: int, max_new: int) -> list[tuple[str, list[int]]]:
    """(``set/tTURN``, token ids) for the first ``limit`` questions of each dev set and turn."""
    from hsdjax.frontends.bench.questions import dev_set_prompts

    return dev_set_prompts(ar, DEV, limit, max_new)


def run_interleaved(runners: list[Any], prompts: list[tuple[str, list[int]]], max_new: int
                    ) -> dict[str, list[dict[str, Any]]]:
    """Per runner, a row per prompt (set, tokens, decode seconds, the engine's counters); compiled first."""
    from hsdjax.frontends.bench.runners import rotations, warm_up

    warm_up(runners, lambda r: r.turn(prompts[0][1], max_new))
    rows: dict[str, list[dict[str, Any]]] = {r.name: [] for r in runners}
    for i, ((label, ids), order) in enumerate(rotations(prompts, runners)):
        for r in order:
            t = r.turn(ids, max_new)
            rows[r.name].append({"set": label, "tokens": t.tokens, "decode_s": t.decode_s, **t.stats})
        print(f"[{i + 1}/{len(prompts)}] {label}", file=sys.stderr, flush=True)
    return rows


def acceptance_after_previous(rs: list[dict[str, Any]], depths: int, top: int = 3) -> dict[str, Any]:
    """Acceptance per depth split by what the round before emitted (1: every draft rejected; 2: one
    draft accepted, ...; ``top`` or more pooled): with a chain kept across rounds, which states a tree
    reads depends on the previous round, so a fault in kept states shows up in one bucket only."""
    from hsdjax.frontends.bench.report import acceptance_given_reach, count_rounds

    groups: dict[int, list[int]] = {}
    for r in rs:
        a = r["accept_lengths"]
        for prev, cur in zip(a, a[1:]):
            groups.setdefault(min(prev, top), []).append(cur)
    return {f"after {k}{'+' if k == top else ''}": {"rounds": len(v), "per_depth": [
        round(p, 3) for p in acceptance_given_reach(count_rounds(v), depths)]} for k, v in sorted(groups.items())}


def summarize(rs: list[dict[str, Any]], base: list[dict[str, Any]], costs: dict[int, float]) -> dict[str, Any]:
    """One method's figures against ``ar`` (``base``), with the step-time split from the pass ``costs``."""
    from hsdjax.frontends.bench.report import (
        acceptance_given_reach,
        accepted_length,
        by_set,
        count_rounds,
        median_ratio,
        speed,
        speedup,
    )
    from hsdjax.frontends.tune import interpolate

    toks = sum(len(r["tokens"]) - 1 for r in rs)
    dec = [speed(len(r["tokens"]) - 1, r["decode_s"]) for r in rs]
    bdec = [speed(len(b["tokens"]) - 1, b["decode_s"]) for b in base]
    passes = sum(r["target_passes"] for r in rs)
    hist = count_rounds(a for r in rs for a in r["accept_lengths"])
    states = sum(r.get("drafter_states", 0) for r in rs)
    accepted = sum(len(r["tokens"]) - 1 - r["target_passes"] for r in rs)
    looked_up = sum(r.get("lookup_drafts", 0) for r in rs)  # supplied by a grafted lookup chain
    own = accepted - looked_up  # what the drafter's own work bought
    round_s = sum(r["decode_s"] for r in rs) / max(passes, 1)
    verify_s = interpolate(costs, int(round(statistics.mean(r["mean_tree_nodes"] for r in rs))))
    depths = max(DEPTHS_SHOWN, max(hist, default=0) - 1)
    return {
        "decode_tok_s": statistics.mean(dec), "ratio_of_means": speedup(dec, bdec),
        "median_ratio": median_ratio(dec, bdec),
        "accepted_length": accepted_length(toks, passes),
        "per_depth": [round(p, 3) for p in acceptance_given_reach(hist, depths)],
        "per_depth_after_previous": acceptance_after_previous(rs, depths),
        "draft_passes_per_token": sum(r.get("draft_passes", 0) for r in rs) / max(toks, 1),
        "drafter_states_per_token": states / max(toks, 1),
        "utilisation": (own / states) if states else None,
        "lookup_share": looked_up / accepted if accepted else None,
        "reused_states": sum(r.get("reused_states", 0) for r in rs),
        "drafter_mmacs_per_accepted": (sum(r.get("drafter_macs", 0.0) for r in rs) / 1e6 / own
                                       if own else None),
        "by_set": by_set(rs, base),
        "identical": sum(r["tokens"] == b["tokens"] for r, b in zip(rs, base)), "questions": len(rs),
        "round_ms": round_s * 1e3, "verify_pass_ms": verify_s * 1e3,
        "drafter_ms": max(round_s - verify_s, 0.0) * 1e3, "ar_pass_ms": costs[1] * 1e3,
    }


def print_after_previous(s: dict[str, Any]) -> None:
    print("    by the previous round's emitted tokens: " + "; ".join(
        f"{k} ({v['rounds']} rounds) {v['per_depth']}" for k, v in s["per_depth_after_previous"].items()))


def print_summary(summary: dict[str, dict[str, Any]], timed: bool = True) -> None:
    if not timed:
        print(f"{'method':<14} {'acc.len':>7} {'states/tok':>10} {'util':>6} {'reused':>6} {'MMAC/acc':>8} "
              f"{'== ar':>6}  accepted length by set")
        for name, s in summary.items():
            util = f"{s['utilisation']:.3f}" if s["utilisation"] is not None else "-"
            macs = f"{s['drafter_mmacs_per_accepted']:.2f}" if s["drafter_mmacs_per_accepted"] else "-"
            sets = ", ".join(f"{k} {v['accepted_length']:.2f}" for k, v in s["by_set"].items())
            print(f"{name:<14} {s['accepted_length']:>7.2f} {s['drafter_states_per_token']:>10.3f} {util:>6} "
                  f"{s['reused_states']:>6} {macs:>8} {s['identical']:>3}/{s['questions']}  {sets}")
        for name, s in summary.items():
            if name != "ar":
                print(f"{name}: acceptance per depth {s['per_depth']}")
                print_after_previous(s)
        return
    print(f"{'method':<12} {'dec tok/s':>9} {'x ar':>6} {'median':>6} {'acc.len':>7} {'pass/tok':>8} "
          f"{'states/tok':>10} {'util':>6} {'reused':>6} {'round ms':>8} {'verify':>6} {'drafter':>7} {'== ar':>6}")
    for name, s in summary.items():
        util = f"{s['utilisation']:.3f}" if s["utilisation"] is not None else "-"
        print(f"{name:<12} {s['decode_tok_s']:>9.1f} {s['ratio_of_means']:>5.2f}x {s['median_ratio']:>5.2f}x "
              f"{s['accepted_length']:>7.2f} {s['draft_passes_per_token']:>8.3f} {s['drafter_states_per_token']:>10.3f} "
              f"{util:>6} {s['reused_states']:>6} {s['round_ms']:>8.1f} {s['verify_pass_ms']:>6.1f} "
              f"{s['drafter_ms']:>7.1f} {s['identical']:>3}/{s['questions']}")
    for name, s in summary.items():
        if name != "ar":
            macs = s["drafter_mmacs_per_accepted"]
            print(f"{name}: acceptance per depth {s['per_depth']}; drafter M multiply-adds per accepted draft "
                  f"{macs:.2f}" if macs else f"{name}: acceptance per depth {s['per_depth']}")
            print_after_previous(s)
            print("    by set (accepted length / decode speed vs ar): " + ", ".join(
                f"{k} {v['accepted_length']:.2f} / {v['speedup']:.2f}x" for k, v in s["by_set"].items()))


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
    from hsdjax.frontends.api import enable_compilation_cache, load_model
    from hsdjax.frontends.tune import pass_cost

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
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=METHOD[,KEY=V...]:CHECKPOINT",
                   help="add METHOD (hsd, eagle or sps) with this drafter checkpoint ('-': the shipped one, or "
                        "none) and options (depth, width, budget, lookup, min_prob, draft_length), shown as LABEL "
                        "(repeatable)")
    p.add_argument("--acceptance-only", action="store_true",
                   help="acceptance and identity only: no pass-cost timing, no speed columns")
    p.add_argument("--json-out", default=None)
    p.add_argument("--kv-cache", default=None, choices=("float32", "float16", "bfloat16"),
                   help="KV cache storage for every method (default: the compute dtype)")
    p.add_argument("--coverage-data", default=None, help="drafter data folder: report how much of ar's output "
                   "draft vocabularies of 4,096 and 8,192 tokens built from it cover, per dev set")
    args = p.parse_args()
    enable_compilation_cache()
    model = load_model(args.model, cache_dtype=args.kv_cache)
    opts = {k: getattr(args, k) for k in ("depth", "width", "budget", "min_prob")
            if getattr(args, k) is not None}
    runners = []
    for spec in args.methods.split(","):
        path = args.hsd_drafter if spec.startswith("hsd") else args.eagle_drafter if spec == "eagle" else None
        runners.append(make_runner(model, spec, {**opts, "drafter": path} if path else opts))
    for label, method, extra in map(parse_variant, args.variant):
        runners.append(make_runner(model, method, {**opts, **extra}, label))
    ar = next(r for r in runners if r.name == "ar")
    prompts = dev_prompts(ar.gen, args.limit, args.max_new_tokens)
    rows = run_interleaved(runners, prompts, args.max_new_tokens)
    costs = ({n: 1.0 for n in (1, 2, 4, 8, 12, 16, 24)} if args.acceptance_only
             else pass_cost(model, nodes=(1, 2, 4, 8, 12, 16, 24)))
    base = rows["ar"]
    summary = {r.name: summarize(rows[r.name], base, costs) for r in runners}
    if args.acceptance_only:  # speeds of a run that may share the CPUs mean nothing: leave them out
        timing = ("decode_tok_s", "ratio_of_means", "median_ratio", "round_ms", "verify_pass_ms", "drafter_ms",
                  "ar_pass_ms")
        summary = {name: {**{k: v for k, v in s.items() if k not in timing},
                          "by_set": {k: {"accepted_length": v["accepted_length"]} for k, v in s["by_set"].items()}}
                   for name, s in summary.items()}
    print_summary(summary, timed=not args.acceptance_only)
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
