"""`pld`: prompt lookup (n-gram) drafting, training-free.

The newest tokens of a row (its last ``min_ngram``..``max_ngram`` tokens, longest first; at least 2 by
default, since a one-token match was right too rarely to pay for its pass) are looked up in the
row's earlier context; the tokens that followed each match are proposed as continuations. The
``width`` best matches (longer n-gram first, then most recent) become chains that are merged into one
trie, so a round verifies several guesses at once. ``lengths`` makes a chain's length depend on how
long its match is (a longer match is right more often, so it earns a longer chain and a larger pass);
the pass then runs at the smallest size that holds the chain. Everything is vectorised over the
context; there is no drafter state and no drafter forward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from hsdjax.core.drafters.base import DraftCost, Drafter
from hsdjax.core.tree import chains_to_tree

# Two different caps on n, the number of a row's newest tokens a lookup matches:
FIXED_MAX_NGRAM = 3  # with one fixed continuation length (no table), matches of up to 3 tokens are sought:
#                      `pld`'s default ``max_ngram``, hsd / eagle's grafted lookup (``lookup`` / ``lookup_ngram``)
#                      and the largest ``--lookup-ngram`` the command line takes
TABLE_MAX_NGRAM = 8  # the longest match a chain-length table (``lengths``, ``--lookup-lengths``) may name: the
#                      most entries the option takes (checked by ``hsdjax.core.methods.parse_lookup_lengths``)


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
    name: str = "pld"
    width: int = 2  # candidate continuations per round
    depth: int = 6  # tokens per continuation
    max_ngram: int = FIXED_MAX_NGRAM
    min_ngram: int = 2
    lengths: tuple[int, ...] = ()  # chain length by match length (1, 2, ... tokens); (): ``depth`` from min_ngram

    def __post_init__(self):
        lengths = self.lengths or fixed_lengths(self.depth, self.min_ngram, self.max_ngram)
        check_lengths(lengths)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "depth", max(lengths))
        object.__setattr__(self, "num_nodes", 1 + self.width * self.depth)
        object.__setattr__(self, "max_depth", self.depth)
        # no match: verify the root alone; else a pass the size of the chain its match earns
        object.__setattr__(self, "tiers", tuple(sorted({1 + n for n in lengths} | {1})))

    def propose(self, dparams, state, gen):
        chains, lengths = lookup_by_match(gen.seq, gen.seq_len, self.width, self.lengths)
        tree = chains_to_tree(gen.last_token(), chains, lengths)
        return tree, state, DraftCost.of(jnp.zeros((gen.seq.shape[0],), jnp.int32))


def fixed_lengths(depth: int, min_ngram: int, max_ngram: int) -> tuple[int, ...]:
    """Chain lengths by match length (1 .. ``max_ngram`` tokens): ``depth`` from ``min_ngram`` on."""
    return tuple(depth if n >= min_ngram else 0 for n in range(1, max_ngram + 1))


def check_lengths(lengths: tuple[int, ...]) -> None:
    """Refuse chain-length tables that propose nothing or hold negative lengths."""
    if not lengths or max(lengths) < 1 or min(lengths) < 0:
        raise ValueError(f"lookup chain lengths by match length must be >= 0 with one >= 1 (got {lengths})")


def lookup_by_match(seq: Int[Array, "B S"], length: Int[Array, " B"], width: int, lengths: tuple[int, ...]
                    ) -> tuple[Int[Array, "B W D"], Int[Array, "B W"]]:
    """``lookup_continuations`` with each chain cut to the length its match earns: ``lengths[n - 1]``
    tokens for a match of the ``n`` newest tokens (matches of up to ``len(lengths)`` tokens are sought,
    of at least the first n with a nonzero length)."""
    min_ngram = next(n for n, d in enumerate(lengths, 1) if d > 0)
    chains, avail, ngram = lookup_continuations(seq, length, width, max(lengths), len(lengths), min_ngram,
                                                with_ngram=True)
    earned = jnp.array((0, *lengths), jnp.int32)[ngram]
    return chains, jnp.minimum(avail, earned)


def lookup_continuations(seq: Int[Array, "B S"], length: Int[Array, " B"], width: int, depth: int, max_ngram: int,
                         min_ngram: int = 1, with_ngram: bool = False) -> tuple[Int[Array, "..."], ...]:
    """The ``width`` best earlier continuations of each row's newest tokens (longer n-gram match first,
    then the most recent), ``depth`` tokens each [B, W, D], and how many of them lie inside the context
    [B, W] (0: no match); with ``with_ngram`` also the length of each match's n-gram [B, W] (0: none)."""
    b, s = seq.shape
    last = jnp.take_along_axis(seq, (length[:, None] - 1 - jnp.arange(max_ngram)[None, :]).clip(0), axis=1)
    # A match ends at e (exclusive, e < length): seq[e-1-j] == seq[length-1-j] for j < n.
    ends = jnp.arange(s)[None, :]  # [1, S]
    back = ends[:, :, None] - 1 - jnp.arange(max_ngram)[None, None, :]  # [1, S, G]
    window = jnp.take_along_axis(seq[:, :, None], jnp.broadcast_to(back.clip(0), (b, s, max_ngram)), axis=1)
    eq = (window == last[:, None, :]) & (back >= 0)
    n_match = jnp.sum(jnp.cumprod(eq.astype(jnp.int32), axis=-1), axis=-1)  # [B, S]
    usable = (ends < length[:, None]) & (n_match >= min_ngram)
    score = jnp.where(usable, n_match * s + ends, -1)
    if width == 1:  # the first maximum, as top_k returns it; XLA's CPU top_k sorts the whole row
        where = jnp.argmax(score, axis=1)[:, None].astype(jnp.int32)
        top = jnp.take_along_axis(score, where, axis=1)
    else:
        top, where = jax.lax.top_k(score, width)  # [B, W]
    follow = where[:, :, None] + jnp.arange(depth)[None, None, :]  # [B, W, D]
    chains = jnp.take_along_axis(seq[:, None, :], follow.clip(0, s - 1), axis=2)
    avail = jnp.clip(length[:, None] - where, 0, depth)  # continuation tokens inside the context
    avail = jnp.where(top >= 0, avail, 0)
    if with_ngram:
        return chains, avail, jnp.where(top >= 0, top // s, 0)
    return chains, avail
