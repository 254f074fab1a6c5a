"""The Python API: ``load_model`` (from ``hsdjax.runtime.loading``; optionally sharded over a mesh), then
``Generator.generate`` (one prompt or a batch) / ``Generator.stream`` with one method (``ar``, ``pld``,
``sps``, ``hsd``, ``eagle``; see ``hsdjax.core.methods``).

Underneath are the jitted functions of ``hsdjax.core.engine`` (``prefill``, ``start_decoding``, ``decode``:
one loop for every method, the method's drafter from ``hsdjax.core.methods.make_drafter`` plugged in),
which take params, caches and draft state as explicit pytrees, so they can also be called from a
user's own jitted code. This module only prepares inputs (tokenize, chat template, bucketing), keeps
the compiled programs per shape, and turns outputs back into text and statistics.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hsdjax.core import engine
from hsdjax.core.methods import make_drafter
from hsdjax.core.sampling import SamplingParams
from hsdjax.errors import HsdjaxError
from hsdjax.runtime import sharding
from hsdjax.runtime.loading import LoadedModel, default_dtype, default_layer_loop, enable_compilation_cache, load_model  # noqa: F401  (re-exported)
from hsdjax.runtime.tokenizer import IncrementalDecoder

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


@dataclasses.dataclass
class TokenLogprob:
    """A generated token's log-probability under the distribution it was drawn from (the target's,
    adjusted by temperature / top-k / top-p; the plain one when greedy) and the most likely tokens
    there (``top``: (id, log-probability), descending)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(seq: np.ndarray, logprobs: engine.TokenLogprobs, row: int, start: int,
                   end: int) -> list[TokenLogprob]:
    """Sequence positions ``start:end`` of row ``row``: its tokens (``seq``) with their recorded
    ``logprobs`` (both on the host, as numpy arrays)."""
    ids, lp, top_ids, top = (np.asarray(a)[row, start:end] for a in (seq, logprobs.token, logprobs.top_ids,
                                                                     logprobs.top))
    return [TokenLogprob(int(t), float(v), list(zip(i.tolist(), p.tolist())))
            for t, v, i, p in zip(ids.tolist(), lp.tolist(), top_ids, top)]


