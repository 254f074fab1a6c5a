"""Collectives in the compiled decode step of a sharded target: what one speculative round communicates.

    python experiments/sharding_hlo.py                                    # tiny-8kv and smollm2-135m, ar and pld
    python experiments/sharding_hlo.py --config smollm2-135m --method pld --mesh data=1,model=8 --batch 4

Lowers and compiles ``hsdjax.core.engine.decode`` (and ``prefill``) for a model's *shapes* on a CPU mesh of
forced host devices (``--xla_force_host_platform_device_count``; no weights are materialised), reads
the partitioned HLO text and counts all-reduce / all-gather / reduce-scatter / collective-permute /
all-to-all instructions, with the bytes each moves per device, inside one round of the decode
while-loop. Loops with a known trip count (the ``lax.scan`` over layers) are multiplied out; where a
round branches (``pld`` verifies at the smallest tier that holds its tree) every branch is shown.
XLA's SPMD partitioner is the same on every backend, so the counts carry over to TPU and GPU
(their schedulers may combine or overlap collectives, never add any).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # 8 query and 8 KV heads: attention really splits over model=8 (and 4, 2)
    "tiny-8kv": dict(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=8, num_kv_heads=8, head_dim=8, max_context=2048),
    # SmolLM2-135M-Instruct's shapes (9 query / 3 KV heads: attention is replicated on model=8)
    "smollm2-135m": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_context=8192),
    # Qwen2.5-Coder-1.5B-Instruct's shapes (12 query / 2 KV heads)
    "qwen2.5-coder-1.5b": dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6,
                               max_context=32768, qkv_bias=True),
    # Llama-3-8B's shapes (32 query / 8 KV heads): a target that needs more than one 16 GB chip
    "llama3-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_context=8192,
                      tie_embeddings=False),
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}


# ------------------------------------------------------------------------------------------ HLO text
def split_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: instruction lines} and the name of the entry computation."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO result type such as ``f32[1,1,576]{2,1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"\b(f32|bf16|f16|s32|u32|s8|u8|pred|s64|f64)\[([\d,]*)\]", text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def _collective(line: str) -> tuple[str, int] | None:
    m = re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s+([a-z\-]+)\(", line)
    if not m:
        return None
    op = m.group(2).removesuffix("-start")
    return (op, _shape_bytes(m.group(1))) if op in COLLECTIVES else None


def _callees(line: str) -> list[tuple[str, list[str], int]]:
    """(kind, computations, multiplier) called by one instruction."""
    out: list[tuple[str, list[str], int]] = []
    body = re.search(r"\bbody=%([\w.\-]+)", line)
    if body:
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        out.append(("while", [body.group(1)], int(trip.group(1)) if trip else 1))
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
        out.append(("branches", [b.strip().lstrip("%") for b in branches.group(1).split(",")], 1))
    pair = [m.group(1) for key in ("true_computation", "false_computation")
            for m in [re.search(rf"\b{key}=%([\w.\-]+)", line)] if m]
    if pair:
        out.append(("branches", pair, 1))
    for key in ("calls", "to_apply", "condition"):
        m = re.search(rf"\b{key}=%([\w.\-]+)", line)
        if m:
            out.append(("call", [m.group(1)], 1))
    return out


class Counts(collections.Counter):
    """``{(op, "count"|"bytes"): n}``."""

    def add(self, other: "Counts", times: int = 1) -> None:
        for k, v in other.items():
            self[k] += v * times

    @property
    def bytes(self) -> int:
        return sum(v for (_, k), v in self.items() if k == "bytes")

    def summary(self) -> dict[str, dict[str, int]]:
        return {op: {"count": self[(op, "count")], "bytes": self[(op, "bytes")]}
                for op in COLLECTIVES if self[(op, "count")]}


@dataclasses.dataclass
class Node:
    """Collectives a computation always runs, and its conditionals (label, times run, branches)."""

    always: Counts = dataclasses.field(default_factory=Counts)
    conds: list[tuple[str, int, list["Node"]]] = dataclasses.field(default_factory=list)


def source_functions(hlo: str) -> dict[int, str]:
    """stack_frame_id -> the innermost Python function (``file.py:function``) from the HLO's tables."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
        elif section and re.match(r"^\d+ ", line):
            key, _, rest = line.partition(" ")
            tables[section][int(key)] = rest
        elif section and line.strip() == "":
            section = None if tables.get(section) else section

    def field(text: str, name: str) -> int:
        return int(re.search(rf"\b{name}=(\d+)", text).group(1))

    out = {}
    for frame, text in tables.get("StackFrames", {}).items():
        loc = tables["FileLocations"][field(text, "file_location_id")]
        file = tables["FileNames"][field(loc, "file_name_id")].strip('"').rsplit("/", 1)[-1]
        func = tables["FunctionNames"][field(loc, "function_name_id")].strip('"')
        out[frame] = f"{file}:{func}"
    return out


