"""The decoding engine: prefill, then one jitted ``lax.while_loop`` of draft -> verify -> accept rounds.

Every method runs through the same loop: a drafter proposes a tree, the target verifies it in one
pass, the accepted path is committed to the KV cache and appended to the sequence, and the drafter
observes the result (and may reuse its work). Plain decoding (`ar`) is the drafter whose tree is only
its root, so a round is one ordinary decoding step.

Everything a generation needs lives in one pytree, ``DecodeState`` (target KV cache and token
sequence, per-row sampling settings and RNG keys, drafter state, statistics), donated between calls.
``decode`` advances it by up to ``max_rounds`` rounds, so a whole generation is one call and
streaming / cancellation happen between calls of the same compiled program. Shapes are static per
(batch, prompt bucket, cache bucket, drafter); the number of rounds is a traced argument, so
changing it never recompiles.

Log-probabilities are an option of the state (``prefill(..., top_logprobs=K)``): the pass that
verifies a token also records its log-probability and the K most likely tokens (``TokenLogprobs``,
aligned with ``seq``), so they cost no second forward pass; a state without them (the default)
compiles a loop that computes none.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int, UInt

from hsdjax.core.drafters.base import TargetStates
from hsdjax.core.sampling import SamplingParams, log_probs, select_tokens, top_k_blocked
from hsdjax.core.tree import DraftTree, ancestor_mask, compact
from hsdjax.core.tree import positions as tree_positions
from hsdjax.core.verify import Verdict, accept_tree, draw_node_tokens, verify_chain_sampled, verify_tree
from hsdjax.errors import HsdjaxError
from hsdjax.runtime.config import ModelConfig
from hsdjax.runtime.model import KVCache, Transformer, causal_mask, commit, gather_path, init_cache, write_path
from hsdjax.runtime.sharding import row_axis

PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CACHE_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
MAX_STOP_IDS = 8


@struct.dataclass
class TokenLogprobs:
    """Per sequence position (aligned with ``GenState.seq``; valid for generated tokens only): the
    token's log-probability under the distribution it was drawn from (``sampling.log_probs``: the
    adjusted target distribution, the plain one for greedy rows) and the K most likely tokens."""

    token: Float[Array, "B S"]
    top_ids: Int[Array, "B S K"]  # descending log-probability, ties by lower id
    top: Float[Array, "B S K"]

    @classmethod
    def zeros(cls, batch: int, size: int, k: int) -> "TokenLogprobs":
        return cls(jnp.zeros((batch, size), jnp.float32), jnp.zeros((batch, size, k), jnp.int32),
                   jnp.zeros((batch, size, k), jnp.float32))

    @classmethod
    def of(cls, logits: Float[Array, "B P V"], tokens: Int[Array, "B P"], sp: SamplingParams,
           k: int) -> "TokenLogprobs":
        """The values of ``tokens[b, j]``, drawn from ``logits[b, j]`` (P positions per row)."""
        b, p, v = logits.shape
        flat_sp = jax.tree_util.tree_map(lambda a: jnp.repeat(a, p, axis=0), sp)
        lp = log_probs(logits.reshape(b * p, v), flat_sp)
        token = jnp.take_along_axis(lp, tokens.reshape(b * p, 1), axis=1)[:, 0]
        top, ids = top_k_blocked(lp, k) if k else (lp[:, :0], jnp.zeros((b * p, 0), jnp.int32))
        return cls(token.reshape(b, p), ids.astype(jnp.int32).reshape(b, p, k), top.reshape(b, p, k))

    def write(self, new: "TokenLogprobs", start: Int[Array, " B"], active: Bool[Array, " B"]) -> "TokenLogprobs":
        """``new``'s P positions written from ``start[b]`` on, in active rows."""
        def put(old: Array, upd: Array) -> Array:
            at = lambda row, u, s: jax.lax.dynamic_update_slice(row, u, (s,) + (0,) * (u.ndim - 1))  # noqa: E731
            out = jax.vmap(at)(old, upd.astype(old.dtype), start)
            return jnp.where(active.reshape(-1, *([1] * (old.ndim - 1))), out, old)

        return jax.tree_util.tree_map(put, self, new)


@struct.dataclass
class GenState:
    """The carry of a generation (all arrays; B rows)."""

    cache: KVCache  # holds every token of ``seq`` but the last one
    seq: Int[Array, "B S"]  # prompt + generated tokens, row b valid up to seq_len[b]
    seq_len: Int[Array, " B"]
    prompt_len: Int[Array, " B"]
    done: Bool[Array, " B"]
    max_new: Int[Array, " B"]
    keys: UInt[Array, "B 2"]  # per-row base RNG keys; a step's key is fold_in(key, seq_len)
    sampling: SamplingParams
    stop_ids: Int[Array, " M"]  # padded with -1
    logprobs: TokenLogprobs | None = None  # recorded only when prefill was asked for them

    @property
    def n_out(self) -> Int[Array, " B"]:
        """Generated tokens per row."""
        return self.seq_len - self.prompt_len

    def last_token(self) -> Int[Array, " B"]:
        """The newest token of each row (not yet in the cache)."""
        return jnp.take_along_axis(self.seq, (self.seq_len - 1)[:, None], axis=1)[:, 0]


