"""Long prompt chunks, before and after the two blockings of 2026-12-07: the CPU kernel's matmuls in
row blocks that keep their activations in one core's L2 (``cpu_matmul.rows_per_call``) and the prompt's
own attention in blocks of queries (``tree_attention.QUERY_BLOCK``). "before" turns both off in the
same process (one kernel call and one query block per chunk), then row blocks alone, then both, interleaved:

    python experiments/prefill_blocking.py                          # SmolLM2, 1 x 1,024 and 4 x 512
    python experiments/prefill_blocking.py --model qwen2.5-coder-1.5b --shapes 1x512

Times a whole causal forward of random tokens (the prefill's work, its cache writes excluded) through
the model's default path, compilation excluded; medians of interleaved runs and the largest
difference of the outputs (the matmul blocking is bitwise; the attention's adds in another order).
"""

from __future__ import annotations

import argparse
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import hsdjax
from hsdjax.kernels import cpu_matmul
from hsdjax.runtime.model import Transformer, causal_mask

attention = importlib.import_module("hsdjax.kernels.tree_attention")


def forward_program(model, rows: int, t: int):
    cfg = model.cfg

    def fwd(params, tokens):
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t))
        return Transformer(cfg).apply({"params": params}, tokens, pos, causal_mask(jnp.full((rows,), t), t), None)["hidden"]

    tokens = jnp.asarray(np.random.default_rng(0).integers(10, 30000, (rows, t)), jnp.int32)
    return jax.jit(fwd).lower(model.params, tokens).compile(), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", default="1x1024,4x512", help="rows x tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model = hsdjax.load_model(args.model)
    print(f"{args.model}: {model.backend.get('why', model.cfg.resolved_backend)}")
    for shape in args.shapes.split(","):
        rows, t = map(int, shape.split("x"))
        programs = {}
        for name, matmul_rows, query_block in (("before", lambda k: 1 << 30, 1 << 20),
                                               ("rows only", cpu_matmul.rows_per_call, 1 << 20),
                                               ("after", cpu_matmul.rows_per_call, attention.QUERY_BLOCK)):
            saved = cpu_matmul.rows_per_call, attention.QUERY_BLOCK
            cpu_matmul.rows_per_call, attention.QUERY_BLOCK = matmul_rows, query_block
            programs[name], tokens = forward_program(model, rows, t)
            cpu_matmul.rows_per_call, attention.QUERY_BLOCK = saved
        times = {name: [] for name in programs}
        outs = {}
        for rep in range(args.reps + 1):
            for name, prog in programs.items():
                t0 = time.perf_counter()
                outs[name] = jax.block_until_ready(prog(model.params, tokens))
                if rep:
                    times[name].append(time.perf_counter() - t0)
        b, r, a = (np.median(times[n]) for n in ("before", "rows only", "after"))
        same_rows = bool(jnp.array_equal(outs["before"], outs["rows only"]))
        diff = float(jnp.max(jnp.abs(outs["before"] - outs["after"])))
        print(f"{rows} x {t} tokens: before {rows * t / b:.0f} tok/s, row blocks {rows * t / r:.0f} "
              f"({b / r:.2f}x, bitwise {same_rows}), and query blocks {rows * t / a:.0f} tok/s ({b / a:.2f}x), "
              f"largest output difference {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
