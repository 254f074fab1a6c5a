"""`pld`: prompt lookup (n-gram) drafting, training-free.

The newest tokens of a row (its last ``min_ngram``..``max_ngram`` tokens, longest first; at least 2 by
default, since a one-token match was right too rarely to pay for its pass) are looked up in the
row's earlier context; the tokens that followed each match are proposed as continuations. The
``width`` best matches (longer n-gram first, then most recent) become chains that are merged into one
trie, so a round verifies several guesses at once. Everything is vectorised over the context; there
is no drafter state and no drafter forward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from hsdjax.drafters.base import DraftCost, Drafter
from hsdjax.tree import chains_to_tree


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
    name: str = "pld"
    width: int = 2  # candidate continuations per round
    depth: int = 6  # tokens per continuation
    max_ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self):
        object.__setattr__(self, "num_nodes", 1 + self.width * self.depth)
        object.__setattr__(self, "max_depth", self.depth)
        # no match: verify the root alone; one chain's worth: a chain-sized pass
        object.__setattr__(self, "tiers", (1, 1 + self.depth))

    def propose(self, dparams, state, gen):
        chains, lengths = lookup_continuations(gen.seq, gen.seq_len, self.width, self.depth, self.max_ngram,
                                               self.min_ngram)
        tree = chains_to_tree(gen.last_token(), chains, lengths)
        return tree, state, DraftCost.of(jnp.zeros((gen.seq.shape[0],), jnp.int32))


def lookup_continuations(seq: Int[Array, "B S"], length: Int[Array, " B"], width: int, depth: int, max_ngram: int,
                         min_ngram: int = 1) -> tuple[Int[Array, "B W D"], Int[Array, "B W"]]:
    """The ``width`` best earlier continuations of each row's newest tokens (longer n-gram match first,
    then the most recent), ``depth`` tokens each, and how many of them lie inside the context (0: no
    match)."""
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
    top, where = jax.lax.top_k(score, width)  # [B, W]
    follow = where[:, :, None] + jnp.arange(depth)[None, None, :]  # [B, W, D]
    chains = jnp.take_along_axis(seq[:, None, :], follow.clip(0, s - 1), axis=2)
    avail = jnp.clip(length[:, None] - where, 0, depth)  # continuation tokens inside the context
    return chains, jnp.where(top >= 0, avail, 0)
