"""Lossless verification of a draft tree against the target's logits at every node.

Two rules, both exact:

* ``verify_tree`` -- for trees that are a deterministic function of the context (greedy drafts, top-k
  trees, prompt lookup, ...). At every node draw the target's next token ``y`` (argmax when greedy,
  otherwise a sample from the temperature/top-k/top-p adjusted target distribution, with a fresh
  key per node). A node is accepted when its parent is accepted and its token equals the parent's
  ``y``. The output is the deepest accepted path plus that node's ``y`` (the bonus token). Each output
  token is therefore a draw from the target given the tokens before it, whatever the tree: this is
  SpecInfer's sibling-by-sibling rule with one-hot draft distributions, and it is lossless because
  the tree never depends on random draws.
* ``verify_chain_sampled`` -- for chains whose tokens were *sampled* from a drafter distribution q.
  Token x_d is accepted with probability min(1, p_d(x_d) / q_d(x_d)); at the first rejection the
  output token is drawn from the residual max(p_d - q_d, 0) / Z; when every draft is accepted the
  bonus token is drawn from p at the last node. This is standard speculative sampling (Leviathan et
  al.; Chen et al.), whose output distribution equals sampling from p. Greedy rows use one-hot p and q,
  which reduces the rule to "accept while the draft equals the argmax".

Both return a ``Verdict``: the accepted path's node slots (root first), its length and the bonus.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, UInt

from hsdjax.core.sampling import SamplingParams, argmax_last, select_tokens, target_probs
from hsdjax.core.tree import DraftTree


@struct.dataclass
class Verdict:
    path: Int[Array, "B P"]  # node slots of the accepted path, root first; P = max_depth + 1
    n_path: Int[Array, " B"]  # nodes on the path, root included (>= 1)
    bonus: Int[Array, " B"]  # the target's token after the path

    def emitted(self, tree: DraftTree) -> Int[Array, "B P"]:
        """The new tokens of the round, path tokens after the root then the bonus (n_path valid)."""
        path_tokens = jnp.take_along_axis(tree.tokens, self.path, axis=1)  # [B, P]; slot 0 is the root
        shifted = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
        idx = jnp.arange(self.path.shape[1])[None, :]
        return jnp.where(idx == (self.n_path - 1)[:, None], self.bonus[:, None], shifted)


def node_keys(keys: UInt[Array, "B 2"], n: int) -> UInt[Array, "B N 2"]:
    return jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(jnp.arange(n)))(keys)


def _path_to(tree: DraftTree, node: Int[Array, " B"], max_depth: int) -> Int[Array, "B P"]:
    """Slots of the root-to-``node`` path, root first, padded with ``node``."""
    steps = [node]
    for _ in range(max_depth):
        prev = steps[-1]
        parent = jnp.take_along_axis(tree.parents, prev[:, None], axis=1)[:, 0]
        steps.append(jnp.where(parent >= 0, parent, prev))
    rev = jnp.stack(steps, axis=1)  # node, parent, grandparent, ... then the root repeated
    depth = jnp.take_along_axis(tree.depth, node[:, None], axis=1)  # [B, 1]
    idx = depth - jnp.arange(max_depth + 1)[None, :]  # position d of the path is rev[depth - d]
    return jnp.take_along_axis(rev, jnp.clip(idx, 0, max_depth), axis=1)


def draw_node_tokens(logits: Float[Array, "B N V"], sp: SamplingParams, keys: UInt[Array, "B 2"]) -> Int[Array, "B N"]:
    """The target's token at every node: its argmax for greedy rows, a draw with the node's key otherwise."""
    b, n, v = logits.shape
    flat_sp = jax.tree_util.tree_map(lambda a: jnp.repeat(a, n, axis=0), sp)
    return select_tokens(logits.reshape(b * n, v), flat_sp, node_keys(keys, n).reshape(b * n, 2)).reshape(b, n)


def accept_tree(y: Int[Array, "B N"], tree: DraftTree, max_depth: int) -> Verdict:
    """The deterministic-tree rule given the target's token ``y`` at every node: the deepest node whose
    path matches the target's tokens, and the target's token after it."""
    n = y.shape[1]
    accepted = jnp.arange(n)[None, :] == 0
    parent = jnp.maximum(tree.parents, 0)
    match = tree.valid & (tree.parents >= 0) & (tree.tokens == jnp.take_along_axis(y, parent, axis=1))
    for _ in range(max_depth):
        accepted = accepted | (match & jnp.take_along_axis(accepted, parent, axis=1))
    deepest = jnp.argmax(jnp.where(accepted, tree.depth, -1), axis=1)
    depth = jnp.take_along_axis(tree.depth, deepest[:, None], axis=1)[:, 0]
    return Verdict(path=_path_to(tree, deepest, max_depth), n_path=depth + 1,
                   bonus=jnp.take_along_axis(y, deepest[:, None], axis=1)[:, 0])


def verify_tree(logits: Float[Array, "B N V"], tree: DraftTree, sp: SamplingParams, keys: UInt[Array, "B 2"],
                max_depth: int) -> Verdict:
    """The deterministic-tree rule (see module docstring)."""
    return accept_tree(draw_node_tokens(logits, sp, keys), tree, max_depth)


def residual_probs(p: Float[Array, "... V"], q: Float[Array, "... V"]) -> Float[Array, "... V"]:
    """norm(max(p - q, 0)); falls back to p where p <= q everywhere (then rejection never happens)."""
    r = jnp.maximum(p - q, 0.0)
    z = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(z > 0, r / jnp.where(z > 0, z, 1.0), p)


def verify_chain_sampled(logits: Float[Array, "B N V"], tree: DraftTree, sp: SamplingParams,
                         keys: UInt[Array, "B 2"], max_depth: int,
                         residual: Callable[[Array, Array], Array] = residual_probs) -> Verdict:
    """The sampled-chain rule (see module docstring); ``tree`` must be a chain with ``q_probs``."""
    b, n, v = logits.shape
    flat_sp = jax.tree_util.tree_map(lambda a: jnp.repeat(a, n, axis=0), sp)
    # flattened, not vmapped: under vmap the sampling fast path's conditionals become selects (both run)
    p = target_probs(logits.reshape(b * n, v), flat_sp).reshape(b, n, v)  # [B, N, V]
    q = tree.q_probs  # [B, N-1, V]
    drafts = tree.tokens[:, 1:]
    p_x = jnp.take_along_axis(p[:, :-1], drafts[:, :, None], axis=2)[:, :, 0]
    q_x = jnp.take_along_axis(q, drafts[:, :, None], axis=2)[:, :, 0]
    k_accept, k_out = jax.vmap(lambda k: jax.random.split(k))(keys).transpose(1, 0, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (n - 1,)))(k_accept)
    ok = (u * q_x < p_x) & tree.valid[:, 1:]  # u < p/q without dividing by q = 0
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # leading accepted drafts
    n_valid = jnp.sum(tree.valid[:, 1:], axis=1)
    p_stop = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # target dist after the path
    q_stop = jnp.take_along_axis(q, jnp.minimum(n_acc, n - 2)[:, None, None], axis=1)[:, 0]
    out_dist = jnp.where((n_acc < n_valid)[:, None], residual(p_stop, q_stop), p_stop)
    bonus = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(k_out, out_dist).astype(jnp.int32)
    greedy = argmax_last(out_dist)
    bonus = jnp.where(sp.temperature > 0, bonus, greedy)
    node = n_acc  # chain slots are depths
    return Verdict(path=_path_to(tree, node, max_depth), n_path=n_acc + 1, bonus=bonus)
