"""hsdjax plain autoregressive decoding (``method="ar"``) against Hugging Face transformers ``generate``.

    python benchmarks/ar_vs_transformers.py [--model smollm2-135m] [--max-new-tokens 128] [--repeats 5]
        [--prompt TEXT] [--hf-dtypes float32,bfloat16] [--threads N] [--json-out FILE]

Both engines get the same prompt (chat template applied) and the same weights (transformers loads the
same GGUF file and dequantizes it), decode greedily, batch 1. hsdjax runs in this process (its default
dtype: float32 on CPU); each transformers dtype runs in its own long-lived subprocess
(``hsdjax.frontends.peers``) so that memory stays bounded and torch's thread pool does not compete
with XLA's inside one process. Each engine is warmed up once (hsdjax: compilation), then the repeats are
interleaved, the order rotated each repeat, so drift of a shared machine hits every engine alike.

Reported per engine, as medians over repeats:

* end-to-end tokens/s = new tokens / (prefill + decode seconds);
* decode tokens/s = (new tokens - 1) / decode seconds, since the first new token comes out of the
  prefill (hsdjax: its prefill call; transformers: the time until the first token reaches a streamer);
* the fraction of the memory-bandwidth bound: read bandwidth / weight bytes read per token
  (``cfg.num_params()`` x bytes per parameter; KV-cache reads and caches are ignored);

and hsdjax / transformers as the median of per-repeat ratios. The greedy tokens of hsdjax and
transformers float32 are checked for equality; other dtypes are expected to drift, so only the length
of their agreement is shown. ``--threads`` sets torch's threads and the bandwidth measurement's; XLA
uses its own pool over all cores. Results go to stdout as a table; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

DEFAULT_PROMPT = "Explain in a few paragraphs how a refrigerator works, and why it needs electricity."
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}


class BenchError(Exception):
    """A failure worth one line (plus a worker's log), not a traceback."""


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ bandwidth


def measure_bandwidth(threads: int, gib: float = 1.0, rounds: int = 5) -> dict[str, Any]:
    """Best-of-``rounds`` copy (bytes read + written) and read-only (a sum) bandwidth over a float32 array
    of ``gib`` GiB, split across ``threads`` threads (numpy releases the GIL for both)."""
    n = int(gib * 2**30) // 4
    src = np.ones(n, np.float32)
    dst = np.zeros_like(src)  # touched, so no page faults are timed
    edges = np.linspace(0, n, threads + 1).astype(int)
    parts = [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]
    with ThreadPoolExecutor(threads) as pool:
        def best(fn: Callable[[slice], Any]) -> float:
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                list(pool.map(fn, parts))
                times.append(time.perf_counter() - t0)
            return min(times)

        copy_s = best(lambda s: np.copyto(dst[s], src[s]))
        read_s = best(lambda s: src[s].sum())
    return {"array_bytes": src.nbytes, "threads": threads, "rounds": rounds,
            "copy_gb_s": 2 * src.nbytes / copy_s / 1e9, "read_gb_s": src.nbytes / read_s / 1e9}


# ------------------------------------------------------------------------------------------ engines


@dataclass
class Run:
    """One generation: the new tokens (a final stop token included) and its two phases in seconds."""

    tokens: list[int]
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / (self.prefill_s + self.decode_s)

    @property
    def decode_tokens_per_s(self) -> float | None:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None


class HsdjaxEngine:
    """hsdjax's ``Generator`` (method "ar"), in this process."""

    def __init__(self, gen: Any):
        self.gen = gen
        self.name, self.dtype = "hsdjax", gen.model.cfg.dtype

    def run(self, ids: list[int], max_new: int) -> Run:
        r = self.gen.generate(ids, max_new_tokens=max_new)[0]
        return Run(r.tokens, r.prefill_s, r.decode_s)


class TransformersEngine:
    """A transformers peer (``hsdjax.frontends.peers``, its own subprocess), started at once; see ``wait_ready``."""

    def __init__(self, model: str, dtype: str, threads: int, eos: Sequence[int], name: str = "transformers",
                 peer: str = "hf-ar", draft: str | None = None):
        from hsdjax.frontends.peers import Peer

        self.name, self.dtype = name, dtype
        self.peer = Peer(peer, model, eos, dtype=dtype, threads=threads, draft=draft)
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        self.info = self.peer.wait_ready()
        return self.info

    def run(self, ids: list[int], max_new: int) -> Run:
        a = self.peer.generate(ids, max_new)
        return Run(a["tokens"], a["prefill_s"], a["total_s"] - a["prefill_s"])

    def close(self) -> None:
        self.peer.close()


def _library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def label(engine: Any) -> str:
    return f"{engine.name} {engine.dtype}"


# ------------------------------------------------------------------------------------------ summary


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def median(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(engines: list[Any], runs: dict[str, list[Run]], num_params: int, read_gb_s: float) -> dict[str, Any]:
    ours = runs[label(engines[0])]
    summary = {}
    for e in engines:
        rs = runs[label(e)]
        bound = read_gb_s * 1e9 / (num_params * BYTES_PER_PARAM[e.dtype])
        decode = median([r.decode_tokens_per_s for r in rs])
        s = {"engine": e.name, "dtype": e.dtype, "new_tokens": [len(r.tokens) for r in rs],
             "tokens_per_s": median([r.tokens_per_s for r in rs]), "decode_tokens_per_s": decode,
             "prefill_s": median([r.prefill_s for r in rs]), "bound_tokens_per_s": bound,
             "decode_fraction_of_bound": decode / bound if decode else None,
             "tokens_stable_across_repeats": all(r.tokens == rs[0].tokens for r in rs)}
        if e is not engines[0]:
            s["hsdjax_ratio"] = median([a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, rs)])
            s["hsdjax_decode_ratio"] = median([a.decode_tokens_per_s / b.decode_tokens_per_s
                                               for a, b in zip(ours, rs)
                                               if a.decode_tokens_per_s and b.decode_tokens_per_s])
            n = agreement(ours[0].tokens, rs[0].tokens)
            s["agreement"] = {"identical": ours[0].tokens == rs[0].tokens, "common_prefix": n,
                              "hsdjax_tokens": len(ours[0].tokens), "tokens": len(rs[0].tokens),
                              "first_mismatch": None if ours[0].tokens == rs[0].tokens else n}
        summary[label(e)] = s
    return summary


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_report(result: dict[str, Any]) -> None:
    m, bw, summary = result["model"], result["bandwidth"], result["summary"]
    print(f"model {m['name']} ({m['num_params'] / 1e6:.1f} M params), prompt {m['prompt_tokens']} tokens, "
          f"up to {result['max_new_tokens']} new tokens, greedy, batch 1, {result['repeats']} interleaved repeats, "
          f"torch threads {result['threads']}")
    load = result["machine"]["loadavg"]
    print(f"machine: {result['machine']['cores']} cores, 1-min load average {load['start']:.1f} at start, "
          f"{load['end']:.1f} at end (anything near the core count means the timings are contended)")
    print(f"memory bandwidth (best of {bw['rounds']}, {bw['threads']} threads, 1 GiB float32): "
          f"copy {bw['copy_gb_s']:.1f} GB/s (read + write), read {bw['read_gb_s']:.1f} GB/s\n")
    head = ["engine", "dtype", "new", "e2e tok/s", "decode tok/s", "prefill ms", "bound tok/s", "decode/bound",
            "hsdjax/this e2e", "decode"]
    rows = [head]
    for s in summary.values():
        rows.append([s["engine"], s["dtype"], format(median(s["new_tokens"]), "g"), _fmt(s["tokens_per_s"], ".1f"),
                     _fmt(s["decode_tokens_per_s"], ".1f"), _fmt(s["prefill_s"] * 1e3, ".1f"),
                     _fmt(s["bound_tokens_per_s"], ".1f"), _fmt(s["decode_fraction_of_bound"], ".0%"),
                     _fmt(s.get("hsdjax_ratio"), ".2f") + ("x" if "hsdjax_ratio" in s else ""),
                     _fmt(s.get("hsdjax_decode_ratio"), ".2f") + ("x" if "hsdjax_decode_ratio" in s else "")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("(medians over repeats; ratios are medians of per-repeat ratios; bound = read bandwidth / weight bytes)\n")

    for key, s in summary.items():
        if not s["tokens_stable_across_repeats"]:
            print(f"warning: {key} produced different tokens in different repeats")
        a = s.get("agreement")
        if a is None:
            continue
        if s["dtype"] == "float32":
            verdict = (f"identical ({a['tokens']} tokens)" if a["identical"] else
                       f"DIFFER from index {a['first_mismatch']} ({a['common_prefix']} tokens agree; "
                       f"hsdjax {a['hsdjax_tokens']} tokens, transformers {a['tokens']})")
            print(f"greedy tokens, hsdjax vs {key}: {verdict}")
        else:
            print(f"greedy tokens, hsdjax vs {key}: the first {a['common_prefix']} of {a['hsdjax_tokens']} agree "
                  f"(this dtype is expected to drift)")


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF folder")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (the chat template is applied)")
    p.add_argument("--hf-dtypes", default="float32,bfloat16", help="comma-separated transformers dtypes")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads and bandwidth-measurement threads (default: the cores available)")
    p.add_argument("--json-out", type=Path, help="write every measurement here as JSON")
    args = p.parse_args(argv)
    args.hf_dtypes = [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]
    bad = [d for d in args.hf_dtypes if d not in BYTES_PER_PARAM]
    if bad or args.max_new_tokens < 1 or args.repeats < 1 or args.threads < 1:
        p.error(f"need --max-new-tokens, --repeats, --threads >= 1 and --hf-dtypes among {', '.join(BYTES_PER_PARAM)}")
    return args


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from hsdjax.frontends.api import Generator, load_model
    from hsdjax.runtime import registry

    source = registry.resolve(args.model)  # a clear HsdjaxError when the model isn't installed
    load_start = os.getloadavg()[0]
    progress(f"measuring memory bandwidth ({args.threads} threads)")
    bandwidth = measure_bandwidth(args.threads)
    progress(f"copy {bandwidth['copy_gb_s']:.1f} GB/s, read {bandwidth['read_gb_s']:.1f} GB/s")

    progress(f"loading {source.name} for hsdjax")
    model = load_model(args.model)
    gen = Generator(model, method="ar")
    ids = gen.encode_prompt(args.prompt)
    eos = model.tokenizer.stop_ids
    if args.hf_dtypes:
        progress(f"starting transformers workers ({', '.join(args.hf_dtypes)}); they load while hsdjax compiles")
    hf = [TransformersEngine(args.model, d, args.threads, eos) for d in args.hf_dtypes]
    try:
        engines = [HsdjaxEngine(gen), *hf]
        warm = gen.generate(ids, max_new_tokens=args.max_new_tokens)[0]
        progress(f"hsdjax warm-up done (compile {warm.compile_s:.1f} s)")
        for e in hf:
            info = e.wait_ready()
            progress(f"transformers {e.dtype} loaded in {info['load_s']:.1f} s; warming up")
            e.run(ids, args.max_new_tokens)

        runs: dict[str, list[Run]] = {label(e): [] for e in engines}
        orders = []
        for r in range(args.repeats):
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            orders.append([label(e) for e in order])
            for e in order:
                runs[label(e)].append(e.run(ids, args.max_new_tokens))
            progress(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{label(e)} {runs[label(e)][-1].tokens_per_s:.1f} tok/s" for e in engines))
    finally:
        for e in hf:
            e.close()

    import jax

    num_params = model.cfg.num_params()
    return {
        "model": {"name": model.name, "path": str(source.path), "num_params": num_params, "prompt_tokens": len(ids),
                  "prompt": args.prompt, "stop_ids": list(eos)},
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
        "machine": {"cores": os.cpu_count(), "loadavg": {"start": load_start, "end": os.getloadavg()[0]},
                    "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "jax": jax.__version__, "jax_backend": jax.default_backend(),
                    **{k: v for k, v in _library_versions().items() if hf}},
        "bandwidth": bandwidth,
        "hsdjax_compile_s": warm.compile_s,
        "hf_workers": {e.dtype: e.info for e in hf},
        "orders": orders,
        "runs": {k: [asdict(r) for r in v] for k, v in runs.items()},
        "summary": summarize(engines, runs, num_params, bandwidth["read_gb_s"]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from hsdjax.errors import HsdjaxError

    try:
        result = bench(args)
    except (HsdjaxError, BenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_report(result)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
        progress(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
