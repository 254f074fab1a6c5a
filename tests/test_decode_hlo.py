"""The compiled decode loop copies no KV-cache layers per round (cheap speculative rounds).

XLA inserts a ``copy`` where a loop-carried buffer cannot be updated in place, e.g. when a conditional
passes the cache through its branches. Such copies cost a whole cache layer of memory traffic per
round. This test compiles the real decode loop for every drafter on a tiny model, collects the
computations reachable from the while body (branches, nested loops, fusions) and counts ``copy``
instructions of cache-layer size. XLA's CPU backend copies the last layer's keys/values even for
plain decoding (``ar``: four copies of one layer, whatever the depth); no drafter may copy more.
Before verification ran at one static size with the commit outside the tier switch, `hsd`, `eagle`
and `pld` copied every layer (4 per layer).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hsdjax.core import engine
from hsdjax.core.drafters import ARDrafter
from hsdjax.core.drafters.pld import PromptLookupDrafter
from hsdjax.core.sampling import SamplingParams
from hsdjax.runtime.model import init_params
from tests.conftest import TINY_LLAMA
from tests.test_feature_drafters import feature_drafter

CACHE = 256
CFG = TINY_LLAMA.replace(num_layers=4, scan_layers=False)
CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)"
                   r"=\{?([^}\s]+)\}?")
COPY = re.compile(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(")


def decode_hlo(params, drafter, dparams, batch: int = 2) -> str:
    prompt_len = 32
    gen, fwd = engine.prefill(params, jnp.ones((batch, prompt_len), jnp.int32), jnp.full((batch,), 5),
                              jnp.full((batch,), 20), SamplingParams.make(batch),
                              jax.vmap(jax.random.PRNGKey)(jnp.arange(batch)), engine.stop_array(()), cfg=CFG,
                              cache_size=CACHE, spare=drafter.spare, keep_layers=drafter.prompt_layers)
    state = engine.start_decoding(dparams, gen, fwd, drafter=drafter)
    return engine.decode.lower(params, dparams, state, jnp.int32(3), cfg=CFG, drafter=drafter).compile().as_text()


def computations(hlo: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{") and not line.startswith(" "):
            current = head.group(1)
            comps[current] = []
        elif current is not None and line.startswith(" "):
            comps[current].append(line)
    return comps


def loop_cache_copies(hlo: str, layer_elems: int) -> int:
    """``copy`` instructions of at least a cache layer's size inside the decode loop's body."""
    comps = computations(hlo)
    stack = [m.group(1) for lines in comps.values() for line in lines for m in re.finditer(r"body=%?([\w.\-]+)", line)]
    seen: set[str] = set()
    while stack:
        name = stack.pop().strip().lstrip("%")
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for m in CALLS.finditer(line):
                stack.extend(m.group(1).split(","))
    count = 0
    for name in seen:
        for line in comps[name]:
            m = COPY.search(line)
            if m and np.prod([int(x) for x in m.group(1).split(",") if x] or [1]) >= layer_elems:
                count += 1
    return count


@pytest.fixture(scope="module")
def copies():
    params = init_params(CFG, seed=1)
    layer_elems = 2 * CFG.num_kv_heads * CACHE * CFG.head_dim  # one layer's keys (batch 2)
    drafters = {"ar": (ARDrafter(), ()), "pld": (PromptLookupDrafter(), ())}
    for method in ("hsd", "eagle"):
        drafters[method] = feature_drafter(CFG, params, method, depth=4, width=3, budget=5)
    return {name: loop_cache_copies(decode_hlo(params, d, dp), layer_elems) for name, (d, dp) in drafters.items()}


def test_ar_copies_less_than_one_copy_per_layer(copies):
    assert copies["ar"] < 2 * CFG.num_layers


@pytest.mark.parametrize("method", ["pld", "hsd", "eagle"])
def test_speculative_rounds_copy_no_more_than_ar(copies, method):
    assert copies[method] <= copies["ar"], copies
