"""Why does each compiled server program hold 0.1-0.4 GB that is neither its code nor its trace? The
unrolled layer loop: compiles the server's `pld` decode program (batch 1 and 2) for SmolLM2 with the
layers unrolled (the CPU default) and under ``lax.scan``, and prints per program the HLO instructions,
the resident-set growth after compiling and one call (C heap trimmed), the compile time, and the time
of 8 decoding rounds (median of 7; stop other work on the machine first). XLA:CPU keeps each
executable's optimized HLO module and buffer assignment, which grow with the instruction count.

    HSDJAX_COMPILATION_CACHE=0 python experiments/layer_loop_memory.py scan
    HSDJAX_COMPILATION_CACHE=0 python experiments/layer_loop_memory.py unrolled
"""
import gc
import sys
import time

import jax
import jax.numpy as jnp

from hsdjax.core import engine
from hsdjax.frontends.api import load_model
from hsdjax.frontends.serving.scheduler import GenRequest, Scheduler, release_free_heap


def rss_mb() -> float:
    gc.collect()
    release_free_heap()
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def main(loop: str) -> None:
    model = load_model("smollm2-135m", layer_loop=loop)
    sched = Scheduler(model, "pld", max_batch=8, max_context=2048, warmup=False, prefix_cache_mb=0, spec_max_active=1)
    bos = sched.tokenizer.encode("Hi", add_special_tokens=True) or [0]
    req = GenRequest(id="x", prompt_ids=bos * 9, max_new=4000, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                     stops=[], loop=None, queue=None)
    new = sched._prefill_now(req)
    for rows in ([0], [0, -1]):
        def fresh():
            return jax.block_until_ready(engine.take_rows(new, jnp.asarray(rows, jnp.int32)))
        state = fresh()
        r0, t0 = rss_mb(), time.perf_counter()
        c = engine.decode.lower(sched.params, sched.dparams, state, jnp.int32(1), cfg=sched.cfg,
                                drafter=sched.drafter).compile()
        t1 = time.perf_counter()
        lines = len(c.as_text().splitlines())
        jax.block_until_ready(c(sched.params, sched.dparams, state, jnp.int32(1)))
        r1 = rss_mb()
        times = []
        for _ in range(7):
            st = fresh()
            t = time.perf_counter()
            jax.block_until_ready(c(sched.params, sched.dparams, st, jnp.int32(8)))
            times.append(time.perf_counter() - t)
        print(f"{loop} batch {len(rows)}: compile {t1 - t0:.1f} s, {lines} HLO lines, RSS +{r1 - r0:.0f} MB, "
              f"8 rounds {sorted(times)[3] * 1e3:.0f} ms (median of 7)", flush=True)
        del c  # the next program's growth is measured alone


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "unrolled")
