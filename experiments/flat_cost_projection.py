"""Where do `hsd`'s trees pay when verification costs one step for up to 16 nodes (the memory-bound
case: a GPU, or a bigger target on any device)? Runs the real decoding loop, greedy, on the dev-set
prompts for `hsd` (full head and ``--shortlist``) and `eagle` over trees of up to 16 nodes, and counts
per run: tokens per round, the drafter's multiply-adds per round and per accepted draft, the share of
accepted drafts that came from states drafted in an earlier round (`hsd`'s reuse), and whether every
output equals `ar`'s. The projection charges each round one target step (flat verification) plus the
drafter's multiply-adds in units of one target step's (``target_step_macs``: every layer's projections
and MLP, and the head):

    tokens per unit of work = tokens per round / (1 + drafter MACs per round / target MACs per step)

Counts, not times (independent of the machine's load). The drafter's sequential passes per round are
printed beside it: where a drafter pass is latency-bound rather than arithmetic-bound, they are its cost.

    python experiments/flat_cost_projection.py [--trees 4/3/5,6/4/10,8/4/15] [--limit 2] [--max-new 128]
        [--hsd-drafter PATH] [--shortlist 256]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import hsdjax
from hsdjax.core.drafters.base import layer_macs
from hsdjax.core.methods import make_drafter
from hsdjax.frontends.api import Generator
from hsdjax.frontends.bench.questions import dev_set_prompts

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"  # the Spec-Bench question files


def target_step_macs(cfg) -> float:
    """Multiply-adds of one target token-step, attention to the context left out (a short context)."""
    per_layer = layer_macs(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, 0)
    return float(cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size)


def run(gen: Generator, prompts, ref, max_new: int) -> dict:
    """Totals over the prompts of one drafter and tree."""
    t = dict(tokens=0, rounds=0, accepted=0, macs=0.0, reused=0, equal=0, passes=0)
    for name, ids in prompts:
        r = gen.generate([ids], max_new_tokens=max_new)[0]
        s = r.stats
        t["equal"] += r.tokens == ref[name, tuple(ids)]
        t["tokens"] += len(r.tokens) - 1
        t["rounds"] += s["target_passes"]
        t["accepted"] += s["accepted_drafts"] - s["lookup_drafts"]
        t["macs"] += s["drafter_macs"]
        t["reused"] += s.get("reused_drafts", 0)
        t["passes"] += s.get("draft_passes", 0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trees", default="4/3/5,6/4/10,8/4/15", help="depth/width/budget, comma-separated")
    ap.add_argument("--shortlist", type=int, default=256, help="hsd's shortlist run beside the full head (0: none)")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--hsd-drafter", default=None, help="an `hsd` checkpoint instead of the shipped one")
    args = ap.parse_args()
    model = hsdjax.load_model(args.model)
    step = target_step_macs(model.cfg)
    ar = Generator(model, "ar")
    prompts = dev_set_prompts(ar, args.questions, args.limit, args.max_new)
    ref = {(name, tuple(ids)): ar.generate([ids], max_new_tokens=args.max_new)[0].tokens for name, ids in prompts}
    print(f"{model.name}: {len(prompts)} dev prompts, {args.max_new} new tokens, greedy; one target step = "
          f"{step / 1e6:.1f} M multiply-adds")
    print("| tree | drafter | tokens/round | drafter MMACs/round | MMACs per accepted draft | reused share "
          "| drafter passes/round | projected tokens per step of work | vs eagle | outputs = ar |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tree in args.trees.split(","):
        depth, width, budget = (int(x) for x in tree.split("/"))
        hsd, hparams = make_drafter("hsd", model, depth=depth, width=width, budget=budget,
                                    shortlist=args.shortlist or None, drafter=args.hsd_drafter)
        variants = [("hsd", dataclasses.replace(hsd, shortlist=0), hparams)]
        if args.shortlist:
            variants.append((f"hsd S={args.shortlist}", hsd, hparams))
        variants.append(("eagle", *make_drafter("eagle", model, depth=depth, width=width, budget=budget)))
        rows = []
        for label, drafter, params in variants:
            t = run(Generator.with_drafter(model, drafter, params), prompts, ref, args.max_new)
            tpr = t["tokens"] / max(t["rounds"], 1)
            macs_round = t["macs"] / max(t["rounds"], 1)
            rows.append((label, t, tpr, macs_round, tpr / (1 + macs_round / step)))
        eagle = rows[-1][4]
        for label, t, tpr, macs_round, projected in rows:
            share = t["reused"] / t["accepted"] if t["accepted"] else 0.0
            print(f"| {tree} | {label} | {tpr:.3f} | {macs_round / 1e6:.2f} | "
                  f"{t['macs'] / 1e6 / max(t['accepted'], 1):.2f} | {share:.1%} | "
                  f"{t['passes'] / max(t['rounds'], 1):.2f} | {projected:.3f} | "
                  f"{projected / eagle:.3f}x | {t['equal']}/{len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
