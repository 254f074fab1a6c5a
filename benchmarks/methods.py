"""Speculative methods against plain decoding (and transformers peers) on Spec-Bench question files.

    python benchmarks/methods.py --model smollm2-135m --methods ar,pld \\
        --questions ../shared/data/eval/humaneval.jsonl --limit 20 --max-new-tokens 128
    python benchmarks/methods.py --model qwen2.5-coder-1.5b --methods ar,sps --peers hf-ar,hf-assisted \\
        --questions ../shared/data/eval/humaneval.jsonl --limit 8

Greedy. Every method is compiled before timing; methods (and peers, each in its own subprocess) are
interleaved question by question, in a rotating order, so machine drift hits all alike. For each method
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ar_vs_transformers import Run, TransformersEngine, progress  # noqa: E402



def read_questions(paths: list[str], limit: int | None) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        lines = Path(path).read_text().splitlines()
        items = [json.loads(line) for line in lines if line.strip()]
        out.extend(items[:limit] if limit else items)
    return out


def build_prompts(gen: Any, questions: list[dict[str, Any]], turn: int, max_new: int) -> list[list[int]]:
    """Token ids per question; for turn 2, turn 1 is answered greedily by ``gen`` first."""
    prompts = []
    for q in questions:
        messages = [{"role": "user", "content": q["turns"][0]}]
        if turn == 2 and len(q["turns"]) > 1:
            answer = gen.generate(messages, max_new_tokens=max_new)[0].text
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}]
        prompts.append(gen.encode_prompt(messages))
    return prompts


class Method:
    def __init__(self, gen: Any):
        self.gen, self.name = gen, gen.method
        self.passes: list[int] = []

    def run(self, ids: list[int], max_new: int) -> Run:
        r = self.gen.generate(ids, max_new_tokens=max_new)[0]
        self.passes.append(r.stats["target_passes"])
        return Run(r.tokens, r.prefill_s, r.decode_s)


def summarize(engines: list[Any], runs: dict[str, list[Run]]) -> dict[str, Any]:
    base = runs["ar"]
    out = {}
    for e in engines:
        rs = runs[e.name]
        e2e = [r.tokens_per_s for r in rs]
        dec = [r.decode_tokens_per_s for r in rs if r.decode_tokens_per_s]
        row = {
            "external": not isinstance(e, Method),
            "mean_tokens_per_s": statistics.mean(e2e),
            "mean_decode_tokens_per_s": statistics.mean(dec) if dec else None,
            "speedup_vs_ar": statistics.mean(e2e) / statistics.mean(r.tokens_per_s for r in base),
            "median_ratio_vs_ar": statistics.median(a.tokens_per_s / b.tokens_per_s for a, b in zip(rs, base)),
            "identical_to_ar": sum(a.tokens == b.tokens for a, b in zip(rs, base)),
            "questions": len(rs),
        }
        if dec and base[0].decode_tokens_per_s:
            row["decode_speedup_vs_ar"] = row["mean_decode_tokens_per_s"] / statistics.mean(
                r.decode_tokens_per_s for r in base if r.decode_tokens_per_s)
        if isinstance(e, Method):
            row["mean_accepted_length"] = sum(len(r.tokens) - 1 for r in rs) / max(1, sum(e.passes))
        out[e.name] = row
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

    from hsdjax.api import Generator, load_model
    from hsdjax.errors import HsdjaxError

    try:
        model = load_model(args.model)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if "ar" not in methods:
            methods.insert(0, "ar")
        opts = {k: v for k, v in (("draft_model", args.draft_model), ("depth", args.depth), ("width", args.width))
                if v is not None}
        engines: list[Any] = [Method(Generator(model, m, **(opts if m != "ar" else {}))) for m in methods]
    except HsdjaxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    draft = args.draft_model or (model.source.spec.draft_model if model.source.spec else None)
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        engines.append(TransformersEngine(args.model, "float32", 2, model.tokenizer.stop_ids, name=p, peer=p,
                                          draft=draft))
    questions = read_questions(args.questions, args.limit)
    progress(f"{len(questions)} questions; building prompts (turn {args.turn})")
    prompts = build_prompts(engines[0].gen, questions, args.turn, args.max_new_tokens)
    for e in engines:  # compile / load before timing
        if isinstance(e, TransformersEngine):
            e.wait_ready()
        e.run(prompts[0], args.max_new_tokens)
        if isinstance(e, Method):
            e.passes.clear()
    runs: dict[str, list[Run]] = {e.name: [] for e in engines}
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        order = engines[i % len(engines):] + engines[: i % len(engines)]
        for e in order:
            runs[e.name].append(e.run(ids, args.max_new_tokens))
        progress(f"question {i + 1}/{len(prompts)} ({time.perf_counter() - t0:.0f}s)")
    for e in engines:
        if isinstance(e, TransformersEngine):
            e.close()
    summary = summarize(engines, runs)
    header = (f"{args.model}, greedy, {args.max_new_tokens} new tokens, {len(prompts)} questions from "
              f"{', '.join(Path(q).name for q in args.questions)} (turn {args.turn}); means over questions")
    print_report(summary, header)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
