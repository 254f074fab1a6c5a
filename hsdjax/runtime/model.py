"""Model runtime: the Llama / Qwen2 decoder in Flax, its KV cache, and the masked multi-token forward.

One forward call takes, per batch row, an arbitrary set of T new tokens with explicit positions and an
explicit mask among them (causal for prefill, a tree mask for verification, one token for decoding).
Every new token attends to the row's cached prefix (``cache.length`` valid entries) and to the new
tokens its mask allows. The forward never writes the cache: it returns the new keys/values, and
``commit`` packs the chosen ones (all of them for plain decoding, the accepted path for speculative
decoding) right after the row's prefix. Layers are stacked and run under ``nn.scan`` so compile time
does not grow with depth.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from hsdjax.errors import HsdjaxError
from hsdjax.kernels.cpu_attention import MAX_NEW_TOKENS, tree_attention_cpu
from hsdjax.kernels.cpu_matmul import PANEL, panel_matmul, panel_matmul_reference, screened_argmax
from hsdjax.kernels.tree_attention import attention_fn
from hsdjax.runtime.config import ModelConfig


def argmax_last(x: Float[Array, "... V"]) -> Int[Array, "..."]:
    """``jnp.argmax(x, axis=-1)`` (the first index of the maximum; a NaN counts as the maximum) as two
    plain reductions, a max and a min over indices where the max sits: XLA's CPU backend vectorizes
    those but not argmax's (value, index) pair reduction, which made the LM head's argmax cost 0.25 ms
    for one row of SmolLM2's 49,152 logits and 0.94 ms for 8 (0.08 / 0.26 ms this way)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    nan = jnp.isnan(x)
    # XLA's vectorized CPU max may drop a NaN (the packed max returns its second operand), so whether a
    # row holds one is asked separately; such a row's first NaN wins, as in jnp.argmax
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == m)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


@struct.dataclass
class KVCache:
    """Keys/values per layer and the number of valid entries per row, [B].

    ``k``/``v`` are one stacked [L, B, K, S, D] array when layers run under ``lax.scan``, or a tuple
    of L [B, K, S, D] arrays when they are unrolled (see ``ModelConfig.scan_layers``).
    """

    k: Float[Array, "L B K S D"] | tuple[Float[Array, "B K S D"], ...]
    v: Float[Array, "L B K S D"] | tuple[Float[Array, "B K S D"], ...]
    length: Int[Array, " B"]

    @property
    def size(self) -> int:
        return self.k[0].shape[2]


