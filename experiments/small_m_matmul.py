"""Small-M matmuls: does a tuned BLAS beat XLA's CPU dot where speculative passes live (T = 1-16 tokens)?

Runs SmolLM2-135M's matmul chain (30 layers of q/k/v/o and gate/up/down, then the 49,152-row head;
float32, random weights) for T tokens two ways, interleaved, medians over ``--repeats``:

* ``xla``: the chain jitted (what the model runs);
* ``blas``: the same chain through NumPy, i.e. OpenBLAS's sgemm (Python dispatch included, ~0.2 ms);
* ``kernel``: the chain jitted through hsdjax's CPU matmul kernel on panel-packed weights (when built:
  ``hsdjax cpu-matmul build``).

It prints absolute milliseconds and both ratios: each engine's T-token time over its own one-token
time (the growth the round-cost issue quoted) and over XLA's one-token time (what a speculative round
actually pays against `ar`). Only the second decides whether routing small-M matmuls to BLAS would pay:

    python experiments/small_m_matmul.py [--sizes 1,2,4,8,16] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

E, F, LAYERS, VOCAB, KV = 576, 1536, 30, 49152, 192  # SmolLM2-135M


def weights(seed: int = 0) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"q": (E, E), "k": (E, KV), "v": (E, KV), "o": (E, E), "g": (E, F), "u": (E, F), "d": (F, E)}
    layers = [{k: (rng.standard_normal(s, np.float32) * 0.02) for k, s in shapes.items()} for _ in range(LAYERS)]
    return layers, rng.standard_normal((E, VOCAB), np.float32) * 0.02


def chain(x, layers, head, mm, silu):
    for w in layers:
        q, k, v = mm(x, w["q"]), mm(x, w["k"]), mm(x, w["v"])
        x = x + mm(q, w["o"]) + 0.0 * (k[:, :1] + v[:, :1]).sum()
        x = x + mm(silu(mm(x, w["g"])) * mm(x, w["u"]), w["d"])
    return mm(x, head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    layers, head = weights()
    layers_j, head_j = jax.device_put(layers), jax.device_put(head)
    xla = jax.jit(lambda x, ls, h: chain(x, ls, h, jnp.matmul, jax.nn.silu))
    from hsdjax.kernels import cpu_matmul

    kernel = cpu_matmul.load()
    if kernel:
        packed = jax.device_put([{k: cpu_matmul.pack(v) for k, v in w.items()} for w in layers])
        head_p = jax.device_put(cpu_matmul.pack(head))
        panel = jax.jit(lambda x, ls, h: chain(x, ls, h, cpu_matmul.panel_matmul, jax.nn.silu))
    np_silu = lambda a: a / (1.0 + np.exp(-a))  # noqa: E731
    rng = np.random.default_rng(1)
    out: dict[int, dict[str, float]] = {}
    for t in (int(s) for s in args.sizes.split(",")):
        x = rng.standard_normal((t, E), np.float32)
        xj = jnp.asarray(x)
        got_x, got_b = np.asarray(xla(xj, layers_j, head_j)), chain(x, layers, head, np.matmul, np_silu)
        assert np.allclose(got_x, got_b, atol=1e-3 * np.abs(got_x).max()), "the two chains disagree"
        runs = {"xla": lambda: xla(xj, layers_j, head_j).block_until_ready(),
                "blas": lambda: chain(x, layers, head, np.matmul, np_silu)}
        if kernel:
            assert np.allclose(np.asarray(panel(xj, packed, head_p)), got_x, atol=1e-3 * np.abs(got_x).max())
            runs["kernel"] = lambda: panel(xj, packed, head_p).block_until_ready()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        out[t] = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    first = min(out)
    extra = " kernel ms | kernel / XLA T=1 |" if kernel else ""
    print("| T | XLA ms | OpenBLAS ms | XLA / XLA T=1 | OpenBLAS / OpenBLAS T=1 | OpenBLAS / XLA T=1 |" + extra)
    print("| --- " * (6 + 2 * kernel) + "|")
    for t, r in out.items():
        x1 = out[first]["xla"]
        tail = f" {r['kernel']:.1f} | {r['kernel'] / x1:.2f} |" if kernel else ""
        print(f"| {t} | {r['xla']:.1f} | {r['blas']:.1f} | {r['xla'] / x1:.2f} | "
              f"{r['blas'] / out[first]['blas']:.2f} | {r['blas'] / x1:.2f} |" + tail)


if __name__ == "__main__":
    main()
