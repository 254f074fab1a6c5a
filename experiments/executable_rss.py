"""What one compiled program holds in memory: the resident set around compiling (or loading from JAX's
persistent cache) the server's largest program, the `pld` speculative decode, and which mappings grew.

    python experiments/executable_rss.py
    HSDJAX_COMPILATION_CACHE=0 python experiments/executable_rss.py          # compiled, not loaded
    MALLOC_MMAP_THRESHOLD_=65536 python experiments/executable_rss.py         # allocator retention?
    XLA_FLAGS=--xla_cpu_use_thunk_runtime=false python experiments/executable_rss.py

Output of 2026-12-07: experiments/outputs/serve-program-sizes-xeon.txt.
"""
import time, gc, sys
import jax, jax.numpy as jnp
from hsdjax.core import engine
from hsdjax.frontends.api import load_model
from hsdjax.frontends.serving.scheduler import GenRequest, Scheduler, release_free_heap
def rss():
    gc.collect(); release_free_heap()
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
model = load_model("smollm2-135m")
sched = Scheduler(model, "pld", max_batch=8, max_context=2048, warmup=False, prefix_cache_mb=0, spec_max_active=1)
bos = sched.tokenizer.encode("Hi", add_special_tokens=True) or [0]
r = GenRequest(id="x", prompt_ids=bos * 9, max_new=0, temperature=0.0, top_p=1.0, top_k=0, seed=0, stops=[], loop=None, queue=None)
new = sched._prefill_now(r)
state = engine.take_rows(new, jnp.asarray([0], jnp.int32)); jax.block_until_ready(state)
r0 = rss()
t0 = time.perf_counter()
c = engine.decode.lower(sched.params, sched.dparams, state, jnp.int32(1), cfg=sched.cfg, drafter=sched.drafter).compile()
t1 = time.perf_counter()
r1 = rss()
out = c(sched.params, sched.dparams, state, jnp.int32(1)); jax.block_until_ready(out); del out
r2 = rss()
print(f"compile/load {t1-t0:.1f}s  rss before {r0:.0f}  after compile {r1:.0f} (+{r1-r0:.0f})  after a call {r2:.0f} (+{r2-r1:.0f})")
del c; r3 = rss(); print(f"after dropping the executable {r3:.0f} ({r3-r2:+.0f})")

def maps():
    out = {}
    cur = None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if "-" in parts[0] and len(parts) >= 5 and ":" not in parts[0]:
            name = parts[5] if len(parts) > 5 else "[anon]"
            cur = (parts[1], "lib" if name.startswith("/") else name)
        elif parts[0] == "Rss:":
            out[cur] = out.get(cur, 0) + int(parts[1]) / 1024
    return out
m0 = maps()
c2 = engine.decode.lower(sched.params, sched.dparams, engine.take_rows(new, jnp.asarray([0, -1], jnp.int32)), jnp.int32(1), cfg=sched.cfg, drafter=sched.drafter).compile()
release_free_heap(); gc.collect()
m1 = maps()
for k in sorted(set(m0) | set(m1), key=lambda k: -(m1.get(k, 0) - m0.get(k, 0)))[:6]:
    print(k, round(m1.get(k, 0) - m0.get(k, 0), 1), "MB")
