"""`eagle`: the token-conditioned feature drafter baseline (EAGLE-2/3's idea, our implementation).

The layer's input is ``fc([feature; embedding of the next token])``: the fused target state of a
verified position, or the layer's own output for a drafted one. Every node of the draft tree needs
its own pass of the layer (its token enters the input), so a tree of depth D costs D-1 layer passes
over the frontier (with tree attention among a node's ancestors), plus one pass that ingests the
verified path. It shares the network, head, tree builder and training data with `hsd` and has no
reuse: it exists to measure what hidden-state drafting adds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float

from hsdjax.core.drafters.base import DraftCost
from hsdjax.core.drafters.dynamic_tree import frontiers_expanded, grow_tree
from hsdjax.core.drafters.feature import (
    FeatureDrafter,
    FeatureDrafterNet,
    attend_and_finish,
    ingest,
    ingest_path,
    init_context,
)


@struct.dataclass
class EagleState:
    ctx: dict[str, Array]
    root_out: Float[Array, "B W"]  # the layer's output at the last verified position


@dataclasses.dataclass(frozen=True)
class EagleDrafter(FeatureDrafter):
    name: str = "eagle"

    def init_state(self, dparams, gen, prompt_states):
        b, s = gen.seq.shape
        states = prompt_states.per_position()  # [B, P, F, E]
        p_len = states.shape[1]
        x = self.verified_inputs(dparams, states, self.prompt_next_tokens(gen, p_len))
        ctx, last = ingest(self._net(), dparams["net"], init_context(self.cfg, b, s), x, gen.prompt_len, empty=True)
        return EagleState(ctx=ctx, root_out=last)

    def propose(self, dparams, state: EagleState, gen):
        net, p = self._net(), dparams["net"]
        c = self.cfg
        b = gen.seq.shape[0]
        k, depth = self.width, self.depth
        m = max(depth - 1, 1) * k  # local slots: the processed frontier nodes of depths 1 .. D-1
        head = dparams["head"]

        def logp_of(out):
            return jax.nn.log_softmax(net.apply({"params": p}, out, head, method=FeatureDrafterNet.logits), axis=-1)

        first = logp_of(state.root_out)
        root = gen.last_token()
        local = (jnp.zeros((b, m, c.kv_heads, c.head_dim), jnp.float32),) * 2

        def children(d, tokens, slots, parent_idx, carry):
            outs, lk, lv, anc = carry  # outputs and ancestor masks of the previous frontier
            parent_out = jnp.take_along_axis(outs, parent_idx[:, :, None], axis=1)
            parent_anc = jnp.take_along_axis(anc, parent_idx[:, :, None], axis=1)
            emb = net.apply({"params": p}, dparams["embed"], tokens, method=FeatureDrafterNet.embed)
            x = net.apply({"params": p}, parent_out, emb, method=FeatureDrafterNet.eagle_input)
            pos = jnp.broadcast_to((state.ctx["len"] + d - 1)[:, None], (b, k))
            q, kk, vv = net.apply({"params": p}, x, pos, method=FeatureDrafterNet.project)
            lo = (d - 1) * k
            lk, lv = lk.at[:, lo: lo + k].set(kk), lv.at[:, lo: lo + k].set(vv)
            own = jnp.zeros((b, k, m), bool).at[:, jnp.arange(k), lo + jnp.arange(k)].set(True)
            mask = parent_anc | own
            out = attend_and_finish(net, p, state.ctx, x, q, lk, lv, mask)
            return logp_of(out), (out, lk, lv, mask)

        carry = (state.root_out[:, None, :], *local, jnp.zeros((b, 1, m), bool))
        tree, cum, _ = grow_tree(root, first, children, carry, dparams["vocab_ids"], depth, k, self.budget,
                                 self.min_prob, self.grow_prob)
        passes = frontiers_expanded(cum, depth, k, self.grow_prob)  # frontier passes drafted (D-1 unless skipped)
        tree = self.graft_lookup(tree, gen)
        n = jnp.full((b,), passes + 1, jnp.int32)  # frontier passes + the ingest after verification
        frontier = passes * k  # nodes the layer processes (tree attention over their ancestors too)
        per_node = (c.state_width + c.hidden) * c.state_width + self._layer_macs(gen.seq_len.astype(jnp.float32) + depth)
        macs = frontier * per_node + (1 + frontier) * self._head_macs()
        cost = DraftCost(passes=n, states=1 + frontier * jnp.ones((b,), jnp.int32), reused=jnp.zeros_like(n),
                         macs=macs.astype(jnp.float32))
        return tree, state, cost

    def observe(self, dparams, state: EagleState, gen_before, gen_after, verdict, path_states):
        active = ~gen_before.done
        count = jnp.where(active, verdict.n_path, 0)
        fused = path_states.per_position()  # [B, P, F, E]
        t = fused.shape[1]
        next_tokens = self.path_next_tokens(gen_before, gen_after, t)
        inputs = lambda n: self.verified_inputs(dparams, fused[:, :n], next_tokens[:, :n])  # noqa: E731
        ctx, last = ingest_path(self._net(), dparams["net"], state.ctx, inputs, count, t)
        # finished rows ingest nothing (count 0), so their context is unchanged without a copy
        return EagleState(ctx=ctx, root_out=jnp.where(active[:, None], last, state.root_out))
