"""Dynamic draft trees grown by cumulative confidence (EAGLE-2's idea), shared by `hsd` and `eagle`.

A tree of depth D and width K has 1 + D*K slots: slot 0 is the root, depth d occupies slots
1+(d-1)K ... dK. Depth 1 holds the root's K most likely children; each further depth keeps the K
most likely (by cumulative log-probability along the path) among the top-K children of every node
of the previous depth. Finally the ``budget`` most likely nodes stay valid (a node is always at
least as likely as its parent, and ties go to the earlier slot, so kept nodes keep their ancestors);
nodes whose cumulative probability is below ``min_prob`` are dropped too, which lets the engine
verify a smaller tier when the drafter is unsure. ``grow_prob`` spares the most likely node: every
other node needs a cumulative probability of at least ``grow_prob`` (the tree grows past one draft
only where the drafter is sure), and a depth whose frontier cannot reach it is not drafted at all.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hsdjax.core.tree import DraftTree


def expand(cum: Float[Array, "B K"], logp: Float[Array, "B K V"], width: int):
    """The ``width`` best children of a frontier: (their parent index in the frontier [B, W],
    draft-vocabulary index [B, W], cumulative log-probability [B, W])."""
    b, k, v = logp.shape
    top_lp, top_idx = jax.lax.top_k(logp, width)  # [B, K, W] best children of each frontier node
    total = (cum[:, :, None] + top_lp).reshape(b, k * width)
    best, flat = jax.lax.top_k(total, width)
    parent = flat // width
    token = jnp.take_along_axis(top_idx.reshape(b, k * width), flat, axis=1)
    return parent, token, best


def grow_tree(
    root: Int[Array, " B"],
    first_logp: Float[Array, "B V"],
    children_logp: Callable[[int, Int[Array, "B K"], Int[Array, "B K"], Int[Array, "B K"], object],
                            tuple[Float[Array, "B K V"], object]],
    carry: object,
    vocab_ids: Int[Array, " V"],
    depth: int,
    width: int,
    budget: int,
    min_prob: float = 0.0,
    grow_prob: float = 0.0,
) -> tuple[DraftTree, Float[Array, "B N"], object]:
    """Grow a tree. ``children_logp(d, tokens, slots, parent_frontier, carry)`` returns the draft
    log-probabilities of the children of the depth-d frontier (its full-vocabulary ``tokens``, tree
    ``slots`` and the index of each node's parent in the previous frontier) and the new carry.

    Returns the tree, each slot's cumulative log-probability, and the final carry.
    """
    b = root.shape[0]
    n = 1 + depth * width
    tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(root)
    parents = jnp.full((b, n), -1, jnp.int32)
    depths = jnp.zeros((b, n), jnp.int32)
    cum_all = jnp.zeros((b, n), jnp.float32)
    cum = jnp.zeros((b, 1), jnp.float32)
    logp = first_logp[:, None, :]
    front_slots = jnp.zeros((b, 1), jnp.int32)
    for d in range(1, depth + 1):
        parent_idx, vocab_idx, cum = expand(cum, logp, width)
        new_tokens = vocab_ids[vocab_idx]
        new_parents = jnp.take_along_axis(front_slots, parent_idx, axis=1)
        start = 1 + (d - 1) * width
        slots = start + jnp.arange(width, dtype=jnp.int32)
        tokens = tokens.at[:, start: start + width].set(new_tokens)
        parents = parents.at[:, start: start + width].set(new_parents)
        depths = depths.at[:, start: start + width].set(d)
        cum_all = cum_all.at[:, start: start + width].set(cum)
        front_slots = jnp.broadcast_to(slots, (b, width))
        if d < depth:
            logp, carry = _children_if_sure(children_logp, d, new_tokens, front_slots, parent_idx, carry, cum,
                                            grow_prob)
    # keep the `budget` best nodes (root always), ties to the earlier slot
    score = jnp.where(jnp.arange(n)[None, :] == 0, jnp.inf, cum_all)
    order = jnp.lexsort((jnp.broadcast_to(jnp.arange(n), (b, n)), -score), axis=-1)
    rank = jnp.argsort(order, axis=1)
    valid = (rank <= budget) & ((cum_all >= jnp.log(jnp.maximum(min_prob, 1e-30))) | (rank == 0))
    if grow_prob > 0:
        valid = valid & ((cum_all >= jnp.log(grow_prob)) | (rank <= 1))
    valid = _close_under_ancestors(valid, parents, depth)
    tree = DraftTree(tokens=tokens, parents=jnp.where(valid, parents, -1), depth=depths, valid=valid)
    return tree, cum_all, carry


def _children_if_sure(children_logp, d, tokens, slots, parent_idx, carry, cum, grow_prob):
    """``children_logp``, skipped (children at -inf, carry zeros) when ``grow_prob`` > 0 and no row's
    frontier reaches it: a child is never more likely than its parent, so none could be kept."""
    run = lambda c: children_logp(d, tokens, slots, parent_idx, c)  # noqa: E731
    if grow_prob <= 0:
        return run(carry)
    shapes = jax.eval_shape(run, carry)

    def skip(_):
        logp = jnp.full(shapes[0].shape, -jnp.inf, shapes[0].dtype)
        return logp, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1])

    return jax.lax.cond(jnp.any(cum >= jnp.log(grow_prob)), run, skip, carry)


def frontiers_expanded(cum_all: Float[Array, "B N"], depth: int, width: int, grow_prob: float = 0.0):
    """How many of depths 1 .. depth-1 had their children drafted (``_children_if_sure``: all of them
    unless ``grow_prob`` skipped one for the whole batch); a scalar, for the drafter's cost counters."""
    if grow_prob <= 0 or depth < 2:
        return jnp.int32(depth - 1)
    front = cum_all[:, 1: 1 + (depth - 1) * width].reshape(-1, depth - 1, width)
    return jnp.sum(jnp.any(front >= jnp.log(grow_prob), axis=(0, 2))).astype(jnp.int32)


def _close_under_ancestors(valid, parents, depth):
    """Drop nodes whose parent is not kept (ties or thresholds could otherwise orphan them)."""
    for _ in range(depth):
        parent_ok = jnp.where(parents >= 0, jnp.take_along_axis(valid, jnp.maximum(parents, 0), axis=1), True)
        valid = valid & parent_ok
    return valid
