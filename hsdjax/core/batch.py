"""The running batch of a continuous batcher: one ``DecodeState`` whose rows belong to items (the
server's choices, the data recorder's conversations) or are free, held at one of a few batch sizes (one
compiled decode program each).

Rows come in from a freshly prefilled state (``place``: the state is created, or grown to a larger
size, as needed), leave when their item is done (``release``), and the busy rows are compacted into a
smaller size when they fit (``shrink``). The server's scheduler (``hsdjax.frontends.serving.scheduler``) and the
drafter-data recorder (``train.datagen.ContinuousRecorder``) both run over it, each adding only its own
policy: when to admit, when to shrink, what a finished row becomes.
"""

from __future__ import annotations

from typing import Generic, Sequence, TypeVar

import jax
import numpy as np

from hsdjax.core import engine
from hsdjax.runtime.config import ModelConfig

T = TypeVar("T")


def pooled_cache(cfg: ModelConfig) -> bool:
    """Whether a ``RowPool`` over this model keeps its KV cache at the largest size (``pooled``): where the
    layers scan over a stacked cache that the CPU kernels read by row in place. Elsewhere (XLA's path, the
    unrolled layout, a mesh) slicing the batch's rows out of a larger cache could copy them every pass."""
    return bool(cfg.scan_layers) and cfg.resolved_backend == "cpu-kernel"


def _device_rows(rows: Sequence[int] | np.ndarray) -> jax.Array:
    """Row indices on the device without a program (``jnp.asarray`` of a host array compiles a small one
    per length, which the server's warm-up would have to foresee)."""
    return jax.device_put(np.asarray(rows, np.int32))


class RowPool(Generic[T]):
    """``state``'s rows and who owns them: ``slots[i]`` is row i's item, None while the row is free.

    ``pooled``: the state's KV cache holds the largest size's rows from the start
    (``engine.with_capacity``), so growing the batch copies no cache (only the small per-row leaves) and
    shrinking moves only the rows that move (``engine.compact_rows``): a running stream does not wait
    for every row's cache to be copied when a request joins (needs the stacked cache)."""

    def __init__(self, sizes: Sequence[int], pooled: bool = False):
        self.sizes = tuple(sorted(set(sizes)))
        self.pooled = pooled
        self.state: engine.DecodeState | None = None
        self.slots: list[T | None] = []

    @property
    def size(self) -> int:
        """Rows of the running state (0 without one)."""
        return len(self.slots)

    def busy(self) -> list[int]:
        return [i for i, item in enumerate(self.slots) if item is not None]

    def free(self) -> list[int]:
        return [i for i, item in enumerate(self.slots) if item is None]

    def any_busy(self) -> bool:
        return any(item is not None for item in self.slots)

    def size_for(self, rows: int) -> int:
        """The smallest batch size holding ``rows`` rows (the largest when none does)."""
        return min((s for s in self.sizes if s >= rows), default=self.sizes[-1])

    def place(self, new: engine.DecodeState, items: Sequence[T], at_least: int = 0) -> list[int]:
        """Rows ``0 .. len(items) - 1`` of ``new`` into free rows, one per item (rows of ``new`` beyond
        them are dropped). The state is created at, or first grown to, the size that holds the busy rows,
        the new ones and ``at_least`` rows. Returns the rows the items got."""
        k = len(items)
        want = self.size_for(max(len(self.busy()) + k, at_least))
        if self.state is None:
            rows = np.full((want,), -1, np.int32)
            rows[:k] = np.arange(k)
            same = want == k == new.gen.seq_len.shape[0]
            self.state = new if same else engine.take_rows(new, _device_rows(rows))
            if self.pooled:
                self.state = engine.with_capacity(self.state, self.sizes[-1])
            self.slots = [None] * want
            got = list(range(k))
        else:
            if want > self.size:
                self._grow(want)
            got = self.free()[:k]
            if len(got) < k:
                raise ValueError(f"{k} rows do not fit in the {len(got)} free rows of a batch of {self.size}")
            target = got + [engine.DROP_ROW] * (new.gen.seq_len.shape[0] - k)
            self.state = engine.insert_rows(self.state, new, _device_rows(target))
        for i, item in zip(got, items):
            self.slots[i] = item
        return got

    def _grow(self, size: int) -> None:
        """The running rows stay where they are; rows ``self.size ..`` are new and free."""
        self.state = engine.grow_rows(self.state, size)
        self.slots += [None] * (size - self.size)

    def release(self, i: int) -> T | None:
        """Row ``i`` is free again (its computation is the caller's to stop); returns its item."""
        item, self.slots[i] = self.slots[i], None
        return item

    def shrink(self, size: int | None = None) -> None:
        """Move the busy rows, in order, into a state of ``size`` rows (default: the smallest size that
        holds them) when that is smaller; drop the state when no row is busy."""
        busy = self.busy()
        if not busy:
            self.clear()
            return
        size = size or self.size_for(len(busy))
        if size < len(busy):
            raise ValueError(f"{len(busy)} busy rows do not fit in a batch of {size}")
        if size >= self.size:
            return
        rows = np.full((size,), -1, np.int32)
        rows[: len(busy)] = busy
        move = engine.compact_rows if self.pooled else engine.take_rows
        self.state = move(self.state, _device_rows(rows))
        self.slots = [self.slots[i] for i in busy] + [None] * (size - len(busy))

    def clear(self) -> None:
        """No running state (frees its KV cache)."""
        self.state, self.slots = None, []
