"""Speculative methods against plain decoding (and transformers peers) on Spec-Bench question files.

    python benchmarks/methods.py --model smollm2-135m --methods ar,pld \\
        --questions ../shared/data/eval/humaneval.jsonl --limit 20 --max-new-tokens 128
    python benchmarks/methods.py --model qwen2.5-coder-1.5b --methods ar,sps --peers hf-ar,hf-assisted \\
        --questions ../shared/data/eval/humaneval.jsonl --limit 8

Greedy. Every method is compiled before timing; methods (and peers, in worker subprocesses) are
interleaved question by question, in a rotating order, so machine drift hits all alike (question reading,
runners, interleaving and arithmetic are ``hsdjax.bench``'s; ``hsdjax bench`` is the resumable harness
with Spec-Bench answer files, this script adds decode-only figures and ``--turn``). For each method
it prints Spec-Bench's arithmetic (mean over questions of new tokens / seconds, speed-up = ratio of those
means against ``ar``), the median of per-question ratios, decode-only figures, the mean accepted length
(new tokens per target pass), and whether every output is token-identical to ``ar``.
``--turn 2`` measures the second turn of two-turn questions (turn 1 answered by ``ar`` first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def decode_speed(t: Any) -> float | None:
    """Tokens/s after the first new token (which comes out of the prefill)."""
    n = len(t.tokens) - 1
    return n / t.decode_s if n > 0 and t.decode_s > 0 else None


def summarize(runners: list[Any], turns: dict[str, list[Any]]) -> dict[str, Any]:
    from hsdjax.bench.report import accepted_length, median_ratio, speed, speedup

    base = turns["ar"]
    base_e2e = [speed(len(t.tokens), t.wall_time) for t in base]
    base_dec = [d for d in map(decode_speed, base) if d]
    out = {}
    for r in runners:
        ts = turns[r.name]
        e2e = [speed(len(t.tokens), t.wall_time) for t in ts]
        dec = [d for d in map(decode_speed, ts) if d]
        row = {
            "external": r.external,
            "mean_tokens_per_s": statistics.mean(e2e),
            "mean_decode_tokens_per_s": statistics.mean(dec) if dec else None,
            "speedup_vs_ar": speedup(e2e, base_e2e),
            "median_ratio_vs_ar": median_ratio(e2e, base_e2e),
            "identical_to_ar": sum(a.tokens == b.tokens for a, b in zip(ts, base)),
            "questions": len(ts),
        }
        if dec and decode_speed(base[0]):
            row["decode_speedup_vs_ar"] = speedup(dec, base_dec)
        if not r.external:
            row["mean_accepted_length"] = accepted_length(sum(len(t.tokens) - 1 for t in ts),
                                                          sum(t.target_passes for t in ts))
        out[r.name] = row
    return out


def print_report(summary: dict[str, Any], header: str) -> None:
    print(header)
    print(f"{'method':<12} {'tok/s':>7} {'speed-up':>8} {'median':>7} {'decode tok/s':>12} {'decode x':>8} "
          f"{'acc.len':>7} {'== ar':>7}")
    for name, r in summary.items():
        dec = f"{r['mean_decode_tokens_per_s']:.1f}" if r["mean_decode_tokens_per_s"] else "-"
        decx = f"{r['decode_speedup_vs_ar']:.2f}x" if r.get("decode_speedup_vs_ar") else "-"
        acc = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
        label = name + (" (ext)" if r["external"] else "")
        print(f"{label:<12} {r['mean_tokens_per_s']:>7.1f} {r['speedup_vs_ar']:>7.2f}x {r['median_ratio_vs_ar']:>6.2f}x "
              f"{dec:>12} {decx:>8} {acc:>7} {r['identical_to_ar']:>3}/{r['questions']:<3}")


def run_interleaved(runners: list[Any], prompts: list[list[int]], max_new: int) -> dict[str, list[Any]]:
    """Every runner on every prompt (compiled / loaded first), in a rotating order."""
    from hsdjax.bench.runners import rotations, warm_up

    warm_up(runners, lambda r: r.turn(prompts[0], max_new))
    turns: dict[str, list[Any]] = {r.name: [] for r in runners}
    t0 = time.perf_counter()
    for i, (ids, order) in enumerate(rotations(prompts, runners)):
        for r in order:
            turns[r.name].append(r.turn(ids, max_new))
        progress(f"question {i + 1}/{len(prompts)} ({time.perf_counter() - t0:.0f}s)")
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="ar,pld")
    parser.add_argument("--peers", default="", help="comma-separated: hf-ar, hf-assisted, hf-pld, llamacpp")
    parser.add_argument("--questions", action="append", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--turn", type=int, choices=(1, 2), default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)

    from hsdjax.api import load_model
    from hsdjax.bench.questions import build_prompts, select_questions
    from hsdjax.bench.runners import make_runners
    from hsdjax.errors import HsdjaxError

    notes: list[str] = []
    try:
        questions, _ = select_questions(args.questions, args.limit)
        model = load_model(args.model)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if "ar" not in methods:
            methods.insert(0, "ar")
        peers = [p for p in args.peers.split(",") if p]
        opts = {k: v for k, v in (("draft_model", args.draft_model), ("depth", args.depth), ("width", args.width))
                if v is not None}
        runners, workers = make_runners(model, list(dict.fromkeys([*methods, *peers])), opts, 0.0,
                                        "float32", notes)
    except HsdjaxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        progress(note)
    progress(f"{len(questions)} questions; building prompts (turn {args.turn})")
    try:
        prompts = build_prompts(runners[0].gen, questions, args.turn, args.max_new_tokens)
        turns = run_interleaved(runners, prompts, args.max_new_tokens)
    finally:
        for w in workers:
            w.close()
    summary = summarize(runners, turns)
    header = (f"{args.model}, greedy, {args.max_new_tokens} new tokens, {len(prompts)} questions from "
              f"{', '.join(Path(q).name for q in args.questions)} (turn {args.turn}); means over questions")
    print_report(summary, header)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
