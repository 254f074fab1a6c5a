"""Self-distillation data for feature drafters: the target answers training prompts itself.

The target generates answers with the jitted engine (plain decoding with a recording drafter) and
records, per token: the token, whether it belongs to an answer, the target's input states of the
fused layers plus its last layer's output (bfloat16, held as uint16 bits), and its top-k next-token logits.

Generation is a continuous batch (``ContinuousRecorder``): every ``refill_every`` rounds finished rows
leave the batch (their records go to the shard stream) and freshly prefilled prompts take their slots
(``engine.insert_rows``). Prompts come from one or more files, interleaved by per-source weights
(``prompt_stream``); they are taken in chunks sorted by length, so prefill buckets are dense, and each
chunk runs at the smallest KV-cache size its prompts need. Multi-turn prompts (``turns``) are answered
turn by turn, each turn seeing the target's own earlier answers; the whole conversation is one document.

Documents become shards (``shard_00000.npz`` ...); ``manifest.json`` lists the shards and, per shard, the
stream indices of its prompts, so a process killed at any moment resumes without redoing or losing a
shard (rows in flight at the kill are simply generated again). Work stops at a token budget.
``first_prompt`` starts the work at a later index of the same stream: a slice of prompts that a drafter
trained on the stream's beginning has never seen (its own folder).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Int

from hsdjax.core import engine
from hsdjax.core.batch import RowPool
from hsdjax.core.drafters.base import ARDrafter, TargetStates
from hsdjax.core.drafters.checkpoint import frozen_from_target
from hsdjax.core.sampling import top_k_blocked
from hsdjax.errors import HsdjaxError
from hsdjax.frontends.api import Generator
from hsdjax.jsonl import read_objects
from hsdjax.kernels.cpu_matmul import panel_matmul
from hsdjax.runtime import sharding
from hsdjax.runtime.model import Transformer, causal_mask
from hsdjax.runtime.sharding import to_host
from hsdjax.train.answers import AnswerStore, GitCommits, shard_documents
from hsdjax.train.train import sigterm_as_interrupt

MANIFEST_FORMAT = 2  # 2: shards list their prompts' stream indices (continuous batching)
PERF_KEYS = ("dir", "answers", "token_budget", "batch", "refill_every", "chunk", "shard_tokens",
             "rerecord_batch", "rerecord_dtype")  # not part of the data
PREFILL_SIZES = (16, 4, 1)  # new rows are prefilled in groups of these sizes (few compiled shapes, no padding)


def fused_layer_indices(num_layers: int) -> tuple[int, int, int, int]:
    """Recorded states: inputs of a low, a middle and a high layer (EAGLE-3's choice: 2, L/2, L-3)
    and the last layer's output (index L), from which the final normed state is recomputed."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0), num_layers)


# ------------------------------------------------------------------------------------------ prompts


def _source_of(source: str, names: Iterable[str]) -> str | None:
    """The entry of ``names`` that ``source`` falls under (``t0`` covers ``t0:<template>``), or None."""
    for s in names:
        if source == s or source.startswith(s + ":"):
            return s
    return None


def _prompt_files(prompts: Any) -> list[Path]:
    files = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise HsdjaxError(f"data.prompts must be a path or a non-empty list of paths (got {prompts!r})")
    return [Path(f) for f in files]


def read_prompts(paths: str | list[str], exclude_sources: list[str], max_turns: int = 2) -> list[dict[str, Any]]:
    """Training prompts from jsonl files (``prompt``, optional ``source`` and ``turns``), minus excluded
    sources, in file order. Each row: ``{"source", "turns": (user turn, ...)}`` (at most ``max_turns``)."""
    rows = []
    for path in _prompt_files(paths):
        if not path.is_file():
            raise HsdjaxError(f"training prompts not found: {path}")
        for n, obj in read_objects(path, "training prompts"):
            if not isinstance(obj.get("prompt"), str):
                raise HsdjaxError(f"{path}:{n}: expected an object with a string 'prompt'")
            source = str(obj.get("source", ""))
            if _source_of(source, exclude_sources):
                continue
            turns = obj.get("turns") or [obj["prompt"]]
            if not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
                raise HsdjaxError(f"{path}:{n}: 'turns' must be a list of non-empty strings")
            rows.append({"source": source, "turns": tuple(turns[:max(1, max_turns)])})
    if not rows:
        raise HsdjaxError(f"{', '.join(map(str, _prompt_files(paths)))}: no prompts left after excluding "
                          f"sources {exclude_sources}")
    return rows


def source_weight_table(rows: list[dict[str, Any]], weights: dict[str, Any] | None) -> dict[str, float]:
    """Weight of every source group in ``rows`` (the part of ``source`` before ":", so ``t0`` covers
    ``t0:<template>``); unlisted groups weigh 1, names no file has are errors."""
    present = sorted({r["source"].split(":")[0] for r in rows})
    weights = dict(weights or {})
    for name, w in weights.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0:
            raise HsdjaxError(f"data.source_weights[{name!r}] must be a number >= 0 (got {w!r})")
        if name not in present:
            raise HsdjaxError(f"data.source_weights names {name!r}, which no prompt file has (sources: {present})")
    return {g: float(weights.get(g, 1.0)) for g in present}


def prompt_stream(data_cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's prompts as one deterministic stream: row ``i`` has ``index`` ``i``.

    Each source group's prompts keep their file order; groups interleave in proportion to their
    weights (``source_weights``: the k-th prompt of a group of weight w sits at (k + u) / w, u a
    ``seed``-ed offset in [0, 1)), so every prefix of the stream holds the groups in those proportions
    until one runs out. A weight of 0, like ``exclude_sources``, leaves a source out."""
    rows = read_prompts(data_cfg["prompts"], [], int(data_cfg.get("max_turns", 2)))
    weights = source_weight_table(rows, data_cfg.get("source_weights"))  # excluded sources may be named
    exclude = list(data_cfg.get("exclude_sources", []))
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        if not _source_of(r["source"], exclude):
            groups[r["source"].split(":")[0]].append(r)
    rng = np.random.RandomState(int(data_cfg.get("seed", 0)))
    keyed = []
    for g in sorted(groups):
        u = rng.uniform()
        if weights[g] > 0:
            keyed += [((k + u) / weights[g], g, k, r) for k, r in enumerate(groups[g])]
    if not keyed:
        raise HsdjaxError(f"no prompts left after excluding sources {exclude} and those of weight 0")
    keyed.sort(key=lambda x: x[:3])
    return [dict(r, index=i) for i, (*_, r) in enumerate(keyed)]


def data_key(target_fingerprint: str, data_cfg: dict[str, Any]) -> str:
    """Folder name for a data configuration: same target + same settings = same data (the budget and
    the settings that only change speed are left out, so raising the budget continues the same folder)."""
    settings = {k: v for k, v in data_cfg.items() if k not in PERF_KEYS}
    if not settings.get("first_prompt"):  # 0 is the default: the same folder as a config that omits it
        settings.pop("first_prompt", None)
    blob = json.dumps({"target": target_fingerprint, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def data_settings(data_cfg: dict[str, Any]) -> dict[str, Any]:
    """The generation settings of a data config, with defaults, checked."""
    if "prompts" not in data_cfg:
        raise HsdjaxError("data.prompts is missing (a prompts file or a list of them)")
    out = {}
    for key, default in (("token_budget", 1_000_000), ("batch", 64), ("refill_every", 16), ("chunk", 4096),
                         ("shard_tokens", 16384), ("max_prompt_tokens", 384), ("max_new_tokens", 256),
                         ("top_k_logits", 8), ("max_turns", 2), ("rerecord_batch", 4)):
        v = data_cfg.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise HsdjaxError(f"data.{key} must be a positive integer (got {v!r})")
        out[key] = v
    temperature = data_cfg.get("temperature", 0.0)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise HsdjaxError(f"data.temperature must be a number >= 0 (got {temperature!r})")
    out["temperature"] = float(temperature)
    out["seed"] = int(data_cfg.get("seed", 0))
    first = data_cfg.get("first_prompt", 0)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise HsdjaxError(f"data.first_prompt must be a whole number >= 0 (got {first!r})")
    out["first_prompt"] = first
    answers = data_cfg.get("answers")
    if answers is not None and (not isinstance(answers, str) or not answers.strip()):
        raise HsdjaxError(f"data.answers must be a folder path (got {answers!r})")
    out["answers"] = answers
    rerecord_dtype = data_cfg.get("rerecord_dtype", "float32")
    if rerecord_dtype not in ("float32", "bfloat16", "auto"):
        raise HsdjaxError(f"data.rerecord_dtype must be float32, bfloat16 or auto (got {rerecord_dtype!r})")
    out["rerecord_dtype"] = rerecord_dtype
    return out


def _writer_tag() -> str:
    """Process index and pid: temporary file names no other writer uses."""
    return f"{jax.process_index()}.{os.getpid()}"


class DataWriter:
    """Shards + manifest in one folder; writes are atomic (temporary file, then rename).

    Each shard entry lists the stream indices of its documents' prompts: the finished prompts are
    their union, so a rerun skips exactly those. A shard written but not yet in the manifest (a kill
    between the two renames) is overwritten by the next run.

    In a multi-process run every process computes the same replicated data and writes it; each writes
    through its own temporary name, so a shared folder ends with one whole copy and local folders each
    get theirs."""

    def __init__(self, folder: Path, meta: dict[str, Any]):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.manifest_path = folder / "manifest.json"
        if self.manifest_path.exists():
            self.manifest = json.loads(self.manifest_path.read_text())
            if self.manifest.get("format") != MANIFEST_FORMAT and self.manifest.get("shards"):
                raise HsdjaxError(f"{folder} holds drafter data in an older format (no prompt indices per "
                                  "shard); move it away or set data.dir to a new folder")
        else:
            self.manifest = {**meta, "format": MANIFEST_FORMAT, "shards": [], "prompts_done": 0, "tokens": 0,
                             "answer_tokens": 0, "seconds": 0.0, "complete": False}

    def done_prompts(self) -> set[int]:
        return {i for shard in self.manifest["shards"] for i in shard.get("prompts", [])}

    def add(self, arrays: dict[str, np.ndarray], prompts: list[int], seconds: float,
            piece: int | None = None) -> None:
        """Write one shard; ``piece``: the index of the recorded-answers piece holding its answers (the
        stream's order, ``ordered_shards``)."""
        name = f"shard_{len(self.manifest['shards']):05d}.npz"
        tmp = self.folder / f"{name}.{_writer_tag()}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, self.folder / name)
        n, answer = int(arrays["tokens"].shape[0]), int(arrays["answer"].sum())
        entry = {"file": name, "tokens": n, "answer_tokens": answer, "prompts": prompts}
        if piece is not None:
            entry["piece"] = int(piece)
        self.manifest["shards"].append(entry)
        self.manifest["prompts_done"] += len(prompts)
        self.manifest["tokens"] += n
        self.manifest["answer_tokens"] += answer
        self.manifest["seconds"] += seconds
        self.save()

    def save(self) -> None:
        tmp = self.manifest_path.with_suffix(f".{_writer_tag()}.tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1))
        os.replace(tmp, self.manifest_path)


# ------------------------------------------------------------------------------------------ recording


def bfloat16_bits(x: Array) -> Array:
    """``x`` rounded to bfloat16, as its uint16 bit patterns. The recording buffers hold bits: XLA's CPU
    scatter into a bfloat16 buffer rewrote the whole buffer each round (14 ms for 64 rows x 256
    positions of SmolLM2 states), into a uint16 one it writes the rows in place (0.02 ms)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


@dataclasses.dataclass(frozen=True)
class RecordingDrafter(ARDrafter):
    """Plain decoding that records, at every position, the target states of ``layers`` and the
    target's top-k next-token logits: from the prompt's forward at the start, then from each
    round's verified root. (The root's logits are recomputed from its state: the engine does not
    hand them to drafters.)"""

    name: str = "record"
    layers: tuple[int, ...] = ()
    top_k: int = 8

    @property
    def prompt_layers(self) -> tuple[int, ...]:
        return self.layers

    def _top(self, dparams, hidden):
        if "head_panels" in dparams:  # the model's own float32 logits, through its CPU kernel
            logits = panel_matmul(hidden, dparams["head_panels"])
        else:
            logits = jnp.einsum("...e,ve->...v", hidden, dparams["head"], preferred_element_type=jnp.float32)
        vals, ids = top_k_blocked(logits, self.top_k)
        return vals.astype(jnp.float16), ids.astype(jnp.int32)

    def init_state(self, dparams, gen, prompt_states):
        b, s = gen.seq.shape
        states = bfloat16_bits(prompt_states.per_position())  # [B, P, F, E]
        p = states.shape[1]
        vals, ids = jax.lax.map(lambda h: self._top(dparams, h), prompt_states.hidden)  # row by row
        buf = {"states": jnp.zeros((b, s, *states.shape[2:]), jnp.uint16).at[:, :p].set(states),
               "top_logits": jnp.zeros((b, s, self.top_k), jnp.float16).at[:, :p].set(vals),
               "top_ids": jnp.zeros((b, s, self.top_k), jnp.int32).at[:, :p].set(ids)}
        return buf

    def observe(self, dparams, state, gen_before, gen_after, verdict, path_states):
        pos = gen_before.seq_len - 1  # the root, verified this round
        rows = jnp.arange(pos.shape[0])
        fused = bfloat16_bits(path_states.per_position()[:, 0])  # [B, F, E], the root's
        vals, ids = self._top(dparams, path_states.hidden[:, 0])
        return {"states": state["states"].at[rows, pos].set(fused),
                "top_logits": state["top_logits"].at[rows, pos].set(vals),
                "top_ids": state["top_ids"].at[rows, pos].set(ids)}


def recording_generator(model: Any, top_k: int) -> Generator:
    """A ``Generator`` that decodes plainly and records (see ``RecordingDrafter``)."""
    return Generator.with_drafter(model, *recording_drafter(model, top_k))


def recording_drafter(model: Any, top_k: int) -> tuple[RecordingDrafter, dict[str, Array]]:
    """The recording drafter of a target and its params: the target's full LM head, or, where the model
    runs its head through the CPU kernel (one device, float32 activations), those panels: the logits the
    model itself computes, and 20% cheaper than XLA's dot at 64 rows (19 against 23 ms on SmolLM2)."""
    drafter = RecordingDrafter(layers=fused_layer_indices(model.cfg.num_layers), top_k=top_k)
    mesh = getattr(model, "mesh", None)
    if model.cfg.resolved_backend == "cpu-kernel" and model.cfg.cpu_matmul_activations == "float32" and mesh is None:
        return drafter, {"head_panels": model.params["head_panels"]}
    return drafter, sharding.replicate({"head": frozen_from_target(model)["head_full"]}, mesh)


@dataclasses.dataclass
class Job:
    """One conversation in flight: its prompt's stream index, the turn being answered, its token ids."""

    index: int
    source: str
    turns: tuple[str, ...]
    ids: list[int]
    turn: int = 0
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    answer_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # earlier answers in ids


@jax.jit
def _gather_rows(state: engine.DecodeState, rows: Int[Array, " N"]) -> dict[str, Array]:
    """Rows ``rows`` of the sequence and of the recording buffers (a small copy, not the KV cache)."""
    g = state.gen
    return {"seq": g.seq[rows], "seq_len": g.seq_len[rows], "prompt_len": g.prompt_len[rows],
            **{k: v[rows] for k, v in state.draft.items()}}


def row_record(seq: np.ndarray, seq_len: int, prompt_len: int, rec: dict[str, np.ndarray],
               spans: Iterable[tuple[int, int]] = ()) -> dict[str, np.ndarray]:
    """One finished row as a document: every position but the last generated token (no record)."""
    n = seq_len - 1
    answer = np.arange(n) >= prompt_len
    for a, b in spans:
        answer[a:b] = True
    return {"tokens": seq[:n].astype(np.int32), "answer": answer,
            "states": np.asarray(rec["states"][:n]).view(np.uint16),  # bfloat16 bits (npz has no bfloat16)
            "top_logits": np.asarray(rec["top_logits"][:n]), "top_ids": np.asarray(rec["top_ids"][:n])}


@dataclasses.dataclass
class RecorderWork:
    """Where a data run's time goes: seconds in decode calls and in prefills (compiles included),
    slot-rounds decoded (rounds x rows of the running batch, finished rows included) and the tokens
    generated in them; ``generated / slot_rounds`` is the batch's occupancy."""

    decode_s: float = 0.0
    prefill_s: float = 0.0
    slot_rounds: int = 0
    generated: int = 0

    def add_to(self, totals: dict[str, Any]) -> dict[str, Any]:
        """``totals`` (a manifest's ``work``, summed over runs) plus this run's figures."""
        out = {k: totals.get(k, 0) + v for k, v in dataclasses.asdict(self).items()}
        out["occupancy"] = round(out["generated"] / max(out["slot_rounds"], 1), 3)
        return out


class ContinuousRecorder:
    """A running batch of ``batch`` rows at one KV-cache size: jobs go in, recorded rows come out.

    ``run`` decodes ``refill_every`` rounds per call; between calls finished rows are handed to
    ``finish`` (which may return the conversation's next turn) and free slots get freshly prefilled
    jobs (groups of ``PREFILL_SIZES`` rows, so few prefill shapes compile and none is padded). Finished
    rows still cost a slot in every round, so the batch starts no larger than its work needs and, once
    the queue is empty, shrinks by 4x whenever the busy rows fit (``batch_sizes``). The rows are a
    ``hsdjax.core.batch.RowPool``, as the server's."""

    def __init__(self, gen: Generator, *, batch: int, cache_size: int, max_new: int, temperature: float, seed: int,
                 refill_every: int, work: RecorderWork | None = None):
        self.gen, self.drafter = gen, gen.drafter  # a recording generator (``recording_generator``)
        self.work = work if work is not None else RecorderWork()
        self.batch, self.cache_size, self.max_new = batch, cache_size, max_new
        self.temperature, self.seed, self.refill_every = temperature, seed, refill_every
        self.rows: RowPool[Job] = RowPool(self.batch_sizes)
        self.deferred: list[Job] = []  # next turns that need a larger cache

    @property
    def batch_sizes(self) -> list[int]:
        """Batch sizes the running state takes: ``batch``, then quarters of it (one compiled decode each)."""
        sizes = [self.batch]
        while sizes[-1] >= 4:
            sizes.append(sizes[-1] // 4)
        return sizes

    def fits(self, job: Job) -> bool:
        return len(job.ids) + self.max_new + self.drafter.spare + 1 <= self.cache_size

    def run(self, queue: collections.deque[Job], admit: Callable[[], bool],
            finish: Callable[[Job, dict[str, Any]], Job | None]) -> None:
        """Decode until ``queue`` is empty (or ``admit()`` says stop taking jobs) and every row is done."""
        while True:
            if admit():
                self._fill(queue)
            else:
                queue.clear()
            if not queue:  # nothing left to admit: the busy rows move into the smallest size holding them
                self.rows.shrink()
            if not self.rows.any_busy():
                break
            t0 = time.perf_counter()
            self.rows.state, _, _ = self.gen.decode_rows(self.rows.state, self.refill_every)
            self.work.decode_s += time.perf_counter() - t0
            self.work.slot_rounds += self.rows.size * self.refill_every
            self._collect(queue, finish)
        self.rows.clear()  # frees the batch's cache

    def _fill(self, queue: collections.deque[Job]) -> None:
        """Prefill queued jobs into the free rows (a new batch starts at the size the queue needs)."""
        start = self.rows.size_for(len(queue)) if self.rows.state is None else 0
        room = start or len(self.rows.free())
        while room and queue:
            size = next(s for s in PREFILL_SIZES if s <= min(room, len(queue)))
            jobs = [queue.popleft() for _ in range(size)]
            self.rows.place(self._prefill(jobs), jobs, at_least=start)
            room -= size

    def _prefill(self, jobs: list[Job]) -> engine.DecodeState:
        """Prefill ``jobs`` (similar lengths: the queue is sorted) into a fresh state of len(jobs) rows."""
        base = jax.random.PRNGKey(self.seed)
        keys = jnp.stack([jax.random.fold_in(jax.random.fold_in(base, j.index), j.turn) for j in jobs])
        t0 = time.perf_counter()
        state, _, _ = self.gen.prefill_rows([j.ids for j in jobs], max_new_tokens=self.max_new,
                                            temperature=self.temperature, keys=keys, batch=len(jobs),
                                            cache_size=self.cache_size)
        self.work.prefill_s += time.perf_counter() - t0
        return state

    def _collect(self, queue: collections.deque[Job], finish: Callable[[Job, dict[str, Any]], Job | None]) -> None:
        """Hand finished rows to ``finish``; their next turns go to the front of the queue (or, when they
        need a larger cache, to ``deferred``)."""
        done = to_host(self.rows.state.gen.done)
        rows = [i for i in self.rows.busy() if done[i]]
        if not rows:
            return
        n = engine.pick_bucket(len(rows), (1, 4, 16, 64, 256, 1024, 4096), "finished rows")
        idx = np.asarray(rows + [rows[0]] * (n - len(rows)), np.int32)
        got = {k: to_host(v) for k, v in _gather_rows(self.rows.state, jnp.asarray(idx)).items()}
        for k, i in enumerate(rows):
            job = self.rows.release(i)
            raw = {key: v[k] for key, v in got.items()}
            self.work.generated += int(raw["seq_len"]) - int(raw["prompt_len"])
            nxt = finish(job, raw)
            if nxt is not None:
                (queue.appendleft if self.fits(nxt) else self.deferred.append)(nxt)


# ------------------------------------------------------------------------------------------ the data folder


def encode_turns(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids of a conversation (chat template when the model has one; else the last user turn)."""
    if tok.has_chat_template:
        return tok.encode_chat(messages)
    return tok.encode(messages[-1]["content"], add_special_tokens=True)


def next_turn(tok: Any, job: Job, raw: dict[str, Any], max_prompt: int) -> Job | None:
    """The conversation's next turn with the target's own answer in context, or None (last turn, no
    chat template, or the conversation grew past ``max_prompt`` tokens)."""
    if job.turn + 1 >= len(job.turns) or not tok.has_chat_template:
        return None
    stops = set(tok.stop_ids)
    answer_ids = raw["seq"][int(raw["prompt_len"]): int(raw["seq_len"])].tolist()
    answer = tok.decode([t for t in answer_ids if t not in stops], skip_special_tokens=True)
    said = job.messages + [{"role": "assistant", "content": answer}]
    messages = said + [{"role": "user", "content": job.turns[job.turn + 1]}]
    ids = tok.encode_chat(messages)
    if len(ids) > max_prompt:
        return None
    end = len(tok.encode_chat(said, add_generation_prompt=False))
    spans = job.answer_spans + [(len(job.ids), end)]
    if ids[: len(job.ids)] != job.ids or end > len(ids):  # the template re-rendered earlier turns
        spans = []
    return Job(job.index, job.source, job.turns, ids, job.turn + 1, messages, spans)


class ShardSink:
    """Collects finished documents and writes a shard whenever ``shard_tokens`` are buffered."""

    def __init__(self, writer: DataWriter, shard_tokens: int, bar: Any, answers: AnswerStore | None = None,
                 commits: GitCommits | None = None, pending: int = 0):
        self.writer, self.shard_tokens, self.bar = writer, shard_tokens, bar
        self.pending = pending  # recorded answers to re-record after this run: they count toward the budget
        self.answers, self.commits = answers, commits  # each shard's answers also become a piece there
        self.docs: list[dict[str, np.ndarray]] = []
        self.prompts: list[int] = []
        self.sources = set(writer.manifest.get("sources", []))
        self.work = RecorderWork()  # this process's; the manifest's ``work`` sums every run's
        self.work_before = dict(writer.manifest.get("work", {}))
        self.buffered = 0
        self.t0 = time.perf_counter()

    @property
    def tokens(self) -> int:
        """Tokens written plus buffered plus recorded answers still to re-record."""
        return self.writer.manifest["tokens"] + self.buffered + self.pending

    def add(self, job: Job, doc: dict[str, np.ndarray]) -> None:
        self.docs.append(doc)
        self.prompts.append(job.index)
        self.sources.add(job.source.split(":")[0])
        n = int(doc["tokens"].shape[0])
        self.buffered += n
        self.bar.update(n)
        if self.buffered >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.docs:
            return
        arrays = {k: np.concatenate([d[k] for d in self.docs]) for k in self.docs[0]}
        arrays["doc"] = np.concatenate([np.full(d["tokens"].shape, i, np.int32) for i, d in enumerate(self.docs)])
        man = self.writer.manifest
        man["sources"] = sorted(self.sources)
        man["work"] = self.work.add_to(self.work_before)
        now = time.perf_counter()
        piece = len(self.answers.pieces) if self.answers is not None else None  # the piece it becomes
        self.writer.add(arrays, self.prompts, now - self.t0, piece)
        if self.answers is not None and jax.process_index() == 0:  # one writer of the repository's copy
            self.answers.add(self.docs, self.prompts)
            if self.commits is not None:
                self.commits.maybe(self.answers)
        self.t0, self.docs, self.prompts, self.buffered = now, [], [], 0
        self.bar.set_postfix(prompts=man["prompts_done"], answer_tok=man["answer_tokens"],
                             busy=f"{man['work']['occupancy']:.0%}")


def generate_data(model: Any, data_cfg: dict[str, Any], folder: Path, *, progress: bool = True,
                  commit_every_s: float | None = None, log: Any = print) -> dict[str, Any]:
    """Generate (or continue generating) the data described by ``data_cfg`` into ``folder``.
    ``commit_every_s``: commit the recorded answers (``data.answers``) to the git work tree holding them at
    most that often while the run goes, and at its end, kill included (``GitCommits``)."""
    opts = data_settings(data_cfg)
    layer_idx = fused_layer_indices(model.cfg.num_layers)
    meta = {"target": model.name, "target_fingerprint": model.fingerprint, "layers": list(layer_idx),
            "config": data_cfg, "sources": []}
    writer = DataWriter(folder, meta)
    answers = open_answers(model, data_cfg)
    if commit_every_s is not None and answers is None:
        raise HsdjaxError("committing answers needs a folder for them: set data.answers in the config")
    commits = (GitCommits(answers.folder, commit_every_s, log)
               if commit_every_s is not None and jax.process_index() == 0 else None)
    restore = sigterm_as_interrupt() if commits is not None else (lambda: None)  # a kill commits too
    try:
        return _generate(model, data_cfg, opts, writer, answers, commits, progress)
    finally:
        restore()
        if commits is not None:
            commits.maybe(answers, force=True)


def _generate(model: Any, data_cfg: dict[str, Any], opts: dict[str, Any], writer: DataWriter,
              answers: AnswerStore | None, commits: GitCommits | None, progress: bool) -> dict[str, Any]:
    """``generate_data``'s work: the prompts no shard and no recorded answer holds generated first (the work
    that cannot be redone without generating, committed as it goes), then the recorded answers the folder
    lacks re-recorded. The shards remember their piece, so the stream reads the same in either order."""
    man, budget = writer.manifest, opts["token_budget"]
    pending = 0  # tokens of recorded answers not yet in a shard here
    if answers is not None:
        if jax.process_index() == 0:
            export_shards(writer, answers)
        done = writer.done_prompts()
        pending = sum(int(p["tokens"]) for _, p in in_budget(answers.pieces, budget) if not set(p["prompts"]) <= done)
    if not man["complete"] and man["tokens"] + pending < budget:  # complete = every prompt used
        _generate_new(model, data_cfg, opts, writer, answers, commits, progress, pending)
    if answers is not None:
        rerecord_pieces(model, answers, writer, opts, progress=progress)
    return man


def _generate_new(model: Any, data_cfg: dict[str, Any], opts: dict[str, Any], writer: DataWriter,
                  answers: AnswerStore | None, commits: GitCommits | None, progress: bool, pending: int) -> None:
    """Generate answers for the prompts nothing holds yet until ``pending`` (recorded answers to re-record)
    plus the shards reach the token budget, or every prompt is used."""
    from tqdm import tqdm

    man, budget = writer.manifest, opts["token_budget"]
    stream = prompt_stream(data_cfg)
    if opts["first_prompt"] >= len(stream):
        raise HsdjaxError(f"data.first_prompt {opts['first_prompt']} is past the end of the prompt stream "
                          f"({len(stream)} prompts)")
    done = writer.done_prompts() | (answers.held_prompts() if answers is not None else set())
    todo = [r for r in stream[opts["first_prompt"]:] if r["index"] not in done]
    gen = recording_generator(model, opts["top_k_logits"])
    tok = model.tokenizer
    bar = tqdm(total=budget, initial=min(man["tokens"] + pending, budget), unit="tok", desc="drafter data",
               disable=not progress, smoothing=0.1)
    sink = ShardSink(writer, opts["shard_tokens"], bar, answers, commits, pending)
    for start in range(0, len(todo), opts["chunk"]):
        if sink.tokens >= budget:
            break
        jobs = _encode_chunk(tok, todo[start: start + opts["chunk"]], _prompt_limit(model, opts, gen.drafter))
        _run_chunk(gen, jobs, opts, sink, lambda: sink.tokens < budget, sink.work)
    sink.flush()
    bar.close()
    man["complete"] = sink.tokens < budget  # every prompt was used before the budget ran out
    writer.save()


# ------------------------------------------------------------------------------------------ recorded answers


def open_answers(model: Any, data_cfg: dict[str, Any]) -> AnswerStore | None:
    """The folder of recorded answers ``data.answers`` names (None when it names none), bound to this
    target, its tokenizer and these data settings (see ``hsdjax.train.answers``); ``data_cfg`` as
    ``data_settings`` checked it."""
    if data_cfg.get("answers") is None:
        return None
    settings = {k: v for k, v in data_cfg.items() if k not in PERF_KEYS}
    meta = {"target": model.name, "target_fingerprint": model.fingerprint,
            "tokenizer": getattr(model.tokenizer, "fingerprint", None),
            "data_key": data_key(model.fingerprint, data_cfg), "settings": settings}
    return AnswerStore(data_cfg["answers"], meta)


def export_shards(writer: DataWriter, answers: AnswerStore) -> int:
    """Pieces for the data folder's shards whose prompts no piece holds yet (data generated before the
    folder of answers was named); returns how many were written."""
    held, written = answers.held_prompts(), 0
    for shard in writer.manifest["shards"]:
        if not shard.get("prompts") or set(shard["prompts"]) <= held:
            continue
        with np.load(writer.folder / shard["file"]) as z:
            docs = shard_documents({k: z[k] for k in ("tokens", "answer", "doc")})
        keep = [(d, p) for d, p in zip(docs, shard["prompts"]) if p not in held]
        answers.add([d for d, _ in keep], [p for _, p in keep])
        written += 1
    return written


def in_budget(pieces: list[dict[str, Any]], budget: int) -> list[tuple[int, dict[str, Any]]]:
    """The pieces (with their indices) that make a token budget's data: in order, each one that starts
    before the budget (the run that made them stopped once the budget was reached; its last documents
    may run past it)."""
    out, start = [], 0
    for i, piece in enumerate(pieces):
        if start >= budget:
            break
        out.append((i, piece))
        start += int(piece["tokens"])
    return out


def rerecord_pieces(model: Any, answers: AnswerStore, writer: DataWriter, opts: dict[str, Any], *,
                    progress: bool = True) -> int:
    """Shards for the recorded answers the data folder lacks, piece by piece, of the pieces the token
    budget takes (``in_budget``: all of a generating run's, its last documents past the budget too), by
    a teacher-forced pass over each document (``teacher_forced``): no token is generated. A piece
    becomes one shard, so a killed run resumes at the next piece. Returns the tokens re-recorded."""
    from tqdm import tqdm

    done = writer.done_prompts()
    todo = [(i, p) for i, p in in_budget(answers.pieces, opts["token_budget"]) if not set(p["prompts"]) <= done]
    if not todo:
        return 0
    total = sum(p["tokens"] for _, p in todo)
    drafter, dparams = recording_drafter(model, opts["top_k_logits"])
    model, programs = rerecording_target(model, opts["rerecord_dtype"]), {}
    bar = tqdm(total=total, unit="tok", desc="re-recording answers", disable=not progress, smoothing=0.1)
    recorded = 0
    for index, piece in todo:
        docs = [d for d in answers.read(piece) if d["prompt"] not in done]
        t0 = time.perf_counter()
        records, compile_s = teacher_forced(model, drafter, dparams, [d["tokens"] for d in docs],
                                            opts["rerecord_batch"], programs)
        for d, rec in zip(docs, records):
            rec["tokens"], rec["answer"] = d["tokens"], d["answer"]
        arrays = {k: np.concatenate([r[k] for r in records]) for k in records[0]}
        arrays["doc"] = np.concatenate([np.full(len(r["tokens"]), i, np.int32) for i, r in enumerate(records)])
        seconds = time.perf_counter() - t0
        man = writer.manifest
        man["rerecorded_tokens"] = man.get("rerecorded_tokens", 0) + int(arrays["tokens"].size)
        man["rerecord_s"] = round(man.get("rerecord_s", 0.0) + seconds, 2)
        man["rerecord_compile_s"] = round(man.get("rerecord_compile_s", 0.0) + compile_s, 2)
        writer.add(arrays, [d["prompt"] for d in docs], seconds, index)
        recorded += int(arrays["tokens"].size)
        bar.update(int(arrays["tokens"].size))
    bar.close()
    return recorded


RERECORD_ALIGN = 64  # a teacher-forced group's documents are padded to a multiple of this (one program each)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter"))
def record_forward(params: dict[str, Any], dparams: dict[str, Array], tokens: Int[Array, "B T"],
                   lengths: Int[Array, " B"], *, cfg: Any, drafter: RecordingDrafter) -> dict[str, Array]:
    """What ``drafter`` records at every position of whole documents (right-padded to T), from one
    causal forward over them: no cache, no decoding state, no sampled token."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    fwd = Transformer(cfg).apply({"params": params}, tokens, positions, causal_mask(lengths, t), None,
                                 keep_layers=drafter.layers)
    states = bfloat16_bits(TargetStates(hidden=fwd["hidden"], layers=fwd["layers"]).per_position())
    chunks = fwd["hidden"].reshape(b * t // RERECORD_ALIGN, RERECORD_ALIGN, -1)  # small logits blocks stay in cache
    vals, ids = jax.lax.map(lambda h: drafter._top(dparams, h), chunks)
    return {"states": states, "top_logits": vals.reshape(b, t, -1), "top_ids": ids.reshape(b, t, -1)}


def rerecording_target(model: Any, dtype: str) -> Any:
    """The target the teacher-forced passes run: ``model`` itself, or for ``dtype="bfloat16"`` on the CPU
    kernels a copy whose projections are decoded once to bfloat16 and multiplied by XLA's dot with
    bfloat16 inputs and float32 sums (``ModelConfig.prefill_dot_dtype``), which runs on the CPU's
    bfloat16 units (AMX, AVX512-BF16): Qwen2.5-Coder-1.5B's passes 1.7x faster on a Xeon with AMX; states
    within 0.4% (median; 2% at p99) of the float32 pass's, top-1 ids equal at 99.8% of positions. The
    LM head (the recorded logits and ids) keeps the float32 products. ``"auto"``: bfloat16 where the CPU
    has bfloat16 units (``cpu_matmul.has_bf16_units``; without them XLA's bfloat16 dot is slower than the
    kernel's float32 one), else float32. Other backends: the model's own dtype."""
    from hsdjax.kernels.cpu_matmul import PANEL, decompress, has_bf16_units, is_compressed

    if dtype == "auto":
        dtype = "bfloat16" if has_bf16_units() else "float32"
    if dtype == "float32" or model.cfg.resolved_backend != "cpu-kernel":
        return model

    decode = jax.jit(lambda w: decompress(w).astype(jnp.bfloat16))

    def leaf(path, w):
        name = jax.tree_util.keystr(path)
        if "head" in name:  # the model's LM head: not read by these passes
            return w
        if is_compressed(w):
            return decode(w)
        if w.ndim >= 3 and w.shape[-1] == PANEL and w.dtype == jnp.float32:  # float32 panels
            return w.astype(jnp.bfloat16)
        return w

    params = jax.tree_util.tree_map_with_path(leaf, model.params)
    cfg = model.cfg.replace(cpu_matmul_prefill_xla=True, prefill_dot_dtype=dtype)
    return dataclasses.replace(model, params=params, cfg=cfg)


def teacher_forced(model: Any, drafter: RecordingDrafter, dparams: dict[str, Array], docs: list[np.ndarray],
                   batch: int, programs: dict | None = None) -> tuple[list[dict[str, np.ndarray]], float]:
    """What the recorder records for each document (``states``, ``top_logits``, ``top_ids`` at each of
    its positions), from one forward over its tokens (``record_forward``) instead of generating them:
    documents sorted by length, ``batch`` rows per pass (fewer, a power of two, for a short last group),
    each group padded to a multiple of ``RERECORD_ALIGN`` positions (a power-of-two prompt bucket padded
    the answers' lengths by 1.9x). Also returns the seconds spent compiling (once per padded shape;
    ``programs`` keeps the compiled ones from call to call)."""
    order = sorted(range(len(docs)), key=lambda i: (len(docs[i]), i))
    out: list[dict[str, np.ndarray]] = [{} for _ in docs]
    compile_s = 0.0
    programs = {} if programs is None else programs
    for start in range(0, len(order), batch):
        group = order[start: start + batch]
        rows = min(batch, 1 << (len(group) - 1).bit_length())
        t = -(-max(len(docs[i]) for i in group) // RERECORD_ALIGN) * RERECORD_ALIGN
        tokens, lengths = np.zeros((rows, t), np.int32), np.ones(rows, np.int32)
        for r, i in enumerate(group):
            tokens[r, :len(docs[i])], lengths[r] = docs[i], len(docs[i])
        args = (model.params, dparams, jnp.asarray(tokens), jnp.asarray(lengths))
        if (rows, t) not in programs:  # compiled apart, so the seconds say what compiling cost
            t0 = time.perf_counter()
            programs[rows, t] = record_forward.lower(*args, cfg=model.cfg, drafter=drafter).compile()
            compile_s += time.perf_counter() - t0
        rec = {k: to_host(v) for k, v in programs[rows, t](*args).items()}
        for r, i in enumerate(group):
            n = len(docs[i])
            out[i] = {"states": rec["states"][r, :n].view(np.uint16), "top_logits": rec["top_logits"][r, :n],
                      "top_ids": rec["top_ids"][r, :n]}
    return out, compile_s


def _prompt_limit(model: Any, opts: dict[str, Any], drafter: RecordingDrafter, turn: int = 0) -> int:
    """Longest prompt of a first turn (``max_prompt_tokens``) or of a later one (that plus
    ``max_new_tokens``), within the model's context."""
    fits = model.cfg.max_context - opts["max_new_tokens"] - drafter.spare - 1
    return min(opts["max_prompt_tokens"] + (opts["max_new_tokens"] if turn else 0), fits)


def _encode_chunk(tok: Any, rows: list[dict[str, Any]], max_prompt: int) -> list[Job]:
    """Jobs of a chunk of stream rows, prompts over ``max_prompt`` tokens left out."""
    jobs = []
    for r in rows:
        messages = [{"role": "user", "content": r["turns"][0]}]
        ids = encode_turns(tok, messages)
        if 0 < len(ids) <= max_prompt:
            jobs.append(Job(r["index"], r["source"], r["turns"], ids, 0, messages))
    return jobs


def _run_chunk(gen: Generator, jobs: list[Job], opts: dict[str, Any], sink: ShardSink,
               admit: Callable[[], bool], work: RecorderWork | None = None) -> None:
    """Answer a chunk of jobs: one continuous batch per KV-cache size, smallest first, each fed its
    prompts sorted by length; next turns that outgrow a cache size wait for a larger one."""
    model, drafter, tok = gen.model, gen.drafter, gen.model.tokenizer
    max_conv = _prompt_limit(model, opts, drafter, turn=1)

    def cache_for(job: Job) -> int:
        return engine.plan_shapes(model.cfg, len(job.ids), opts["max_new_tokens"], spare=drafter.spare)[1]

    def finish(job: Job, raw: dict[str, Any]) -> Job | None:
        nxt = next_turn(tok, job, raw, max_conv)
        if nxt is None:
            sink.add(job, row_record(raw["seq"], int(raw["seq_len"]), int(raw["prompt_len"]), raw, job.answer_spans))
        return nxt

    pending: dict[int, list[Job]] = collections.defaultdict(list)
    for job in jobs:
        pending[cache_for(job)].append(job)
    while pending:
        size = min(pending)
        queue = collections.deque(sorted(pending.pop(size), key=lambda j: (len(j.ids), j.index)))
        rec = ContinuousRecorder(gen, batch=opts["batch"], cache_size=size, max_new=opts["max_new_tokens"],
                                 temperature=opts["temperature"], seed=opts["seed"], refill_every=opts["refill_every"],
                                 work=work)
        rec.run(queue, admit, finish)
        for job in rec.deferred:
            pending[cache_for(job)].append(job)


def generate_recorded(gen: Generator, rows: list[list[int]], max_new: int, temperature: float,
                       seed: int) -> dict[str, np.ndarray]:
    """The fixed-batch recorder (reference for tests and benchmarks): ``gen`` (a ``recording_generator``)
    answers ``rows`` in one batch that runs until its longest answer ends; returns the flat recorded
    stream (see ``flatten_recorded``)."""
    run = gen.run_rows(rows, max_new_tokens=max_new, temperature=temperature, seed=seed)
    return flatten_recorded(run.state, [len(r) for r in rows])


def flatten_recorded(state: Any, prompt_lens: list[int]) -> dict[str, np.ndarray]:
    """The recorded rows of a finished ``DecodeState`` (of a ``RecordingDrafter``) as one stream
    (``doc`` numbers the sequences, ``answer`` marks generated tokens; the last generated token has no
    record and is dropped)."""
    rec = jax.tree_util.tree_map(to_host, state.draft)  # to_host: whole arrays even when sharded (multi-host)
    seq, seq_len = to_host(state.gen.seq), to_host(state.gen.seq_len)
    docs = [row_record(seq[i], int(seq_len[i]), p_len, {k: v[i] for k, v in rec.items()})
            for i, p_len in enumerate(prompt_lens)]
    out = {k: np.concatenate([d[k] for d in docs]) for k in docs[0]}
    out["doc"] = np.concatenate([np.full(d["tokens"].shape, i, np.int32) for i, d in enumerate(docs)])
    return out


def states_file(folder: Path, shards: list[dict[str, Any]], total: int) -> np.ndarray:
    """The ``states`` of ``shards`` (raw uint16 [total, F, E]) as one read-only memory-mapped ``.npy`` in
    ``folder``, named by the shards it holds; written once, shard by shard, then reused (by the other
    method's training on the same folder too). Writing a new one removes the folder's older ones."""
    key = hashlib.sha256(json.dumps([[s["file"], int(s["tokens"]), s.get("sha256")] for s in shards]).encode())
    path = folder / f"states-{key.hexdigest()[:16]}.npy"
    if not path.exists():
        with np.load(folder / shards[0]["file"]) as z:
            first = z["states"]
        tmp = path.with_suffix(".partial")
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=first.dtype, shape=(total, *first.shape[1:]))
        at = 0
        for shard in shards:
            with np.load(folder / shard["file"]) as z:
                part = z["states"]
            out[at: at + len(part)] = part
            at += len(part)
        out.flush()
        del out
        for old in folder.glob("states-*.npy"):
            old.unlink()
        os.replace(tmp, path)
    states = np.load(path, mmap_mode="r")
    if states.shape[0] != total:
        raise HsdjaxError(f"{path}: {states.shape[0]} tokens of states, the shards hold {total}; delete it")
    return states


def ordered_shards(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """A data folder's shards in the stream's order: that of the recorded-answers pieces they hold (a
    machine may generate new answers before re-recording older ones), else the order they were written."""
    shards = manifest["shards"]
    return [s for _, s in sorted(enumerate(shards), key=lambda e: (e[1].get("piece", e[0]), e[0]))]


def load_shards(folder: Path, limit_tokens: int | None = None, skip_answers: int = 0) -> dict[str, np.ndarray]:
    """All shards of a data folder as one flat stream; ``states`` as bfloat16 [N, F, E].

    ``limit_tokens``: the first shards only, whole shards until they hold at least that many tokens (the
    manifest copy's ``tokens`` and ``answer_tokens`` then say where they end). ``skip_answers``: leave
    out every shard that holds any of the folder's first ``skip_answers`` answer tokens (whole shards);
    the manifest copy then records ``skipped_tokens`` and ``skipped_answers``, and ``prompt_span``: the
    first and last stream index of the prompts in the shards loaded; its ``shards`` are listed in the
    stream's order (``ordered_shards``).

    Each array is allocated once at its final size and filled shard by shard (2M tokens of SmolLM2
    states are ~9 GB: a concatenation would need twice that). ``states``, most of the data (1M tokens of
    Qwen2.5-Coder-1.5B's are 12.6 GB), is a read-only memory map of one file in the folder made from the
    shards the first time they are loaded (``states_file``): the kernel's page cache holds it and can give
    it back, so training on more data than memory holds slows down instead of being killed."""
    man_path = folder / "manifest.json"
    if not man_path.exists():
        raise HsdjaxError(f"no drafter data in {folder} (run `hsdjax train-drafter CONFIG --stage data` first)")
    man = json.loads(man_path.read_text())
    shards, total, skipped, skipped_answers = [], 0, 0, 0
    for shard in ordered_shards(man):
        if limit_tokens and total >= limit_tokens:
            break
        if skipped_answers < skip_answers:
            skipped += int(shard["tokens"])
            skipped_answers += int(shard["answer_tokens"])
            continue
        shards.append(shard)
        total += int(shard["tokens"])
    if not shards:
        if skip_answers:
            raise HsdjaxError(f"drafter data in {folder}: no shard lies past its first {skip_answers} answer "
                              f"tokens (it holds {skipped_answers}); a larger --token-budget extends it")
        raise HsdjaxError(f"drafter data in {folder} has no shards yet")
    data: dict[str, np.ndarray] = {"states": states_file(folder, shards, total)}
    at, doc_offset = 0, 0
    for shard in shards:
        with np.load(folder / shard["file"]) as z:
            arrays = {k: z[k] for k in z.files if k != "states"}
        n = arrays["tokens"].shape[0]
        if n != int(shard["tokens"]):
            raise HsdjaxError(f"{folder / shard['file']}: {n} tokens, the manifest says {shard['tokens']}")
        arrays["doc"] = arrays["doc"] + doc_offset
        doc_offset = int(arrays["doc"].max()) + 1
        for k, v in arrays.items():
            if k not in data:
                data[k] = np.empty((total, *v.shape[1:]), v.dtype)
            data[k][at: at + n] = v
        at += n
    data["states"] = data["states"].view(ml_dtypes.bfloat16)
    indices = [i for shard in shards for i in shard.get("prompts", [])]  # format 1 shards list none
    if limit_tokens:  # where in the sequence the loaded data end (not the folder)
        man = {**man, "tokens": skipped + total,
               "answer_tokens": skipped_answers + sum(int(shard["answer_tokens"]) for shard in shards)}
    data["manifest"] = {**man, "shards": ordered_shards(man), "skipped_tokens": skipped, "skipped_answers": skipped_answers,
                        "prompt_span": [min(indices), max(indices)] if indices else None}
    return data
