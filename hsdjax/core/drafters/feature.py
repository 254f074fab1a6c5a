"""Feature drafters' network: the Flax module shared by `hsd` and `eagle`, and its attention helpers.

Both drafters read the target's hidden states of the verified context (a fusion of a low, a middle and
a high layer, each RMS-normed, projected to the target width) and run one decoder layer sized like
the target's (grouped-query attention with RoPE, SwiGLU MLP) with its own KV cache. They differ in
how tokens enter:

* ``hsd`` (hidden-state drafting): the layer's input is a fused target state or the layer's own
  previous output; no token embedding enters the chain. Tokens are injected late by ``g``, which
  turns a predicted state plus the embeddings of the path's last tokens into a state for the head.
  Three forms of ``g``: ``mlp`` (residual MLP over the concatenation), ``film`` (a gated scale and
  shift computed from the token embeddings), and ``attn``: ``mlp`` plus one attention read of the
  verified context (the layer's cached keys and values) with a query made from the predicted state and
  the injected tokens, so the injected token can look up where it occurred before and what followed
  (what ``eagle``'s layer does with its token-fed query), while the chain itself stays token-free.
* ``eagle`` (token-conditioned features): the layer's input is ``fc([feature; embedding of the next
  token])``, so every tree node needs its own pass of the layer.

The head is the target's frozen LM head restricted to a draft vocabulary (``vocab_ids``), applied
after a learned RMS norm; optionally (``head_delta``) training also learns a correction to those rows,
stored in the checkpoint and added to them once when the drafter is loaded, so it costs nothing per
round. Target embeddings are frozen inputs, never drafter parameters.

At inference both drafters keep the layer's keys and values of the verified context in a cache and
ingest each round's verified path (``ingest_path``): at the smallest path tier that holds the round's
counts, keys written before the cache is read, through the C++ attention kernel where the drafter's
matrices are packed for the CPU kernels (experiments/notes/benchmarks-log.md, "A cheaper drafter round").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hsdjax.core.drafters.base import Drafter, layer_macs
from hsdjax.core.drafters.pld import FIXED_MAX_NGRAM, check_lengths, fixed_lengths, lookup_by_match
from hsdjax.core.tree import DraftTree, graft_chain
from hsdjax.kernels.cpu_matmul import PANEL, compress_columns, is_compressed, pack, pack_exact, panel_matmul
from hsdjax.kernels.tree_attention import REFERENCE_BLOCK_S, attention_fn
from hsdjax.runtime.config import resolve_backend
from hsdjax.runtime.model import apply_rope, attention_for, rms_norm, rope_tables

INJECTIONS = ("mlp", "film", "attn")  # hsd's forms of g (``FeatureDrafterNet.inject``)


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """Shape and form of a feature drafter (stored in its checkpoint)."""

    method: str  # "hsd" | "eagle"
    hidden: int  # the target's hidden size E
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int  # draft vocabulary size
    fused: int = 3  # number of target layers fused at the input
    injection: str = "mlp"  # hsd: "mlp" | "film" | "attn"
    inject_tokens: int = 2  # hsd: embeddings of the path's last tokens given to g
    inject_hidden: int = 0  # hsd: hidden width of g's MLP (mlp / attn forms; 0: the drafter's width W)
    head_delta: bool = False  # a trained [V, E] correction to the frozen head rows (``HEAD_DELTA``)
    width: int = 0  # the drafter's own width W (0: the target's E); W < E adds ``lift`` [W, E] before the head
    root_token: bool = False  # hsd: verified inputs carry the next token (known once verified), as eagle's do
    chain_layer: bool = False  # hsd: the chain's own steps run a second layer; the first reads verified inputs only
    chain_g: bool = False  # hsd: nodes below depth 1 (the chain's states) get a g and output norms of their own
    eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def state_width(self) -> int:
        """W: the width of the drafter's layer and of its predicted states."""
        return self.width or self.hidden

    @property
    def g_hidden(self) -> int:
        """The hidden width of ``g``'s MLP."""
        return self.inject_hidden or self.state_width

    @property
    def narrow(self) -> bool:
        return self.state_width != self.hidden

    @property
    def token_input(self) -> bool:
        """Whether a verified position's layer input is ``fc([feature; embedding of the next token])``:
        always for ``eagle``; for ``hsd`` with ``root_token`` (the chain's own steps stay token-free)."""
        return self.method == "eagle" or self.root_token

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _init(scale: float = 0.02):
    return nn.initializers.normal(stddev=scale)


