"""Is a feature drafter's low acceptance on the dev sets an inference bug or what it learned?

For the first questions of each dev set, records `ar`'s greedy answer with the target's states and
top-k logits exactly as the training data are recorded (``generate_recorded``), computes the
training metric (top-1 agreement per rollout step, ``rollout_loss``) on that answer, and runs the
drafter in the decoding loop (``--lookup 0``, depth 1) on the same question. If the loop's first-draft
acceptance matches the training metric's step 1 on the same text, inference reproduces training and
acceptance is limited by the drafter itself:

    python experiments/drafter_gap.py --method hsd --limit 2 --max-new-tokens 128 [--drafter PATH]

It also splits the first draft's acceptance by what the round before emitted (one token: its draft
was rejected; two: accepted), in the loop (``accept_lengths``) and in the training metric replayed as
the loop's rounds (``replayed_rounds``): a split that differs between the two points at inference.

And it splits the training metric's step 1 by what a prompt lookup would have drafted at the same
position (``lookup_drafts``: the graft's own lookup of the newest 2-4 tokens in the context; right,
wrong, or no match): the positions where the lookup is right are the ones the decoding loop's
lookup graft already covers, so a drafter gains the tuned tree only where the lookup is not right.
The tuned tree (depth 1, budget 1, the graft) is replayed the same way (``replayed_graft_rounds``)
next to the loop's own accepted lengths, and replayed again with the first draft right more often
where the lookup is not right: how good a drafter must get there for a given accepted length.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import ml_dtypes
import numpy as np

EVAL = "../shared/data/eval/"
SETS = ("mt_bench", "gsm8k", "humaneval", "alpaca")
OPTS = {"rollout": 4, "step_decay": 0.8, "ce_weight": 1.0, "reg_weight": 0.2, "feature_noise": 0.0}


def replayed_rounds(correct: np.ndarray) -> list[int]:
    """The depth-1 loop replayed on the training metric: ``correct[t]`` says whether the draft made at
    position t (for the token at t + 2) is right. A round whose root sits at r uses the draft made at
    r - 1 and emits 2 tokens when it is right, else 1. Returns the tokens each round emitted: the
    graft's replay with no lookup hits."""
    return replayed_graft_rounds(correct, np.zeros(len(correct), np.int32))


def split_by_previous(emitted: list[int]) -> tuple[list[int], list[int]]:
    """(hits, rounds) of depth-1 rounds (tokens emitted per round: 1 or 2) after a round that emitted
    one token and after one that emitted two (the prefill counts as one)."""
    hits, rounds = [0, 0], [0, 0]
    last = 1
    for n in emitted:
        rounds[last - 1] += 1
        hits[last - 1] += n == 2
        last = min(int(n), 2)
    return hits, rounds


LOOKUP_CLASSES = ("no match", "lookup wrong", "lookup right")
GRAFT_LENGTHS = (0, 2, 2, 6)  # the tuned trees' lookup graft (``lookup_lengths`` 0,2,2,6)


def lookup_drafts(tokens: np.ndarray, lengths: tuple[int, ...] = GRAFT_LENGTHS) -> tuple[np.ndarray, np.ndarray]:
    """What the decoding loop's lookup graft (``lookup_by_match``, one chain, chain lengths by match
    length ``lengths``) drafts at each position t of one document from the context up to t + 1, i.e.
    for the tokens from t + 2 on (the first draft made at t is for t + 2). Returns its class per position
    (0: no match, 1: its first token is wrong, 2: right) and how many of its tokens are right in a row.
    The last two positions (no token at t + 2) are 0."""
    from hsdjax.core.drafters.pld import lookup_by_match

    n = len(tokens)
    classes, hits = np.zeros(n, np.int8), np.zeros(n, np.int32)
    if n < 3:
        return classes, hits
    seq = jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (n - 2, n))  # row t: the context is its first t + 2
    chains, avail = lookup_by_match(seq, jnp.arange(2, n, dtype=jnp.int32), 1, lengths)
    chains, avail = np.asarray(chains[:, 0]), np.asarray(avail[:, 0])
    ahead = np.arange(chains.shape[1])
    later = np.take(tokens, np.minimum(np.arange(2, n)[:, None] + ahead[None, :], n - 1))
    right = (chains == later) & (ahead[None, :] < avail[:, None]) & (np.arange(2, n)[:, None] + ahead[None, :] < n)
    hits[: n - 2] = np.argmin(np.concatenate([right, np.zeros((n - 2, 1), bool)], axis=1), axis=1)
    classes[: n - 2] = np.where(avail > 0, np.where(hits[: n - 2] > 0, 2, 1), 0)
    return classes, hits