def breakdown(comps: dict[str, list[str]], name: str, where: dict[int, str], memo: dict[str, Node]) -> Node:
    """The collectives of one run of computation ``name``: loops with a known trip count multiplied
    out, conditionals kept apart (labelled by the Python function that built them)."""
    if name in memo:
        return memo[name]
    node = Node()
    for line in comps.get(name, []):
        hit = _collective(line)
        if hit:
            node.always[(hit[0], "count")] += 1
            node.always[(hit[0], "bytes")] += hit[1]
        for kind, names, times in _callees(line):
            if kind == "branches":
                frame = re.search(r"stack_frame_id=(\d+)", line)
                label = where.get(int(frame.group(1)), "?") if frame else "?"
                node.conds.append((label, 1, [breakdown(comps, n, where, memo) for n in names]))
                continue
            for n in names:
                child = breakdown(comps, n, where, memo)
                node.always.add(child.always, times)
                node.conds += [(label, t * times, b) for label, t, b in child.conds]
    memo[name] = node
    return node


def resolve(node: Node, choose: Any) -> Counts:
    """Total collectives when ``choose(label, branches)`` picks the branch every conditional takes."""
    total = Counts()
    total.add(node.always)
    for label, times, branches in node.conds:
        total.add(resolve(branches[choose(label, branches)], choose), times)
    return total


def _greedy(label: str, branches: list[Node]) -> int:
    """Sampling conditionals (``sampling.py``) take branch 0, the all-greedy one; others the costliest."""
    return 0 if label.startswith("sampling.py") else _worst(label, branches)


def _worst(label: str, branches: list[Node]) -> int:
    costs = [resolve(b, _worst) for b in branches]
    return max(range(len(costs)), key=lambda i: (costs[i].bytes, sum(costs[i].values())))


def round_report(hlo: str) -> dict[str, Any]:
    """Collectives of the whole program and of one round of the decode loop: greedy (per verification
    tier when the round branches on it) and with sampling rows (the costliest branches)."""
    comps, entry = split_computations(hlo)
    where, memo = source_functions(hlo), {}
    report: dict[str, Any] = {"program": resolve(breakdown(comps, entry, where, memo), _greedy).summary()}
    loops = [line for line in comps[entry] if "while(" in line and 'op_name="jit(decode)/while"' in line]
    if not loops:
        return report
    body = Node()  # one round: the loop body and its condition (which runs once per round too)
    for key in ("body", "condition"):
        part = breakdown(comps, re.search(rf"\b{key}=%([\w.\-]+)", loops[0]).group(1), where, memo)
        body.always.add(part.always)
        body.conds += part.conds
    report["round_greedy"] = resolve(body, _greedy).summary()
    report["round_sampling"] = resolve(body, _worst).summary()
    tiers = [b for label, _, b in body.conds if label.startswith("engine.py")]
    if tiers:
        report["round_greedy_per_tier"] = [resolve(b, _greedy).summary() for b in tiers[0]]
    return report


