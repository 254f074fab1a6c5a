"""`hsd`: hidden-state drafting with late token injection and draft reuse (the headline method).

The chain (one decoder layer) predicts the target's next hidden states from the fused states of the
verified context and from its own predictions, never from a token. ``chain[j]`` is the guess for
the state at position ``root + j``. A tree is grown by injection: the children of a depth-d node
come from ``g(chain[d], embeddings of the node's token and its parent's)`` through the head, all
nodes of a depth in one batched call, so the chain runs once per depth, not per node.

After verification accepts ``a`` drafts, the verified states are ingested (one layer pass, whose
last output is a fresh guess for the new root position; with ``root_token`` each verified position's
input also carries its next token, known once verified, the new root included, as ``eagle``'s does,
while the chain's own steps stay token-free; with ``chain_layer`` those steps run a second layer of
their own, so the first is trained on verified inputs alone; with ``chain_g`` the nodes below depth
1, which read chain states, go through a ``g`` and output norms of their own) and the chain is
shifted by ``a + 1``: its states beyond the accepted path are still guesses for the positions that
follow, so the next round reuses them and only extends the chain by the missing depths (the fresh
root state's keys replace those of the old guess it stands in for, as in training, where each
rollout step attends to the keys of the step before). With ``ahead`` > 0 the chain runs that many
states past the tree's depth, so that states survive a partial acceptance too (they are drafted once
and read by later rounds). The refresh policy decides when to throw the kept states away instead:
``reuse`` (never), ``refresh`` (always), or ``minN`` (when fewer than N kept states remain).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from hsdjax.core.drafters.base import DraftCost
from hsdjax.core.drafters.dynamic_tree import frontiers_expanded, grow_tree
from hsdjax.core.drafters.feature import (
    FeatureDrafter,
    FeatureDrafterNet,
    attend_and_finish,
    context_read,
    ingest,
    ingest_path,
    init_context,
)
from hsdjax.errors import HsdjaxError

POLICIES = ("reuse", "refresh", "min1", "min2", "min3")


@struct.dataclass
class HSDState:
    ctx: dict[str, Array]  # drafter keys/values of the verified context, by position
    chain: Float[Array, "B C W"]  # chain[j]: predicted state at position ctx.len + j
    chain_k: Float[Array, "B C K D"]  # keys/values of chain[j] as the layer input at that position
    chain_v: Float[Array, "B C K D"]
    n_chain: Int[Array, " B"]  # valid chain states (>= 1)
    fresh: Int[Array, "B C"]  # 1 where the state was computed in the current round


@dataclasses.dataclass(frozen=True)
class HSDDrafter(FeatureDrafter):
    name: str = "hsd"
    policy: str = "min2"
    ahead: int = 0  # chain states drafted beyond the tree's depth, for the rounds after a partial acceptance
    # > 0: a chain state's children are scored among the ``shortlist`` likeliest tokens of the state's own
    # token-free logits (one head per depth, shared by its nodes; needs ``dparams["head_rows"]``, the
    # draft head [V, E] unpacked): per node only ``g`` and S head rows, not the whole draft vocabulary
    shortlist: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.shortlist and (self.cfg.injection == "attn" or not 0 < self.shortlist <= self.cfg.vocab):
            raise HsdjaxError(f"an hsd shortlist needs mlp or film injection and 1..{self.cfg.vocab} candidates "
                              f"(got {self.shortlist}, {self.cfg.injection} injection)")

    # ------------------------------------------------------------------ state
    def init_state(self, dparams, gen, prompt_states):
        b, s = gen.seq.shape
        c = self.cfg
        states = prompt_states.per_position()  # [B, P, F, E]
        x = self.verified_inputs(dparams, states, self.prompt_next_tokens(gen, states.shape[1]))
        ctx, first = ingest(self._net(), dparams["net"], init_context(c, b, s), x, gen.prompt_len, empty=True)
        size = self.chain_size
        return HSDState(
            ctx=ctx, chain=jnp.zeros((b, size, c.state_width), jnp.float32).at[:, 0].set(first),
            chain_k=jnp.zeros((b, size, c.kv_heads, c.head_dim), jnp.float32),
            chain_v=jnp.zeros((b, size, c.kv_heads, c.head_dim), jnp.float32),
            n_chain=jnp.ones((b,), jnp.int32), fresh=jnp.zeros((b, size), jnp.int32).at[:, 0].set(1))

    # ------------------------------------------------------------------ chain
    @property
    def chain_size(self) -> int:
        """Chain slots: the ``depth`` states a tree reads, ``ahead`` more, and one for the shift."""
        return self.depth + self.ahead + 1

    def _chain_step(self, dparams, ctx: dict[str, Array], st: HSDState, j: int) -> HSDState:
        """chain[j+1] from chain[j] (rows whose chain is exactly j+1 long). ``st`` holds the chain
        fields only (its ``ctx`` is empty): the context cache is read, never carried through."""
        net, p = self._net(), dparams["net"]
        b = st.chain.shape[0]
        x = st.chain[:, j: j + 1]
        pos = (ctx["len"] + j)[:, None]
        q, k, v = net.apply({"params": p}, x, pos, method=FeatureDrafterNet.chain_project)
        ck = st.chain_k.at[:, j].set(k[:, 0])
        cv = st.chain_v.at[:, j].set(v[:, 0])
        local_mask = (jnp.arange(ck.shape[1]) <= j)[None, None, :].repeat(b, 0)
        out = attend_and_finish(net, p, ctx, x, q, ck, cv, local_mask, chain=True)[:, 0]
        need = st.n_chain == j + 1
        return st.replace(
            chain=jnp.where(need[:, None, None], st.chain.at[:, j + 1].set(out), st.chain),
            chain_k=jnp.where(need[:, None, None, None], ck, st.chain_k),
            chain_v=jnp.where(need[:, None, None, None], cv, st.chain_v),
            n_chain=jnp.where(need, j + 2, st.n_chain),
            fresh=jnp.where(need[:, None], st.fresh.at[:, j + 1].set(1), st.fresh))

    def _extend(self, dparams, st: HSDState, active) -> tuple[HSDState, Int[Array, " B"]]:
        """Make sure ``depth + ahead`` chain states exist; one chain step per missing state, skipped
        when no active row needs it. Returns the state and the chain steps per row."""
        steps = jnp.zeros_like(st.n_chain)
        ctx, chain = st.ctx, st.replace(ctx=())  # the conditional carries the small chain fields only
        for j in range(self.depth + self.ahead - 1):
            need = (chain.n_chain == j + 1) & active
            steps = steps + need.astype(jnp.int32)
            chain = jax.lax.cond(jnp.any(need), lambda s, j=j: self._chain_step(dparams, ctx, s, j), lambda s: s,
                                 chain)
        return chain.replace(ctx=ctx), steps

    # ------------------------------------------------------------------ rounds
    def propose(self, dparams, state: HSDState, gen):
        net, p = self._net(), dparams["net"]
        active = ~gen.done
        root = gen.last_token()
        prev = jnp.take_along_axis(gen.seq, jnp.maximum(gen.seq_len - 2, 0)[:, None], axis=1)[:, 0]
        embed, head = dparams["embed"], dparams["head"]

        def injected(state_vec, tokens, parent_tokens, d):  # [B, E], [B, K], [B, K] -> g [B, K, W]
            chain = d > 0  # a chain state's node (``chain_g``: its own g and norms)
            toks = jnp.stack([tokens, parent_tokens], axis=-1)[..., : self.cfg.inject_tokens]
            embs = net.apply({"params": p}, embed, toks, chain, method=FeatureDrafterNet.embed)
            s = jnp.broadcast_to(state_vec[:, None, :], (*tokens.shape, state_vec.shape[-1]))
            context = None
            if self.cfg.injection == "attn":  # the tokens sit at position ctx.len + d (chain[d]'s)
                pos = jnp.broadcast_to((state.ctx["len"] + d)[:, None], tokens.shape)
                q = net.apply({"params": p}, s, embs, pos, chain, method=FeatureDrafterNet.inject_query)
                context = context_read(q, state.ctx, net.backend)
            return net.apply({"params": p}, s, embs, context, chain, method=FeatureDrafterNet.inject)

        def inject_logp(state_vec, tokens, parent_tokens, d):  # -> [B, K, V]
            g = injected(state_vec, tokens, parent_tokens, d)
            return jax.nn.log_softmax(net.apply({"params": p}, g, head, d > 0, method=FeatureDrafterNet.logits),
                                      axis=-1)

        def shortlist_logp(state_vec, tokens, parent_tokens, d):  # inject_logp over a shortlist, -inf elsewhere
            chain = d > 0
            cand = jax.lax.top_k(net.apply({"params": p}, state_vec, head, chain, method=FeatureDrafterNet.logits),
                                 self.shortlist)[1]  # [B, S] draft-vocabulary indices
            g = injected(state_vec, tokens, parent_tokens, d)
            y = net.apply({"params": p}, g, chain, method=FeatureDrafterNet.head_input)  # [B, K, E]
            rows = jnp.take(dparams["head_rows"], cand, axis=0)  # [B, S, E]
            scores = jax.nn.log_softmax(jnp.einsum("bke,bse->bks", y, rows, preferred_element_type=jnp.float32), axis=-1)
            b, k = tokens.shape
            full = jnp.full((b, k, self.cfg.vocab), -jnp.inf, jnp.float32)
            return full.at[jnp.arange(b)[:, None, None], jnp.arange(k)[None, :, None], cand[:, None, :]].set(scores)

        first = inject_logp(state.chain[:, 0], root[:, None], prev[:, None], 0)[:, 0]
        grow = active
        if self.grow_prob > 0:  # deeper chain states only for rows sure enough of a first draft to go on
            grow = grow & (jnp.max(first, axis=-1) >= jnp.log(self.grow_prob))  # a child is never likelier
        st, steps = self._extend(dparams, state, grow)

        def children(d, tokens, slots, parent_idx, prev_tokens):
            parent_tokens = jnp.take_along_axis(prev_tokens, parent_idx, axis=1)
            score = shortlist_logp if self.shortlist else inject_logp
            logp = score(st.chain[:, d], tokens, parent_tokens, d)
            return jnp.where((st.n_chain > d)[:, None, None], logp, -jnp.inf), tokens  # rows not extended

        tree, cum, _ = grow_tree(root, first, children, root[:, None], dparams["vocab_ids"], self.depth,
                                 self.width, self.budget, self.min_prob, self.grow_prob)
        used_depths = jnp.max(jnp.where(tree.valid, tree.depth, 0), axis=1)  # chain states the tree used
        kept = st.fresh[:, : self.depth] == 0  # chain states computed in an earlier round
        reused = jnp.sum((jnp.arange(self.depth)[None, :] < used_depths[:, None]) & kept, axis=1)
        # a depth-d node is drafted from chain state d - 1
        from_kept = jnp.take_along_axis(kept, jnp.clip(tree.depth - 1, 0, self.depth - 1), axis=1)
        tree = tree.replace(reused=tree.valid & (tree.depth > 0) & from_kept)
        tree = self.graft_lookup(tree, gen)
        # g + head for the root and each depth's frontier that was drafted
        frontiers = frontiers_expanded(cum, self.depth, self.width, self.grow_prob)
        heads = 1 + frontiers * self.width
        node_head = self._head_macs()
        if self.shortlist:  # the root's full head, one per expanded depth, then S rows a node
            node_head = (1 + frontiers) * self._head_macs() / heads + self.shortlist * self.cfg.hidden
        macs = (steps * self._layer_macs(gen.seq_len.astype(jnp.float32) + self.depth + self.ahead)
                + heads * (self._inject_macs(gen.seq_len.astype(jnp.float32)) + node_head))
        # +1 pass: the ingest after verification
        cost = DraftCost(passes=steps + 1, states=steps + 1, reused=reused, macs=macs.astype(jnp.float32))
        return tree, st.replace(fresh=jnp.zeros_like(st.fresh)), cost

    def observe_macs(self, gen_before, n_path):
        """The ingest, plus the root state's key/value projection when the chain is kept (depth > 1)."""
        c = self.cfg
        rekey = (self.depth + self.ahead > 1) * c.state_width * 2 * c.kv_heads * c.head_dim
        return super().observe_macs(gen_before, n_path) + jnp.where(gen_before.done, 0.0, float(rekey))

    def observe(self, dparams, state: HSDState, gen_before, gen_after, verdict, path_states):
        net, p = self._net(), dparams["net"]
        active = ~gen_before.done
        count = jnp.where(active, verdict.n_path, 0)
        fused = path_states.per_position()  # [B, P, F, E]
        next_tokens = self.path_next_tokens(gen_before, gen_after, fused.shape[1])
        inputs = lambda n: self.verified_inputs(dparams, fused[:, :n], next_tokens[:, :n])  # noqa: E731
        ctx, fresh_state = ingest_path(net, p, state.ctx, inputs, count, fused.shape[1])
        # shift the chain by the advance; the fresh ingest output replaces the kept guess for the root
        size = state.chain.shape[1]
        idx = jnp.arange(size)[None, :] + count[:, None]
        take = lambda a: jnp.take_along_axis(a, jnp.minimum(idx, size - 1).reshape(*idx.shape, *([1] * (a.ndim - 2))),  # noqa: E731
                                             axis=1)
        kept = jnp.maximum(state.n_chain - count, 0)
        n_chain = jnp.maximum(kept, 1)
        if self.policy == "refresh":
            n_chain = jnp.ones_like(n_chain)
        elif self.policy.startswith("min"):
            n_chain = jnp.where(kept - 1 >= int(self.policy[3:]), n_chain, 1)
        chain_k, chain_v = take(state.chain_k), take(state.chain_v)
        if self.depth + self.ahead > 1:  # kept chain states are extended from the fresh root state: give it its own keys
            _, k0, v0 = net.apply({"params": p}, fresh_state[:, None], ctx["len"][:, None],
                                  method=FeatureDrafterNet.chain_project)
            chain_k, chain_v = chain_k.at[:, 0].set(k0[:, 0]), chain_v.at[:, 0].set(v0[:, 0])
        new = HSDState(ctx=ctx, chain=take(state.chain).at[:, 0].set(fresh_state), chain_k=chain_k,
                       chain_v=chain_v, n_chain=n_chain, fresh=jnp.zeros_like(state.fresh).at[:, 0].set(1))
        # finished rows ingest nothing (count 0): only their small chain fields need restoring
        keep_old = lambda a, b: jnp.where(active.reshape(-1, *([1] * (a.ndim - 1))), b, a)  # noqa: E731
        chain = jax.tree_util.tree_map(keep_old, state.replace(ctx=()), new.replace(ctx=()))
        return chain.replace(ctx=ctx)
