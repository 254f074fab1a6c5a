"""The jitted autoregressive engine (`ar`): prefill, then a ``lax.while_loop`` of one-token steps.

Everything a generation needs lives in one pytree, ``GenState`` (KV cache, output buffer, counters,
per-row sampling settings and RNG keys), donated between calls. ``decode`` advances it by up to
``max_steps`` tokens per row, so a whole generation is one call and streaming / cancellation happen
between calls of the same compiled program. Shapes are static per (batch, prompt bucket, cache
bucket); the number of steps is a traced argument, so changing it never recompiles.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int, UInt

from hsdjax.config import ModelConfig
from hsdjax.errors import HsdjaxError
from hsdjax.model import KVCache, Transformer, causal_mask, commit, init_cache
from hsdjax.sampling import SamplingParams, select_tokens

PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CACHE_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
MAX_STOP_IDS = 8


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


def step_keys(keys: UInt[Array, "B 2"], counter: Int[Array, " B"]) -> UInt[Array, "B 2"]:
    return jax.vmap(jax.random.fold_in)(keys, counter)


def is_stop(tokens: Int[Array, "..."], stop_ids: Int[Array, " M"]) -> Bool[Array, "..."]:
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def finished(token: Int[Array, " B"], n_out: Int[Array, " B"], state: GenState, cache: KVCache,
             spare: int = 1) -> Bool[Array, " B"]:
    """Rows that end after emitting ``token``: a stop token, the budget, or no room for ``spare``
    more cache entries."""
    return is_stop(token, state.stop_ids) | (n_out >= state.max_new) | (cache.length + spare >= cache.size)


@partial(jax.jit, static_argnames=("cfg", "cache_size", "spare"))
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
) -> tuple[GenState, dict[str, Array]]:
    """Run the prompts (right-padded to P), fill the cache, choose each row's first new token.

    Rows with ``max_new`` 0 are padding: they start done. ``spare`` is the number of cache slots a
    step may need (1 for plain decoding, the tree size for speculative decoding). Also returns the
    prompt's forward outputs (``hidden``, ``layers``, ``k``, ``v``) for drafters.
    """
    model = Transformer(cfg)
    b, p = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    fwd = model.apply({"params": params}, prompt, positions, causal_mask(prompt_len, p))
    cache = commit(init_cache(cfg, b, cache_size), fwd["k"], fwd["v"], positions, prompt_len)
    last = (prompt_len - 1)[:, None]
    hidden_last = jnp.take_along_axis(fwd["hidden"], last[:, :, None], axis=1)[:, 0]
    logits = model.apply({"params": params}, hidden_last, method=Transformer.logits)
    first = select_tokens(logits, sampling, step_keys(keys, prompt_len))
    seq = jnp.zeros((b, cache_size), jnp.int32).at[:, :p].set(prompt)
    seq = seq.at[jnp.arange(b), prompt_len].set(first)
    state = GenState(cache=cache, seq=seq, seq_len=prompt_len + 1, prompt_len=prompt_len, done=max_new <= 0,
                     max_new=max_new, keys=keys, sampling=sampling, stop_ids=stop_ids)
    state = state.replace(done=state.done | finished(first, state.n_out, state, cache, spare))
    return state, fwd


def ar_round(params: dict[str, Any], state: GenState, cfg: ModelConfig) -> GenState:
    """One plain decoding step for every row that is not done."""
    model = Transformer(cfg)
    b = state.seq_len.shape[0]
    positions = state.cache.length[:, None]
    fwd = model.apply({"params": params}, state.last_token()[:, None], positions, jnp.ones((b, 1, 1), bool),
                      state.cache)
    active = ~state.done
    cache = commit(state.cache, fwd["k"], fwd["v"], jnp.zeros((b, 1), jnp.int32), active.astype(jnp.int32))
    logits = model.apply({"params": params}, fwd["hidden"][:, 0], method=Transformer.logits)
    token = select_tokens(logits, state.sampling, step_keys(state.keys, state.seq_len))
    rows = jnp.arange(b)
    slot = jnp.minimum(state.seq_len, state.seq.shape[1] - 1)
    seq = state.seq.at[rows, slot].set(jnp.where(active, token, state.seq[rows, slot]))
    seq_len = state.seq_len + active.astype(jnp.int32)
    state = state.replace(cache=cache, seq=seq, seq_len=seq_len)
    return state.replace(done=state.done | (active & finished(token, state.n_out, state, cache)))


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def decode(params: dict[str, Any], state: GenState, max_steps: Int[Array, ""], *, cfg: ModelConfig) -> GenState:
    """Advance every row by up to ``max_steps`` tokens (fewer when all rows are done)."""

    def cond(carry):
        step, st = carry
        return (step < max_steps) & ~jnp.all(st.done)

    def body(carry):
        step, st = carry
        return step + 1, ar_round(params, st, cfg)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state