def pick_bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise HsdjaxError(f"{what} of {n} tokens exceeds the largest supported size ({buckets[-1]})")


def plan_shapes(cfg: ModelConfig, prompt_len: int, max_new: int, spare: int = 0) -> tuple[int, int]:
    """(prompt bucket, cache bucket) for a prompt and budget; ``spare`` slots for draft trees."""
    if prompt_len < 1:
        raise HsdjaxError("the prompt is empty")
    if max_new < 1:
        raise HsdjaxError(f"max_new_tokens must be at least 1 (got {max_new})")
    total = prompt_len + max_new
    if total > cfg.max_context:
        raise HsdjaxError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) = {total} exceeds the model's "
            f"context of {cfg.max_context} tokens"
        )
    p_bucket = pick_bucket(prompt_len, PROMPT_BUCKETS, "a prompt")
    s_bucket = pick_bucket(max(p_bucket, total + spare + 1), CACHE_BUCKETS, "prompt + new tokens")
    return p_bucket, s_bucket


def stop_array(stop_ids: tuple[int, ...] | list[int]) -> Int[Array, " M"]:
    ids = list(stop_ids)[:MAX_STOP_IDS]
    return jnp.array(ids + [-1] * (MAX_STOP_IDS - len(ids)), jnp.int32)


def pack_rows(rows: list[list[int]], p_bucket: int, batch: int | None = None, max_new: int = 0
              ) -> tuple[Int[np.ndarray, "B P"], Int[np.ndarray, " B"], Int[np.ndarray, " B"]]:
    """Prompts right-padded to ``p_bucket`` in a batch of ``batch`` rows (default: one per prompt):
    (prompt, prompt_len, max_new). Padding rows hold a one-token prompt and a budget of 0, so they
    finish at once and cost no drafting."""
    b = len(rows) if batch is None else batch
    if not rows or b < len(rows):
        raise HsdjaxError(f"{len(rows)} prompts do not fit a batch of {b}")
    prompt = np.zeros((b, p_bucket), np.int32)
    lengths = np.ones((b,), np.int32)
    budget = np.zeros((b,), np.int32)
    for i, r in enumerate(rows):
        if not 0 < len(r) <= p_bucket:
            raise HsdjaxError(f"prompt {i} has {len(r)} tokens; the prompt bucket holds 1 to {p_bucket}")
        prompt[i, : len(r)] = r
        lengths[i] = len(r)
        budget[i] = max_new
    return prompt, lengths, budget


