"""Self-distillation data throughput: the continuous-batch recorder against single-stream decoding.

    python benchmarks/datagen_throughput.py [--model smollm2-135m] [--prompts 128] [--max-new-tokens 128]
        [--batch 64] [--refill-every 16] [--warmup 24] [--fixed] [--json]

Measured in one process, greedy:

* ``ar``: single-stream plain decoding (``Generator(model, "ar")``) of one chat prompt, ``--max-new-tokens``
  tokens, decode tokens/s (the best of two calls after a compiling one).
* ``continuous``: ``generate_data`` (the recorder ``hsdjax train-drafter --stage data`` runs) answering the
  first ``--prompts`` prompts of the shipped drafter configs' prompt stream, at ``--batch``, into a
  temporary folder: generated tokens/s (answers) and recorded tokens/s (prompt + answer positions
  written to shards) over the call's wall time (prefill, decode, copies, shard writes) less the time
  JAX spent tracing and compiling (counted with a ``jax.monitoring`` listener; reported as
  ``compile_s``). A warm-up call on ``--warmup`` other prompts compiles the common shapes first.
* ``fixed`` (with ``--fixed``): the old fixed-batch recorder on the same prompts, batches of 32 run to
  their longest answer.
* ``rerecord``: the same data rebuilt in a fresh folder from the answers ``continuous`` kept
  (``data.answers``), by teacher-forced prefills and no generation: what a machine without the data
  pays for it when the answers are committed. Its recorded tokens/s (compile excluded) against
  ``continuous``'s is the gain.

Ratios are to ``ar``'s decode tokens/s. The machine may be shared: say so when quoting numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # for the repository's configs (hsdjax itself is imported installed)

DEFAULT_CONFIG = ROOT / "configs" / "drafter-smollm2-135m-hsd.json"


def measure_ar(model, max_new: int) -> float:
    from hsdjax.frontends.api import Generator

    gen = Generator(model, "ar")
    prompt = "Explain how a hash map works and when to use one."
    rates = [gen.generate(prompt, max_new_tokens=max_new)[0].to_json()["decode_tokens_per_s"] for _ in range(3)]
    return max(rates[1:])


def stream_file(data_cfg: dict, start: int, count: int, folder: Path) -> str:
    """The prompt stream's rows [start, start + count) as a prompts file (stream order kept)."""
    from hsdjax.train.datagen import prompt_stream

    rows = prompt_stream(data_cfg)[start: start + count]
    path = folder / f"prompts-{start}.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["turns"][0], "turns": list(r["turns"]), "source": r["source"]})
                            + "\n" for r in rows))
    return str(path)


COMPILE_S = [0.0]


def _count_compiles(event: str, duration: float, **_: object) -> None:
    """jax.monitoring listener: seconds spent tracing, lowering and compiling (persistent-cache loads too)."""
    if event.startswith("/jax/") and ("compile" in event or "trace" in event or "lower" in event):
        COMPILE_S[0] += duration


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rates(wall: float, compile_s: float, tokens: int, answers: int) -> dict:
    run = max(wall - compile_s, 1e-9)
    return {"wall_s": round(wall, 1), "compile_s": round(compile_s, 1), "recorded_tokens": tokens,
            "generated_tokens": answers, "generated_tok_s": round(answers / run, 1),
            "recorded_tok_s": round(tokens / run, 1)}


def run_continuous(model, data_cfg: dict, prompts_file: str, folder: Path, answers: Path | None = None) -> dict:
    """``generate_data`` into ``folder`` (keeping the answers in ``answers``; re-recording them from there
    when it already holds them)."""
    from hsdjax.train.datagen import generate_data

    cfg = dict(data_cfg, prompts=prompts_file, token_budget=10**9, source_weights={}, exclude_sources=[],
               answers=str(answers) if answers else None)
    c0, t0 = COMPILE_S[0], time.perf_counter()
    man = generate_data(model, cfg, folder, progress=False)
    wall = time.perf_counter() - t0
    work = man.get("work", {})
    return {"prompts": man["prompts_done"], "rerecorded_tokens": man.get("rerecorded_tokens", 0),
            **rates(wall, COMPILE_S[0] - c0, man["tokens"], man["answer_tokens"]),
            **{f"work_{k}": round(v, 1) if isinstance(v, float) else v for k, v in work.items()}}


