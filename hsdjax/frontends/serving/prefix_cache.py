"""Prefix reuse for the server: prompts' leading token blocks kept on the device, found again by hash.

A prompt is cut into blocks of ``BLOCK`` tokens. Block i is named by a chained digest: SHA-256 over
the digest of block i - 1 and block i's token ids, so one name stands for the whole prefix up to the
end of that block (the hashed block chain vLLM uses; no radix tree to keep consistent). Each stored
block holds, for its positions, what a later prompt with the same prefix needs so that it need not
run them again: the target's keys and values of every layer, and the target states the drafter reads
(``engine.PromptFill``'s ``hidden`` and ``layers``), so feature drafters start from the same states
as without reuse.

Blocks live in one preallocated pool of ``capacity`` blocks (the memory budget, fixed when the server
starts); the table of names is kept in least-recently-used order, and a new block takes a free slot
or evicts the least recently used one. A lookup touches the matched chain from its last block to its
first, so a prefix's first blocks are the last of it to go. Nothing is ever pinned: the scheduler
thread loads a match into a request's ``PromptFill`` at once (one jitted copy) and stores a prompt's
blocks when its prefill completes, so a cancelled, failed or oversized request leaves nothing behind.
Only whole blocks of the prompt are stored, and a match always leaves at least the prompt's last token
to run (its logits give the first new token).
"""

from __future__ import annotations

import collections
import hashlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from hsdjax.core.engine import PromptFill
from hsdjax.runtime.config import ModelConfig

BLOCK = 32  # tokens per block: the smallest prompt piece, so a reused prefix ends where a piece starts


@struct.dataclass
class BlockPool:
    """The stored blocks: keys/values [L, N, K, BLOCK, D] and drafter states (``hidden`` [N, BLOCK, E],
    ``layers`` [F, N, BLOCK, E] or None) of N block slots."""

    k: Float[Array, "L N K T D"]
    v: Float[Array, "L N K T D"]
    hidden: Float[Array, "N T E"]
    layers: Float[Array, "F N T E"] | None


def block_bytes(cfg: ModelConfig, layers: int) -> int:
    """Device memory of one block."""
    item = jnp.dtype(cfg.dtype).itemsize
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    return BLOCK * item * (kv + (1 + layers) * cfg.hidden_size)


def _cache_layers(cache_part: Any) -> Array:
    """A cache's keys or values as one stacked [L, B, K, S, D] array (either layout)."""
    return jnp.stack(cache_part) if isinstance(cache_part, tuple) else cache_part


@partial(jax.jit, donate_argnames=("pool",))
def _save(pool: BlockPool, fill: PromptFill, source: Int[Array, " M"], slots: Int[Array, " M"]) -> BlockPool:
    """Copy blocks ``source[i]`` (block index within row 0 of ``fill``) into pool slots ``slots[i]``
    (a slot out of range drops that entry)."""
    def blocks(x: Array, axis: int) -> Array:  # [..., S, ...] -> [..., M, BLOCK, ...] at the chosen blocks
        m = source.shape[0]
        idx = source[:, None] * BLOCK + jnp.arange(BLOCK)[None, :]  # [M, BLOCK]
        taken = jnp.take(x, idx.reshape(-1), axis=axis)
        return taken.reshape(*x.shape[:axis], m, BLOCK, *x.shape[axis + 1:])

    k = blocks(_cache_layers(fill.cache.k)[:, 0], 2)  # [L, K, M, BLOCK, D]
    v = blocks(_cache_layers(fill.cache.v)[:, 0], 2)
    put = lambda dst, upd, axis: dst.at[(slice(None),) * axis + (slots,)].set(upd.astype(dst.dtype), mode="drop")  # noqa: E731
    out = pool.replace(k=put(pool.k, jnp.moveaxis(k, 2, 1), 1), v=put(pool.v, jnp.moveaxis(v, 2, 1), 1),
                       hidden=put(pool.hidden, blocks(fill.hidden[0], 0), 0))
    if pool.layers is not None:
        out = out.replace(layers=put(pool.layers, blocks(fill.layers[:, 0], 1), 1))
    return out


