"""Where `hsdjax serve`'s memory goes: the resident set after each start-up stage, and the compiled
programs of the warm-up grouped by program.

The scheduler runs in this process as the server runs it (``serve.build_app``'s settings), so every
figure is a stage of a real start: import, the model's weights (by dtype), the scheduler's pools (the
prefix cache), then the warm-up, whose compiled programs are attributed one by one (the resident set
after each compile finishes, the C heap trimmed first, as the server trims it at ready). An executable
XLA:CPU keeps holds its machine code and runtime tables, roughly in proportion to the operations it
holds: an unrolled 30-layer forward pass is ~60-70 MB, so a program holding several passes (a tree
decode with verification tiers) costs several times that.

    python benchmarks/serve_memory.py                       # the server's defaults (pld, batch 8, 2048)
    python benchmarks/serve_memory.py --max-context 512 --json-out mem.json

Run it with nothing else running for figures worth publishing (compiles are slow on 2 cores: with an
empty compilation cache a 2048-token warm-up takes ~15 min; the figures do not depend on the cache).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import re
import sys
import time

MB = 2**20


def resident_mb() -> float:
    """RSS after handing free C heap back (what the server does at ready and when idle)."""
    from hsdjax.frontends.serving.scheduler import release_free_heap

    release_free_heap()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / MB


def live_arrays_mb() -> dict[str, float]:
    import jax

    out: dict[str, float] = collections.Counter()
    for a in jax.live_arrays():
        out[str(a.dtype)] += a.nbytes / MB
    return {k: round(v, 1) for k, v in sorted(out.items())}


class CompileLog(logging.Handler):
    """RSS growth between consecutive 'Finished XLA compilation' records, by program name."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.last = resident_mb()
        self.programs: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"Finished XLA compilation of (\S+)", record.getMessage())
        if match:
            now = resident_mb()
            self.programs.append((match.group(1), now - self.last))
            self.last = now

    def grouped(self) -> list[dict]:
        groups: dict[str, list[float]] = collections.defaultdict(list)
        for name, grew in self.programs:
            groups[name].append(grew)
        rows = [{"program": k, "count": len(v), "mb": round(sum(v), 1), "largest_mb": round(max(v), 1)}
                for k, v in groups.items()]
        return sorted(rows, key=lambda r: -r["mb"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="pld")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--prefix-cache-mb", type=float, default=256.0)
    ap.add_argument("--spec-max-active", default="auto")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    stages: list[dict] = []

    def stage(name: str, **extra) -> None:
        row = {"stage": name, "rss_mb": round(resident_mb(), 1), "live_arrays_mb": live_arrays_mb(), **extra}
        stages.append(row)
        print(f"{name:<28} RSS {row['rss_mb']:8.1f} MB   live arrays {row['live_arrays_mb']}", flush=True)

    import jax

    from hsdjax.frontends import serve
    from hsdjax.frontends.api import enable_compilation_cache, load_model
    from hsdjax.frontends.serving.metrics import Metrics
    from hsdjax.frontends.serving.scheduler import Scheduler

    enable_compilation_cache()
    stage("import")
    model = load_model(args.model)
    gc.collect()
    stage("model loaded", backend=model.backend.get("path"))
    sched = Scheduler(model, args.method, max_batch=args.max_batch, max_context=args.max_context,
                      spec_max_active=serve.spec_max_active_setting(args.spec_max_active),
                      prefix_cache_mb=args.prefix_cache_mb, metrics=Metrics(), warmup=False)
    stage("scheduler (pools)", buckets=list(sched.buckets), cache_size=sched.cache_size)
    compiles = CompileLog()
    jax_log = logging.getLogger("jax")
    jax_log.addHandler(compiles)
    jax_log.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    t0 = time.perf_counter()
    sched._warmup()
    warm_s = time.perf_counter() - t0
    jax.config.update("jax_log_compiles", False)
    jax_log.removeHandler(compiles)
    gc.collect()
    stage("warmed up", warmup_s=round(warm_s, 1))
    programs = compiles.grouped()
    print(f"\ncompiled programs ({sum(p['count'] for p in programs)}), RSS growth while each finished:")
    print(f"{'program':<34} {'count':>5} {'MB':>8} {'largest':>8}")
    for p in programs:
        print(f"{p['program']:<34} {p['count']:>5} {p['mb']:>8.1f} {p['largest_mb']:>8.1f}")
    report = {"settings": vars(args), "stages": stages, "programs": programs, "cpu": cpu_name()}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
