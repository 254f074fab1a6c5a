"""What the opt-in activation modes of the CPU kernel (``--cpu-matmul bf16x`` / ``int8x`` / ``int16x``) do to the model.

    python experiments/activation_modes.py --limit 2 --max-new-tokens 256 --modes auto,bf16x,int8x

The first mode (``auto``: float32 products) is the reference. Its greedy answers to the dev-set questions
(as ``feature_drafters.py`` picks them) are fed to every mode's model in one teacher-forced pass per
question; printed per mode, over the answer positions: how often the mode's top-1 token is the
reference's, the mean KL divergence of its next-token distribution from the reference's, and, for
greedy decoding of its own, how many answers equal the reference's token for token and where the
others first differ. Speed is ``feature_drafters.py``'s business (run it with ``HSDJAX_CPU_MATMUL``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # round_cost / feature_drafters


def teacher_forced_logprobs(model: Any, seq: list[int]) -> Any:
    """Next-token log-probabilities at every position of ``seq`` (one full pass)."""
    import jax
    import jax.numpy as jnp

    from hsdjax.runtime.model import Transformer, causal_mask

    t = len(seq)
    net = Transformer(model.cfg)
    out = net.apply({"params": model.params}, jnp.asarray([seq], jnp.int32), jnp.arange(t)[None],
                    causal_mask(jnp.array([t]), t))
    logits = net.apply({"params": model.params}, out["hidden"], method=Transformer.logits)
    return jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    import numpy as np
    from feature_drafters import dev_prompts  # (experiments put benchmarks/ on sys.path)

    from hsdjax.frontends.api import Generator, enable_compilation_cache, load_model
    from hsdjax.frontends.bench.runners import LocalMethod

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="auto,bf16x,int8x", help="the first is the reference")
    p.add_argument("--limit", type=int, default=2, help="questions per dev set")
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args()
    enable_compilation_cache()
    modes = args.modes.split(",")
    answers: dict[str, list[list[int]]] = {}
    ref_logprobs: list[Any] = []
    prompts: list[tuple[str, list[int]]] = []
    rows = []
    for mode in modes:
        model = load_model(args.model, cpu_matmul=mode)
        gen = Generator(model, "ar")
        if not prompts:
            prompts = dev_prompts(gen, args.limit, args.max_new_tokens)
        runner = LocalMethod(gen)
        answers[mode] = [list(runner.turn(ids, args.max_new_tokens).tokens) for _, ids in prompts]
        agree, kls, n = 0, [], 0
        for q, (_, ids) in enumerate(prompts):
            ref = answers[modes[0]][q]
            lp = np.asarray(teacher_forced_logprobs(model, ids + ref)[len(ids) - 1: len(ids) + len(ref) - 1])
            if mode == modes[0]:
                ref_logprobs.append(lp)
                continue
            base = ref_logprobs[q]
            agree += int((lp.argmax(-1) == base.argmax(-1)).sum())
            kls.append(float((np.exp(base) * (base - lp)).sum(-1).mean()))
            n += len(ref)
        diffs = [first_difference(a, r) for a, r in zip(answers[mode], answers[modes[0]])]
        differing = [d for d in diffs if d is not None]
        rows.append((mode, agree / n if n else 1.0, statistics.fmean(kls) if kls else 0.0,
                     len(diffs) - len(differing), len(diffs),
                     statistics.median(differing) if differing else None))
        print(f"[{mode} done]", file=sys.stderr, flush=True)
    print(f"{args.model}, {len(prompts)} dev-set questions, {args.max_new_tokens} new tokens; reference: {modes[0]}")
    print(f"{'mode':<8} {'top-1 agree':>11} {'mean KL':>9} {'greedy == ref':>13} {'median first diff':>17}")
    for mode, agree, kl, same, total, med in rows:
        if mode == modes[0]:
            print(f"{mode:<8} {'(reference)':>11}")
            continue
        print(f"{mode:<8} {agree:>11.4f} {kl:>9.2e} {same:>9}/{total:<3} {('-' if med is None else f'{med:g}'):>17}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