def run_fixed(model, data_cfg: dict, prompts_file: str) -> dict:
    from hsdjax.train.datagen import _encode_chunk, generate_recorded, prompt_stream, recording_generator

    gen = recording_generator(model, int(data_cfg.get("top_k_logits", 8)))
    rows = prompt_stream({"prompts": prompts_file})
    jobs = _encode_chunk(model.tokenizer, rows, int(data_cfg.get("max_prompt_tokens", 384)))
    max_new = int(data_cfg["max_new_tokens"])
    c0, t0, tokens, answers = COMPILE_S[0], time.perf_counter(), 0, 0
    for i in range(0, len(jobs), 32):
        out = generate_recorded(gen, [j.ids for j in jobs[i: i + 32]], max_new, 0.0, 0)
        tokens += len(out["tokens"])
        answers += int(out["answer"].sum())
    return rates(time.perf_counter() - t0, COMPILE_S[0] - c0, tokens, answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="drafter config whose data section is used")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--refill-every", type=int, default=16)
    ap.add_argument("--fixed", action="store_true", help="also time the old fixed-batch recorder")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import jax

    from hsdjax.frontends.api import load_model

    jax.monitoring.register_event_duration_secs_listener(_count_compiles)

    data_cfg = json.loads(Path(args.config).read_text())["data"]
    data_cfg = dict(data_cfg, prompts=[str((ROOT / p).resolve()) if not Path(p).is_absolute() else p
                                       for p in ([data_cfg["prompts"]] if isinstance(data_cfg["prompts"], str)
                                                 else data_cfg["prompts"])],
                    max_new_tokens=args.max_new_tokens, batch=args.batch, refill_every=args.refill_every)
    model = load_model(args.model)
    report = {"model": args.model, "batch": args.batch, "refill_every": args.refill_every,
              "max_new_tokens": args.max_new_tokens, "prompts": args.prompts}
    report["ar_decode_tok_s"] = round(measure_ar(model, args.max_new_tokens), 1)
    log(f"ar: {report['ar_decode_tok_s']} tok/s")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.warmup:
            warm = stream_file(data_cfg, args.prompts, args.warmup, tmp)
            log(f"warm-up: {run_continuous(model, data_cfg, warm, tmp / 'warm', tmp / 'warm-answers')}")
        timed = stream_file(data_cfg, 0, args.prompts, tmp)
        report["continuous"] = run_continuous(model, data_cfg, timed, tmp / "timed", tmp / "answers")
        log(f"continuous: {report['continuous']}")
        if args.warmup:  # compiles the re-recording shapes, on the warm-up prompts' answers
            run_continuous(model, data_cfg, warm, tmp / "warm-rerecorded", tmp / "warm-answers")
        report["rerecord"] = run_continuous(model, data_cfg, timed, tmp / "rerecorded", tmp / "answers")
        assert report["rerecord"]["rerecorded_tokens"] == report["rerecord"]["recorded_tokens"]  # nothing generated
        log(f"rerecord: {report['rerecord']}")
        if args.fixed:
            report["fixed"] = run_fixed(model, data_cfg, timed)
            log(f"fixed: {report['fixed']}")
    ar = report["ar_decode_tok_s"]
    report["rerecord"]["recorded_vs_continuous"] = round(
        report["rerecord"]["recorded_tok_s"] / report["continuous"]["recorded_tok_s"], 2)
    for kind in ("continuous", "fixed"):
        if kind in report:
            r = report[kind]
            r["generated_vs_ar"] = round(r["generated_tok_s"] / ar, 2)
            r["recorded_vs_ar"] = round(r["recorded_tok_s"] / ar, 2)
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.model}, max_new_tokens {args.max_new_tokens}, {args.prompts} prompts")
    print(f"  ar single stream: {ar} tok/s (decode)")
    for kind in ("continuous", "fixed"):
        if kind in report:
            r = report[kind]
            print(f"  {kind:>10}: generated {r['generated_tok_s']} tok/s ({r['generated_vs_ar']}x ar), "
                  f"recorded {r['recorded_tok_s']} tok/s ({r['recorded_vs_ar']}x ar); "
                  f"{r['generated_tokens']} generated / {r['recorded_tokens']} recorded tokens in {r['wall_s']} s "
                  f"({r['compile_s']} s of it compiling)")
            if "work_slot_rounds" in r:
                print(f"  {'':>10}  decode calls {r['work_decode_s']} s, prefills {r['work_prefill_s']} s (compiles "
                      f"included), batch occupancy {r['work_occupancy']:.0%} (tokens generated per slot-round)")
    r = report["rerecord"]
    print(f"    rerecord: recorded {r['recorded_tok_s']} tok/s from the kept answers, no generation "
          f"({r['recorded_vs_continuous']}x continuous's recorded tok/s); {r['recorded_tokens']} tokens in "
          f"{r['wall_s']} s ({r['compile_s']} s of it compiling)")


if __name__ == "__main__":
    main()