def row_keys(seed: int, n: int) -> UInt[Array, "N 2"]:
    """The RNG key of each of ``n`` rows generated with ``seed``: row i's key is fold_in(seed, i)."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(n))


def step_keys(keys: UInt[Array, "B 2"], counter: Int[Array, " B"]) -> UInt[Array, "B 2"]:
    return jax.vmap(jax.random.fold_in)(keys, counter)


def is_stop(tokens: Int[Array, "..."], stop_ids: Int[Array, " M"]) -> Bool[Array, "..."]:
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def finished(token: Int[Array, " B"], n_out: Int[Array, " B"], state: GenState, cache: KVCache,
             spare: int = 1) -> Bool[Array, " B"]:
    """Rows that end after emitting ``token``: a stop token, the budget, or no room for ``spare``
    more cache entries."""
    return is_stop(token, state.stop_ids) | (n_out >= state.max_new) | (cache.length + spare >= cache.size)


def first_token(gen: GenState, logits: Float[Array, "B V"], spare: int) -> GenState:
    """Each row's first new token, drawn from ``logits`` (its last prompt position) with the row's key
    at ``prompt_len``, appended after the prompt (with its log-probabilities when the state keeps them)."""
    first = select_tokens(logits, gen.sampling, step_keys(gen.keys, gen.prompt_len))
    rows = jnp.arange(first.shape[0])
    live = gen.max_new > 0  # rows with max_new 0 are padding: they start done
    logprobs = gen.logprobs
    if logprobs is not None:
        new = TokenLogprobs.of(logits[:, None], first[:, None], gen.sampling, logprobs.top_ids.shape[-1])
        logprobs = logprobs.write(new, gen.prompt_len, live)
    gen = gen.replace(seq=gen.seq.at[rows, gen.prompt_len].set(first), seq_len=gen.prompt_len + 1, done=~live,
                      logprobs=logprobs)
    return gen.replace(done=gen.done | finished(first, gen.n_out, gen, gen.cache, spare))


@struct.dataclass
class PromptFill:
    """A prompt being prefilled, possibly in pieces (chunked prefill) and after a reused prefix: the
    target cache filled so far (``cache.length`` tokens per row) and the target states of those
    positions that drafters read (``hidden`` [B, P, E], ``layers`` [F, B, P, E] for ``keep_layers``),
    in buffers of the prompt bucket P."""

    cache: KVCache
    hidden: Float[Array, "B P E"]
    layers: Float[Array, "F B P E"] | None


def empty_fill(cfg: ModelConfig, batch: int, prompt_bucket: int, cache_size: int,
               keep_layers: tuple[int, ...] = ()) -> PromptFill:
    """Nothing filled yet."""
    dt = jnp.dtype(cfg.dtype)
    layers = jnp.zeros((len(keep_layers), batch, prompt_bucket, cfg.hidden_size), dt) if keep_layers else None
    return PromptFill(cache=init_cache(cfg, batch, cache_size), hidden=jnp.zeros((batch, prompt_bucket, cfg.hidden_size), dt),
                      layers=layers)


def _write_at(buf: Array, upd: Array, start: Int[Array, " B"], axis: int) -> Array:
    """``upd`` written into ``buf`` from ``start[b]`` on along ``axis`` (rows on axis ``axis - 1``)."""
    def one(row, u, s):
        return jax.lax.dynamic_update_slice(row, u.astype(row.dtype), (0,) * (axis - 1) + (s,) + (0,) * (row.ndim - axis))
    return jax.vmap(one, in_axes=(axis - 1, axis - 1, 0), out_axes=axis - 1)(buf, upd, start)


def fill_piece(params: dict[str, Any], fill: PromptFill, piece: Int[Array, "B C"], piece_len: Int[Array, " B"], *,
               cfg: ModelConfig, keep_layers: tuple[int, ...] = (), fresh: bool = False) -> PromptFill:
    """Run the next ``piece_len[b]`` prompt tokens of each row (right-padded to C) over its filled
    prefix: their keys/values join the cache, their states the ``hidden``/``layers`` buffers. All C
    slots from ``cache.length`` on are written, so ``cache.length + C`` must fit the buffers (the
    piece plan of ``piece_sizes`` guarantees it). ``fresh`` (static): nothing is filled yet, so the
    pass skips attention to the (empty) cache."""
    b, c = piece.shape
    start = fill.cache.length
    positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    fwd = Transformer(cfg).apply({"params": params}, piece, positions, causal_mask(piece_len, c),
                                 None if fresh else fill.cache, keep_layers=keep_layers)
    keep = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    cache = commit(fill.cache, fwd["k"], fwd["v"], keep, piece_len)
    hidden = _write_at(fill.hidden, fwd["hidden"], start, 1)
    layers = _write_at(fill.layers, fwd["layers"], start, 2) if keep_layers else fill.layers
    return PromptFill(cache=cache, hidden=hidden, layers=layers)


def fill_done(params: dict[str, Any], fill: PromptFill, prompt: Int[Array, "B P"], max_new: Int[Array, " B"],
              sampling: SamplingParams, keys: UInt[Array, "B 2"], stop_ids: Int[Array, " M"], *, cfg: ModelConfig,
              spare: int = 1, top_logprobs: int | None = None) -> tuple[GenState, TargetStates]:
    """The generation state of a filled prompt (``cache.length`` = the prompt length per row): each
    row's first new token from its last prompt position, and the drafters' prompt states."""
    prompt_len = fill.cache.length
    b, p = prompt.shape
    cache_size = fill.cache.size
    hidden_last = jnp.take_along_axis(fill.hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    logits = Transformer(cfg).apply({"params": params}, hidden_last, method=Transformer.logits)
    seq = jnp.zeros((b, cache_size), jnp.int32).at[:, :p].set(prompt)
    logprobs = None if top_logprobs is None else TokenLogprobs.zeros(b, cache_size, top_logprobs)
    state = GenState(cache=fill.cache, seq=seq, seq_len=prompt_len, prompt_len=prompt_len, done=max_new <= 0,
                     max_new=max_new, keys=keys, sampling=sampling, stop_ids=stop_ids, logprobs=logprobs)
    state = first_token(state, logits, spare)
    # Only what drafters use leaves the program (the per-layer states of a long prompt are large).
    return state, TargetStates(hidden=fill.hidden, layers=fill.layers)


@partial(jax.jit, static_argnames=("cfg", "cache_size", "spare", "keep_layers", "top_logprobs"))
def prefill(
    params: dict[str, Any],
    prompt: Int[Array, "B P"],
    prompt_len: Int[Array, " B"],
    max_new: Int[Array, " B"],
    sampling: SamplingParams,
    keys: UInt[Array, "B 2"],
    stop_ids: Int[Array, " M"],
    *,
    cfg: ModelConfig,
    cache_size: int,
    spare: int = 1,
    keep_layers: tuple[int, ...] = (),
    top_logprobs: int | None = None,
) -> tuple[GenState, dict[str, Array]]:
    """Run the prompts (right-padded to P), fill the cache, choose each row's first new token.

    Rows with ``max_new`` 0 are padding: they start done. ``spare`` is the number of cache slots a
    step may need (1 for plain decoding, the tree size for speculative decoding). Also returns the
    prompt's final hidden states (``hidden`` [B, P, E]) and, for drafters that read them, the states
    of the ``keep_layers`` (``layers`` [F, B, P, E]). ``top_logprobs`` K (static): the state records
    every generated token's ``TokenLogprobs`` with the K most likely tokens (None: records nothing).
    One piece of ``fill_piece`` then ``fill_done``; the server runs the same two in pieces
    (``prefill_piece`` / ``prefill_done``).
    """
    b, p = prompt.shape
    fill = empty_fill(cfg, b, p, cache_size, keep_layers)
    fill = fill_piece(params, fill, prompt, prompt_len, cfg=cfg, keep_layers=keep_layers, fresh=True)
    return fill_done(params, fill, prompt, max_new, sampling, keys, stop_ids, cfg=cfg, spare=spare,
                     top_logprobs=top_logprobs)


start_fill = jax.jit(empty_fill, static_argnums=(0, 1, 2, 3, 4))
prefill_piece = jax.jit(fill_piece, static_argnames=("cfg", "keep_layers", "fresh"), donate_argnames=("fill",))
prefill_done = jax.jit(fill_done, static_argnames=("cfg", "spare", "top_logprobs"))


def piece_sizes(start: int, end: int, limit: int) -> list[int]:
    """How a prompt's positions ``start`` .. ``end`` - 1 are prefilled in pieces of at most ``limit``
    tokens: each piece is a power of two (>= 32, so a few compiled programs serve every prompt) that
    starts at a multiple of itself, so padding never runs past the prompt bucket, and no larger than
    what is left (but 32), so a piece pads at most 31 positions (a 1,100-token prompt runs as
    1024 + 64 + 32, not as one padded 2,048). ``start`` must be a multiple of 32. Returns the padded
    piece sizes; the last one may hold fewer than its size."""
    if start % 32:
        raise ValueError(f"a prompt piece must start at a multiple of 32 (got {start})")
    sizes, at = [], start
    while at < end:
        size = 32
        while size * 2 <= min(limit, end - at) and at % (size * 2) == 0:
            size *= 2
        sizes.append(size)
        at += size
    return sizes


def piece_programs(longest: int, largest: int) -> list[int]:
    """The piece sizes ``piece_sizes`` can produce for prompts of at most ``longest`` tokens, pieces of at
    most ``largest``: what a server compiles ahead, one program per size (run as a later piece, also for a
    prompt's first: over an empty cache the cache part of its attention does no work, and one program
    instead of a fresh and a later one holds ~100-200 MB less). A piece of size S needs S prompt tokens;
    32 serves every shorter remainder."""
    out, size = [], 32
    while size <= largest:
        if size == 32 or size <= longest:
            out.append(size)
        size *= 2
    return out


@partial(jax.jit, static_argnames=("cfg", "spare"))
def fork_rows(params: dict[str, Any], gen: GenState, prompt_states: TargetStates, keys: UInt[Array, "N 2"], *,
              cfg: ModelConfig, spare: int = 1) -> tuple[GenState, TargetStates]:
    """N generations of one prompt, prefilled once: row i is a copy of row 0 of ``gen`` (and of
    ``prompt_states``) with RNG key ``keys[i]`` and its first token drawn again with that key (from the
    same logits as ``prefill``'s). Feed the result to ``start_decoding``."""
    rows = jnp.zeros((keys.shape[0],), jnp.int32)
    last = gen.prompt_len[0] - 1
    logits = Transformer(cfg).apply({"params": params}, prompt_states.hidden[:1, last], method=Transformer.logits)
    gen = _gather_rows(gen, rows).replace(keys=keys)
    return first_token(gen, jnp.repeat(logits, keys.shape[0], axis=0), spare), prompt_states.take_rows(rows)


@struct.dataclass
class RoundStats:
    """Per-row counters accumulated over rounds (a round = one target verification pass)."""

    target_passes: Int[Array, " B"]
    draft_passes: Int[Array, " B"]  # drafter forward passes (its layer stack called once)
    drafter_states: Int[Array, " B"]  # drafter states computed that can carry a draft (DraftCost.states)
    reused_states: Int[Array, " B"]  # states a tree used that were computed in an earlier round
    drafter_macs: Float[Array, " B"]  # drafter multiply-adds (DraftCost.macs + Drafter.observe_macs)
    accepted_drafts: Int[Array, " B"]  # drafted tokens accepted (lookup's included)
    lookup_drafts: Int[Array, " B"]  # of those, the ones a grafted prompt-lookup chain supplied (no drafter state)
    reused_drafts: Int[Array, " B"]  # of those, the ones drafted from a state of an earlier round (hsd's reuse)
    tree_nodes: Int[Array, " B"]  # valid tree nodes verified, root included
    verified_nodes: Int[Array, " B"]  # size of the target passes run (the tier, padding included)
    accept_hist: Int[Array, "B P"]  # accept_hist[b, k]: rounds that emitted k new tokens
    round_log: Int[Array, "B R"]  # round_log[b, r]: tokens emitted by round r (R = sequence buffer size)

    @classmethod
    def zeros(cls, batch: int, max_depth: int, max_rounds: int) -> "RoundStats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, z, jnp.zeros((batch,), jnp.float32), z, z, z, z, z, jnp.zeros((batch, max_depth + 2), jnp.int32),
                   jnp.zeros((batch, max_rounds), jnp.int8))