# The network's matrices ([K, N], used as ``x @ w``). With the target on the CPU kernels (backend
# "cpu-kernel") those whose N is a whole number of panels are stored as panels ``[N / 32, K, 32]``
# (``pack_for_cpu``; bfloat16 where their values are, as a checkpoint's are) and multiplied by the kernel:
# the drafter's small-M products then run at the kernel's speed instead of XLA's (same values up to the
# order of additions; the drafter's numbers never change the output, only how much of it is accepted).
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "fuse", "fc", "g_in", "g_out", "g_scale", "g_shift",
            "g_q", "g_o", "lift")


def in_panels(backend: str, n: int) -> bool:
    """Whether a matrix (or the head) of N output columns is stored as panels under a resolved backend:
    the one rule ``pack_for_cpu`` packs by and the network reads by."""
    return backend == "cpu-kernel" and n % PANEL == 0


@dataclasses.dataclass(frozen=True)
class Matrix:
    """A network matrix as stored: ``value`` is [K, N], or its panels [N / 32, K, 32] when ``panels``."""

    value: Any
    panels: bool


def matmul(x: Float[Array, "... K"], w: Matrix) -> Float[Array, "... N"]:
    """``x @ w``: XLA's dot, or the CPU kernel for a matrix stored as panels."""
    return panel_matmul(x, w.value) if w.panels else x @ w.value


def pack_for_cpu(net: dict[str, Any], head: Float[Array, "V E"], target_head: Any = None,
                 vocab_ids: Int[Array, " V"] | None = None) -> tuple[dict[str, Any], Any]:
    """The network's matrices and the draft head as panels for the CPU kernel (where their widths are
    whole panels; the rest stay as they are); the head becomes the panels of ``head.T``. As float32
    panels, unless the target's own head is compressed (``target_head``, its panels: the model was
    loaded with compressed weights): then matrices whose values are bfloat16 values (a checkpoint's)
    are stored in bfloat16, and the head, when it is exactly the target head's ``vocab_ids`` rows,
    compressed with that head's block scales. Either way the products are the float32 panels' bits."""
    lean = target_head is not None and is_compressed(target_head)
    to_panels = pack_exact if lean else lambda v: pack(jnp.asarray(v, jnp.float32))

    def walk(d: dict[str, Any]) -> dict[str, Any]:
        return {k: walk(v) if isinstance(v, dict) else
                to_panels(v) if k in MATRICES and v.ndim == 2 and in_panels("cpu-kernel", v.shape[1]) else v
                for k, v in d.items()}
    if not in_panels("cpu-kernel", head.shape[0]):
        return walk(net), head
    head_t = jnp.asarray(head, jnp.float32).T
    packed = compress_columns(target_head, vocab_ids, head_t) if lean and vocab_ids is not None else None
    return walk(net), to_panels(head_t) if packed is None else packed


def _matrix(mod: nn.Module, name: str, init: Any, shape: tuple[int, int]) -> Matrix:
    """A matrix parameter [K, N], stored as panels where ``mod.backend`` says so (``in_panels``; the
    panels of ``pack_for_cpu`` are taken as they are, with no shape check)."""
    if not mod.is_initializing() and mod.has_variable("params", name):
        return Matrix(mod.get_variable("params", name), in_panels(mod.backend, shape[1]))
    return Matrix(mod.param(name, init, shape), False)


