"""Does `hsd` need the whole draft head per node? Its chain state's own (token-free) logits pick a
shortlist of S candidates once per depth; each node's injected state then scores only those S head
rows (``HSDDrafter.shortlist``), instead of all 4,096. The shipped SmolLM2 drafter, not retrained:

    python experiments/hsd_shortlist.py [--shortlists 0,16,64,256] [--limit 2] [--max-new 128] [--tree 4/3/5]

Runs the dev-set prompts (the first ``--limit`` questions of each set and turn) with every shortlist,
greedy, and prints per shortlist (and for the shipped `eagle` on the same tree): tokens per round, the drafter's multiply-adds per accepted draft and
whether every output equals `ar`'s (the same as `--shortlist S` on the command line). Counts, not times: they do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import hsdjax
from hsdjax.core.methods import make_drafter
from hsdjax.frontends.api import Generator
from hsdjax.frontends.bench.questions import dev_set_prompts

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"  # the Spec-Bench question files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shortlists", default="0,16,64,256")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--tree", default="4/3/5", help="depth/width/budget (the method's default tree)")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--policies", default="", help="S/POLICY/AHEAD,...: shortlist S with a chain refresh policy "
                                                    "(reuse, refresh, min1..3) and states drafted ahead")
    args = ap.parse_args()
    model = hsdjax.load_model(args.model)
    depth, width, budget = (int(x) for x in args.tree.split("/"))
    drafter, dparams = make_drafter("hsd", model, depth=depth, width=width, budget=budget, shortlist=1)
    ar = Generator(model, "ar")
    prompts = dev_set_prompts(ar, args.questions, args.limit, args.max_new)
    ref = {}
    for name, ids in prompts:
        ref[name, tuple(ids)] = ar.generate([ids], max_new_tokens=args.max_new)[0].tokens
    print(f"{model.name}, hsd {drafter.depth}/{drafter.width}/{drafter.budget}, {len(prompts)} dev prompts, "
          f"{args.max_new} new tokens")
    print("shortlist | tokens per round | drafter MMACs per accepted draft | reused share | outputs equal to ar")
    eagle = make_drafter("eagle", model, depth=depth, width=width, budget=budget)
    runs = [(str(s) if s else "full", Generator.with_drafter(model, dataclasses.replace(drafter, shortlist=s), dparams))
            for s in (int(x) for x in args.shortlists.split(","))]
    for spec in filter(None, args.policies.split(",")):  # S/policy/ahead: the chain's reuse with a shortlist
        s, policy, ahead = spec.split("/")
        runs.append((spec, Generator.with_drafter(model, dataclasses.replace(drafter, shortlist=int(s), policy=policy,
                                                                             ahead=int(ahead)), dparams)))
    for label, gen in runs + [("eagle", Generator.with_drafter(model, *eagle))]:
        tokens = passes = accepted = 0
        macs, equal, reused = 0.0, 0, 0
        for name, ids in prompts:
            r = gen.generate([ids], max_new_tokens=args.max_new)[0]
            equal += r.tokens == ref[name, tuple(ids)]
            tokens += len(r.tokens) - 1
            passes += r.stats["target_passes"]
            accepted += r.stats["accepted_drafts"] - r.stats["lookup_drafts"]
            macs += r.stats["drafter_macs"]
            reused += r.stats.get("reused_drafts", 0)
        print(f"{label:>9} | {tokens / passes:.3f} | {macs / 1e6 / max(accepted, 1):.2f} | "
              f"{reused / max(accepted, 1):.3f} | {equal}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