@struct.dataclass
class DecodeState:
    """The whole carry of the decoding loop: target state, drafter state, statistics."""

    gen: GenState
    draft: Any
    stats: RoundStats


def append_tokens(gen: GenState, cache: KVCache, tokens: Int[Array, "B P"], count: Int[Array, " B"],
                  spare: int) -> tuple[GenState, Int[Array, " B"]]:
    """Append ``tokens[b, :count[b]]`` to each active row, cut after a stop token or at the budget.

    Returns the new state and the number of tokens each row actually emitted.
    """
    b, p = tokens.shape
    idx = jnp.arange(p)[None, :]
    active = ~gen.done
    stop_at = jnp.where(is_stop(tokens, gen.stop_ids) & (idx < count[:, None]), idx, p)
    first_stop = jnp.min(stop_at, axis=1)
    n = jnp.minimum(jnp.minimum(count, first_stop + 1), gen.max_new - gen.n_out)
    n = jnp.where(active, jnp.maximum(n, 0), 0)
    seq = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))(
        gen.seq, tokens.astype(jnp.int32), gen.seq_len)
    seq = jnp.where(active[:, None], seq, gen.seq)
    gen = gen.replace(cache=cache, seq=seq, seq_len=gen.seq_len + n)
    ended = (first_stop < n) | (gen.n_out >= gen.max_new) | (cache.length + spare >= cache.size)
    return gen.replace(done=gen.done | (active & ended)), n


