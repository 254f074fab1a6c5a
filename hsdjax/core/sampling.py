"""Token selection: greedy argmax, and temperature / top-k / top-p sampling, per batch row.

Settings are arrays (one value per row) so one compiled program serves every request; a row with
temperature 0 is greedy, and so is any temperature below ``GREEDY_BELOW`` (float32's smallest normal
number: smaller ones are subnormal, which the CPU may flush to zero mid-computation). Logits are
shifted by their row's maximum before the division, so no temperature the settings accept overflows:
at 2e-38 the maximum stays 0 and every other logit lands near -1e38 or at -inf (greedy, ties drawn at
random).
The adjustment order is temperature -> top-k -> top-p, as in Hugging Face
``generate``. ``adjust_logits`` is the single definition of the target distribution that plain
sampling and speculative verification both use.

``adjust_logits`` never sorts the vocabulary when no row filters (top_k 0, top_p >= 1); otherwise
it finds each row's cut-off among the ``CANDIDATES`` largest logits (an exact blocked top-k) and
falls back to the full sort (``adjust_logits_reference``) only when some row's cut-off lies beyond
them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int, Shaped, UInt

from hsdjax.runtime.model import argmax_last

NEG_INF = -jnp.inf
GREEDY_BELOW = float(np.finfo(np.float32).tiny)  # temperatures under float32's smallest normal are greedy
CANDIDATES = 256  # the largest logits per row the fast top-k / top-p path looks at
FIT_MARGIN = 1e-4  # a top-p row fits only if the candidates hold this much more than top_p


@struct.dataclass
class SamplingParams:
    """Per-row settings: temperature (0 = greedy), top_k (0 = off), top_p (1 = off)."""

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]

    @classmethod
    def make(cls, batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        return cls(
            temperature=jnp.full((batch,), effective_temperature(temperature), jnp.float32),
            top_k=jnp.full((batch,), top_k, jnp.int32),
            top_p=jnp.full((batch,), top_p, jnp.float32),
        )


def effective_temperature(temperature: float) -> float:
    """The temperature sampling uses: ``temperature``, or 0 (greedy) below ``GREEDY_BELOW``."""
    return float(temperature) if temperature >= GREEDY_BELOW else 0.0


def _lowest(dtype: jnp.dtype) -> Array:
    """The smallest value of ``dtype`` (-inf for floats): padding that ``top_k`` ranks last."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf, dtype)
    return jnp.array(jnp.iinfo(dtype).min, dtype)


def top_k_blocked(
    x: Shaped[Array, "*lead V"], k: int, block: int | None = None
) -> tuple[Shaped[Array, "*lead k"], Int[Array, "*lead k"]]:
    """``lax.top_k`` (same values, same indices) in two stages over blocks of the last axis.

    The k blocks with the largest maxima hold the top k, so only k*block candidates are ranked.
    ``block`` defaults to the power of two nearest sqrt(V/k), which about minimises the two stages'
    sizes (a power of two usually divides V, and padding costs a copy).
    """
    *lead, v = x.shape
    block = block or 2 ** max(0, round(math.log2(math.sqrt(v / k))))
    if v <= k * block:
        return jax.lax.top_k(x, k)
    pad = (-v) % block
    if pad:
        x = jnp.concatenate([x, jnp.broadcast_to(_lowest(x.dtype), (*lead, pad))], axis=-1)
    blocks = x.reshape(*lead, -1, block)
    _, best = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    best = jnp.sort(best, axis=-1)  # candidates in index order: ties resolve as lax.top_k does
    cand = jnp.take_along_axis(blocks, best[..., None], axis=-2).reshape(*lead, k * block)
    vals, ci = jax.lax.top_k(cand, k)
    return vals, jnp.take_along_axis(best, ci // block, axis=-1) * block + ci % block


def _scaled(logits: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """Logits less their row's maximum, over temperature (rows with temperature 0 are left unscaled).

    Shifting first keeps every value at or below 0, so a tiny temperature sends logits to -inf, never
    to +inf (whose difference in the softmax would be NaN); the distribution is the same."""
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    logits = logits.astype(jnp.float32)
    return (logits - jnp.max(logits, axis=-1, keepdims=True)) / temp[:, None]


def _keep(scaled: Float[Array, "B V"], threshold: Float[Array, " B"]) -> Float[Array, "B V"]:
    """Every token at or above its row's threshold keeps its logit; the rest get -inf."""
    return jnp.where(scaled >= threshold[:, None], scaled, NEG_INF)


def _top_k_of(sp: SamplingParams, vocab: int) -> Int[Array, " B"]:
    """Each row's top-k count (the whole vocabulary when top-k is off)."""
    return jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab), vocab)


def _reference_threshold(scaled: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, " B"]:
    """Each row's smallest kept logit, from a full sort of the vocabulary."""
    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    k = _top_k_of(sp, vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)[:, 0]
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, NEG_INF)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked strictly above
    keep_sorted = (before < sp.top_p[:, None]) | (jnp.arange(vocab)[None, :] == 0) | (sp.top_p >= 1)[:, None]
    n_keep = jnp.sum(keep_sorted, axis=-1)
    return jnp.maximum(jnp.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)[:, 0], kth)