@dataclasses.dataclass
class GenerationResult:
    """One row's output and its statistics (seconds exclude compilation)."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" or "length"
    prefill_s: float
    decode_s: float
    compile_s: float
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token of ``tokens``, when asked for

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    def to_json(self) -> dict[str, Any]:
        """The ``generate --json`` object."""
        seconds = self.seconds
        return {
            "text": self.text,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "seconds": round(seconds, 6),
            "tokens_per_s": round(self.new_tokens / seconds, 3) if seconds > 0 else None,
            "decode_tokens_per_s": round(self.new_tokens / self.decode_s, 3) if self.decode_s > 0 else None,
            "compile_s": round(self.compile_s, 3),
            **{k: v for k, v in self.stats.items() if k != "accept_lengths"},
        }


@dataclasses.dataclass
class RowsRun:
    """A batch of prepared rows run to the end (``Generator.run_rows``)."""

    state: engine.DecodeState
    prefill_s: float  # prefill + the drafter's start, compilation excluded
    decode_s: float
    compile_s: float


class Generator:
    """Generates text with one method on one loaded model; compiled programs are kept per shape."""

    def __init__(self, model: LoadedModel, method: str = "ar", **options: Any):
        self._setup(model, method, *make_drafter(method, model, **options))

    @classmethod
    def with_drafter(cls, model: LoadedModel, drafter: Any, dparams: Any = ()) -> "Generator":
        """A generator that runs a given drafter instance with its params (a recording drafter, a
        fixed tree for benchmarks, a drafter built by hand) instead of a registered method's."""
        gen = cls.__new__(cls)
        gen._setup(model, drafter.name, drafter, dparams)
        return gen

    def _setup(self, model: LoadedModel, method: str, drafter: Any, dparams: Any) -> None:
        self.model, self.method, self.drafter = model, method, drafter
        self.mesh = getattr(model, "mesh", None)
        self.dparams = sharding.replicate(dparams, self.mesh)  # drafters run whole on every device
        self._compiled: dict[tuple[Any, ...], Any] = {}

    # ------------------------------------------------------------------ inputs
    def encode_prompt(self, prompt: Prompt, chat: bool = True, system: str | None = None) -> list[int]:
        """Token ids for a prompt: a string (chat template applied unless ``chat=False``), a list of
        chat messages, or a list of token ids (used as is)."""
        tok = self.model.tokenizer
        if isinstance(prompt, str):
            if not prompt.strip() and chat:
                raise HsdjaxError("the prompt is empty")
            if chat and tok.has_chat_template:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}]
                return tok.encode_chat(messages)
            ids = tok.encode(prompt, add_special_tokens=True)
        elif prompt and isinstance(prompt[0], dict):
            if not tok.has_chat_template:
                raise HsdjaxError(f"model {self.model.name} has no chat template; pass raw text instead")
            ids = tok.encode_chat(list(prompt))
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.model.cfg.vocab_size]
            if bad:
                raise HsdjaxError(f"token ids out of range [0, {self.model.cfg.vocab_size}): {bad[:5]}")
        if not ids:
            raise HsdjaxError("the prompt is empty")
        return ids

    def _batch(self, rows: list[list[int]], max_new: int, temperature: float, top_k: int, top_p: float,
               seed: int, keys: Any = None, batch: int | None = None, cache_size: int | None = None
               ) -> tuple[dict[str, Any], int]:
        """The placed prefill inputs of ``rows`` and the cache size."""
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise HsdjaxError(f"invalid sampling settings: temperature={temperature} (>= 0), "
                              f"top_p={top_p} (0 < top_p <= 1), top_k={top_k} (>= 0)")
        if not rows:
            raise HsdjaxError("no prompts given")
        longest = max(len(r) for r in rows)
        p_bucket, s_bucket = engine.plan_shapes(self.model.cfg, longest, max_new, spare=self.drafter.spare)
        if cache_size is not None:
            p_bucket, s_bucket = min(p_bucket, cache_size), cache_size
            if longest + max_new + self.drafter.spare + 1 > cache_size:
                raise HsdjaxError(f"a {longest}-token prompt and {max_new} new tokens do not fit a {cache_size}-slot "
                                  "cache")
        b = engine.pick_bucket(len(rows), BATCH_BUCKETS, "a batch") if batch is None else batch
        prompt, lengths, budget = engine.pack_rows(rows, p_bucket, b, max_new)
        inputs = dict(
            prompt=jnp.asarray(prompt), prompt_len=jnp.asarray(lengths), max_new=jnp.asarray(budget),
            sampling=SamplingParams.make(b, temperature, top_k, top_p),
            keys=engine.row_keys(seed, b) if keys is None else jnp.asarray(keys),
            stop_ids=engine.stop_array(self.model.tokenizer.stop_ids),
        )
        return sharding.place_inputs(inputs, self.mesh), s_bucket

    # ------------------------------------------------------------------ compiled programs
    def _program(self, kind: str, fn: Any, *args: Any, **static: Any) -> tuple[Any, float]:
        shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), args[1:])
        key = (kind, str(shapes), tuple(sorted(static.items())))
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        compiled = fn.lower(*args, **static).compile()
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t0

    def _prefill(self, inputs: dict[str, Any], s_bucket: int, top_logprobs: int | None = None
                 ) -> tuple[engine.DecodeState, float, float]:
        """Prefill plus the drafter's start (both timed as prefill, compilation excluded)."""
        args = (self.model.params, inputs["prompt"], inputs["prompt_len"], inputs["max_new"],
                inputs["sampling"], inputs["keys"], inputs["stop_ids"])
        program, compile_s = self._program("prefill", engine.prefill, *args, cfg=self.model.cfg,
                                           cache_size=s_bucket, spare=self.drafter.spare,
                                           keep_layers=self.drafter.prompt_layers, top_logprobs=top_logprobs)
        t0 = time.perf_counter()
        gen, prompt_states = program(*args)
        jax.block_until_ready(gen)
        elapsed = time.perf_counter() - t0
        start_args = (self.dparams, gen, prompt_states)
        start, c2 = self._program("start", engine.start_decoding, *start_args, drafter=self.drafter)
        t0 = time.perf_counter()
        state = sharding.shard_state(start(*start_args), self.model.cfg, self.mesh)
        jax.block_until_ready(state)
        return state, elapsed + time.perf_counter() - t0, compile_s + c2

    def _decode_program(self, state: engine.DecodeState) -> tuple[Any, float]:
        program, compile_s = self._program("decode", engine.decode, self.model.params, self.dparams, state,
                                           jnp.int32(1), cfg=self.model.cfg, drafter=self.drafter)
        return (lambda st, n: program(self.model.params, self.dparams, st, jnp.int32(n))), compile_s

    # ------------------------------------------------------------------ public
    def prefill_rows(self, rows: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, seed: int = 0, keys: Any = None, batch: int | None = None,
                     cache_size: int | None = None, top_logprobs: int | None = None
                     ) -> tuple[engine.DecodeState, float, float]:
        """Prefill prepared rows (token ids, e.g. from ``encode_prompt``) and start the drafter:
        (state, seconds, compile seconds). ``batch``: rows of the state (default: the next batch
        bucket; padding rows finish at once); ``cache_size``: KV-cache slots (default: planned from
        the longest prompt and the budget); ``keys``: one RNG key per row (default: row i gets
        ``fold_in(seed, i)``)."""
        inputs, s_bucket = self._batch(rows, max_new_tokens, temperature, top_k, top_p, seed, keys, batch, cache_size)
        return self._prefill(inputs, s_bucket, top_logprobs)

    def decode_rows(self, state: engine.DecodeState, rounds: int) -> tuple[engine.DecodeState, float, float]:
        """At most ``rounds`` more speculative rounds of every unfinished row: (state, seconds,
        compile seconds)."""
        program, compile_s = self._decode_program(state)
        t0 = time.perf_counter()
        state = program(state, rounds)
        jax.block_until_ready(state)
        return state, time.perf_counter() - t0, compile_s

    def run_rows(self, rows: list[list[int]], *, max_new_tokens: int, **options: Any) -> RowsRun:
        """Prepared rows run to the end of their budgets (``prefill_rows``'s options): the final
        ``DecodeState`` (tokens, the drafter's state, counters) and the times."""
        state, prefill_s, compile_s = self.prefill_rows(rows, max_new_tokens=max_new_tokens, **options)
        state, decode_s, c2 = self.decode_rows(state, max_new_tokens)
        return RowsRun(state, prefill_s, decode_s, compile_s + c2)

    def generate(self, prompts: Prompt | Sequence[Prompt], *, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 chat: bool = True, system: str | None = None,
                 top_logprobs: int | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a batch (one compiled call per batch); one result per prompt.
        ``top_logprobs`` K: each result's ``logprobs`` holds every new token's log-probability and the
        K most likely tokens, recorded by the passes that chose them (``engine.TokenLogprobs``)."""
        batch = [prompts] if _is_single(prompts) else list(prompts)
        if not batch:
            raise HsdjaxError("no prompts given")
        rows = [self.encode_prompt(p, chat, system) for p in batch]
        run = self.run_rows(rows, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, top_logprobs=top_logprobs)
        return self._results(run.state, rows, run.prefill_s, run.decode_s, run.compile_s)

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, chat: bool = True, system: str | None = None,
               chunk_steps: int = 8) -> Iterator[str]:
        """Yield text pieces as they are generated (whole UTF-8 characters only). The final
        ``GenerationResult`` is available as ``self.last_result`` when the iterator ends; closing
        the iterator early stops the generation."""
        rows = [self.encode_prompt(prompt, chat, system)]
        state, prefill_s, compile_s = self.prefill_rows(rows, max_new_tokens=max_new_tokens, temperature=temperature,
                                                        top_k=top_k, top_p=top_p, seed=seed)
        program, c2 = self._decode_program(state)
        decoder = IncrementalDecoder(self.model.tokenizer, skip_special_tokens=True)
        stops = set(self.model.tokenizer.stop_ids)
        decode_s = 0.0
        seen = int(sharding.to_host(state.gen.prompt_len)[0])
        while True:
            n = int(sharding.to_host(state.gen.seq_len)[0])
            new = [t for t in sharding.to_host(state.gen.seq)[0, seen:n].tolist() if t not in stops]
            seen = n
            piece = decoder.push(new)
            if piece:
                yield piece
            if bool(sharding.to_host(state.gen.done)[0]):
                break
            t0 = time.perf_counter()
            state = program(state, chunk_steps)
            jax.block_until_ready(state)
            decode_s += time.perf_counter() - t0
        tail = decoder.flush()
        if tail:
            yield tail
        self.last_result = self._results(state, rows, prefill_s, decode_s, compile_s + c2)[0]

    def _results(self, state: engine.DecodeState, rows: list[list[int]], prefill_s: float, decode_s: float,
                 compile_s: float) -> list[GenerationResult]:
        gen, st = state.gen, jax.tree_util.tree_map(sharding.to_host, state.stats)
        seq, start, end = (sharding.to_host(a) for a in (gen.seq, gen.prompt_len, gen.seq_len))
        logprobs = None if gen.logprobs is None else jax.tree_util.tree_map(sharding.to_host, gen.logprobs)
        stops = set(self.model.tokenizer.stop_ids)
        results = []
        for i, r in enumerate(rows):
            toks = seq[i, start[i]: end[i]].tolist()
            stopped = bool(toks) and toks[-1] in stops
            text = self.model.tokenizer.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)
            passes = int(st.target_passes[i])
            decoded = len(toks) - 1  # the first new token comes from the prefill pass
            hist = st.accept_hist[i].tolist()
            while len(hist) > 1 and hist[-1] == 0:
                hist.pop()
            results.append(GenerationResult(
                text=text, tokens=toks, prompt_tokens=len(r), finish_reason="stop" if stopped else "length",
                prefill_s=prefill_s, decode_s=decode_s, compile_s=compile_s,
                stats={
                    "method": self.method, "devices": sharding.mesh_devices(self.mesh),
                    "mesh": sharding.mesh_shape(self.mesh), "batch": len(rows),
                    "mean_accepted_length": round(decoded / passes, 4) if passes else None,
                    "target_passes": passes,
                    "mean_tree_nodes": round(int(st.tree_nodes[i]) / passes, 3) if passes else None,
                    "mean_verified_nodes": round(int(st.verified_nodes[i]) / passes, 3) if passes else None,
                    "accept_hist": hist,
                    **_drafter_stats_of(self.drafter.name, st, i, passes),
                    "accept_lengths": st.round_log[i, :passes].tolist(),
                },
                logprobs=None if logprobs is None else token_logprobs(seq, logprobs, i, start[i], end[i]),
            ))
        return results


def _drafter_stats_of(drafter_name: str, st: Any, i: int, passes: int) -> dict[str, Any]:
    """Drafter work counters of row ``i`` (the same definitions for every drafting method)."""
    states, accepted, looked_up = int(st.drafter_states[i]), int(st.accepted_drafts[i]), int(st.lookup_drafts[i])
    own = accepted - looked_up  # the drafter's own accepted drafts: what its work bought
    out: dict[str, Any] = {"draft_passes": int(st.draft_passes[i]), "drafter_states": states,
                           "accepted_drafts": accepted, "lookup_drafts": looked_up,
                           "draft_utilisation": round(own / states, 4) if states else None}
    macs = float(st.drafter_macs[i])
    out["drafter_macs"] = macs
    out["accepted_per_gmac"] = round(own / (macs / 1e9), 3) if macs else None
    if drafter_name == "hsd":
        out["chain_steps"] = states
        out["reused_states"] = int(st.reused_states[i])
        # the draft reuse the method exists for: accepted drafts that came from an earlier round's states
        out["reused_drafts"] = int(st.reused_drafts[i])
        out["reused_share"] = round(int(st.reused_drafts[i]) / own, 4) if own else None
    return out


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    if prompts and isinstance(prompts[0], dict):
        return True  # one conversation
    return bool(prompts) and isinstance(prompts[0], int)