class DraftLayer(nn.Module):
    """One pre-norm decoder layer; attention is computed outside (``project`` then ``finish``) so the
    same weights serve training rollouts, cached inference and tree attention."""

    cfg: FeatureConfig
    backend: str = "reference"  # resolved (``FeatureDrafterNet.backend``)

    def setup(self):
        c = self.cfg
        e, h, k, d = c.state_width, c.heads, c.kv_heads, c.head_dim
        self.attn_norm = self.param("attn_norm", nn.initializers.ones, (e,))
        self.mlp_norm = self.param("mlp_norm", nn.initializers.ones, (e,))
        self.wq = _matrix(self, "wq", _init(), (e, h * d))
        self.wk = _matrix(self, "wk", _init(), (e, k * d))
        self.wv = _matrix(self, "wv", _init(), (e, k * d))
        self.wo = _matrix(self, "wo", _init(0.02 / math.sqrt(2)), (h * d, e))
        self.w_gate = _matrix(self, "w_gate", _init(), (e, c.mlp))
        self.w_up = _matrix(self, "w_up", _init(), (e, c.mlp))
        self.w_down = _matrix(self, "w_down", _init(0.02 / math.sqrt(2)), (c.mlp, e))

    def project(self, x: Float[Array, "B T W"], positions: Int[Array, "B T"]):
        """Queries [B, T, H, D], keys and values [B, T, K, D] (RoPE applied)."""
        c = self.cfg
        b, t, _ = x.shape
        y = rms_norm(x, self.attn_norm, c.eps)
        q = matmul(y, self.wq).reshape(b, t, c.heads, c.head_dim)
        k = matmul(y, self.wk).reshape(b, t, c.kv_heads, c.head_dim)
        v = matmul(y, self.wv).reshape(b, t, c.kv_heads, c.head_dim)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: Float[Array, "B T W"], attn: Float[Array, "B T H D"]) -> Float[Array, "B T W"]:
        b, t = x.shape[:2]
        x = x + matmul(attn.reshape(b, t, -1), self.wo)
        y = rms_norm(x, self.mlp_norm, self.cfg.eps)
        return x + matmul(jax.nn.silu(matmul(y, self.w_gate)) * matmul(y, self.w_up), self.w_down)

    def __call__(self, x, positions):  # for init only
        q, k, v = self.project(x, positions)
        return self.finish(x, q)


def output_side(mod: nn.Module, c: FeatureConfig) -> dict[str, Any]:
    """The weights between a drafter state and its draft logits, created on ``mod``: the token
    embeddings' norm, the head's norm and, for ``hsd``, ``g`` in its form (``injection``). The network
    holds one set; with ``chain_g`` the chain's states use a second (``ChainOutput``)."""
    e, w = c.hidden, c.state_width
    side = {"emb_norm": mod.param("emb_norm", nn.initializers.ones, (e,)),
            "out_norm": mod.param("out_norm", nn.initializers.ones, (e,))}
    if c.method == "eagle":
        return side  # no g: eagle's tokens enter through fc alone
    if c.injection in ("mlp", "attn"):
        side["g_in"] = _matrix(mod, "g_in", _init(), (w + c.inject_tokens * e, c.g_hidden))
        side["g_out"] = _matrix(mod, "g_out", _init(0.01), (c.g_hidden, w))
        if c.injection == "attn":
            side["g_q"] = _matrix(mod, "g_q", _init(), (w + c.inject_tokens * e, c.heads * c.head_dim))
            side["g_o"] = _matrix(mod, "g_o", _init(0.01), (c.heads * c.head_dim, w))
    elif c.injection == "film":
        width = c.inject_tokens * e
        side["g_scale"] = _matrix(mod, "g_scale", _init(0.01), (width, w))
        side["g_shift"] = _matrix(mod, "g_shift", _init(0.01), (width, w))
    else:
        raise ValueError(f"unknown injection {c.injection!r}")
    return side


OUTPUT_SIDE = ("emb_norm", "out_norm", "g_in", "g_out", "g_q", "g_o", "g_scale", "g_shift")  # ``output_side``'s names


class ChainOutput(nn.Module):
    """``chain_g``: the output side (``output_side``) of the chain's own states, i.e. of tree nodes below
    depth 1; the first draft keeps the network's, so each is trained for one kind of state."""

    cfg: FeatureConfig
    backend: str = "reference"

    @nn.compact
    def __call__(self) -> dict[str, Any]:
        return output_side(self, self.cfg)


