"""`sps`: standard speculative decoding with an independent small draft LM of the same tokenizer.

The draft model keeps its own KV cache over the verified sequence. Each round it first catches up on
the tokens verified since its last round (one forward over at most 2 tokens: the bonus token and,
when every draft was accepted, the last draft; its last position gives the first draft distribution), then drafts a chain autoregressively. Greedy rows
draft the argmax (a deterministic chain); sampling rows draw from the draft's temperature/top-k/top-p
adjusted distribution and are verified with the min(1, p/q) rule. Draft keys/values of drafted tokens
that the target accepts are kept, so accepted drafts are never recomputed.

Draft length: ``fixed`` drafts ``depth`` tokens every round. ``adaptive`` keeps a length per row that
follows the row's recent acceptance, as transformers' assisted generation does: it starts at half of
``depth``, grows by 2 after a round whose drafts were all accepted and shrinks by 1 after any other
(between 1 and ``depth``); a round drafts as long as its longest row needs (a ``while_loop``) and is
verified at the smallest pass size (``tiers``) holding every row's chain.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int

from hsdjax.core.drafters.base import DraftCost, Drafter, layer_macs
from hsdjax.core.sampling import select_tokens, target_probs
from hsdjax.core.tree import chain
from hsdjax.errors import HsdjaxError
from hsdjax.runtime.config import ModelConfig
from hsdjax.runtime.model import KVCache, Transformer, causal_mask, commit, init_cache

DRAFT_LENGTHS = ("fixed", "adaptive")


@struct.dataclass
class DraftLMState:
    cache: KVCache  # the draft model's cache over the verified sequence (plus drafts during a round)
    length: Int[Array, " B"]  # drafts the next round proposes per row (``depth`` when fixed)


@dataclasses.dataclass(frozen=True)
class DraftLMDrafter(Drafter):
    name: str = "sps"
    draft_cfg: ModelConfig | None = None
    depth: int = 4
    sampled_chain: bool = True
    draft_length: str = "fixed"  # or "adaptive" (see the module doc)

    def __post_init__(self):
        if self.draft_length not in DRAFT_LENGTHS:
            raise HsdjaxError(f"unknown draft length {self.draft_length!r}; available: {', '.join(DRAFT_LENGTHS)}")
        object.__setattr__(self, "num_nodes", 1 + self.depth)
        object.__setattr__(self, "max_depth", self.depth)
        if self.adaptive:  # verify short chains at short passes: 2, 3, 5, 9, ... nodes
            object.__setattr__(self, "tiers", tuple(1 + 2**i for i in range(self.depth.bit_length())
                                                    if 1 + 2**i < self.num_nodes))

    @property
    def adaptive(self) -> bool:
        return self.draft_length == "adaptive"

    @property
    def start_length(self) -> int:
        return max(1, self.depth // 2) if self.adaptive else self.depth

    def _model(self) -> Transformer:
        return Transformer(self.draft_cfg)

    def init_state(self, dparams, gen, prompt_states):
        b, s = gen.seq.shape
        prompt = gen.seq[:, : prompt_states.hidden.shape[1]]
        p = prompt.shape[1]
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        fwd = self._model().apply({"params": dparams}, prompt, positions, causal_mask(gen.prompt_len, p))
        cache = commit(init_cache(self.draft_cfg, b, s), fwd["k"], fwd["v"], positions, gen.prompt_len)
        return DraftLMState(cache=cache, length=jnp.full((b,), self.start_length, jnp.int32))

    def _step(self, dparams, cache, tokens, lengths):
        """Feed ``tokens[b, :lengths[b]]`` after the cache; commit them; logits at the last one."""
        b, t = tokens.shape
        model = self._model()
        positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        fwd = model.apply({"params": dparams}, tokens, positions, causal_mask(lengths, t), cache)
        cache = commit(cache, fwd["k"], fwd["v"], jnp.broadcast_to(jnp.arange(t), (b, t)), lengths)
        last = jnp.take_along_axis(fwd["hidden"], (lengths - 1)[:, None, None], axis=1)[:, 0]
        return cache, model.apply({"params": dparams}, last, method=Transformer.logits)

    def propose(self, dparams, state: DraftLMState, gen):
        cache = state.cache
        b, s = gen.seq.shape
        catch_up = 2  # the last draft (never fed to the draft model) and the bonus, at most
        behind = gen.seq_len - cache.length  # verified tokens the draft has not consumed (>= 1)
        idx = (cache.length[:, None] + jnp.arange(catch_up)[None, :]).clip(0, s - 1)
        cache, logits = self._step(dparams, cache, jnp.take_along_axis(gen.seq, idx, axis=1),
                                   jnp.clip(behind, 1, catch_up))
        keys = jax.vmap(jax.random.fold_in)(gen.keys, gen.seq_len + 7919)  # independent of the target's

        def draw(d, logits):
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, d))(keys)
            return select_tokens(logits, gen.sampling, step_keys), target_probs(logits, gen.sampling)

        if self.adaptive:
            drafts, qs, cache = self._draft_while(dparams, cache, logits, draw, state.length, gen.done)
            length = state.length
        else:
            drafts, qs = [], []
            for d in range(self.depth):
                token, q = draw(d, logits)
                drafts.append(token)
                qs.append(q)
                if d + 1 < self.depth:
                    cache, logits = self._step(dparams, cache, token[:, None], jnp.ones((b,), jnp.int32))
            drafts, qs, length = jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), None
        tree = chain(gen.last_token(), drafts, length=length, q_probs=qs)
        drafted = state.length  # drafts per row; the draft model computed catch_up + drafted - 1 positions
        macs = (catch_up + drafted - 1) * self._token_macs(gen.seq_len.astype(jnp.float32) + drafted)
        return tree, state.replace(cache=cache), DraftCost.of(drafted, macs=macs)

    def _draft_while(self, dparams, cache, logits, draw, length, done):
        """Drafts 0 .. max(length) - 1 of every row (one draft-model step between two), in a
        ``while_loop`` that stops at the longest chain any unfinished row wants."""
        b = length.shape[0]
        longest = jnp.max(jnp.where(done, 1, length))
        token, q = draw(0, logits)
        drafts = jnp.zeros((b, self.depth), jnp.int32).at[:, 0].set(token)
        qs = jnp.zeros((b, self.depth, q.shape[-1]), q.dtype).at[:, 0].set(q)

        def body(carry):
            d, cache, drafts, qs = carry
            cache, logits = self._step(dparams, cache, drafts[:, d - 1][:, None], jnp.ones((b,), jnp.int32))
            token, q = draw(d, logits)
            return d + 1, cache, drafts.at[:, d].set(token), qs.at[:, d].set(q)

        _, cache, drafts, qs = jax.lax.while_loop(lambda c: c[0] < longest, body, (jnp.int32(1), cache, drafts, qs))
        return drafts, qs, cache

    def _token_macs(self, keys):
        """One token through the draft model (every layer, then the full-vocabulary head)."""
        c = self.draft_cfg
        per_layer = layer_macs(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, keys)
        return c.num_layers * per_layer + c.hidden_size * c.vocab_size

    def observe(self, dparams, state, gen_before, gen_after, verdict, path_states):
        # The draft cache holds the verified prefix and the drafts fed back (all but the row's last);
        # keep the accepted ones.
        accepted = verdict.n_path - 1
        kept = gen_before.seq_len + jnp.minimum(accepted, state.length - 1)
        cache_len = jnp.where(gen_before.done, state.cache.length, jnp.minimum(kept, gen_after.seq_len))
        length = state.length
        if self.adaptive:
            grown = jnp.where(accepted >= state.length, state.length + 2, state.length - 1)
            length = jnp.where(gen_before.done, state.length, jnp.clip(grown, 1, self.depth))
        return DraftLMState(cache=state.cache.replace(length=cache_len), length=length)


def check_draft_compatible(target: Any, draft: Any) -> None:
    """A draft LM must share the target's tokenizer (same vocabulary, same token strings)."""
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise HsdjaxError(f"draft model {draft.name} has vocabulary {draft.cfg.vocab_size}, target {target.name} "
                          f"has {target.cfg.vocab_size}: sps needs a draft model of the same tokenizer")
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    probe = range(0, target.cfg.vocab_size, max(1, target.cfg.vocab_size // 997))
    if any(t_tok.id_to_token(i) != d_tok.id_to_token(i) for i in probe):
        raise HsdjaxError(f"draft model {draft.name} does not share {target.name}'s tokenizer")