def init_cache(cfg: ModelConfig, batch: int, size: int, dtype: Any = None) -> KVCache:
    """An empty cache of ``size`` slots per row (stored in ``cfg.cache_dtype``, else the compute dtype)."""
    dtype = dtype or jnp.dtype(cfg.cache_dtype or cfg.dtype)
    layer = (batch, cfg.num_kv_heads, size, cfg.head_dim)
    if cfg.scan_layers:
        k = jnp.zeros((cfg.num_layers, *layer), dtype)
        v = jnp.zeros((cfg.num_layers, *layer), dtype)
    else:
        k = tuple(jnp.zeros(layer, dtype) for _ in range(cfg.num_layers))
        v = tuple(jnp.zeros(layer, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=k, v=v, length=jnp.zeros((batch,), jnp.int32))


def gather_path(new_k: Float[Array, "L B T K D"], new_v: Float[Array, "L B T K D"], keep: Int[Array, "B A"]
                ) -> tuple[Float[Array, "L B A K D"], Float[Array, "L B A K D"]]:
    """The new entries ``keep[b, :]`` of each row (e.g. a tree's accepted path), in order."""
    take = jax.vmap(lambda x, idx: x[:, idx], in_axes=(1, 0), out_axes=1)  # [L, B, A, K, D]
    return take(new_k, keep), take(new_v, keep)


def write_path(cache: KVCache, k_sel: Float[Array, "L B A K D"], v_sel: Float[Array, "L B A K D"],
               n_keep: Int[Array, " B"]) -> KVCache:
    """Write A entries per row right after the row's prefix; the first ``n_keep[b]`` become valid.

    All A entries are written (slots beyond ``n_keep`` hold garbage that the advanced ``length``
    masks out and the next write overwrites), so the cache needs A spare slots. A stacked cache may
    hold more rows than the batch (a row pool, ``pooled_rows``): row b is written, rows past B stay.
    """
    k_sel, v_sel = k_sel.transpose(0, 1, 3, 2, 4), v_sel.transpose(0, 1, 3, 2, 4)  # [L, B, K, A, D]
    batch = cache.length.shape[0]
    if pooled_rows(cache) and (isinstance(cache.k, tuple) or _on_explicit_mesh(k_sel)):
        raise HsdjaxError("a KV cache with more rows than the batch needs the stacked layout off a mesh")

    def write(buf, upd, start):  # one row: buf [..., K, S, D], upd [..., K, A, D]
        return jax.lax.dynamic_update_slice(buf, upd.astype(buf.dtype), (0,) * (buf.ndim - 2) + (start, 0))

    if isinstance(cache.k, tuple):
        write_rows = jax.vmap(write, in_axes=(0, 0, 0))
        k = tuple(write_rows(c, k_sel[i], cache.length) for i, c in enumerate(cache.k))
        v = tuple(write_rows(c, v_sel[i], cache.length) for i, c in enumerate(cache.v))
    elif _on_explicit_mesh(k_sel):  # traced under an explicit mesh: the batched update keeps the shardings
        write_rows = jax.vmap(write, in_axes=(1, 1, 0), out_axes=1)
        k, v = write_rows(cache.k, k_sel, cache.length), write_rows(cache.v, v_sel, cache.length)
    else:  # one update per row, in place: a vmap over the batch axis (axis 1) made XLA keep the stacks
        k, v = cache.k, cache.v  # batch-major, and copy both whole to the kernels' layout every round
        for b in range(batch):
            at = (0, b, 0, cache.length[b], 0)
            k = jax.lax.dynamic_update_slice(k, k_sel[:, b:b + 1].astype(k.dtype), at)
            v = jax.lax.dynamic_update_slice(v, v_sel[:, b:b + 1].astype(v.dtype), at)
    return KVCache(k=k, v=v, length=cache.length + n_keep.astype(jnp.int32))


def pooled_rows(cache: KVCache) -> bool:
    """Whether the cache holds more rows than the batch (``engine.with_capacity``: rows ``B ..`` of a
    row pool, kept so that growing the batch copies no cache)."""
    rows = cache.k[0].shape[0] if isinstance(cache.k, tuple) else cache.k.shape[1]
    return rows > cache.length.shape[0]


def _on_explicit_mesh(x: Array) -> bool:
    """Whether ``x`` is traced under a mesh with explicit axes (``jax.sharding``'s explicit mode), where
    slicing a row out of an update gives it a sharding the cache does not have."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return bool(getattr(mesh, "axis_names", ()))


def commit(
    cache: KVCache,
    new_k: Float[Array, "L B T K D"],
    new_v: Float[Array, "L B T K D"],
    keep: Int[Array, "B A"],
    n_keep: Int[Array, " B"],
) -> KVCache:
    """Append the new entries ``keep[b, :n_keep[b]]`` of each row after its prefix."""
    return write_path(cache, *gather_path(new_k, new_v, keep), n_keep)


def sum_last_in_fixed_order(x: Float[Array, "... E"]) -> Float[Array, "... 1"]:
    """Sum over the last axis in one fixed order of additions (16-wide partial sums, then halving), so
    a row's sum does not depend on how many rows XLA reduces together: a T-token pass and a one-token
    step give the same bits (a plain reduce is vectorized differently for different shapes)."""
    e = x.shape[-1]
    if e % 16:
        return jnp.sum(x, axis=-1, keepdims=True)
    parts = x.reshape(*x.shape[:-1], e // 16, 16)
    acc = parts[..., 0, :]
    for i in range(1, e // 16):
        acc = acc + parts[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc


def rms_norm(x: Float[Array, "... E"], scale: Float[Array, " E"], eps: float) -> Float[Array, "... E"]:
    var = sum_last_in_fixed_order(jnp.square(x.astype(jnp.float32))) / x.shape[-1]
    return (x * jax.lax.rsqrt(var + eps)).astype(x.dtype) * scale


def rope_tables(positions: Int[Array, "B T"], head_dim: int, theta: float,
                materialize: bool = False) -> tuple[Array, Array]:
    """cos/sin tables [B, T, D/2] for the half-split rotary embedding.

    ``materialize`` computes them once into buffers: XLA otherwise fuses the cos/sin into every
    consumer and evaluates them per element there (per head, for q and k, in each of an unrolled
    stack's layers: ~60 fusions for SmolLM2). A conditional's results cannot be fused into their users,
    so the tables come out of a ``lax.cond`` whose two branches are the same (its predicate reads the
    positions, so it is not folded). Only where a conditional is cheap (CPU; on GPU its predicate is
    read by the host)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))

    def tables(pos):
        angles = pos.astype(jnp.float32)[..., None] * inv_freq
        return jnp.cos(angles), jnp.sin(angles)

    if materialize:
        return jax.lax.cond(positions.reshape(-1)[0] >= 0, tables, tables, positions)
    return tables(positions)