@struct.dataclass
class PassResult:
    """What leaves one verification pass: the verdict, the round's new tokens, the keys/values of the
    accepted path (to commit) and the target's states along it for the drafter."""

    verdict: Verdict
    emitted: Int[Array, "B P"]  # the round's new tokens, ``verdict.n_path`` valid per row
    path_k: Any  # [L, B, P, K, D] keys of the accepted path's nodes
    path_v: Any
    path_states: TargetStates  # along the accepted path (``layers``: the drafter's ``prompt_layers``)
    logprobs: TokenLogprobs | None  # of ``emitted`` [B, P], when the state records them
    lookup_accepted: Int[Array, " B"]  # accepted drafts that a grafted lookup chain supplied
    reused_accepted: Int[Array, " B"]  # accepted drafts made from a drafter state of an earlier round


def node_tokens(params: dict[str, Any], cfg: ModelConfig, hidden: Float[Array, "B N E"], sp: SamplingParams,
                keys: UInt[Array, "B 2"]) -> Int[Array, "B N"]:
    """The target's token at every node (``verify.draw_node_tokens``). When every row is greedy no logits
    are formed: ``Transformer.greedy_tokens`` (through the int8 screen where the model has one)."""
    model = Transformer(cfg)

    def drawn(_):
        logits = model.apply({"params": params}, hidden, method=Transformer.logits)
        return draw_node_tokens(logits, sp, keys)

    def greedy(_):
        return model.apply({"params": params}, hidden, method=Transformer.greedy_tokens)

    return jax.lax.cond(jnp.any(sp.temperature > 0), drawn, greedy, None)