def replayed_graft_rounds(drafted: np.ndarray, chain_hits: np.ndarray) -> list[int]:
    """The loop with one chain of drafts and the lookup graft replayed: a round whose root sits at r
    verifies the drafts made at r - 1 (``drafted[r - 1]`` of them right in a row: a bool for one draft)
    and the graft's chain from the context up to r (``chain_hits[r - 1]`` right in a row), and emits one
    token more than the longer right run of the two."""
    emitted, r = [], 1  # the first round's root is the prefill's token, its draft made at the prompt's end
    while r - 1 < len(drafted):
        emitted.append(1 + max(int(chain_hits[r - 1]), int(drafted[r - 1])))
        r += emitted[-1]
    return emitted


def better_first_draft(replay_inputs: list[tuple[np.ndarray, ...]], base: float) -> list[tuple[float, float]]:
    """The depth-1 tree with the graft replayed with the first draft right 5, 10, 20 points more often
    (and always) where the lookup is not right than its measured ``base``: misses there turned into hits
    at random. ``replay_inputs``: per answer, (first-draft hits, graft hits in a row, lookup class).
    Returns (first-draft accuracy there, accepted tokens per round)."""
    rng = np.random.default_rng(0)
    out = []
    for target in (base + 0.05, base + 0.10, base + 0.20, 1.0):
        lift = max(target - base, 0.0) / max(1.0 - base, 1e-9)  # the share of misses turned into hits
        emitted = []
        for correct, chain_hits, classes in replay_inputs:
            flip = (classes != 2) & (rng.random(len(correct)) < lift)
            emitted += replayed_graft_rounds(correct | flip, chain_hits)
        out.append((min(target, 1.0), float(np.mean(emitted))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", choices=("hsd", "eagle"), default="hsd")
    ap.add_argument("--limit", type=int, default=2, help="questions per dev set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafter", default=None, help="a drafter checkpoint (default: the shipped one)")
    args = ap.parse_args()

    from hsdjax.core.drafters.checkpoint import frozen_from_target, load_drafter, shipped_path
    from hsdjax.frontends.api import Generator, load_model
    from hsdjax.frontends.bench.questions import read_questions
    from hsdjax.train.datagen import generate_recorded, recording_generator
    from hsdjax.train.train import WindowData, rollout_loss

    model = load_model(args.model)
    questions = [(name, q) for name in SETS for q in read_questions(f"{EVAL}{name}.jsonl")[: args.limit]]
    recorder = recording_generator(model, 8)
    rows = [recorder.encode_prompt(q.turns[0]) for _, q in questions]
    rec = generate_recorded(recorder, rows, args.max_new_tokens, 0.0, seed=0)
    rec["states"] = rec["states"].view(ml_dtypes.bfloat16)
    path = args.drafter or shipped_path(model.name, args.method)
    cfg, _, dparams, _ = load_drafter(path, model, args.method)
    full = frozen_from_target(model)
    ids = np.asarray(dparams["vocab_ids"])
    frozen = {"embed": full["embed"], "head": jnp.take(full["head_full"], jnp.asarray(ids), axis=0),
              "final_norm": full["final_norm"]}
    vocab_map = np.full((full["embed"].shape[0],), -1, np.int32)
    vocab_map[ids] = np.arange(len(ids), dtype=np.int32)
    gen = Generator(model, args.method, lookup=0, depth=1, budget=1, drafter=str(path))
    lengths = ",".join(map(str, GRAFT_LENGTHS))
    grafted = Generator(model, args.method, depth=1, width=3, budget=1, drafter=str(path), lookup_lengths=lengths)
    chain3 = Generator(model, args.method, depth=3, width=1, budget=3, drafter=str(path), lookup_lengths=lengths)
    print(f"{args.method}: training metric (top-1 agreement at rollout steps 1-4) vs the decoding loop's "
          "first-draft acceptance, same answers")
    split = {"training metric": ([0, 0], [0, 0]), "loop": ([0, 0], [0, 0])}
    by_lookup = np.zeros((3, 2), np.int64)  # per lookup class: first drafts right, positions
    graft_loop = {1: [], 3: []}  # tokens emitted per round in the loop, a chain of 1 or 3 drafts + graft
    chained = {depth: [] for depth in range(1, 5)}  # the same replayed, chains of 1-4 drafts + graft
    replay_inputs = []  # per answer, from the first round's position on: first-draft hits, graft hits, class
    for i, (name, q) in enumerate(questions):
        n = int(np.sum(rec["doc"] == i))
        window = WindowData(rec, vocab_map, n, 0.3, np.array([i])).batch(np.array([0]))
        _, metrics = rollout_loss(dparams["net"], {k: jnp.asarray(v) for k, v in window.items()}, frozen, cfg, OPTS)
        steps = " / ".join(f"{float(metrics[f'acc{s}']):.2f}" for s in range(1, 5))
        r = gen.generate(q.turns[0], max_new_tokens=args.max_new_tokens)[0]
        loop = r.stats["accepted_drafts"] / r.stats["target_passes"]
        same = r.tokens == rec["tokens"][rec["doc"] == i][len(rows[i]):].tolist() + [r.tokens[-1]]
        print(f"{name:<10} q{q.question_id:<5} training metric {steps}   loop {loop:.2f}   "
              f"(answer {'identical' if same else 'differs'})")
        answer = np.asarray(window["weight"][0]) > 0.99  # the answer's positions (prompt tokens weigh less)
        first = int(np.argmax(answer))  # the prefill's last position: its output is the first round's draft
        start = max(first - 1, 0)  # the rounds' replay starts with the draft made there
        hits = np.stack([np.asarray(metrics[f"correct{s}"][0])[start:] for s in range(1, 5)], axis=1)
        correct = hits[:, 0]
        classes, chain_hits = lookup_drafts(np.asarray(window["tokens"][0]))
        replay_inputs.append((correct, chain_hits[start:], classes[start:]))
        for depth in range(1, 5):  # a chain of `depth` drafts: its right run is the leading hits of rollout steps
            run = np.argmin(np.c_[hits[:, :depth], np.zeros(len(hits), bool)], axis=1)
            chained[depth] += replayed_graft_rounds(run, chain_hits[start:])
        for depth, loop_gen in ((1, grafted), (3, chain3)):
            out = loop_gen.generate(q.turns[0], max_new_tokens=args.max_new_tokens)[0]
            assert out.tokens == r.tokens, f"the loop with {depth} draft(s) and the graft answers differently"
            graft_loop[depth] += list(out.stats["accept_lengths"])
        scored = np.asarray(metrics["anchor"][0])  # answer positions with a token two ahead
        right = np.asarray(metrics["correct1"][0])
        for c in range(3):
            by_lookup[c] += (np.sum(right & scored & (classes == c)), np.sum(scored & (classes == c)))
        for key, emitted in (("training metric", replayed_rounds(correct)), ("loop", r.stats["accept_lengths"])):
            h, n = split_by_previous(emitted)
            for j in (0, 1):
                split[key][0][j] += h[j]
                split[key][1][j] += n[j]
    for key, (h, n) in split.items():
        print(f"first draft accepted, {key}: after a rejected draft {h[0] / max(n[0], 1):.3f} ({n[0]} rounds), "
              f"after an accepted one {h[1] / max(n[1], 1):.3f} ({n[1]} rounds)")
    total = by_lookup[:, 1].sum()
    print("training metric, step 1, by what the lookup graft drafts at the same position: " + ", ".join(
        f"{name} {r / max(n, 1):.3f} ({n / max(total, 1):.0%} of {total})"
        for name, (r, n) in zip(LOOKUP_CLASSES, by_lookup)))
    r, n = by_lookup[:2].sum(axis=0)
    base = r / max(n, 1)
    print(f"  where the lookup is not right (what the graft leaves to the drafter): {base:.3f}")
    print(f"with the lookup graft (depth 1 / budget 1, lookup lengths {lengths}): loop {np.mean(graft_loop[1]):.3f} "
          f"accepted per round ({len(graft_loop[1])} rounds), training metric {np.mean(chained[1]):.3f} "
          f"({len(chained[1])} rounds)")
    print("  replayed with a chain of 1-4 drafts (width 1) and the graft: " + ", ".join(
        f"depth {d} {np.mean(v):.3f}" for d, v in chained.items())
        + f" (the loop at depth 3: {np.mean(graft_loop[3]):.3f})")
    print("  replayed with the first draft right more often where the lookup is not right: " + ", ".join(
        f"{target:.2f}: {accepted:.3f}" for target, accepted in better_first_draft(replay_inputs, base)))


if __name__ == "__main__":
    main()