def apply_rope(x: Float[Array, "B T N D"], cos: Array, sin: Array) -> Float[Array, "B T N D"]:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention_for(backend: str) -> Any:
    """The tree attention a resolved backend (``ModelConfig.resolved_backend``) runs: the C++ kernel
    (``cpu_attention``) for "cpu-kernel", else ``attention_fn``'s (the Pallas kernel or the jnp reference)."""
    return tree_attention_cpu if backend == "cpu-kernel" else attention_fn(backend)


def kernel_matmul(cfg: ModelConfig, h: Float[Array, "... T K"], wp: Any,
                  layer: Int[Array, ""] | None = None) -> Float[Array, "... T N"]:
    """``h @ W`` for weights packed for the CPU kernel (``cpu_matmul.pack_params``): through the kernel,
    or, for a prompt chunk where ``cfg.cpu_matmul_prefill_xla`` (measured faster), through XLA's dot on
    the decoded weights. Decoding steps and tree passes (at most ``MAX_NEW_TOKENS`` new tokens per row)
    always take the kernel, so a tree pass computes what one-token steps compute. ``layer``: ``wp`` is the
    stack over layers and the kernel reads that layer's panels in place."""
    if cfg.cpu_matmul_prefill_xla and h.ndim >= 2 and h.shape[-2] > MAX_NEW_TOKENS:
        return panel_matmul_reference(h, wp, cfg.cpu_matmul_activations, layer, cfg.prefill_dot_dtype)
    return panel_matmul(h, wp, cfg.cpu_matmul_activations, layer)


def _dense_init(scale: float = 0.02):
    return nn.initializers.normal(stddev=scale)