def verify_pass(params: dict[str, Any], cfg: ModelConfig, drafter: Any, gen: GenState, tree: DraftTree
                ) -> PassResult:
    """One target pass over the tree and its verdict. The cache is only read here; the accepted path
    is committed by the caller, so a tier switch around this function never copies the cache."""
    model = Transformer(cfg)
    mask = ancestor_mask(tree, drafter.max_depth)
    fwd = model.apply({"params": params}, tree.tokens, tree_positions(tree, gen.cache.length), mask, gen.cache,
                      keep_layers=drafter.prompt_layers)
    keys = step_keys(gen.keys, gen.seq_len)
    logits = None  # formed only where they are needed (see node_tokens)
    if drafter.sampled_chain or gen.logprobs is not None:
        logits = model.apply({"params": params}, fwd["hidden"], method=Transformer.logits)
        verify = verify_chain_sampled if drafter.sampled_chain else verify_tree
        verdict = verify(logits, tree, gen.sampling, keys, drafter.max_depth)
    else:
        verdict = accept_tree(node_tokens(params, cfg, fwd["hidden"], gen.sampling, keys), tree, drafter.max_depth)
    along = lambda x: jnp.take_along_axis(x, verdict.path.reshape(*verdict.path.shape, *([1] * (x.ndim - 2))),  # noqa: E731
                                          axis=1)
    path_k, path_v = gather_path(fwd["k"], fwd["v"], verdict.path)
    states = TargetStates(hidden=along(fwd["hidden"]),
                          layers=jax.vmap(along)(fwd["layers"]) if drafter.prompt_layers else None)
    emitted = verdict.emitted(tree)
    logprobs = None
    if gen.logprobs is not None:  # emitted token j was drawn at the path's node j
        logprobs = TokenLogprobs.of(along(logits), emitted, gen.sampling, gen.logprobs.top_ids.shape[-1])
    accepted = jnp.arange(verdict.path.shape[1])[None, :] < verdict.n_path[:, None]  # the root's slot: never marked

    def accepted_marked(mark: Bool[Array, "B N"] | None) -> Int[Array, " B"]:
        if mark is None:
            return jnp.zeros_like(verdict.n_path)
        return jnp.sum(accepted & along(mark), axis=1).astype(jnp.int32)

    return PassResult(verdict=verdict, emitted=emitted, path_k=path_k, path_v=path_v, path_states=states,
                      logprobs=logprobs, lookup_accepted=accepted_marked(tree.lookup),
                      reused_accepted=accepted_marked(tree.reused))


def verify_sizes(drafter: Any) -> tuple[int, ...]:
    """The static pass sizes a drafter's trees are verified at: its tiers up to the most valid nodes
    its trees can hold (a tier no tree can need is never compiled)."""
    top = min(drafter.max_valid_nodes, drafter.num_nodes)
    return tuple(sorted({t for t in drafter.tiers if t < top} | {top}))


def fit_tree(tree: DraftTree, size: int) -> DraftTree:
    """The tree in ``size`` slots (compacted when it has more)."""
    return tree if tree.num_nodes == size else compact(tree, size)


def _log_round(log: Int[Array, "B R"], index: Int[Array, " B"], value: Int[Array, " B"],
               active: Bool[Array, " B"]) -> Int[Array, "B R"]:
    rows = jnp.arange(log.shape[0])
    slot = jnp.minimum(index, log.shape[1] - 1)
    return log.at[rows, slot].set(jnp.where(active, value, log[rows, slot]).astype(log.dtype))


