"""How big are the server's compiled programs? XLA's own account (``memory_analysis``) of each program the
server's warm-up compiles, by kind: generated code, and the temporary buffers a call allocates.

    python experiments/serve_program_sizes.py [--model smollm2-135m] [--method pld] [--max-context 2048]

The server's RSS after warm-up (``benchmarks/serve_memory.py``) is mostly compiled programs; this says which,
from the compiler rather than from RSS differences (which mix code with buffers and the allocator's reuse).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

MB = 2**20


def sizes(compiled) -> dict[str, float]:
    """The serialized executable (XLA:CPU's object code and its tables: what the persistent cache stores and
    a process maps when it loads the program; ``memory_analysis`` reports no code size on CPU) and the
    temporary buffers one call allocates."""
    from jax.experimental.serialize_executable import serialize

    m = compiled.memory_analysis()
    blob, _, _ = serialize(compiled)
    return {"serialized_mb": round(len(blob) / MB, 1), "temp_mb": round(m.temp_size_in_bytes / MB, 1) if m else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="pld")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--max-batch", type=int, default=8)
    args = ap.parse_args()

    from hsdjax.core import engine
    from hsdjax.frontends.api import load_model
    from hsdjax.frontends.serving.scheduler import GenRequest, Scheduler, WHOLE_PIECE

    model = load_model(args.model)
    sched = Scheduler(model, args.method, max_batch=args.max_batch, max_context=args.max_context, warmup=False,
                      prefix_cache_mb=0, spec_max_active=1)
    rows = []
    keep = sched.drafter.prompt_layers
    largest = min(max(WHOLE_PIECE, sched.prefill_chunk or 0), sched.cache_size)
    for size in engine.piece_programs(sched.context_limit, largest):  # one program per size since 2026-12-07
        fill = sched._empty_fill()
        piece, n = jnp.zeros((1, size), jnp.int32), jnp.asarray([size], jnp.int32)
        c = engine.prefill_piece.lower(sched.params, fill, piece, n, cfg=sched.cfg, keep_layers=keep).compile()
        rows.append({"program": f"fill_piece {size}", **sizes(c)})
        print(rows[-1], flush=True)
    bos = sched.tokenizer.encode("Hi", add_special_tokens=True) or [0]
    r = GenRequest(id="x", prompt_ids=bos * 9, max_new=0, temperature=0.0, top_p=1.0, top_k=0, seed=0, stops=[],
                   loop=None, queue=None)
    new = sched._prefill_now(r)
    for b in sched.buckets:
        state = engine.take_rows(new, jnp.asarray([0] + [-1] * (b - 1), jnp.int32))
        for drafter in sched._decoders_at(b):
            c = engine.decode.lower(sched.params, sched.dparams, state, jnp.int32(1), cfg=sched.cfg,
                                    drafter=drafter).compile()
            rows.append({"program": f"decode b={b} {type(drafter).__name__}", **sizes(c)})
            print(rows[-1], flush=True)
    total = {k: round(sum(r.get(k) or 0 for r in rows), 1) for k in ("serialized_mb", "temp_mb")}
    print(json.dumps({"programs": len(rows), **total}))


if __name__ == "__main__":
    main()
