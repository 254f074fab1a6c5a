"""What one speculative round costs, measured inside the jitted decoding loop.

    python benchmarks/round_cost.py --model smollm2-135m [--json] [--rounds 32] [--repeats 5]
        [--parts ar,tree,long,hsd,eagle] [--buckets 256,1024,4096] [--random-weights]

Every figure is the wall time of ``engine.decode`` (the one ``lax.while_loop`` that ``Generator``
runs) over ``--rounds`` rounds, divided by the rounds it actually ran (``stats.target_passes``), the
median of ``--repeats`` calls. Each program is compiled first (``lower().compile()``, reported as
``compile_s``) and called once untimed; every timed call starts from a fresh copy of the same
prefilled state, and the repeats are interleaved across the programs of one context (the order
rotated each repeat), so drift of a shared machine hits them alike. So everything a round does
counts: drafting, the target pass, verification, the cache commit, appending, statistics, and the
loop's own copies. Batch 1, greedy, no stop tokens; the prompt is the first tokens of the repository's
README (real weights; the content only matters for ``hsd`` / ``eagle`` / ``pld`` acceptance) or random
ids (random weights). ``--json`` objects also carry every repeat (``table[*].ms_all``), the context at
the start and end of the measured rounds, and the load average: on a shared machine read the spread
before the ratios.

What is measured (each a ratio to the ``ar`` round of the same run at the same context):

* ``ar``: ``ARDrafter``, one plain decoding step per round.
* fixed trees of N = 2, 4, 8, 16 nodes (root included; ``--sizes``): ``FixedTreeDrafter`` below
  proposes the same tree every round, all slots valid, every drafted token the constant
  ``vocab_size - 1`` (which the target almost never predicts, so a round emits ~1 token and the cache
  grows like ``ar``). Shape ``tree`` (default): a spine of depth min(N-1, 4) -- the shipped feature
  drafters' depth -- with the other nodes hung round-robin under the spine's nodes; ``chain``: depth
  N-1. Its ``DraftCost`` is zero: the round is the target pass plus the engine's bookkeeping.
* each at ``--context`` (200) cached tokens -- a prompt of that length, prompt bucket from
  ``PROMPT_BUCKETS`` -- in cache buckets (``prefill``'s static ``cache_size``) 256, 1,024 and 4,096;
  and after a ``--long-context`` (2,000) token prompt in the 4,096 bucket, for ``ar`` and N = 8, 13.
  The context grows by ~1 token per round over the ``--rounds`` measured (in the 256 bucket the
  rounds are capped so the largest tree still fits).
* ``hsd`` and ``eagle`` with the shipped drafters (``make_drafter``; at ``--main-bucket``), split as
    - ``round_ms``: the drafter's rounds in the loop (its tiers, ``lax.switch`` included);
    - ``target_ms``: the fixed-tree round at the size those rounds verified (mean verified nodes per
      pass, rounded; the drafter's ``max_depth``): target pass + verification + commit + append +
      statistics, i.e. everything but drafting, without the tier switch;
    - ``drafter_ms``: a separate jitted ``fori_loop`` that calls only the drafter's ``propose`` and
      ``observe``, with a synthetic verdict replaying the accept lengths of the measured rounds (so
      the chain's reuse / refresh decisions match), synthetic target states along the path (varying
      per round, so nothing is hoisted out of the loop), and the proposed tree folded into the carry
      (so nothing is dead code);
    - ``other_ms`` = round - drafter - target: what the combination costs beyond its parts (the tier
      switch and any copies of the loop state it causes). It is a difference of medians: on a noisy
      machine it can come out negative; compare it with the spread of ``ms_all``.
* ``hsd-f32`` / ``eagle-f32`` (not in the default parts): the same drafter with its panels widened to
  float32, as drafters loaded before their lean (bfloat16 / compressed) panels: an A/B of the bytes a
  drafter reads per round, in the same run.
* ``speeds`` (not in the default parts): end-to-end decode tokens/s of ``--speed-methods`` (ar, pld,
  hsd) for ``--max-new`` new tokens after the ``--context`` prompt, through the same engine calls
  (used by ``benchmarks/accelerator_check.sh``).

``--random-weights`` builds random params of the model's shapes (``init_params``; the shapes of the
registered models are listed below, or ``--config FILE.json`` of ``ModelConfig`` fields) and, for
hsd/eagle, random drafter params of the shipped checkpoint's shape (or the training defaults):
speeds only, accept lengths are meaningless. With ``--json`` the last line of stdout is one JSON
object: ``ar_ms``, ``ratios`` {N: r} (at ``--context`` tokens in ``--main-bucket``), ``long_ratios``
{N: r}, ``long_ar_ms``, ``buckets`` {bucket: {ar_ms, ratios}}, ``hsd`` / ``eagle`` {round_ms, drafter_ms,
target_ms, other_ms, their ratios, verified_nodes, tokens_per_round, settings} (null when not asked
for), ``speeds`` (that part only), ``compile_s``, ``meta`` and ``table`` (every row with all repeats).
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# Shapes of the registered models (from their GGUF headers), for --random-weights without the files.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_context=8192, tie_embeddings=True, qkv_bias=False),
    "qwen2.5-coder-1.5b": dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6,
                               rms_norm_eps=1e-6, max_context=32768, tie_embeddings=True, qkv_bias=True),
    "qwen2.5-coder-0.5b": dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
                               rms_norm_eps=1e-6, max_context=32768, tie_embeddings=True, qkv_bias=True),
}

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden screw press into a system that could produce books far "
    "faster than scribes. Within fifty years, presses operated in more than two hundred European cities, and "
    "millions of volumes circulated. Prices fell, literacy rose, and scholars could compare identical copies "
    "of a text instead of arguing over the errors of hand-copied manuscripts. Scientists exchanged results "
    "in print, reformers spread pamphlets, and governments learned to fear and to license the new machines. "
    "Question: explain step by step why a standard text mattered for science, then summarize the economic "
    "effects in three short bullet points, and finally write a small Python function that counts the words "
    "of a paragraph and returns the ten most common ones with their counts. "
)

PARTS = ("ar", "tree", "long", "hsd", "eagle", "hsd-f32", "eagle-f32", "speeds")
DEFAULT_PARTS = "ar,tree,long,hsd,eagle"


def progress(msg: str) -> None:
    print(f"[round_cost] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ drafters


@functools.lru_cache(maxsize=None)
def _fixed_tree_drafter_class():
    from hsdjax.core.drafters.base import DraftCost, Drafter
    from hsdjax.core.tree import DraftTree

    @dataclasses.dataclass(frozen=True)
    class FixedTreeDrafter(Drafter):
        """The same N-slot tree every round, every drafted token ``token`` (see the module docstring)."""

        name: str = "fixed"
        token: int = 0
        shape: str = "tree"

        def structure(self) -> tuple[list[int], list[int]]:
            n, d = self.num_nodes, self.max_depth
            parents, depth = [-1], [0]
            for i in range(1, n):
                if self.shape == "chain" or i <= d:
                    parents.append(i - 1)
                else:  # round-robin under the spine's nodes 0 .. d-1
                    parents.append((i - d - 1) % d)
                depth.append(depth[parents[-1]] + 1)
            return parents, depth

        def propose(self, dparams, state, gen):
            import jax.numpy as jnp

            root = gen.last_token()
            b, n = root.shape[0], self.num_nodes
            parents, depth = self.structure()
            tokens = jnp.concatenate([root[:, None], jnp.full((b, n - 1), self.token, jnp.int32)], axis=1)
            tree = DraftTree(tokens=tokens.astype(jnp.int32),
                             parents=jnp.broadcast_to(jnp.array(parents, jnp.int32), (b, n)),
                             depth=jnp.broadcast_to(jnp.array(depth, jnp.int32), (b, n)),
                             valid=jnp.ones((b, n), bool))
            return tree, state, DraftCost.of(jnp.zeros_like(root))

    return FixedTreeDrafter


def fixed_tree(n: int, token: int, shape: str = "tree", depth: int | None = None):
    """A ``FixedTreeDrafter`` of ``n`` nodes (root included); depth min(n-1, 4) unless given (chain: n-1)."""
    cls = _fixed_tree_drafter_class()
    if shape == "chain":
        d = n - 1
    else:
        d = min(n - 1, 4) if depth is None else min(depth, n - 1)
    return cls(num_nodes=n, max_depth=d, token=token, shape=shape)


# ------------------------------------------------------------------------------------------ target


@dataclasses.dataclass
class Target:
    name: str
    cfg: Any
    params: Any
    random: bool
    model: Any = None  # the LoadedModel (real weights only)
    fingerprint: str = "random"

    def prompt(self, n: int, seed: int = 0) -> np.ndarray:
        """``n`` prompt tokens: the first ``n`` of the repository's README then ``TEXT`` (repeated when
        short) with real weights, random ids with random weights."""
        if self.model is not None:
            readme = Path(__file__).resolve().parents[1] / "README.md"
            text = (readme.read_text(errors="replace") if readme.is_file() else "") + "\n\n" + TEXT
            ids = self.model.tokenizer.encode(text, add_special_tokens=False)
            reps = -(-n // len(ids))
            return np.array((ids * reps)[:n], np.int32)
        rng = np.random.default_rng(seed)
        return rng.integers(1, self.cfg.vocab_size - 1, size=n).astype(np.int32)


def random_config(args: argparse.Namespace):
    from hsdjax.runtime.config import ModelConfig

    if args.config:
        return ModelConfig(**json.loads(Path(args.config).read_text()))
    if args.model in KNOWN_CONFIGS:
        return ModelConfig(**KNOWN_CONFIGS[args.model])
    from hsdjax.runtime import registry
    from hsdjax.runtime.weights import load_weights

    source = registry.resolve(args.model)  # a clear error when it is neither known nor installed
    cfg, _, _ = load_weights(source.path, source.kind, "random-shapes")
    return cfg


def make_target(args: argparse.Namespace) -> Target:
    import jax
    import jax.numpy as jnp

    from hsdjax.frontends.api import default_dtype, default_layer_loop, load_model

    if not args.random_weights:
        model = load_model(args.model, dtype=args.dtype, layer_loop=args.layer_loop, cache_dtype=args.kv_cache)
        return Target(model.name, model.cfg, model.params, False, model, model.fingerprint)
    layer_loop = args.layer_loop or default_layer_loop(cpu_kernels=False)  # random weights: XLA's path
    from hsdjax.runtime.model import init_params, unstack_layers

    dtype = args.dtype or default_dtype()
    cfg = random_config(args).replace(dtype=dtype, scan_layers=layer_loop == "scan", cache_dtype=args.kv_cache)
    params = init_params(cfg.replace(scan_layers=True), seed=args.seed)
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.dtype(dtype)), params)
    if layer_loop == "unrolled":
        params = unstack_layers(params)
    return Target(args.model if not args.config else Path(args.config).stem, cfg, params, True)


def feature_drafter(target: Target, method: str, seed: int = 0) -> tuple[Any, Any]:
    """The shipped ``hsd`` / ``eagle`` drafter (real weights), or one of its shape with random params."""
    from hsdjax.core.methods import DEFAULTS, make_drafter
    from hsdjax.core.methods import feature_drafter as build_feature_drafter

    if not target.random:
        return make_drafter(method, target.model)
    import jax

    from hsdjax.core.drafters.checkpoint import bind, read_meta, shipped_path
    from hsdjax.core.drafters.feature import FeatureConfig, init_net

    mc = target.cfg
    shipped = shipped_path(target.name, method)
    if shipped.is_file():
        meta = read_meta(shipped)
        fc, layers = FeatureConfig(**meta["config"]), tuple(meta["layers"])
    else:  # the training defaults (train/pipeline.py): fused inputs of layers 2, L/2, L-3
        L = mc.num_layers
        layers = (min(2, L - 1), L // 2, max(L - 3, 0))
        fc = FeatureConfig(method=method, hidden=mc.hidden_size, heads=mc.num_heads, kv_heads=mc.num_kv_heads,
                           head_dim=mc.head_dim, mlp=max(mc.intermediate_size // 2, 8),
                           vocab=min(4096, mc.vocab_size), eps=mc.rms_norm_eps, rope_theta=mc.rope_theta)
    fc = dataclasses.replace(fc, vocab=min(fc.vocab, mc.vocab_size))
    net = init_net(fc, seed)
    net = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), net)  # as load_drafter gives them
    dparams = bind(net, np.arange(fc.vocab, dtype=np.int32), target.params, mc)
    return build_feature_drafter(method, fc, layers, backend=mc.backend, **DEFAULTS[method]), dparams


def float32_panels(dparams: Any) -> Any:
    """A feature drafter's params with bfloat16 and compressed panels widened to float32 panels (equal
    products, 2-4x the bytes): the drafter as it loaded before its lean panels, for A/B timing."""
    import jax
    import jax.numpy as jnp

    from hsdjax.kernels.cpu_matmul import decompress, is_bf16, is_compressed

    def widen(a: Any) -> Any:
        if getattr(a, "ndim", 0) == 3 and is_compressed(a):
            return decompress(a)
        return a.astype(jnp.float32) if getattr(a, "ndim", 0) == 3 and is_bf16(a) else a

    return {**dparams, "net": jax.tree_util.tree_map(widen, dparams["net"]), "head": widen(dparams["head"])}


def pld_drafter(target: Target) -> tuple[Any, Any]:
    from hsdjax.core.methods import DEFAULTS, make_drafter

    if not target.random:
        return make_drafter("pld", target.model)
    from hsdjax.core.drafters.pld import PromptLookupDrafter

    return PromptLookupDrafter(**DEFAULTS["pld"]), ()


# ------------------------------------------------------------------------------------------ measuring


@dataclasses.dataclass
class Program:
    """One compiled decode loop and the prefilled state each timed call starts from."""

    label: str
    drafter: Any
    dparams: Any
    state0: Any
    rounds: int
    compiled: Any = None
    compile_s: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)  # seconds per round, per repeat
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    last: Any = None  # the final state of the last call


class Bench:
    def __init__(self, target: Target, args: argparse.Namespace):
        self.t, self.args = target, args
        self.compile_s = 0.0
        self._prefills: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self._compiled: dict[tuple[Any, ...], Any] = {}  # programs by (kind, static args, input shapes)

    def compiled(self, kind: str, fn: Any, args: tuple[Any, ...], **static: Any) -> tuple[Any, float]:
        """``fn.lower(*args, **static).compile()``, once per static arguments and input shapes."""
        import jax

        shapes = str(jax.tree_util.tree_map(lambda a: (getattr(a, "shape", None), getattr(a, "dtype", None)), args[1:]))
        key = (kind, shapes, tuple(sorted(static.items())))
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        prog = fn.lower(*args, **static).compile()
        dt = time.perf_counter() - t0
        self.compile_s += dt
        self._compiled[key] = prog
        return prog, dt

    # -- states
    def prefill(self, n_prompt: int, cache_size: int, keep_layers: tuple[int, ...], max_new: int | None = None,
                stop_ids: tuple[int, ...] = ()):
        """(GenState, prompt forward) of an ``n_prompt``-token prompt in a cache of ``cache_size`` slots."""
        import jax
        import jax.numpy as jnp

        from hsdjax.core import engine
        from hsdjax.core.sampling import SamplingParams

        key = (n_prompt, cache_size, keep_layers, max_new, stop_ids)
        if key in self._prefills:
            return self._prefills[key]
        if n_prompt + 2 > cache_size:
            raise ValueError(f"a {n_prompt}-token prompt does not fit a {cache_size}-slot cache")
        p_bucket = min(engine.pick_bucket(n_prompt, engine.PROMPT_BUCKETS, "a prompt"), cache_size)
        arr = np.zeros((1, p_bucket), np.int32)
        arr[0, :n_prompt] = self.t.prompt(n_prompt, self.args.seed)
        args = (self.t.params, jnp.asarray(arr), jnp.array([n_prompt], jnp.int32),
                jnp.array([max_new or cache_size], jnp.int32), SamplingParams.make(1, 0.0, 0, 1.0),
                jax.random.PRNGKey(self.args.seed)[None], engine.stop_array(stop_ids))
        prog, _ = self.compiled("prefill", engine.prefill, args, cfg=self.t.cfg, cache_size=cache_size, spare=1,
                                keep_layers=keep_layers)
        out = prog(*args)
        jax.block_until_ready(out)
        self._prefills[key] = out
        return out

    def program(self, label: str, drafter: Any, dparams: Any, n_prompt: int, cache_size: int, rounds: int,
                keep_layers: tuple[int, ...] = (), **prefill_opts: Any) -> Program:
        import jax
        import jax.numpy as jnp

        from hsdjax.core import engine

        gen, fwd = self.prefill(n_prompt, cache_size, keep_layers, **prefill_opts)
        state0 = engine.start_decoding(dparams, gen, fwd, drafter=drafter)
        jax.block_until_ready(state0)
        p = Program(label, drafter, dparams, state0, rounds)
        p.compiled, p.compile_s = self.compiled("decode", engine.decode, (self.t.params, dparams, state0,
                                                                        jnp.int32(rounds)), cfg=self.t.cfg,
                                                drafter=drafter)
        progress(f"compiled {label} (cache {cache_size}) in {p.compile_s:.1f} s")
        return p

    def call(self, p: Program) -> float:
        """One timed decode call from a fresh copy of the state; seconds per round."""
        import jax
        import jax.numpy as jnp

        st = _copy(p.state0)
        jax.block_until_ready(st)
        t0 = time.perf_counter()
        out = p.compiled(self.t.params, p.dparams, st, jnp.int32(p.rounds))
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        p.last = out
        passes = int(out.stats.target_passes[0])
        return dt / max(passes, 1)

    def run(self, programs: list[Program]) -> None:
        """Warm-up call each, then ``repeats`` interleaved timed calls (order rotated per repeat)."""
        for p in programs:
            self.call(p)
        for r in range(self.args.repeats):
            order = programs[r % len(programs):] + programs[:r % len(programs)]
            for p in order:
                p.times.append(self.call(p))
        for p in programs:
            st0, st = p.state0, p.last
            passes = int(st.stats.target_passes[0])
            p.info.clear()
            p.info.update({"ms": 1e3 * statistics.median(p.times), "ms_all": [round(1e3 * t, 4) for t in p.times],
                      "rounds": passes,
                      "tokens_per_round": float(st.gen.seq_len[0] - st0.gen.seq_len[0]) / max(passes, 1),
                      "verified_per_round": float(st.stats.verified_nodes[0]) / max(passes, 1),
                      "context_start": int(st0.gen.cache.length[0]), "context_end": int(st.gen.cache.length[0]),
                      "compile_s": round(p.compile_s, 3)})


def _copy(tree: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True) if hasattr(a, "shape") else a, tree)


# ------------------------------------------------------------------------------------------ drafter alone


def _drafter_loop_fn():
    import jax
    import jax.numpy as jnp

    from hsdjax.core.drafters.base import TargetStates
    from hsdjax.core.verify import Verdict

    @partial(jax.jit, static_argnames=("drafter", "rounds", "vocab"))
    def drafter_loop(dparams, draft, gen, layers_pool, hidden_pool, accept, *, drafter, rounds, vocab):
        """``rounds`` calls of propose + observe with a synthetic verdict; returns (draft, gen, checksum)."""
        b = gen.seq_len.shape[0]
        p = drafter.max_depth + 1
        pool = layers_pool.shape[0]

        def body(i, carry):
            d, g, check = carry
            tree, d, cost = drafter.propose(dparams, d, g)
            n = jnp.clip(accept[:, i % accept.shape[1]], 1, p).astype(jnp.int32)
            path = jnp.broadcast_to(jnp.minimum(jnp.arange(p, dtype=jnp.int32), tree.num_nodes - 1), (b, p))
            fold = (jnp.sum(tree.tokens * tree.valid, axis=1) + jnp.sum(tree.parents + tree.depth, axis=1)
                    + cost.passes + cost.states + cost.reused)
            bonus = ((fold % 2).astype(jnp.int32) + g.last_token()) % vocab  # depends on the whole tree
            verdict = Verdict(path=path, n_path=n, bonus=bonus)
            emitted = verdict.emitted(tree)
            seq = jax.vmap(lambda row, new, s: jax.lax.dynamic_update_slice(row, new, (s,)))(g.seq, emitted, g.seq_len)
            new_g = g.replace(seq=seq, seq_len=g.seq_len + n)
            states = TargetStates(hidden=jax.lax.dynamic_index_in_dim(hidden_pool, i % pool, keepdims=False),
                                  layers=jax.lax.dynamic_index_in_dim(layers_pool, i % pool, keepdims=False))
            d = drafter.observe(dparams, d, g, new_g, verdict, states)
            return d, new_g, check + fold

        return jax.lax.fori_loop(0, rounds, body, (draft, gen, jnp.zeros((b,), jnp.int32)))

    return drafter_loop


def time_drafter_alone(bench: Bench, p: Program) -> dict[str, Any]:
    """ms per round of the drafter's propose + observe alone, replaying ``p``'s accept lengths."""
    import jax
    import jax.numpy as jnp

    cfg, drafter = bench.t.cfg, p.drafter
    passes = max(int(p.last.stats.target_passes[0]), 1)
    accept = jnp.asarray(np.asarray(p.last.stats.round_log[:, :passes], np.int32))
    accept = jnp.maximum(accept, 1)
    b, P, E = 1, drafter.max_depth + 1, cfg.hidden_size
    k = min(8, passes)
    rng = np.random.default_rng(bench.args.seed)
    dtype = jnp.dtype(cfg.dtype)
    gen0, draft0 = p.state0.gen, p.state0.draft
    n_layers = len(drafter.prompt_layers)  # the engine passes the drafter's own layers along the path
    layers_pool = jnp.asarray(rng.standard_normal((k, n_layers, b, P, E), np.float32), dtype)
    hidden_pool = jnp.asarray(rng.standard_normal((k, b, P, E), np.float32), dtype)
    fn = _drafter_loop_fn()
    args = (p.dparams, draft0, gen0, layers_pool, hidden_pool, accept)
    t0 = time.perf_counter()
    compiled = fn.lower(*args, drafter=drafter, rounds=p.rounds, vocab=cfg.vocab_size).compile()
    c = time.perf_counter() - t0
    bench.compile_s += c
    progress(f"compiled {drafter.name}'s propose + observe loop in {c:.1f} s; timing it")
    times = []
    for r in range(bench.args.repeats + 1):
        a = (p.dparams, _copy(draft0), _copy(gen0), layers_pool, hidden_pool, accept)
        jax.block_until_ready(a)
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*a))
        if r:  # the first call is the warm-up
            times.append((time.perf_counter() - t0) / p.rounds)
    return {"ms": 1e3 * statistics.median(times), "ms_all": [round(1e3 * t, 4) for t in times],
            "compile_s": round(c, 3)}


# ------------------------------------------------------------------------------------------ parts


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from hsdjax.core.drafters.base import ARDrafter

    load_start = os.getloadavg()[0]
    t_all = time.perf_counter()
    target = make_target(args)
    cfg = target.cfg
    bench = Bench(target, args)
    token = cfg.vocab_size - 1
    parts = set(args.parts)
    sizes = args.sizes
    feature = {}
    for m in ("hsd", "eagle"):
        if m in parts:
            try:
                feature[m] = feature_drafter(target, m, args.seed)
            except Exception as e:  # noqa: BLE001 - e.g. no shipped drafter for this model: skip with a note
                feature[m] = e
                progress(f"skipping {m}: {e}")
    for m in ("hsd", "eagle"):  # the same drafter with its panels widened to float32 (as loaded before lean panels)
        if f"{m}-f32" in parts and not isinstance(feature.get(m, None), Exception):
            fd = feature.get(m) or feature_drafter(target, m, args.seed)
            feature[f"{m}-f32"] = (fd[0], float32_panels(fd[1]))
    keep = tuple(sorted({i for d in feature.values() if not isinstance(d, Exception) for i in d[0].layers}))

    result: dict[str, Any] = {"ar_ms": None, "ratios": {}, "long_ratios": {}, "buckets": {}, "hsd": None,
                              "eagle": None, "compile_s": None}
    table: list[tuple[str, str, str, dict[str, Any], dict[str, Any]]] = []  # (context, bucket, what, info, ar info)

    def group(n_prompt: int, bucket: int, tree_sizes: Sequence[int], extra: Sequence[tuple[str, Any, Any]] = ()
              ) -> dict[str, Program]:
        drafters = [("ar", ARDrafter(), ())] + [(f"N={n}", fixed_tree(n, token, args.shape), ()) for n in tree_sizes]
        drafters += list(extra)
        room = bucket - n_prompt - max(d.spare for _, d, _ in drafters) - 2
        rounds = max(1, min(args.rounds, room))
        progs = [bench.program(label, d, dp, n_prompt, bucket, rounds, keep) for label, d, dp in drafters]
        for p in progs[1 + len(tree_sizes):]:  # hsd / eagle: add the target-pass round at the size they verify
            bench.call(p)
            st = p.last.stats
            verified = max(1, int(round(float(st.verified_nodes[0]) / max(int(st.target_passes[0]), 1))))
            fixed = fixed_tree(verified, token, "tree", depth=p.drafter.max_depth)
            label = f"target N={verified} depth {fixed.max_depth}"
            p.target_label = label  # type: ignore[attr-defined]
            if not any(q.label == label for q in progs):
                progs.append(bench.program(label, fixed, (), n_prompt, bucket, rounds, keep))
        progress(f"timing context {n_prompt}, bucket {bucket}: {', '.join(p.label for p in progs)} "
                 f"({rounds} rounds x {args.repeats} repeats)")
        bench.run(progs)
        out = {p.label: p for p in progs}
        for p in progs:
            table.append((str(n_prompt), str(bucket), p.label, p.info, out["ar"].info))
        return out

    want_tree = "tree" in parts
    if parts & {"ar", "tree", "hsd", "eagle", "hsd-f32", "eagle-f32"}:
        for bucket in args.buckets:
            extra = []
            if bucket == args.main_bucket:
                for m, fd in feature.items():
                    if not isinstance(fd, Exception):
                        extra.append((m, fd[0], fd[1]))
            progs = group(args.context, bucket, sizes if want_tree else (), extra)
            ar = progs["ar"].info["ms"]
            entry = {"ar_ms": ar, "ratios": {str(n): progs[f"N={n}"].info["ms"] / ar for n in sizes if want_tree}}
            result["buckets"][str(bucket)] = entry
            if bucket == args.main_bucket:
                result["ar_ms"], result["ratios"] = ar, entry["ratios"]
                for m, fd in feature.items():
                    if isinstance(fd, Exception):
                        result[m] = {"skipped": str(fd)}
                        continue
                    target_prog = progs[progs[m].target_label]
                    result[m] = split_feature(bench, progs[m], target_prog, table, progs["ar"].info)
    if "long" in parts:
        progs = group(args.long_context, args.long_bucket, args.long_sizes)
        ar = progs["ar"].info["ms"]
        result["long_ar_ms"] = ar
        result["long_ratios"] = {str(n): progs[f"N={n}"].info["ms"] / ar for n in args.long_sizes}
    if "speeds" in parts:
        result["speeds"] = speeds(bench, args, target)
    result["compile_s"] = round(bench.compile_s, 2)
    result["meta"] = {
        "model": target.name, "random_weights": target.random, "dtype": cfg.dtype,
        "layer_loop": "scan" if cfg.scan_layers else "unrolled", "backend": jax.default_backend(),
        "device": str(jax.devices()[0]), "rounds": args.rounds, "repeats": args.repeats, "context": args.context,
        "long_context": args.long_context, "main_bucket": args.main_bucket, "tree_shape": args.shape,
        "parts": sorted(parts), "loadavg": {"start": load_start, "end": os.getloadavg()[0]},
        "cores": os.cpu_count(), "seconds": round(time.perf_counter() - t_all, 1),
    }
    result["table"] = [{"context": c, "bucket": b, "what": w, "ratio_to_ar": i["ms"] / a["ms"], **i}
                       for c, b, w, i, a in table]
    return result


def split_feature(bench: Bench, p: Program, tp: Program, table: list, ar_info: dict[str, Any]) -> dict[str, Any]:
    """hsd / eagle: round, target-pass round at the verified size, drafter alone, and the rest."""
    verified = tp.drafter.num_nodes
    ar_ms = ar_info["ms"]
    dr = time_drafter_alone(bench, p)
    round_ms, target_ms, drafter_ms = p.info["ms"], tp.info["ms"], dr["ms"]
    out = {"round_ms": round_ms, "target_ms": target_ms, "drafter_ms": drafter_ms,
           "other_ms": round_ms - target_ms - drafter_ms, "verified_nodes": verified,
           "tokens_per_round": p.info["tokens_per_round"], "round_ratio": round_ms / ar_ms,
           "target_ratio": target_ms / ar_ms, "drafter_ratio": drafter_ms / ar_ms,
           "other_ratio": (round_ms - target_ms - drafter_ms) / ar_ms, "drafter_ms_all": dr["ms_all"],
           "settings": {k: getattr(p.drafter, k) for k in ("depth", "width", "budget", "min_prob", "tiers")}}
    if hasattr(p.drafter, "policy"):
        out["settings"]["policy"] = p.drafter.policy
    ctx, bucket = str(int(p.state0.gen.prompt_len[0])), str(int(p.state0.gen.seq.shape[1]))
    table.append((ctx, bucket, f"{p.label} drafter alone", {"ms": drafter_ms}, ar_info))
    table.append((ctx, bucket, f"{p.label} other", {"ms": out["other_ms"]}, ar_info))
    return out


def speeds(bench: Bench, args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """End-to-end decode tokens/s of each method: ``--max-new`` tokens after the ``--context`` prompt."""
    from hsdjax.core import engine
    from hsdjax.core.drafters.base import ARDrafter

    out: dict[str, Any] = {}
    progs = []
    for m in args.speed_methods:
        try:
            if m == "ar":
                d, dp = ARDrafter(), ()
            elif m == "pld":
                d, dp = pld_drafter(target)
            else:
                d, dp = feature_drafter(target, m, args.seed)
        except Exception as e:  # noqa: BLE001
            out[m] = {"skipped": str(e)}
            continue
        _, cache = engine.plan_shapes(target.cfg, args.context, args.max_new, spare=d.spare)
        progs.append(bench.program(f"speed {m}", d, dp, args.context, cache, args.max_new + 1,
                                   tuple(getattr(d, "layers", ())), max_new=args.max_new))
    if progs:
        bench.run(progs)
    for p in progs:
        st0, st = p.state0, p.last
        new = int(st.gen.seq_len[0] - st0.gen.seq_len[0])  # the first new token came from the prefill
        decode_s = p.info["ms"] * p.info["rounds"] / 1e3
        out[p.label.split()[-1]] = {"decode_tokens_per_s": new / decode_s if decode_s > 0 else None,
                                    "new_tokens": new + 1, "rounds": p.info["rounds"],
                                    "tokens_per_round": p.info["tokens_per_round"], "ms_per_round": p.info["ms"]}
    return out


# ------------------------------------------------------------------------------------------ report


def print_table(result: dict[str, Any]) -> None:
    m = result["meta"]
    print(f"model {m['model']}{' (random weights)' if m['random_weights'] else ''}, {m['dtype']}, {m['layer_loop']} "
          f"layers, {m['backend']} ({m['device']}), batch 1, greedy; {m['rounds']} rounds per call, median of "
          f"{m['repeats']} interleaved calls; load average {m['loadavg']['start']:.1f} -> {m['loadavg']['end']:.1f} "
          f"on {m['cores']} cores")
    head = ["context", "bucket", "round", "ms/round", "x ar", "tokens/round", "verified"]
    rows = [head]
    for r in result["table"]:
        rows.append([r["context"], r["bucket"], r["what"], f"{r['ms']:.3f}", f"{r['ratio_to_ar']:.2f}",
                     f"{r['tokens_per_round']:.2f}" if "tokens_per_round" in r else "-",
                     f"{r['verified_per_round']:.1f}" if "verified_per_round" in r else "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for name in ("hsd", "eagle", "hsd-f32", "eagle-f32"):
        s = result.get(name)
        if s and "round_ms" in s:
            print(f"{name}: round {s['round_ms']:.3f} ms ({s['round_ratio']:.2f}x ar) = drafter {s['drafter_ms']:.3f} "
                  f"({s['drafter_ratio']:.2f}x) + target pass N={s['verified_nodes']} {s['target_ms']:.3f} "
                  f"({s['target_ratio']:.2f}x) + other {s['other_ms']:.3f} ({s['other_ratio']:.2f}x); "
                  f"{s['tokens_per_round']:.2f} tokens/round")
        elif s:
            print(f"{name}: skipped ({s.get('skipped')})")
    for k, s in (result.get("speeds") or {}).items():
        if "decode_tokens_per_s" in s:
            print(f"speed {k}: {s['decode_tokens_per_s']:.1f} decode tok/s ({s['tokens_per_round']:.2f} tokens/round)")
        else:
            print(f"speed {k}: skipped ({s.get('skipped')})")
    print(f"compile (excluded from every figure): {result['compile_s']:.1f} s")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF folder")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--rounds", type=int, default=32, help="rounds per timed decode call")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per program (median)")
    p.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma-separated among {','.join(PARTS)}")
    p.add_argument("--buckets", type=ints, default=[256, 1024, 4096], help="cache buckets at --context tokens")
    p.add_argument("--main-bucket", type=int, default=1024, help="bucket of 'ratios', 'ar_ms', hsd and eagle")
    p.add_argument("--sizes", type=ints, default=[2, 4, 8, 16], help="fixed tree sizes (nodes, root included)")
    p.add_argument("--context", type=int, default=200, help="cached tokens (prompt length)")
    p.add_argument("--long-context", type=int, default=2000)
    p.add_argument("--long-bucket", type=int, default=4096)
    p.add_argument("--long-sizes", type=ints, default=[8, 13])
    p.add_argument("--shape", choices=("tree", "chain"), default="tree", help="fixed trees' shape")
    p.add_argument("--speed-methods", default="ar,pld,hsd", help="methods of the 'speeds' part")
    p.add_argument("--max-new", type=int, default=128, help="new tokens of the 'speeds' part")
    p.add_argument("--random-weights", action="store_true", help="random params of the model's shapes")
    p.add_argument("--config", help="JSON file of ModelConfig fields (with --random-weights)")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU/TPU")
    p.add_argument("--kv-cache", default=None, choices=("float32", "float16", "bfloat16"),
                   help="KV cache storage (default: the compute dtype)")
    p.add_argument("--layer-loop", choices=("scan", "unrolled"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="also write the JSON object here")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.speed_methods = [x.strip() for x in args.speed_methods.split(",") if x.strip()]
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        p.error(f"unknown parts {bad}; available: {', '.join(PARTS)}")
    if args.config and not args.random_weights:
        p.error("--config needs --random-weights")
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be at least 1")
    if set(args.parts) & {"hsd", "eagle", "hsd-f32", "eagle-f32"} and args.main_bucket not in args.buckets:
        args.buckets = sorted(set(args.buckets) | {args.main_bucket})
    if args.main_bucket not in args.buckets:
        args.main_bucket = args.buckets[0]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from hsdjax.errors import HsdjaxError
    from hsdjax.frontends.api import enable_compilation_cache

    enable_compilation_cache()
    try:
        result = measure(args)
    except HsdjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(result)
    text = json.dumps(result, default=float)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    if args.json:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