def spec_round(params: dict[str, Any], dparams: Any, state: DecodeState, cfg: ModelConfig,
               drafter: Any) -> DecodeState:
    """One round for every row: draft a tree, verify it in one target pass, accept, compact the
    cache to the accepted path, append the new tokens, let the drafter observe the result.

    Drafters with ``tiers`` (tree sizes, e.g. (1, 7, 13)) are verified at the smallest tier that
    holds every row's valid nodes, so a round with few or no drafts costs a small target pass. Only
    reachable sizes are compiled (see ``verify_sizes``); with one, there is no switch at all, and the
    switch never carries the KV cache (the path is committed after it).
    """
    gen = state.gen
    tree, draft, cost = drafter.propose(dparams, state.draft, gen)
    sizes = verify_sizes(drafter)
    if len(sizes) == 1:
        out = verify_pass(params, cfg, drafter, gen, fit_tree(tree, sizes[0]))
        pass_size = jnp.int32(sizes[0])
    else:
        needed = jnp.max(jnp.where(gen.done, 1, jnp.sum(tree.valid, axis=1)))  # finished rows don't count
        branches = [partial(lambda k, t: verify_pass(params, cfg, drafter, gen, fit_tree(t, k)), k) for k in sizes]
        tier = jnp.searchsorted(jnp.array(sizes), needed)
        out = jax.lax.switch(tier, branches, tree)
        pass_size = jnp.array(sizes, jnp.int32)[tier]
    verdict = out.verdict
    cache = write_path(gen.cache, out.path_k, out.path_v, jnp.where(gen.done, 0, verdict.n_path))
    emitted, path_states = out.emitted, out.path_states
    active = ~gen.done
    new_gen, n_emitted = append_tokens(gen, cache, emitted, verdict.n_path, drafter.spare)
    if out.logprobs is not None:
        new_gen = new_gen.replace(logprobs=gen.logprobs.write(out.logprobs, gen.seq_len, active))
    draft = drafter.observe(dparams, draft, gen, new_gen, verdict, path_states)
    on = active.astype(jnp.int32)
    st = state.stats
    stats = RoundStats(
        target_passes=st.target_passes + on,
        draft_passes=st.draft_passes + cost.passes * on,
        drafter_states=st.drafter_states + cost.states * on,
        reused_states=st.reused_states + cost.reused * on,
        drafter_macs=st.drafter_macs + jnp.where(active, cost.macs + drafter.observe_macs(gen, verdict.n_path), 0.0),
        accepted_drafts=st.accepted_drafts + (verdict.n_path - 1) * on,
        lookup_drafts=st.lookup_drafts + out.lookup_accepted * on,
        reused_drafts=st.reused_drafts + out.reused_accepted * on,
        tree_nodes=st.tree_nodes + jnp.sum(tree.valid, axis=1) * on,
        verified_nodes=st.verified_nodes + pass_size * on,
        accept_hist=st.accept_hist + jax.nn.one_hot(n_emitted, st.accept_hist.shape[1], dtype=jnp.int32) * on[:, None],
        round_log=_log_round(st.round_log, st.target_passes, n_emitted, active),
    )
    return DecodeState(gen=new_gen, draft=draft, stats=stats)


@partial(jax.jit, static_argnames=("drafter",))
def start_decoding(dparams: Any, gen: GenState, prompt_states: TargetStates, *, drafter: Any) -> DecodeState:
    """Initial drafter state (e.g. the draft model's own prefill) and zeroed statistics."""
    b = gen.seq_len.shape[0]
    return DecodeState(gen=gen, draft=drafter.init_state(dparams, gen, prompt_states),
                       stats=RoundStats.zeros(b, drafter.max_depth, gen.seq.shape[1]))


@partial(jax.jit, static_argnames=("cfg", "drafter"), donate_argnames=("state",))
def decode(params: dict[str, Any], dparams: Any, state: DecodeState, max_rounds: Int[Array, ""], *,
           cfg: ModelConfig, drafter: Any) -> DecodeState:
    """Advance every row by up to ``max_rounds`` rounds (fewer when all rows are done).

    With the ``ar`` drafter (a tree of just its root) a round is one plain decoding step.
    """

    def cond(carry):
        step, st = carry
        return (step < max_rounds) & ~jnp.all(st.gen.done)

    def body(carry):
        step, st = carry
        return step + 1, spec_round(params, dparams, st, cfg, drafter)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


@partial(jax.jit, donate_argnames=("state",))
def insert_rows(state: DecodeState, new: DecodeState, slots: Int[Array, " N"]) -> DecodeState:
    """Write the N rows of ``new`` into rows ``slots`` of the running ``state`` (continuous batching).

    Both states must have the same cache size (and drafter); ``new`` may have any batch size N. A
    slot index out of range (``DROP_ROW``) drops that row, so padded prefill batches can be inserted as is.
    Every leaf is indexed on its batch axis (axis 0, or 1 for stacked KV caches); ``stop_ids`` is
    shared and kept from ``state``.
    """

    def put(path, old, upd):
        axis = row_axis(path, old)
        if axis is None:
            return old
        if old.shape[:axis] + old.shape[axis + 1:] != upd.shape[:axis] + upd.shape[axis + 1:]:
            raise HsdjaxError(f"insert_rows: leaf {jax.tree_util.keystr(path)} has shape {upd.shape}, "
                              f"the running state {old.shape} (cache sizes must match)")
        index = (slice(None),) * axis + (slots,)
        return old.at[index].set(upd.astype(old.dtype), mode="drop")

    return jax.tree_util.tree_map_with_path(put, state, new)


@jax.jit
def take_rows(state: DecodeState, rows: Int[Array, " N"]) -> DecodeState:
    """A state of N rows: row i is row ``rows[i]`` of ``state``; an index out of range (e.g. -1) gives a
    finished (``done``) placeholder row. Grows or shrinks the running batch of continuous batching."""
    b = state.gen.seq_len.shape[0]
    valid = (rows >= 0) & (rows < b)
    out = _gather_rows(state, jnp.clip(rows, 0, b - 1))
    return out.replace(gen=out.gen.replace(done=out.gen.done | ~valid))


