"""`sps`: standard speculative decoding with an independent small draft LM of the same tokenizer.

The draft model keeps its own KV cache over the verified sequence. Each round it first catches up on
the tokens verified since its last round (one forward over at most 2 tokens: the bonus token and,
when every draft was accepted, the last draft; its last position gives the first draft distribution), then drafts a chain autoregressively. Greedy rows
draft the argmax (a deterministic chain); sampling rows draw from the draft's temperature/top-k/top-p
adjusted distribution and are verified with the min(1, p/q) rule. Draft keys/values of drafted tokens
that the target accepts are kept, so accepted drafts are never recomputed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from hsdjax.config import ModelConfig
from hsdjax.drafters.base import DraftCost, Drafter, layer_macs
from hsdjax.errors import HsdjaxError
from hsdjax.model import KVCache, Transformer, causal_mask, commit, init_cache
from hsdjax.sampling import select_tokens, target_probs
from hsdjax.tree import chain


@struct.dataclass
class DraftLMState:
    cache: KVCache  # the draft model's cache over the verified sequence (plus drafts during a round)


@dataclasses.dataclass(frozen=True)
class DraftLMDrafter(Drafter):
    name: str = "sps"
    draft_cfg: ModelConfig | None = None
    depth: int = 4
    sampled_chain: bool = True

    def __post_init__(self):
        object.__setattr__(self, "num_nodes", 1 + self.depth)
        object.__setattr__(self, "max_depth", self.depth)

    def _model(self) -> Transformer:
        return Transformer(self.draft_cfg)

    def init_state(self, dparams, gen, prompt_fwd):
        b, s = gen.seq.shape
        prompt = gen.seq[:, : prompt_fwd["hidden"].shape[1]]
        p = prompt.shape[1]
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        fwd = self._model().apply({"params": dparams}, prompt, positions, causal_mask(gen.prompt_len, p))
        cache = commit(init_cache(self.draft_cfg, b, s), fwd["k"], fwd["v"], positions, gen.prompt_len)
        return DraftLMState(cache=cache)

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
        drafts, qs = [], []
        for d in range(self.depth):
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, d))(keys)
            token = select_tokens(logits, gen.sampling, step_keys)
            drafts.append(token)
            qs.append(target_probs(logits, gen.sampling))
            if d + 1 < self.depth:
                cache, logits = self._step(dparams, cache, token[:, None], jnp.ones((b,), jnp.int32))
        tree = chain(gen.last_token(), jnp.stack(drafts, axis=1), q_probs=jnp.stack(qs, axis=1))
        tokens = catch_up + self.depth - 1  # positions the draft model computed this round
        macs = tokens * self._token_macs(gen.seq_len.astype(jnp.float32) + self.depth)
        return tree, DraftLMState(cache=cache), DraftCost.of(jnp.full((b,), self.depth, jnp.int32), macs=macs)

    def _token_macs(self, keys):
        """One token through the draft model (every layer, then the full-vocabulary head)."""
        c = self.draft_cfg
        per_layer = layer_macs(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, keys)
        return c.num_layers * per_layer + c.hidden_size * c.vocab_size

    def observe(self, dparams, state, gen_before, gen_after, verdict, path_states):
        # The draft cache holds the verified prefix and drafts 1..depth-1; keep the accepted ones.
        kept = gen_before.seq_len + jnp.minimum(verdict.n_path - 1, self.depth - 1)
        length = jnp.where(gen_before.done, state.cache.length, jnp.minimum(kept, gen_after.seq_len))
        return DraftLMState(cache=state.cache.replace(length=length))


def check_draft_compatible(target: Any, draft: Any) -> None:
    """A draft LM must share the target's tokenizer (same vocabulary, same token strings)."""
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise HsdjaxError(f"draft model {draft.name} has vocabulary {draft.cfg.vocab_size}, target {target.name} "
                          f"has {target.cfg.vocab_size}: sps needs a draft model of the same tokenizer")
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    probe = range(0, target.cfg.vocab_size, max(1, target.cfg.vocab_size // 997))
    if any(t_tok.id_to_token(i) != d_tok.id_to_token(i) for i in probe):
        raise HsdjaxError(f"draft model {draft.name} does not share {target.name}'s tokenizer")