class FeatureDrafterNet(nn.Module):
    """Parameters and pieces of a feature drafter; the drafters call its methods via ``apply``.
    ``backend``: the target's, resolved (``ModelConfig.resolved_backend``; training builds the network
    with the default): with "cpu-kernel" its matrices and head are panels (``pack_for_cpu``)."""

    cfg: FeatureConfig
    backend: str = "reference"

    def setup(self):
        c = self.cfg
        e, w = c.hidden, c.state_width  # target states and token embeddings are E wide; the drafter's own W
        self.fuse_norm = self.param("fuse_norm", nn.initializers.ones, (c.fused, e))
        self.fuse = _matrix(self, "fuse", _init(), (c.fused * e, w))
        self.side = output_side(self, c)
        if c.narrow:
            self.lift = _matrix(self, "lift", _init(), (w, e))
        self.layer = DraftLayer(c, self.backend)
        if c.chain_layer:
            self.chain = DraftLayer(c, self.backend)
        if c.chain_g:
            self.chain_output = ChainOutput(c, self.backend)
        if c.token_input:
            self.fc = _matrix(self, "fc", _init(), (w + e, w))

    # -- inputs
    def fuse_states(self, states: Float[Array, "... F E"]) -> Float[Array, "... W"]:
        """Fused target states (each layer RMS-normed, concatenated, projected)."""
        y = rms_norm(states, self.fuse_norm, self.cfg.eps)
        return matmul(y.reshape(*y.shape[:-2], -1), self.fuse)

    def _side(self, chain: bool) -> dict[str, Any]:
        """The output side for the chain's states (``chain``) or the first draft's: the same one
        without ``chain_g``."""
        return self.chain_output() if chain and self.cfg.chain_g else self.side

    def embed(self, embed_table: Float[Array, "V E"], tokens: Int[Array, "..."], chain: bool = False
              ) -> Float[Array, "... E"]:
        return rms_norm(jnp.take(embed_table, tokens, axis=0), self._side(chain)["emb_norm"], self.cfg.eps)

    def eagle_input(self, feature: Float[Array, "... W"], token_emb: Float[Array, "... E"]) -> Float[Array, "... W"]:
        return matmul(jnp.concatenate([feature, token_emb], axis=-1), self.fc)

    # -- the layer
    def project(self, x, positions):
        return self.layer.project(x, positions)

    def finish(self, x, attn):
        return self.layer.finish(x, attn)

    def _chain_layer(self) -> DraftLayer:
        return self.chain if self.cfg.chain_layer else self.layer

    def chain_project(self, x, positions):
        """``project`` for the chain's own steps (a predicted state in, at its position): the second
        layer's with ``chain_layer``, else the one layer's."""
        return self._chain_layer().project(x, positions)

    def chain_finish(self, x, attn):
        return self._chain_layer().finish(x, attn)

    # -- outputs
    def _g_input(self, state: Float[Array, "... W"], token_embs: Float[Array, "... N E"]) -> Float[Array, "... G"]:
        flat = token_embs.reshape(*token_embs.shape[:-2], -1)
        return jnp.concatenate([rms_norm(state, jnp.ones((state.shape[-1],), state.dtype), self.cfg.eps), flat], axis=-1)

    def inject_query(self, state: Float[Array, "B T W"], token_embs: Float[Array, "B T N E"],
                     positions: Int[Array, "B T"], chain: bool = False) -> Float[Array, "B T H D"]:
        """``attn`` injection: the query [B, T, H, D] of the context read, at the injected token's position."""
        c = self.cfg
        b, t = state.shape[:2]
        q = matmul(self._g_input(state, token_embs), self._side(chain)["g_q"]).reshape(b, t, c.heads, c.head_dim)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
        return apply_rope(q, cos, sin)

    def inject(self, state: Float[Array, "... W"], token_embs: Float[Array, "... N E"],
               context: Float[Array, "... H D"] | None = None, chain: bool = False) -> Float[Array, "... W"]:
        """``g``: a predicted state plus the embeddings of the path's last tokens (newest first); with
        ``attn`` injection also ``context``, the attention read of ``inject_query``'s query. ``chain``:
        for a chain state (a node below depth 1), through ``chain_g``'s weights when the drafter has them."""
        c, side = self.cfg, self._side(chain)
        if c.injection in ("mlp", "attn"):
            out = state + matmul(jax.nn.silu(matmul(self._g_input(state, token_embs), side["g_in"])), side["g_out"])
            if c.injection == "attn":
                out = out + matmul(context.reshape(*context.shape[:-2], -1), side["g_o"])
            return out
        flat = token_embs.reshape(*token_embs.shape[:-2], -1)
        return state * (1 + jnp.tanh(matmul(flat, side["g_scale"]))) + matmul(flat, side["g_shift"])

    def to_target(self, state: Float[Array, "... W"]) -> Float[Array, "... E"]:
        """A drafter state in the target's width (``lift``; the state itself when W = E)."""
        return matmul(state, self.lift) if self.cfg.narrow else state

    def head_input(self, state: Float[Array, "... W"], chain: bool = False) -> Float[Array, "... E"]:
        """What the head reads of a state: lifted to the target's width and normed (``chain``: see ``inject``)."""
        return rms_norm(self.to_target(state), self._side(chain)["out_norm"], self.cfg.eps)

    def logits(self, state: Float[Array, "... W"], head: Any, chain: bool = False) -> Float[Array, "... V"]:
        """Draft-vocabulary logits through the target's frozen head rows (``chain``: see ``inject``)."""
        y = self.head_input(state, chain)
        if in_panels(self.backend, self.cfg.vocab):  # the panels of head.T (``pack_for_cpu``)
            return panel_matmul(y, head)
        return jnp.einsum("...e,ve->...v", y, head, preferred_element_type=jnp.float32)

    def __call__(self, states, tokens_emb, positions):  # touches every parameter, for init
        x = self.fuse_states(states)
        if self.cfg.token_input:
            x = self.eagle_input(x, tokens_emb[..., 0, :])
        q, k, v = self.project(x, positions)
        out = self.finish(x, q)
        if self.cfg.chain_layer:
            out = self.chain_finish(out, self.chain_project(out, positions)[0])
        if self.cfg.method == "hsd":
            for chain in (False, True) if self.cfg.chain_g else (False,):
                context = self.inject_query(out, tokens_emb, positions, chain) if self.cfg.injection == "attn" else None
                out = self.inject(out, tokens_emb, context, chain)
        return self.to_target(out)