def grow_rows(state: DecodeState, size: int) -> DecodeState:
    """``take_rows(state, [0, 1, .., B - 1, -1, ..])``: the running rows where they are and ``size - B``
    free (``done``) rows after them, as concatenations, which XLA's CPU backend runs at copy speed (the
    gather of ``take_rows`` over the stacked KV caches took 221 ms against 137 for SmolLM2's 8 rows x
    1,024 positions, growing to 9: a running stream's longest wait when a request joins a full batch).
    A row pool's cache (``with_capacity``) already has the rows: it is handed on as it is (the same
    buffers; passed through a jitted function, XLA would copy it)."""
    cache = state.gen.cache
    if isinstance(cache.k, tuple) or cache.k.shape[1] < size:
        return _grow_rows(state, size)
    return _with_kv(_grow_rows(_with_kv(state, None, None), size), cache.k, cache.v)


def _with_kv(state: DecodeState, k: Array | None, v: Array | None) -> DecodeState:
    """``state`` with its KV cache's ``k`` / ``v`` replaced (None: detached, so that a jitted function over
    the small leaves neither copies nor reads the cache)."""
    return state.replace(gen=state.gen.replace(cache=state.gen.cache.replace(k=k, v=v)))


@partial(jax.jit, static_argnames=("size",))
def _grow_rows(state: DecodeState, size: int) -> DecodeState:
    b = state.gen.seq_len.shape[0]

    def grow(path, leaf):
        axis = row_axis(path, leaf)
        if axis is None or leaf.shape[axis] >= size:
            return leaf
        first = jax.lax.slice_in_dim(leaf, 0, 1, axis=axis)  # what ``take_rows`` copies for a row -1
        return jnp.concatenate([leaf, jnp.repeat(first, size - leaf.shape[axis], axis=axis)], axis=axis)

    out = jax.tree_util.tree_map_with_path(grow, state)
    return out.replace(gen=out.gen.replace(done=out.gen.done.at[b:].set(True)))


DROP_ROW = 2**30  # a row index ``insert_rows`` drops, whatever rows the state (or its row pool) holds


@partial(jax.jit, static_argnames=("rows",))
def with_capacity(state: DecodeState, rows: int) -> DecodeState:
    """``state`` with a KV cache of ``rows`` rows (a row pool; rows past the batch are free, zeros), so
    that ``grow_rows`` up to ``rows`` copies no cache and ``compact_rows`` moves only the rows that move.
    Only the stacked cache ([L, B, K, S, D]), which the CPU kernels and the commit index by row in place
    (``model.write_path``); the small leaves (tokens, lengths, drafter state) keep the batch's rows."""
    cache = state.gen.cache
    if isinstance(cache.k, tuple):
        raise HsdjaxError("a row pool needs the stacked KV cache (ModelConfig.scan_layers)")
    extra = rows - cache.k.shape[1]
    if extra <= 0:
        return state
    pad = lambda a: jnp.concatenate([a, jnp.zeros((a.shape[0], extra, *a.shape[2:]), a.dtype)], axis=1)  # noqa: E731
    return state.replace(gen=state.gen.replace(cache=cache.replace(k=pad(cache.k), v=pad(cache.v))))


def compact_rows(state: DecodeState, rows: Int[Array, " N"]) -> DecodeState:
    """``take_rows`` for a row pool (``with_capacity``): the small leaves are gathered as there, the cache
    keeps its rows and copies row ``rows[i]`` into row i in place where they differ (its buffers are
    donated), so shrinking the batch moves only the busy rows that sit past the new size. ``rows`` must
    be increasing apart from its -1 entries (the busy rows in order), so that no row is read after it
    was overwritten."""
    cache = state.gen.cache
    k, v = _move_cache_rows(cache.k, cache.v, rows)
    return _with_kv(take_rows(_with_kv(state, None, None), rows), k, v)


@partial(jax.jit, donate_argnames=("k", "v"))
def _move_cache_rows(k: Array, v: Array, rows: Int[Array, " N"]) -> tuple[Array, Array]:
    def move(i, kv):
        src = rows[i]

        def copy(kv):
            return tuple(jax.lax.dynamic_update_slice_in_dim(a, jax.lax.dynamic_slice_in_dim(a, src, 1, axis=1), i,
                                                             axis=1) for a in kv)

        return jax.lax.cond((src >= 0) & (src != i), copy, lambda kv: kv, kv)

    return jax.lax.fori_loop(0, rows.shape[0], move, (k, v))


def _gather_rows(tree: Any, idx: Int[Array, " N"]) -> Any:
    """``tree`` (a ``DecodeState`` or ``GenState``) with every batched leaf indexed by ``idx`` on its
    batch axis (``row_axis``)."""
    def take(path, leaf):
        axis = row_axis(path, leaf)
        return leaf if axis is None else jnp.take(leaf, idx, axis=axis)

    return jax.tree_util.tree_map_with_path(take, tree)