@partial(jax.jit, donate_argnames=("fill",))
def _load(pool: BlockPool, fill: PromptFill, slots: Int[Array, " M"], count: Int[Array, ""]) -> PromptFill:
    """Row 0 of ``fill`` starts from the first ``count`` of pool blocks ``slots`` (M >= count; the
    rest is padding whose copies the cache length masks and the next piece overwrites)."""
    m = slots.shape[0]
    n = m * BLOCK

    def chain(x: Array, axis: int) -> Array:  # states [..., N, BLOCK, E] -> [..., M * BLOCK, E]
        taken = jnp.take(x, slots, axis=axis)
        return taken.reshape(*x.shape[:axis], n, *x.shape[axis + 2:])

    def into(buf: Array, upd: Array, axis: int) -> Array:  # rows on axis - 1; positions on axis
        index = (slice(None),) * (axis - 1) + (0,) + (slice(0, n),)
        return buf.at[index].set(upd.astype(buf.dtype))

    def kv_chain(x: Array) -> Array:  # pool [L, N, K, BLOCK, D] -> [L, K, M * BLOCK, D]
        taken = jnp.moveaxis(jnp.take(x, slots, axis=1), 1, 2)  # [L, K, M, BLOCK, D]
        return taken.reshape(x.shape[0], x.shape[2], n, x.shape[4])

    k, v = kv_chain(pool.k), kv_chain(pool.v)
    cache = fill.cache
    if isinstance(cache.k, tuple):
        ck = tuple(c.at[0, :, :n].set(k[i].astype(c.dtype)) for i, c in enumerate(cache.k))
        cv = tuple(c.at[0, :, :n].set(v[i].astype(c.dtype)) for i, c in enumerate(cache.v))
    else:
        ck, cv = cache.k.at[:, 0, :, :n].set(k.astype(cache.k.dtype)), cache.v.at[:, 0, :, :n].set(v.astype(cache.v.dtype))
    cache = cache.replace(k=ck, v=cv, length=cache.length.at[0].set(count * BLOCK))
    out = fill.replace(cache=cache, hidden=into(fill.hidden, chain(pool.hidden, 0), 1))
    if fill.layers is not None:
        out = out.replace(layers=into(fill.layers, chain(pool.layers, 1), 2))
    return out


def _padded(ids: list[int], fill_value: int) -> np.ndarray:
    """``ids`` padded to a power of two (so few programs compile), with ``fill_value``."""
    size = 1
    while size < len(ids):
        size *= 2
    out = np.full((size,), fill_value, np.int32)
    out[: len(ids)] = ids
    return out


class PrefixCache:
    """Prompt prefixes by chained block digest -> pool slots, in LRU order (see the module doc)."""

    def __init__(self, cfg: ModelConfig, capacity: int, layers: int = 0):
        if capacity < 1:
            raise ValueError("a prefix cache needs at least one block")
        self.capacity = capacity
        dt = jnp.dtype(cfg.dtype)
        kv = (cfg.num_layers, capacity, cfg.num_kv_heads, BLOCK, cfg.head_dim)
        self.pool = BlockPool(k=jnp.zeros(kv, dt), v=jnp.zeros(kv, dt),
                              hidden=jnp.zeros((capacity, BLOCK, cfg.hidden_size), dt),
                              layers=jnp.zeros((layers, capacity, BLOCK, cfg.hidden_size), dt) if layers else None)
        self.bytes = block_bytes(cfg, layers) * capacity
        self._table: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest first
        self._free = list(range(capacity - 1, -1, -1))
        self.hits = self.lookups = 0

    @property
    def used(self) -> int:
        """Blocks holding a stored prefix."""
        return len(self._table)

    def clear(self) -> None:
        """Forget every stored block."""
        self._table.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    @staticmethod
    def digests(tokens: list[int], blocks: int) -> list[bytes]:
        """The chained digests of the first ``blocks`` whole blocks of ``tokens``."""
        out, prev = [], b""
        ids = np.asarray(tokens[: blocks * BLOCK], np.int64)
        for i in range(blocks):
            prev = hashlib.sha256(prev + ids[i * BLOCK: (i + 1) * BLOCK].tobytes()).digest()
            out.append(prev)
        return out

    def match(self, tokens: list[int]) -> list[int]:
        """Pool slots of the longest stored prefix of ``tokens`` (whole blocks, leaving at least the
        last token to run), most recently used from now on."""
        self.lookups += 1
        found = []
        for d in self.digests(tokens, (len(tokens) - 1) // BLOCK):
            slot = self._table.get(d)
            if slot is None:
                break
            found.append((d, slot))
        for d, _ in reversed(found):  # the first blocks end up the most recent
            self._table.move_to_end(d)
        if found:
            self.hits += 1
        return [slot for _, slot in found]

    def load(self, fill: PromptFill, slots: list[int]) -> PromptFill:
        """``fill`` (one row, nothing filled) starting from the matched blocks."""
        if not slots:
            return fill
        return _load(self.pool, fill, jnp.asarray(_padded(slots, slots[-1])), jnp.int32(len(slots)))

    def store(self, tokens: list[int], fill: PromptFill, filled: int) -> int:
        """Keep the whole blocks of ``tokens`` among the first ``filled`` positions of row 0 of ``fill``
        that are not stored yet; returns how many blocks were added."""
        digests = self.digests(tokens, min(filled, len(tokens)) // BLOCK)
        source, slots, added = [], [], set()
        for i, d in enumerate(digests):
            if d in self._table:
                continue
            if self._free:
                slot = self._free.pop()
            elif next(iter(self._table)) in added:
                break  # the budget is full of this prompt's own first blocks: keep those
            else:
                _, slot = self._table.popitem(last=False)  # the least recently used block goes
            self._table[d] = slot
            added.add(d)
            source.append(i)
            slots.append(slot)
        for d in reversed(digests):  # as in ``match``: the first blocks are the most recent
            if d in self._table:
                self._table.move_to_end(d)
        if source:
            self.pool = _save(self.pool, fill, jnp.asarray(_padded(source, 0)),
                              jnp.asarray(_padded(slots, self.capacity)))
        return len(source)
