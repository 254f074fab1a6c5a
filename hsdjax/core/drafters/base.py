"""The drafter interface every method implements, and `ar` (no drafting) as its simplest case.

A drafter is a frozen dataclass of static settings (hashable: it is a static argument of the jitted
loop) whose methods are pure functions traced inside the loop. Its learnable or model state (draft
LM weights, a trained drafter's params) is passed separately as ``dparams``; its per-generation state
(caches, reusable chain states) is an explicit pytree carried by the loop.

    init_state(dparams, gen, prompt_states) -> state
    propose(dparams, state, gen) -> (tree, state, cost)
    observe(dparams, state, gen_before, gen_after, verdict, path_states) -> state

``propose`` returns a ``DraftTree`` whose root is the newest token and the round's ``DraftCost`` per
row (drafter passes, drafter states computed, states reused from earlier rounds); ``observe`` sees
the verdict and the target's states along the accepted path (a ``TargetStates``, as ``init_state``
gets for the prompt), so feature drafters can extend their context. Drafters that read per-layer
states name the layers in ``prompt_layers``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from hsdjax.core.tree import DraftTree, root_only


@struct.dataclass
class TargetStates:
    """The target's states a drafter receives: at the prompt's positions (``init_state``) or at the
    accepted path's nodes, root first (``observe``)."""

    hidden: Float[Array, "B T E"]  # final-normed: what the LM head reads
    layers: Float[Array, "F B T E"] | None = None  # the drafter's ``prompt_layers`` states, in that order

    def per_position(self) -> Float[Array, "B T F E"]:
        """``layers`` with each position's F states side by side (what a feature drafter fuses)."""
        return jnp.moveaxis(self.layers, 0, 2)

    def first_positions(self, n: int) -> "TargetStates":
        """The states of the first ``n`` positions (e.g. a prompt bucket's)."""
        return TargetStates(hidden=self.hidden[:, :n], layers=None if self.layers is None else self.layers[:, :, :n])

    def take_rows(self, rows: Int[Array, " N"]) -> "TargetStates":
        return TargetStates(hidden=jnp.take(self.hidden, rows, axis=0),
                            layers=None if self.layers is None else jnp.take(self.layers, rows, axis=1))


@struct.dataclass
class DraftCost:
    """What one round of drafting cost, per row. ``passes``: calls of the drafter's network (a layer
    stack over any number of inputs), including the ingest that follows verification; ``states``:
    drafter states computed that can carry a draft (for ``eagle`` every tree node its layer processed,
    for ``hsd`` every chain state, for ``sps`` every drafted token); ``reused``: states used by this
    round's tree that were computed in an earlier round; ``macs``: the multiply-adds of the drafting
    work in ``propose`` (weights and attention; the ingest after verification is
    ``Drafter.observe_macs``), one unit of work for every method alike."""

    passes: Int[Array, " B"]
    states: Int[Array, " B"]
    reused: Int[Array, " B"]
    macs: Float[Array, " B"]

    @classmethod
    def of(cls, passes: Int[Array, " B"], states: Int[Array, " B"] | None = None,
           macs: Float[Array, " B"] | None = None) -> "DraftCost":
        passes = passes.astype(jnp.int32)
        return cls(passes=passes, states=passes if states is None else states.astype(jnp.int32),
                   reused=jnp.zeros_like(passes),
                   macs=jnp.zeros(passes.shape, jnp.float32) if macs is None else macs.astype(jnp.float32))


def layer_macs(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int, keys: Any) -> Any:
    """Multiply-adds of one token through a pre-norm decoder layer attending to ``keys`` keys."""
    projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * mlp
    return projections + 2 * heads * head_dim * keys


@dataclasses.dataclass(frozen=True)
class Drafter(abc.ABC):
    """Base class. Subclasses set ``num_nodes`` (tree slots incl. the root) and ``max_depth``."""

    name: str = "ar"
    num_nodes: int = 1
    max_depth: int = 0
    sampled_chain: bool = False  # tokens sampled from q_probs: verify with the min(1, p/q) rule
    tiers: tuple[int, ...] = ()  # smaller tree sizes to verify at when few nodes are valid

    @property
    def spare(self) -> int:
        """Cache / sequence slots one round may touch beyond the current length."""
        return self.num_nodes + self.max_depth + 2

    @property
    def prompt_layers(self) -> tuple[int, ...]:
        """Target states (indices into the forward's L+1 ``layers``) that ``init_state`` reads for the
        prompt and ``observe`` for the accepted path (both get them stacked in this order)."""
        return ()

    @property
    def max_valid_nodes(self) -> int:
        """The most valid nodes a proposed tree can hold, root included (the largest pass needed)."""
        return self.num_nodes

    def init_state(self, dparams: Any, gen: Any, prompt_states: TargetStates) -> Any:
        """The per-generation state, from the prompt's target states."""
        return ()

    @abc.abstractmethod
    def propose(self, dparams: Any, state: Any, gen: Any) -> tuple[DraftTree, Any, DraftCost]:
        """The next tree (root = ``gen.last_token()``), the new state, the round's cost per row."""

    def observe(self, dparams: Any, state: Any, gen_before: Any, gen_after: Any, verdict: Any,
                path_states: TargetStates) -> Any:
        """Update after verification, from the target's states at the accepted path's nodes (root
        first; ``layers`` only for drafters with ``prompt_layers``)."""
        return state

    def observe_macs(self, gen_before: Any, n_path: Int[Array, " B"]) -> Float[Array, " B"]:
        """Multiply-adds ``observe`` spends on a verified path of ``n_path`` tokens (0 by default)."""
        return jnp.zeros(n_path.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ARDrafter(Drafter):
    """Plain autoregressive decoding: the tree is the root alone, so each round emits one token."""

    def propose(self, dparams, state, gen):
        root = gen.last_token()
        return root_only(root), state, DraftCost.of(jnp.zeros_like(root))