class Block(nn.Module):
    """One pre-norm decoder layer: RMSNorm -> GQA attention (RoPE) -> RMSNorm -> SwiGLU MLP.

    ``layer`` (the CPU kernels' scanned loop): the params and caches are the whole stacks over layers and
    this is the layer to run; the kernels read its weights and cache in place, small params are indexed."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cache_k, cache_v, cos, sin, cache_len, new_mask, layer=None):
        cfg = self.cfg
        backend = cfg.resolved_backend
        e, d = cfg.hidden_size, cfg.head_dim
        hq, hk = cfg.num_heads * d, cfg.num_kv_heads * d
        dt = jnp.dtype(cfg.dtype)

        def p(name, shape, init=_dense_init()):
            if layer is not None:
                return self.get_variable("params", name)[layer].astype(dt)
            return self.param(name, init, shape, jnp.float32).astype(dt)

        def dense(h, name, k_in, n_out):  # h @ W[k_in, n_out] (stored as panels for the CPU kernels)
            if backend == "cpu-kernel":  # float32 or compressed panels (``cpu_matmul.pack_params``)
                if self.has_variable("params", name):
                    return kernel_matmul(cfg, h, self.get_variable("params", name), layer)
                return kernel_matmul(cfg, h, p(name, (n_out // PANEL, k_in, PANEL)))
            return h @ p(name, (k_in, n_out))

        x_in = x
        h = rms_norm(x, p("attn_norm", (e,), nn.initializers.ones), cfg.rms_norm_eps)
        zeros = nn.initializers.zeros
        if cfg.fused_projections:
            qkv = dense(h, "wqkv", e, hq + 2 * hk)
            if cfg.qkv_bias:
                qkv = qkv + p("bqkv", (hq + 2 * hk,), zeros)
            q, k, v = qkv[..., :hq], qkv[..., hq: hq + hk], qkv[..., hq + hk:]
        else:
            q, k, v = dense(h, "wq", e, hq), dense(h, "wk", e, hk), dense(h, "wv", e, hk)
            if cfg.qkv_bias:
                q, k, v = q + p("bq", (hq,), zeros), k + p("bk", (hk,), zeros), v + p("bv", (hk,), zeros)
        b, t = x.shape[:2]
        q = apply_rope(q.reshape(b, t, cfg.num_heads, d), cos, sin)
        k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, d), cos, sin)
        v = v.reshape(b, t, cfg.num_kv_heads, d)
        if cfg.cache_dtype and cfg.cache_dtype != cfg.dtype:  # the new tokens as the cache will hold them, so
            k, v = (a.astype(cfg.cache_dtype).astype(a.dtype) for a in (k, v))  # a tree sees what `ar` reads
        attend = attention_for(backend)
        if layer is None and cache_k is not None and cache_k.shape[0] > b:  # a row pool: the batch's rows
            cache_k, cache_v = cache_k[:b], cache_v[:b]
        if layer is not None:
            attn = attend(q, cache_k, cache_v, cache_len, k, v, new_mask, layer=layer)
        else:
            attn = attend(q, cache_k, cache_v, cache_len, k, v, new_mask)
        x = x + dense(attn.reshape(b, t, hq), "wo", hq, e)

        h = rms_norm(x, p("mlp_norm", (e,), nn.initializers.ones), cfg.rms_norm_eps)
        f = cfg.intermediate_size
        if cfg.fused_projections:
            gate_up = dense(h, "w_gate_up", e, 2 * f)
            gate, up = gate_up[..., :f], gate_up[..., f:]
        else:
            gate, up = dense(h, "w_gate", e, f), dense(h, "w_up", e, f)
        x = x + dense(jax.nn.silu(gate) * up, "w_down", f, e)
        return x, (k, v, x_in)


class Transformer(nn.Module):
    """The decoder: embeddings, a scanned stack of Blocks, final norm; ``logits`` applies the LM head."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        self.embed = self.param("embed", _dense_init(), (cfg.vocab_size, cfg.hidden_size), jnp.float32)
        self.final_norm = self.param("final_norm", nn.initializers.ones, (cfg.hidden_size,), jnp.float32)
        if not cfg.tie_embeddings:
            self.lm_head = self.param("lm_head", _dense_init(), (cfg.hidden_size, cfg.vocab_size), jnp.float32)
        if cfg.resolved_backend == "cpu-kernel" and self.is_initializing():  # the head packed (``pack_params``)
            self.param("head_panels", _dense_init(), (cfg.vocab_size // PANEL, cfg.hidden_size, PANEL), jnp.float32)
        if self.indexed_layers():
            # the kernels read each layer's weights and cache out of the stacks in place: the stacks are
            # broadcast to every step and the layer index is scanned (slicing them, as below, made XLA
            # copy each layer's weights and cache before the custom calls: 2.5x slower decoding)
            self.layers = nn.scan(
                Block,
                variable_broadcast="params",
                split_rngs={"params": False},
                in_axes=(nn.broadcast,) * 6 + (0,),
                length=cfg.num_layers,
            )(cfg)
        elif cfg.scan_layers:
            self.layers = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
            )(cfg)
        else:
            self.blocks = [Block(cfg) for _ in range(cfg.num_layers)]

    def indexed_layers(self) -> bool:
        """Whether the layers run as a scan over the layer index with the stacks broadcast (stacked
        layers through the CPU kernels; not while initializing, which creates the stacked params)."""
        return self.cfg.scan_layers and self.cfg.resolved_backend == "cpu-kernel" and not self.is_initializing()

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        new_mask: Bool[Array, "B T T"],
        cache: KVCache | None = None,
        keep_layers: tuple[int, ...] | None = None,
    ) -> dict[str, Array]:
        """Run T new tokens per row over the cached prefix (none when ``cache`` is None).

        Returns ``hidden`` [B, T, E] (final-normed, what the LM head reads), ``k``/``v``
        [L, B, T, K, D] for ``commit``, and ``layers`` [F, B, T, E]: the states ``keep_layers`` names,
        where state i < L is the input of layer i and state L the last layer's (un-normed) output (all
        L+1 when ``keep_layers`` is None; none when it is empty), for drafters.
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        x = jnp.take(self.embed, tokens, axis=0).astype(dt)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta,
                               materialize=cfg.resolved_backend == "cpu-kernel")
        if cache is None:
            cache_k = cache_v = cache_len = None
        else:
            cache_k, cache_v, cache_len = cache.k, cache.v, cache.length
        if self.indexed_layers():
            index = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            out, (k, v, layer_inputs) = self.layers(x, cache_k, cache_v, cos, sin, cache_len, new_mask, index)
        elif cfg.scan_layers:
            out, (k, v, layer_inputs) = self.layers(x, cache_k, cache_v, cos, sin, cache_len, new_mask)
        else:
            out, per_layer = x, []
            for i, block in enumerate(self.blocks):
                layer_k = None if cache is None else cache_k[i]
                layer_v = None if cache is None else cache_v[i]
                out, kv = block(out, layer_k, layer_v, cos, sin, cache_len, new_mask)
                per_layer.append(kv)
            ks, vs, layer_inputs = zip(*per_layer)  # layer inputs stay separate: only kept ones are stacked
            k, v = jnp.stack(ks), jnp.stack(vs)
        result = {"hidden": rms_norm(out, self.final_norm.astype(dt), cfg.rms_norm_eps), "k": k, "v": v}
        if keep_layers is None:
            result["layers"] = jnp.concatenate([jnp.stack(list(layer_inputs)), out[None]], axis=0)
        elif keep_layers:
            result["layers"] = jnp.stack([out if i == cfg.num_layers else layer_inputs[i] for i in keep_layers])
        return result

    def logits(self, hidden: Float[Array, "... E"]) -> Float[Array, "... V"]:
        """LM head (the tied embedding matrix or the separate head); float32 logits."""
        dt = jnp.dtype(self.cfg.dtype)
        if self.cfg.resolved_backend == "cpu-kernel":  # float32 or compressed panels
            return kernel_matmul(self.cfg, hidden, self.get_variable("params", "head_panels"))
        if self.cfg.tie_embeddings:  # contract with the [V, E] embedding directly: no transposed copy
            return jnp.einsum("...e,ve->...v", hidden, self.embed.astype(dt), preferred_element_type=jnp.float32)
        return jnp.matmul(hidden, self.lm_head.astype(dt), preferred_element_type=jnp.float32)

    def greedy_tokens(self, hidden: Float[Array, "... E"]) -> Int[Array, "..."]:
        """``argmax_last(logits(hidden))``; with ``cfg.screened_head`` the same index without most of the
        head's float32 products (``cpu_matmul.screened_argmax``) where that pays: two rows or more (a tree
        pass, a batch). One row streams the whole head either way, and there the screen's bounds only add
        work (`ar` 0-5% slower, ``experiments/model_variants.py --compare screened``)."""
        if self.cfg.screened_head and math.prod(hidden.shape[:-1]) >= 2:
            params = self.variables["params"]
            return screened_argmax(hidden, params["head_panels"], params["head_colabs"])
        return argmax_last(self.logits(hidden))


def causal_mask(lengths: Int[Array, " B"], t: int) -> Bool[Array, "B T T"]:
    """Causal mask for T new tokens, padding beyond ``lengths`` masked (each query still sees itself)."""
    i = jnp.arange(t)
    causal = i[None, :, None] >= i[None, None, :]
    valid = i[None, None, :] < lengths[:, None, None]
    return (causal & valid) | (i[:, None] == i[None, :])[None]


def init_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """Random parameters in the canonical stacked layout (for tests and tiny models)."""
    model = Transformer(cfg.replace(scan_layers=True))
    tokens = jnp.zeros((1, 1), jnp.int32)
    variables = model.init(jax.random.PRNGKey(seed), tokens, tokens, jnp.ones((1, 1, 1), bool))
    params = dict(variables["params"])
    params["layers"] = dict(params["layers"])
    return params if cfg.scan_layers else unstack_layers(params)


FUSED_PROJECTIONS = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(params: dict[str, Any], packed: bool = False) -> dict[str, Any] | None:
    """Separate q/k/v (and bias) and gate/up weights -> ``wqkv`` / ``bqkv`` / ``w_gate_up`` (concatenated
    on their output axis), for a config with ``fused_projections``. Stacked or unrolled layout.

    ``packed``: params already packed for the CPU kernels (``cpu_matmul.pack_params``), whose output
    axis is the panel axis (first; second when stacked); a weight's panels only join another's stored
    the same way (both 4-bit, both 8-bit or both float32), else None is returned (say a Q4_K q beside a
    Q6_K v): the model keeps its separate matmuls.

    Fewer, wider matmuls (each input read once; fewer kernel calls). On XLA's own CPU dot the fused form
    was 3-5% slower for 2-16-token tree passes; through the CPU kernels 3-6% faster
    (``experiments/model_variants.py --compare fused``), so ``load_model`` fuses when the kernels run."""
    def fuse(layer: dict[str, Any], stacked: bool) -> dict[str, Any] | None:
        out = dict(layer)
        for fused, parts in FUSED_PROJECTIONS.items():
            if all(name in layer for name in parts):
                arrays = [layer[name] for name in parts]
                axis = -1
                if packed and not fused.startswith("b"):
                    axis = 1 if stacked else 0
                    if len({(a.dtype, a.shape[:axis] + a.shape[axis + 1:]) for a in arrays}) != 1:
                        return None
                out[fused] = jnp.concatenate(arrays, axis=axis)
                for name in parts:
                    del out[name]
        return out

    out = {}
    for k, v in params.items():
        out[k] = fuse(v, k == "layers") if (k == "layers" or k.startswith("blocks_")) else v
        if out[k] is None:
            return None
    return out


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Stacked ``layers`` -> ``blocks_0`` ... ``blocks_{L-1}`` for the unrolled layer loop.

    XLA's CPU backend copies each layer's weights out of a stacked array inside ``lax.scan`` before
    its matmuls; separate arrays let decoding read every weight exactly once per token.
    """
    if "layers" not in params:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    num_layers = next(iter(params["layers"].values())).shape[0]
    for i in range(num_layers):
        out[f"blocks_{i}"] = {name: w[i] for name, w in params["layers"].items()}
    return out


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``unstack_layers``: the canonical stacked layout."""
    blocks = sorted((k for k in params if k.startswith("blocks_")), key=lambda k: int(k.split("_")[1]))
    if not blocks:
        return params
    out = {k: v for k, v in params.items() if not k.startswith("blocks_")}
    out["layers"] = {name: jnp.stack([params[b][name] for b in blocks]) for name in params[blocks[0]]}
    return out


def stack_uniform_layers(params: dict[str, Any]) -> dict[str, Any] | None:
    """``stack_layers`` where every layer stores each weight alike (shape and dtype: the same packed
    format), else None (a GGUF may keep, say, some layers' down projections in Q6_K and others in Q4_K,
    whose compressed panels cannot share one array)."""
    blocks = [params[k] for k in params if k.startswith("blocks_")]
    for name in blocks[0] if blocks else ():
        if len({(b[name].shape, jnp.dtype(b[name].dtype)) for b in blocks}) != 1:
            return None
    return stack_layers(params)