def adjust_logits_reference(logits: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """``adjust_logits`` by a full sort of every row (the definition the fast path must equal)."""
    scaled = _scaled(logits, sp)
    return _keep(scaled, _reference_threshold(scaled, sp))


def _filters_off(sp: SamplingParams, vocab: int) -> Bool[Array, " B"]:
    """Rows that keep every token: top-k off (or >= vocabulary) and top-p off."""
    return ((sp.top_k <= 0) | (sp.top_k >= vocab)) & (sp.top_p >= 1)


def _candidate_threshold(
    scaled: Float[Array, "B V"], vals: Float[Array, "B K"], sp: SamplingParams
) -> tuple[Float[Array, " B"], Bool[Array, " B"]]:
    """Each row's threshold from its K largest logits ``vals``, and whether the row's cut-off lies
    among them (the probabilities use the full-vocabulary normaliser when top-k is off)."""
    vocab, cands = scaled.shape[-1], vals.shape[-1]
    k = _top_k_of(sp, vocab)
    pos = jnp.arange(cands)[None, :]
    top = jnp.max(scaled, axis=-1, keepdims=True)  # == vals[:, :1]; slicing vals would stop XLA's CPU
    weights = jnp.exp(jnp.where(pos < k[:, None], vals, NEG_INF) - top)  # TopK rewrite (a full sort)
    full = jnp.sum(jnp.exp(scaled - top), axis=-1)
    probs = weights / jnp.where(k <= cands, jnp.sum(weights, axis=-1), full)[:, None]
    cum = jnp.cumsum(probs, axis=-1)
    keep = ((cum - probs) < sp.top_p[:, None]) | (pos == 0) | (sp.top_p >= 1)[:, None]
    m = jnp.minimum(jnp.sum(keep, axis=-1), k)
    threshold = jnp.take_along_axis(vals, (m - 1)[:, None], axis=-1)[:, 0]
    off = _filters_off(sp, vocab)
    fits = off | (cands >= vocab) | (k <= cands) | ((k == vocab) & (cum[:, -1] >= sp.top_p + FIT_MARGIN))
    return jnp.where(off, NEG_INF, threshold), fits


def _filtered(scaled: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """Top-k / top-p among the candidates, or the full sort where some row's cut-off is beyond them."""
    vals, _ = top_k_blocked(scaled, min(CANDIDATES, scaled.shape[-1]))
    threshold, fits = _candidate_threshold(scaled, vals, sp)
    threshold = jax.lax.cond(jnp.all(fits), lambda: threshold, lambda: _reference_threshold(scaled, sp))
    return _keep(scaled, threshold)


def adjust_logits(logits: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """Temperature-scaled logits with tokens outside top-k / top-p set to -inf (rows with T > 0).

    No sort runs when no row filters; otherwise equal to ``adjust_logits_reference``.
    """
    scaled = _scaled(logits, sp)
    return jax.lax.cond(jnp.all(_filters_off(sp, scaled.shape[-1])), lambda: scaled,
                        lambda: _filtered(scaled, sp))


def _sampled_rows_only(sp: SamplingParams) -> SamplingParams:
    """Filters off on greedy rows (their adjusted logits are unused), so they never force a sort."""
    sampled = sp.temperature > 0
    return sp.replace(top_k=jnp.where(sampled, sp.top_k, 0), top_p=jnp.where(sampled, sp.top_p, 1.0))


def target_probs(logits: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """The distribution plain decoding samples from (one-hot argmax for greedy rows)."""
    greedy = jax.nn.one_hot(argmax_last(logits), logits.shape[-1], dtype=jnp.float32)

    def sampled(_):
        return jax.nn.softmax(adjust_logits(logits, _sampled_rows_only(sp)), axis=-1)

    probs = jax.lax.cond(jnp.any(sp.temperature > 0), sampled, lambda _: greedy, None)
    return jnp.where((sp.temperature > 0)[:, None], probs, greedy)


def log_probs(logits: Float[Array, "B V"], sp: SamplingParams) -> Float[Array, "B V"]:
    """Log-probabilities of the distribution each row's token is drawn from: the log-softmax of the
    adjusted logits (temperature, top-k, top-p; -inf outside the kept tokens) for sampled rows, of the
    plain logits for greedy rows (whose one-hot choice has no useful log-probability)."""
    return jax.nn.log_softmax(adjust_logits(logits, _sampled_rows_only(sp)), axis=-1)


def select_tokens(
    logits: Float[Array, "B V"], sp: SamplingParams, keys: UInt[Array, "B 2"]
) -> Int[Array, " B"]:
    """Next token per row: argmax where temperature is 0, else a sample from the adjusted logits.

    Nothing past the argmax runs unless some row samples (and no sort unless some row filters).
    """
    greedy = argmax_last(logits)

    def sample(_):
        adjusted = adjust_logits(logits, _sampled_rows_only(sp))
        return jax.vmap(jax.random.categorical)(keys, adjusted).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(sp.temperature > 0), sample, lambda _: greedy, None)
    return jnp.where(sp.temperature > 0, sampled, greedy)
