"""Self-distillation data for feature drafters: the target answers training prompts itself.

For each batch of prompts the target generates answers with the jitted engine (plain decoding with
a recording drafter, so nothing is computed twice) and records, per token: the token, whether it
belongs to the answer, the target's input states of the fused layers plus its last layer's output
(bfloat16), and its top-k next-token logits. Batches become shards (``shard_00000.npz`` ...) under the data folder;
``manifest.json`` lists finished shards and how many prompts were consumed, so a rerun continues
where the last one stopped and never redoes a finished shard. Work stops at a token budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array

from hsdjax.drafters.base import ARDrafter
from hsdjax.drafters.checkpoint import frozen_from_target
from hsdjax.errors import HsdjaxError
from hsdjax.jsonl import read_objects
from hsdjax.sharding import to_host



def fused_layer_indices(num_layers: int) -> tuple[int, int, int, int]:
    """Recorded states: inputs of a low, a middle and a high layer (EAGLE-3's choice: 2, L/2, L-3)
    and the last layer's output (index L), from which the final normed state is recomputed."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0), num_layers)


def read_prompts(path: str | Path, exclude_sources: list[str]) -> list[dict[str, Any]]:
    """Training prompts (jsonl with ``prompt`` and optional ``source``), minus excluded sources."""
    path = Path(path)
    if not path.is_file():
        raise HsdjaxError(f"training prompts not found: {path}")
    rows = []
    for n, obj in read_objects(path, "training prompts"):
        if not isinstance(obj.get("prompt"), str):
            raise HsdjaxError(f"{path}:{n}: expected an object with a string 'prompt'")
        source = str(obj.get("source", ""))
        if any(source == s or source.startswith(s + ":") for s in exclude_sources):
            continue
        rows.append({"prompt": obj["prompt"], "source": source})
    if not rows:
        raise HsdjaxError(f"{path}: no prompts left after excluding sources {exclude_sources}")
    return rows


def data_key(target_fingerprint: str, data_cfg: dict[str, Any]) -> str:
    """Folder name for a data configuration: same target + same settings = same data (the budget
    is left out, so raising it continues the same folder)."""
    blob = json.dumps({"target": target_fingerprint, **{k: v for k, v in data_cfg.items() if k not in ("dir", "token_budget")}},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def top_k_blocked(logits: Array, k: int, block: int = 512) -> tuple[Array, Array]:
    """Exact top-k over a large vocabulary in two stages: the k blocks with the largest maxima
    hold the top k, so only k*block candidates are sorted. (On XLA's CPU backend ``lax.top_k``
    over the whole vocabulary is a full sort, about 60x slower here.)"""
    *lead, v = logits.shape
    if v <= k * block:
        return jax.lax.top_k(logits, k)
    pad = (-v) % block
    if pad:
        logits = jnp.concatenate([logits, jnp.full((*lead, pad), -jnp.inf, logits.dtype)], axis=-1)
    blocks = logits.reshape(*lead, -1, block)
    _, best_blocks = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    cand = jnp.take_along_axis(blocks, best_blocks[..., None], axis=-2).reshape(*lead, k * block)
    vals, ci = jax.lax.top_k(cand, k)
    ids = jnp.take_along_axis(best_blocks, ci // block, axis=-1) * block + ci % block
    return vals, ids


def _writer_tag() -> str:
    """Process index and pid: temporary file names no other writer uses."""
    import jax

    return f"{jax.process_index()}.{os.getpid()}"


class DataWriter:
    """Shards + manifest in one folder; writes are atomic (temporary file, then rename).

    In a multi-process run every process computes the same replicated data and writes it; each writes
    through its own temporary name, so a shared folder ends with one whole copy and local folders each
    get theirs."""

    def __init__(self, folder: Path, meta: dict[str, Any]):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.manifest_path = folder / "manifest.json"
        if self.manifest_path.exists():
            self.manifest = json.loads(self.manifest_path.read_text())
        else:
            self.manifest = {**meta, "shards": [], "prompts_done": 0, "tokens": 0, "answer_tokens": 0,
                             "seconds": 0.0, "complete": False}

    def add(self, arrays: dict[str, np.ndarray], prompts_done: int, seconds: float) -> None:
        name = f"shard_{len(self.manifest['shards']):05d}.npz"
        tmp = self.folder / f"{name}.{_writer_tag()}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, self.folder / name)
        n = int(arrays["tokens"].shape[0])
        self.manifest["shards"].append({"file": name, "tokens": n,
                                        "answer_tokens": int(arrays["answer"].sum())})
        self.manifest["prompts_done"] = prompts_done
        self.manifest["tokens"] += n
        self.manifest["answer_tokens"] += int(arrays["answer"].sum())
        self.manifest["seconds"] += seconds
        self.save()

    def save(self) -> None:
        tmp = self.manifest_path.with_suffix(f".{_writer_tag()}.tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1))
        os.replace(tmp, self.manifest_path)


def generate_data(model: Any, data_cfg: dict[str, Any], folder: Path, *, progress: bool = True) -> dict[str, Any]:
    """Generate (or continue generating) the data described by ``data_cfg`` into ``folder``."""
    from tqdm import tqdm

    from hsdjax.api import Generator

    cfg = model.cfg
    layer_idx = fused_layer_indices(cfg.num_layers)
    meta = {"target": model.name, "target_fingerprint": model.fingerprint, "layers": list(layer_idx),
            "config": data_cfg, "sources": []}
    writer = DataWriter(folder, meta)
    man = writer.manifest
    budget = int(data_cfg.get("token_budget", 1_000_000))
    if man["complete"] or man["tokens"] >= budget:  # complete = every prompt used; a larger budget continues
        return man
    prompts = read_prompts(data_cfg["prompts"], list(data_cfg.get("exclude_sources", [])))
    gen = Generator(model, "ar")
    tok = model.tokenizer
    batch = int(data_cfg.get("batch", 32))
    max_prompt = int(data_cfg.get("max_prompt_tokens", 384))
    max_new = int(data_cfg.get("max_new_tokens", 256))
    top_k = int(data_cfg.get("top_k_logits", 8))
    temperature = float(data_cfg.get("temperature", 0.0))
    gen.drafter = RecordingDrafter(layers=layer_idx, top_k=top_k)
    gen.dparams = {"head": frozen_from_target(model)["head_full"]}
    sources = set(man.get("sources", []))
    bar = tqdm(total=budget, initial=min(man["tokens"], budget), unit="tok", desc="drafter data",
               disable=not progress, smoothing=0.1)
    index = man["prompts_done"]
    while man["tokens"] < budget and index < len(prompts):
        t0 = time.perf_counter()
        rows, used = [], []
        while len(rows) < batch and index < len(prompts):
            item = prompts[index]
            index += 1
            ids = tok.encode_chat([{"role": "user", "content": item["prompt"]}]) if tok.has_chat_template \
                else tok.encode(item["prompt"], add_special_tokens=True)
            if len(ids) <= max_prompt:
                rows.append(ids)
                used.append(item["source"])
        if not rows:
            break
        arrays = _generate_recorded(gen, rows, max_new, temperature, seed=index)
        sources.update(s.split(":")[0] for s in used)
        man["sources"] = sorted(sources)
        writer.add(arrays, index, time.perf_counter() - t0)
        bar.update(min(arrays["tokens"].shape[0], max(budget - bar.n, 0)))
        bar.set_postfix(prompts=index, answer_tok=man["answer_tokens"])
    bar.close()
    man["complete"] = index >= len(prompts)
    writer.save()
    return man


@dataclasses.dataclass(frozen=True)
class RecordingDrafter(ARDrafter):
    """Plain decoding that records, at every position, the target states of ``layers`` and the
    target's top-k next-token logits: from the prompt's forward at the start, then from each
    round's verified root. Nothing is computed twice."""

    name: str = "record"
    layers: tuple[int, ...] = ()
    top_k: int = 8

    @property
    def prompt_layers(self) -> tuple[int, ...]:
        return self.layers

    def _top(self, dparams, hidden):
        logits = jnp.einsum("...e,ve->...v", hidden, dparams["head"], preferred_element_type=jnp.float32)
        vals, ids = top_k_blocked(logits, self.top_k)
        return vals.astype(jnp.float16), ids.astype(jnp.int32)

    def init_state(self, dparams, gen, prompt_fwd):
        b, s = gen.seq.shape
        states = jnp.moveaxis(prompt_fwd["layers"], 0, 2).astype(jnp.bfloat16)  # [B, P, F, E]
        p = states.shape[1]
        vals, ids = jax.lax.map(lambda h: self._top(dparams, h), prompt_fwd["hidden"])  # row by row
        buf = {"states": jnp.zeros((b, s, *states.shape[2:]), jnp.bfloat16).at[:, :p].set(states),
               "top_logits": jnp.zeros((b, s, self.top_k), jnp.float16).at[:, :p].set(vals),
               "top_ids": jnp.zeros((b, s, self.top_k), jnp.int32).at[:, :p].set(ids)}
        return buf

    def observe(self, dparams, state, gen_before, gen_after, verdict, path_states):
        pos = gen_before.seq_len - 1  # the root, verified this round
        rows = jnp.arange(pos.shape[0])
        fused = jnp.stack([path_states["layers"][i][:, 0] for i in self.layers], axis=1).astype(jnp.bfloat16)
        vals, ids = self._top(dparams, path_states["hidden"][:, 0])
        return {"states": state["states"].at[rows, pos].set(fused),
                "top_logits": state["top_logits"].at[rows, pos].set(vals),
                "top_ids": state["top_ids"].at[rows, pos].set(ids)}


def _generate_recorded(gen: Any, rows: list[list[int]], max_new: int, temperature: float,
                       seed: int) -> dict[str, np.ndarray]:
    """Generate answers for ``rows`` and return the flat recorded stream (``doc`` numbers the
    sequences, ``answer`` marks generated tokens; the last generated token has no record and is
    dropped)."""
    inputs, _, s_bucket = gen._batch(rows, max_new, temperature, 0, 1.0, seed)
    state, _, _ = gen._prefill(inputs, s_bucket)
    program, _ = gen._decode_program(state)
    return flatten_recorded(program(state, max_new), [len(r) for r in rows])


def flatten_recorded(state: Any, prompt_lens: list[int]) -> dict[str, np.ndarray]:
    """The recorded rows of a finished ``DecodeState`` (of a ``RecordingDrafter``) as one stream."""
    rec = jax.tree_util.tree_map(to_host, state.draft)  # to_host: whole arrays even when sharded (multi-host)
    seq, seq_len = to_host(state.gen.seq), to_host(state.gen.seq_len)
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("tokens", "doc", "answer", "states", "top_logits", "top_ids")}
    for i, p_len in enumerate(prompt_lens):
        n = int(seq_len[i]) - 1
        out["tokens"].append(seq[i, :n].astype(np.int32))
        out["doc"].append(np.full((n,), i, np.int32))
        out["answer"].append(np.arange(n) >= p_len)
        out["states"].append(rec["states"][i, :n].view(np.uint16))  # bfloat16 bits (npz has no bfloat16)
        out["top_logits"].append(rec["top_logits"][i, :n])
        out["top_ids"].append(rec["top_ids"][i, :n])
    return {k: np.concatenate(v) for k, v in out.items()}


def load_shards(folder: Path, limit_tokens: int | None = None) -> dict[str, np.ndarray]:
    """All shards of a data folder as one flat stream; ``states`` as bfloat16 [N, F, E]."""
    man_path = folder / "manifest.json"
    if not man_path.exists():
        raise HsdjaxError(f"no drafter data in {folder} (run `hsdjax train-drafter CONFIG --stage data` first)")
    man = json.loads(man_path.read_text())
    parts: dict[str, list[np.ndarray]] = {}
    doc_offset, total = 0, 0
    for shard in man["shards"]:
        with np.load(folder / shard["file"]) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["doc"] = arrays["doc"] + doc_offset
        doc_offset = int(arrays["doc"].max()) + 1
        for k, v in arrays.items():
            parts.setdefault(k, []).append(v)
        total += arrays["tokens"].shape[0]
        if limit_tokens and total >= limit_tokens:
            break
    if not parts:
        raise HsdjaxError(f"drafter data in {folder} has no shards yet")
    data = {k: np.concatenate(v) for k, v in parts.items()}
    data["states"] = data["states"].view(ml_dtypes.bfloat16)
    data["manifest"] = man
    return data