HEAD_DELTA = "head_delta"  # the params entry of the trained head correction (outside the Flax module)


def init_net(cfg: FeatureConfig, seed: int = 0) -> dict[str, Any]:
    """Fresh drafter parameters (with a zero head correction when ``cfg.head_delta``)."""
    b, t = 1, 2
    n_tok = cfg.inject_tokens if cfg.method == "hsd" else 1
    variables = FeatureDrafterNet(cfg).init(
        jax.random.PRNGKey(seed), jnp.zeros((b, t, cfg.fused, cfg.hidden)), jnp.zeros((b, t, n_tok, cfg.hidden)),
        jnp.zeros((b, t), jnp.int32))
    params = jax.tree_util.tree_map(lambda a: a, dict(variables["params"]))
    if cfg.head_delta:
        params[HEAD_DELTA] = jnp.zeros((cfg.vocab, cfg.hidden), jnp.float32)
    return params


def draft_head(frozen_rows: Float[Array, "V E"], params: dict[str, Any]) -> Float[Array, "V E"]:
    """The head rows a drafter uses: the target's frozen rows plus the trained correction, if any."""
    return frozen_rows + params[HEAD_DELTA] if HEAD_DELTA in params else frozen_rows


# ---------------------------------------------------------------------------------------------------
# Inference: the drafter's cache over the verified context, shared by `hsd` and `eagle`.

CTX_PAD = 64  # context-cache slots beyond the sequence buffer (an ingest may write past the end)


def init_context(cfg: FeatureConfig, batch: int, size: int) -> dict[str, Array]:
    """An empty context cache: keys/values [B, K, S', D] by absolute position (S' a whole number of
    attention blocks), and the ingested length."""
    slots = -(-(size + CTX_PAD) // REFERENCE_BLOCK_S) * REFERENCE_BLOCK_S
    shape = (batch, cfg.kv_heads, slots, cfg.head_dim)
    return {"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32),
            "len": jnp.zeros((batch,), jnp.int32)}


def local_attention(backend: str):
    """The attention of the drafter's own steps (tree nodes and chain states over the context plus their
    local keys) and of the ``attn`` injection's context read, under a resolved backend: ``attention_fn``'s,
    the jnp reference under "cpu-kernel" (only the ingest goes through the C++ kernel)."""
    return attention_fn("reference" if backend == "cpu-kernel" else backend)


def _project_inputs(net: FeatureDrafterNet, params: Any, x: Float[Array, "B T W"], start: Int[Array, " B"]):
    """Queries, keys and values of inputs at positions ``start`` ... (RoPE applied)."""
    positions = start[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    return net.apply({"params": params}, x, positions, method=FeatureDrafterNet.project)


def _append(ctx: dict[str, Array], k: Float[Array, "B T K D"], v: Float[Array, "B T K D"],
            count: Int[Array, " B"]) -> dict[str, Array]:
    """The context cache with the first ``count`` of each row's new keys/values written at its length
    (the rest of the T slots keep their old values: past the length, never read)."""
    start, t = ctx["len"], k.shape[1]
    keep = (jnp.arange(t)[None, :] < count[:, None])[:, None, :, None]  # [B, 1, T, 1]

    def write(buf, upd):
        old = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (0, s, 0), (row.shape[0], t, row.shape[2])))(buf, start)
        new = jnp.where(keep, upd.transpose(0, 2, 1, 3), old)
        return jax.vmap(lambda row, u, s: jax.lax.dynamic_update_slice(row, u, (0, s, 0)))(buf, new, start)

    return {"k": write(ctx["k"], k), "v": write(ctx["v"], v), "len": start + count}