# ------------------------------------------------------------------------------------------ programs
def lower_decode(preset: str, method: str, mesh_spec: str, batch: int, cache: int, layer_loop: str,
                 dtype: str = "bfloat16") -> dict[str, str]:
    """Compiled HLO text of ``prefill`` and ``decode`` for a preset's shapes on the mesh (abstract params)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hsdjax.core import engine
    from hsdjax.core.drafters import ARDrafter
    from hsdjax.core.drafters.pld import PromptLookupDrafter
    from hsdjax.core.sampling import SamplingParams
    from hsdjax.runtime import sharding
    from hsdjax.runtime.config import ModelConfig
    from hsdjax.runtime.model import init_params

    cfg = ModelConfig(**PRESETS[preset], dtype=dtype, scan_layers=layer_loop == "scan")
    mesh = sharding.make_mesh(mesh_spec)
    drafter = ARDrafter() if method == "ar" else PromptLookupDrafter()
    params = jax.eval_shape(lambda: jax.tree_util.tree_map(lambda w: w.astype(dtype), init_params(cfg)))
    specs = sharding.param_specs(cfg, params, mesh)
    params = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), params, specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec))
    prompt_len = 32
    inputs = dict(prompt=jnp.zeros((batch, prompt_len), jnp.int32), prompt_len=jnp.ones((batch,), jnp.int32),
                  max_new=jnp.ones((batch,), jnp.int32), sampling=SamplingParams.make(batch, 0.0, 0, 1.0),
                  keys=jax.random.split(jax.random.PRNGKey(0), batch), stop_ids=engine.stop_array([]))
    inputs = sharding.place_inputs(inputs, mesh)
    args = (inputs["prompt"], inputs["prompt_len"], inputs["max_new"], inputs["sampling"], inputs["keys"],
            inputs["stop_ids"])
    static = dict(cfg=cfg, cache_size=cache, spare=drafter.spare)
    prefill = engine.prefill.lower(params, *args, **static).compile()

    def start(p):
        gen, fwd = engine.prefill(p, *args, **static)
        return engine.start_decoding((), gen, fwd, drafter=drafter)

    state = jax.eval_shape(start, params)
    placed = sharding.decode_state_shardings(state, cfg, mesh)
    state = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, placed)
    decode = engine.decode.lower(params, (), state, jnp.int32(1), cfg=cfg, drafter=drafter).compile()
    return {"prefill": prefill.as_text(), "decode": decode.as_text()}


def _fmt(counts: dict[str, dict[str, int]]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{v['count']} {op} ({v['bytes'] / 1024:.1f} KiB)" for op, v in counts.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", choices=sorted(PRESETS), help="model shapes (repeatable)")
    parser.add_argument("--method", action="append", choices=("ar", "pld"), help="(repeatable; default ar and pld)")
    parser.add_argument("--mesh", default="data=1,model=8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", type=int, default=1024, help="KV cache slots per row")
    parser.add_argument("--layer-loop", choices=("scan", "unrolled"), default="scan")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="params and compute (default bfloat16, as on TPU/GPU)")
    parser.add_argument("--devices", type=int, default=8, help="forced host CPU devices")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = {}
    for preset in args.config or ["tiny-8kv", "smollm2-135m"]:
        for method in args.method or ["ar", "pld"]:
            texts = lower_decode(preset, method, args.mesh, args.batch, args.cache, args.layer_loop, args.dtype)
            results[f"{preset}/{method}"] = {"prefill": round_report(texts["prefill"])["program"],
                                             **round_report(texts["decode"])}
    if args.json:
        print(json.dumps({"mesh": args.mesh, "batch": args.batch, "dtype": args.dtype, "results": results}, indent=1))
        return 0
    print(f"mesh {args.mesh}, batch {args.batch}, {args.dtype}, {args.layer_loop} layers; sizes are each "
          "collective's result per device")
    for name, r in results.items():
        print(f"\n{name}")
        print(f"  prefill, greedy:              {_fmt(r['prefill'])}")
        print(f"  decode round, greedy:         {_fmt(r.get('round_greedy', {}))}")
        for i, tier in enumerate(r.get("round_greedy_per_tier", [])):
            print(f"    verification tier {i}:       {_fmt(tier)}")
        print(f"  decode round, sampling rows:  {_fmt(r.get('round_sampling', {}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
