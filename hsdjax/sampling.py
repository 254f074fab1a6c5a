"""Token selection: greedy argmax, and temperature / top-k / top-p sampling, per batch row.

Settings are arrays (one value per row) so one compiled program serves every request; a row with
temperature 0 is greedy. The adjustment order is temperature -> top-k -> top-p, as in Hugging Face
``generate``. ``adjust_logits`` is the single definition of the target distribution that plain
sampling and speculative verification both use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, UInt

NEG_INF = -jnp.inf


@struct.dataclass
class SamplingParams:
    """Per-row settings: temperature (0 = greedy), top_k (0 = off), top_p (1 = off)."""

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]

    @classmethod
    def make(cls, batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        return cls(
            temperature=jnp.full((batch,), temperature, jnp.float32),
            top_k=jnp.full((batch,), top_k, jnp.int32),
            top_p=jnp.full((batch,), top_p, jnp.float32),
        )


def adjust_logits(logits: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """Temperature-scaled logits with tokens outside top-k / top-p set to -inf (rows with T > 0)."""
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    scaled = logits.astype(jnp.float32) / temp[:, None]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    vocab = logits.shape[-1]
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, NEG_INF)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked strictly above
    keep_sorted = (before < sp.top_p[:, None]) | (jnp.arange(vocab)[None, :] == 0)
    n_keep = jnp.sum(keep_sorted, axis=-1)
    threshold = jnp.maximum(jnp.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1), kth)
    return jnp.where(scaled >= threshold, scaled, NEG_INF)


def target_probs(logits: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """The distribution plain decoding samples from (one-hot argmax for greedy rows)."""
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def sampled(_):
        return jax.nn.softmax(adjust_logits(logits, sp), axis=-1)

    probs = jax.lax.cond(jnp.any(sp.temperature > 0), sampled, lambda _: greedy, None)
    return jnp.where((sp.temperature > 0)[:, None], probs, greedy)


def select_tokens(
    logits: Float[Array, "B V"], sp: SamplingParams, keys: UInt[Array, "B 2"]
) -> Int[Array, " B"]:
    """Next token per row: argmax where temperature is 0, else a sample from the adjusted logits.

    The sort behind top-k/top-p only runs when some row samples.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        adjusted = adjust_logits(logits, sp)
        return jax.vmap(jax.random.categorical)(keys, adjusted).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(sp.temperature > 0), sample, lambda _: greedy, None)
    return jnp.where(sp.temperature > 0, sampled, greedy)