def _attend_last(net: FeatureDrafterNet, params: Any, cache_k, cache_v, start: Int[Array, " B"], x, q, k, v,
                 count: Int[Array, " B"]) -> Float[Array, "B E"]:
    """The layer's output at each row's last new input: the new inputs attend to the cache below
    ``start`` (None: no cache) and causally to each other, then the rest of the layer. Under "cpu-kernel"
    the attention is the C++ kernel's (``attention_for``): it reads only the filled slots and needs no
    loop over the cache in the program, which made XLA copy the whole cache every round (the loop carried
    it while the ingest then wrote into it)."""
    b, t = x.shape[:2]
    causal = jnp.broadcast_to(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], (b, t, t))
    attn = attention_for(net.backend)(q, cache_k, cache_v, start, k, v, causal)
    out = net.apply({"params": params}, x, attn, method=FeatureDrafterNet.finish)
    return jnp.take_along_axis(out, jnp.clip(count - 1, 0, t - 1)[:, None, None], axis=1)[:, 0]


def ingest(net: FeatureDrafterNet, params: Any, ctx: dict[str, Array], x: Float[Array, "B T E"],
           count: Int[Array, " B"], empty: bool = False) -> tuple[dict[str, Array], Float[Array, "B E"]]:
    """Run the drafter layer over ``count`` new verified inputs per row (positions ``ctx["len"]`` ...),
    append their keys/values to the context cache, and return the output at the last one (the
    prediction for the next position). Rows with ``count`` 0 are unchanged (their output is junk).
    ``empty``: the cache is known to be empty (the prompt's ingest), so attention skips it.

    The keys are written first, then read: attention reads only the slots below the old length, which
    the write leaves as they were, and reading the written buffer spares XLA a copy of the old one."""
    start = ctx["len"]
    q, k, v = _project_inputs(net, params, x, start)
    new_ctx = _append(ctx, k, v, count)
    cache_k, cache_v = (None, None) if empty else (new_ctx["k"], new_ctx["v"])
    return new_ctx, _attend_last(net, params, cache_k, cache_v, start, x, q, k, v, count)


INGEST_TIERS = (2, 4)  # path lengths an ingest runs at below the longest (most rounds accept a few tokens)


