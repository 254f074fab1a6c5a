"""Prefill of a 1,000-token prompt and `ar` decoding with the scanned and the unrolled layer loop, both in one
process, interleaved (4 repeats, medians). Stop other work on the machine first.

    python experiments/layer_loop_prefill.py
"""
import sys, statistics
from hsdjax.frontends.api import load_model, Generator
text = open("README.md").read()[:6000]
res = {}
gens = {l: Generator(load_model("smollm2-135m", layer_loop=l), "ar") for l in ("scan", "unrolled")}
for l, g in gens.items():
    ids = g.encode_prompt(text)[:1000]
    g.generate([ids], max_new_tokens=4)  # compile
for rep in range(4):
    for l, g in gens.items():
        ids = g.encode_prompt(text)[:1000]
        r = g.generate([ids], max_new_tokens=32)[0]
        res.setdefault(l, []).append((r.prefill_s, r.decode_s / max(1, len(r.tokens))))
for l, v in res.items():
    print(l, "prompt", len(ids), "prefill median %.3f s" % statistics.median(p for p, _ in v), "decode ms/token %.2f" % (1e3 * statistics.median(d for _, d in v)), [round(p, 3) for p, _ in v])
