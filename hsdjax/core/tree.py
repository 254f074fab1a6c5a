"""Draft trees with static shapes: node arrays, the tree attention mask, positions, and tries.

A tree has N node slots per row. Node 0 is the root: the newest verified token, whose key/value is
not yet in the target cache. Every other node holds a drafted token; ``parents`` point to an earlier
slot (parents[i] < i), ``depth`` counts edges from the root, ``valid`` marks used slots. Siblings
carry distinct tokens when the tree comes from ``chains_to_tree`` (a trie), and chains are trees of
width 1. Invalid slots see only themselves and are never accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int


@struct.dataclass
class DraftTree:
    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]  # -1 for the root and for invalid slots
    depth: Int[Array, "B N"]
    valid: Bool[Array, "B N"]
    # Drafters that sample their tokens keep the distribution each token was drawn from
    # (q_probs[:, i] is the distribution node i+1's token came from; chains only), else None.
    q_probs: Float[Array, "B M V"] | None = None
    # Trees with a grafted prompt-lookup chain mark its nodes (``graft_chain``), so the statistics can
    # tell drafts the drafter made from drafts lookup supplied; else None.
    lookup: Bool[Array, "B N"] | None = None
    # Drafters that keep states across rounds (``hsd``) mark the nodes drafted from a state computed in an
    # earlier round (the draft reuse the method exists for), so accepted tokens can be counted by it.
    reused: Bool[Array, "B N"] | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def root_only(root: Int[Array, " B"]) -> DraftTree:
    """The empty draft: plain decoding is verification of a tree with nothing but its root."""
    b = root.shape[0]
    return DraftTree(tokens=root[:, None], parents=jnp.full((b, 1), -1, jnp.int32),
                     depth=jnp.zeros((b, 1), jnp.int32), valid=jnp.ones((b, 1), bool))


def chain(root: Int[Array, " B"], drafts: Int[Array, "B D"], length: Int[Array, " B"] | None = None,
          q_probs: Float[Array, "B D V"] | None = None) -> DraftTree:
    """A chain root -> drafts[0] -> drafts[1] ...; ``length`` drafted tokens are valid (default all)."""
    b, d = drafts.shape
    idx = jnp.arange(d + 1, dtype=jnp.int32)
    length = jnp.full((b,), d, jnp.int32) if length is None else length
    valid = idx[None, :] <= length[:, None]
    parents = jnp.where(valid, idx[None, :] - 1, -1)
    return DraftTree(tokens=jnp.concatenate([root[:, None], drafts], axis=1).astype(jnp.int32),
                     parents=parents.astype(jnp.int32), depth=jnp.broadcast_to(idx, (b, d + 1)),
                     valid=valid, q_probs=q_probs)


def chains_to_tree(root: Int[Array, " B"], chains: Int[Array, "B W D"], lengths: Int[Array, "B W"]) -> DraftTree:
    """Merge W candidate continuations into one trie (shared prefixes become shared nodes).

    Node (w, d), chain w's token d, lives in slot 1 + w * D + d. It is valid when chain w has more
    than d tokens and no earlier chain shares its first d+1 tokens; otherwise the earlier chain's
    node stands for it, and chain w's deeper nodes hang under that node.
    """
    b, w, d = chains.shape
    live = jnp.arange(d)[None, None, :] < lengths[:, :, None]  # [B, W, D]
    same_tok = (chains[:, :, None, :] == chains[:, None, :, :]) & live[:, :, None, :] & live[:, None, :, :]
    same_prefix = jnp.cumprod(same_tok.astype(jnp.int32), axis=-1).astype(bool)  # [B, W, W', D]
    earlier = jnp.arange(w)[None, :, None, None] >= jnp.arange(w)[None, None, :, None]
    canon = jnp.argmax(same_prefix & earlier, axis=2)  # first chain with the same prefix: [B, W, D]
    slot = 1 + canon * d + jnp.arange(d)[None, None, :]
    valid = live & (canon == jnp.arange(w)[None, :, None])
    parent = jnp.concatenate([jnp.zeros((b, w, 1), jnp.int32), slot[:, :, :-1].astype(jnp.int32)], axis=-1)
    parent = jnp.where(valid, parent, -1)
    depth = jnp.broadcast_to(jnp.arange(1, d + 1, dtype=jnp.int32), (b, w, d))
    cat = lambda head, rest: jnp.concatenate([head, rest.reshape(b, w * d)], axis=1)  # noqa: E731
    return DraftTree(
        tokens=cat(root[:, None], chains).astype(jnp.int32),
        parents=cat(jnp.full((b, 1), -1, jnp.int32), parent),
        depth=cat(jnp.zeros((b, 1), jnp.int32), depth),
        valid=cat(jnp.ones((b, 1), bool), valid),
    )


def ancestor_mask(tree: DraftTree, max_depth: int) -> Bool[Array, "B N N"]:
    """mask[b, i, j]: node j is node i itself or one of its ancestors (the tree attention mask)."""
    n = tree.num_nodes
    eye = jnp.eye(n, dtype=bool)[None]
    parent_of = jax.nn.one_hot(tree.parents, n, dtype=jnp.float32)  # row i: one-hot of parents[i] (none if -1)
    reach = eye.astype(jnp.float32)
    for _ in range(max_depth):  # reach[i] |= reach[parent(i)]
        reach = jnp.minimum(eye + jnp.einsum("bij,bjk->bik", parent_of, reach), 1.0)
    return (reach > 0) & (tree.valid[:, :, None] | eye)


def positions(tree: DraftTree, cache_length: Int[Array, " B"]) -> Int[Array, "B N"]:
    """Position ids of the nodes: the root sits right after the cached prefix."""
    return cache_length[:, None] + tree.depth


def compact(tree: DraftTree, size: int) -> DraftTree:
    """The same tree in its first ``size`` slots: valid slots move to the front in order (parents
    keep pointing at earlier slots). Valid nodes beyond ``size`` are dropped with their subtrees."""
    order = jnp.argsort(~tree.valid, axis=1, stable=True)  # valid slots first, in their order
    new_index = jnp.argsort(order, axis=1)  # old slot -> new slot
    take = lambda a: jnp.take_along_axis(a, order[:, :size], axis=1)  # noqa: E731
    parents = take(tree.parents)
    parents = jnp.where(parents >= 0, jnp.take_along_axis(new_index, jnp.maximum(parents, 0), axis=1), -1)
    valid = take(tree.valid) & ((parents < size) | (parents < 0))
    lookup = None if tree.lookup is None else take(tree.lookup)
    reused = None if tree.reused is None else take(tree.reused)
    q_probs = None
    if tree.q_probs is not None:  # per drafted slot (slot j at j - 1); the root (slot 0) stays first
        q_probs = jnp.take_along_axis(tree.q_probs, (order[:, 1:size] - 1)[:, :, None], axis=1)
    return DraftTree(tokens=take(tree.tokens), parents=jnp.where(valid, parents, -1), depth=take(tree.depth),
                     valid=valid, q_probs=q_probs, lookup=lookup, reused=reused)


def graft_chain(tree: DraftTree, drafts: Int[Array, "B L"], length: Int[Array, " B"]) -> DraftTree:
    """``tree`` plus a chain from its root of the first ``length`` tokens of ``drafts``, in L new slots
    after the tree's own. When a valid depth-1 node of ``tree`` already carries the chain's first token,
    the chain continues under that node and its own first slot stays unused, so no token is verified
    twice at the same place. The result is as deterministic as its parts (``verify_tree``'s rule)."""
    if tree.q_probs is not None:
        raise ValueError("graft_chain: trees of sampled drafts (q_probs) cannot take a chain")
    b, n = tree.tokens.shape
    steps = jnp.arange(drafts.shape[1], dtype=jnp.int32)
    same = tree.valid & (tree.depth == 1) & (tree.tokens == drafts[:, :1])  # [B, N]
    shared = jnp.any(same, axis=1)
    # slot n + j's parent: the root for j = 0, else slot n + j - 1 (the shared node for j = 1)
    parents = jnp.broadcast_to(n + steps - 1, (b, steps.shape[0]))
    parents = jnp.where(steps[None, :] == 0, 0, parents)
    parents = jnp.where((steps[None, :] == 1) & shared[:, None], jnp.argmax(same, axis=1)[:, None], parents)
    valid = (steps[None, :] < length[:, None]) & ~((steps[None, :] == 0) & shared[:, None])
    return DraftTree(
        tokens=jnp.concatenate([tree.tokens, drafts.astype(jnp.int32)], axis=1),
        parents=jnp.concatenate([tree.parents, jnp.where(valid, parents, -1).astype(jnp.int32)], axis=1),
        depth=jnp.concatenate([tree.depth, jnp.broadcast_to(steps + 1, (b, steps.shape[0]))], axis=1),
        valid=jnp.concatenate([tree.valid, valid], axis=1),
        lookup=jnp.concatenate([jnp.zeros((b, n), bool) if tree.lookup is None else tree.lookup, valid], axis=1),
        reused=None if tree.reused is None else jnp.concatenate([tree.reused, jnp.zeros_like(valid)], axis=1))