def ingest_path(net: FeatureDrafterNet, params: Any, ctx: dict[str, Array], inputs: Callable[[int], Array],
                count: Int[Array, " B"], size: int) -> tuple[dict[str, Array], Float[Array, "B E"]]:
    """``ingest`` of a verified path of up to ``size`` positions, computed at the smallest of
    ``INGEST_TIERS`` (and ``size``) that holds every row's ``count``: ``inputs(n)`` builds the layer
    inputs [B, n, W] of the path's first n positions, so a round that accepted one token fuses and
    passes two rows, not ``size``. Only the computation is switched by tier; the cache is written
    outside the switch and read inside it, so XLA need not copy it."""
    sizes = sorted({n for n in INGEST_TIERS if n < size} | {size})
    if len(sizes) == 1:
        return ingest(net, params, ctx, inputs(size), count)
    start = ctx["len"]
    tier = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), jnp.max(count).astype(jnp.int32))

    def project(n):  # inputs, queries, keys and values of the first n positions, zero-padded to ``size``
        x = inputs(n)
        pad = lambda a: jnp.pad(a, [(0, 0), (0, size - n)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        return tuple(pad(a) for a in (x, *_project_inputs(net, params, x, start)))

    x, q, k, v = jax.lax.switch(tier, [lambda n=n: project(n) for n in sizes])
    new_ctx = _append(ctx, k, v, count)

    def attend(n, cache_k, cache_v):
        return _attend_last(net, params, cache_k, cache_v, start, x[:, :n], q[:, :n], k[:, :n], v[:, :n], count)

    branches = [lambda ck, cv, n=n: attend(n, ck, cv) for n in sizes]
    return new_ctx, jax.lax.switch(tier, branches, new_ctx["k"], new_ctx["v"])


def attend_and_finish(net: FeatureDrafterNet, params: Any, ctx: dict[str, Array], x: Float[Array, "B T E"],
                      q: Float[Array, "B T H D"], local_k: Float[Array, "B M K D"], local_v: Float[Array, "B M K D"],
                      local_mask: Bool[Array, "B T M"], chain: bool = False) -> Float[Array, "B T E"]:
    """New inputs ``x`` (queries ``q``) attend to the verified context (its filled part only) plus the
    local keys their mask allows (chain states, or tree ancestors and themselves); then the rest of
    the layer (``chain``: of the chain's layer, ``FeatureDrafterNet.chain_finish``)."""
    attn = local_attention(net.backend)(q, ctx["k"], ctx["v"], ctx["len"], local_k, local_v, local_mask)
    finish = FeatureDrafterNet.chain_finish if chain else FeatureDrafterNet.finish
    return net.apply({"params": params}, x, attn, method=finish)


def context_read(q: Float[Array, "B T H D"], ctx: dict[str, Array], backend: str) -> Float[Array, "B T H D"]:
    """Queries ``q`` attend to the verified context alone (the ``attn`` injection's read): one local
    slot of zeros, masked out, stands for the local keys the attention functions expect."""
    b, t = q.shape[:2]
    none = jnp.zeros((b, 1, ctx["k"].shape[1], ctx["k"].shape[3]), jnp.float32)
    return local_attention(backend)(q, ctx["k"], ctx["v"], ctx["len"], none, none, jnp.zeros((b, t, 1), bool))


@dataclasses.dataclass(frozen=True)
class FeatureDrafter(Drafter):
    """Settings shared by `hsd` and `eagle`: the network's config, the fused target layers, and the
    dynamic tree (``depth`` x ``width`` candidates, the ``budget`` best verified, optionally only those
    above ``min_prob``, then at the smallest tier that holds them). ``lookup`` > 0 grafts prompt
    lookup's best continuation (up to that many tokens, `pld`'s matcher) onto every tree: free to
    draft, verified in the same pass, and only in rounds where the context has a match (the pass then
    runs at the tier ``1 + budget + lookup``)."""

    cfg: FeatureConfig | None = None
    layers: tuple[int, ...] = ()  # fused target layer indices (into the forward's ``layers``)
    depth: int = 4
    width: int = 3
    budget: int = 5  # nodes verified besides the root
    min_prob: float = 0.0
    grow_prob: float = 0.0  # nodes beyond the most likely one need this cumulative probability (0: off)
    backend: str = "auto"  # the target's ``ModelConfig.backend`` (set by ``make_drafter``; ``config.BACKENDS``)
    lookup: int = 0  # tokens of a prompt-lookup continuation grafted onto each tree (0: none)
    lookup_ngram: int = 2  # shortest n-gram match that proposes a continuation (1 grafts weak guesses too often)
    lookup_lengths: tuple[int, ...] = ()  # graft length by match length (1, 2, ... tokens); replaces the two above

    def __post_init__(self):
        lengths = self.lookup_lengths
        if lengths:
            check_lengths(lengths)
            object.__setattr__(self, "lookup", max(lengths))
        elif self.lookup:
            lengths = fixed_lengths(self.lookup, self.lookup_ngram, max(FIXED_MAX_NGRAM, self.lookup_ngram))
        object.__setattr__(self, "lookup_lengths", lengths)
        object.__setattr__(self, "num_nodes", 1 + self.depth * self.width + self.lookup)
        object.__setattr__(self, "max_depth", max(self.depth, self.lookup))
        if not self.tiers:  # smaller verification passes when min_prob leaves few nodes valid
            sizes = {1, min(3, 1 + self.budget), 1 + self.budget // 2} if self.min_prob > 0 else set()
            sizes |= {1 + self.budget}  # rounds without a lookup match
            sizes |= {1 + self.budget + n for n in lengths}  # a graft as long as its match earns
            if self.grow_prob > 0:  # 1 .. budget drafts, with or without each graft length
                sizes |= {1 + k + n for k in range(1, self.budget + 1) for n in (0, *lengths)}
            object.__setattr__(self, "tiers", tuple(sorted(sizes)))

    @property
    def prompt_layers(self) -> tuple[int, ...]:
        return self.layers

    @property
    def max_valid_nodes(self) -> int:
        return 1 + self.budget + self.lookup

    def graft_lookup(self, tree: DraftTree, gen: Any) -> DraftTree:
        """The tree with prompt lookup's best continuation grafted on (unchanged when ``lookup`` is 0)."""
        if not self.lookup:
            return tree
        chains, lengths = lookup_by_match(gen.seq, gen.seq_len, 1, self.lookup_lengths)
        return graft_chain(tree, chains[:, 0], lengths[:, 0])

    @property
    def resolved_backend(self) -> str:
        """``backend`` as it runs here (``hsdjax.runtime.config.resolve_backend``)."""
        return resolve_backend(self.backend)

    def _net(self) -> FeatureDrafterNet:
        return FeatureDrafterNet(self.cfg, self.resolved_backend)

    # -- the layer inputs of verified positions (the context the ingest passes add)
    def verified_inputs(self, dparams, fused: Float[Array, "B T F E"], next_tokens: Int[Array, "B T"]
                        ) -> Float[Array, "B T W"]:
        """Fused states of verified positions, with the embedding of each one's next token mixed in
        when ``cfg.token_input`` (the token after a verified position is always known: at the last one
        it is the new root, the token verification emitted)."""
        net, p = self._net(), dparams["net"]
        feat = net.apply({"params": p}, fused, method=FeatureDrafterNet.fuse_states)
        if not self.cfg.token_input:
            return feat
        emb = net.apply({"params": p}, dparams["embed"], next_tokens, method=FeatureDrafterNet.embed)
        return net.apply({"params": p}, feat, emb, method=FeatureDrafterNet.eagle_input)

    @staticmethod
    def prompt_next_tokens(gen: Any, p_len: int) -> Int[Array, "B P"]:
        """The token after each of the first ``p_len`` positions (a prompt bucket as long as the buffer
        has no token after its last, padding, slot: one pad column keeps the shapes equal)."""
        return jnp.pad(gen.seq, ((0, 0), (0, 1)))[:, 1: p_len + 1]

    @staticmethod
    def path_next_tokens(gen_before: Any, gen_after: Any, t: int) -> Int[Array, "B T"]:
        """The token after each of a round's ``t`` path slots (the emitted token after the last)."""
        idx = jnp.clip(gen_before.seq_len[:, None] + jnp.arange(t)[None, :], 0, gen_after.seq.shape[1] - 1)
        return jnp.take_along_axis(gen_after.seq, idx, axis=1)

    # -- multiply-adds of the pieces (the honest cost counter: DraftCost.macs)
    def _layer_macs(self, keys: Any) -> Any:
        c = self.cfg
        return layer_macs(c.state_width, c.heads, c.kv_heads, c.head_dim, c.mlp, keys)

    def _head_macs(self) -> int:
        """The head over the draft vocabulary (after ``lift`` when the drafter is narrow)."""
        c = self.cfg
        return c.hidden * c.vocab + (c.state_width * c.hidden if c.narrow else 0)

    def _inject_macs(self, keys: Any = 0) -> Any:
        """``g`` for one node (``hsd``); ``attn`` injection reads ``keys`` context positions."""
        c = self.cfg
        w, e = c.state_width, c.hidden
        if c.injection == "film":
            return 2 * c.inject_tokens * e * w
        macs = (w + c.inject_tokens * e) * c.g_hidden + c.g_hidden * w
        if c.injection == "attn":
            hd = c.heads * c.head_dim
            macs = macs + (w + c.inject_tokens * e) * hd + hd * w + 2 * hd * keys
        return macs

    def _input_macs(self) -> int:
        """Fusing the target states of one position (``eagle`` also mixes in a token embedding)."""
        c = self.cfg
        w, e = c.state_width, c.hidden
        return c.fused * e * w + ((w + e) * w if c.token_input else 0)

    def observe_macs(self, gen_before, n_path):
        """The ingest: each verified token's states fused and passed through the layer."""
        keys = gen_before.seq_len.astype(jnp.float32)
        per_token = self._input_macs() + self._layer_macs(keys)
        return jnp.where(gen_before.done, 0.0, n_path.astype(jnp.float32) * per_token)
