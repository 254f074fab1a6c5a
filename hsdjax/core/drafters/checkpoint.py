"""Feature-drafter checkpoints: one safetensors file (bfloat16 weights + the draft vocabulary) whose
metadata records the drafter's shape, the target it was trained for (name and weights fingerprint),
its training sources and summary. Loading binds it to a loaded target: the head and the token
embeddings come from the target's frozen weights, never from the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from hsdjax.core.drafters.feature import HEAD_DELTA, OUTPUT_SIDE, FeatureConfig, draft_head, pack_for_cpu
from hsdjax.errors import HsdjaxError
from hsdjax.runtime.weights import flatten, unflatten

SHIPPED_DIR = Path(__file__).parent / "checkpoints"
FORMAT = "hsdjax-feature-drafter/1"


def shipped_path(model_name: str, method: str) -> Path:
    return SHIPPED_DIR / f"{model_name}-{method}.safetensors"


def save_drafter(path: Path, cfg: FeatureConfig, params: Any, vocab_ids: np.ndarray, layers: tuple[int, ...],
                 target: Any, info: dict[str, Any]) -> Path:
    """Write a checkpoint (weights in bfloat16)."""
    from safetensors.numpy import save_file

    tensors = {"net." + k.replace("/", "."): np.asarray(v, np.float32).astype(ml_dtypes.bfloat16)
               for k, v in flatten(jax.device_get(params)).items()}  # tensor names: net.layer.wq ...
    # contiguous: safetensors' numpy writer stores a strided view's raw buffer (0.8.0)
    tensors["vocab_ids"] = np.ascontiguousarray(vocab_ids, np.int32)
    meta = {"format": FORMAT, "config": json.dumps(cfg.to_json()), "layers": json.dumps(list(layers)),
            "target": target.name, "target_fingerprint": target.fingerprint, "info": json.dumps(info)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{jax.process_index()}.{os.getpid()}.tmp")  # one per process: multi-host safe
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def read_meta(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise HsdjaxError(f"{path}: not a drafter checkpoint ({e})") from None
    if meta.get("format") != FORMAT:
        raise HsdjaxError(f"{path}: not an hsdjax feature-drafter checkpoint")
    return {"config": json.loads(meta["config"]), "layers": tuple(json.loads(meta["layers"])),
            "target": meta["target"], "target_fingerprint": meta["target_fingerprint"],
            "info": json.loads(meta.get("info", "{}"))}


def read_drafter(path: str | Path) -> tuple[FeatureConfig, tuple[int, ...], np.ndarray, dict[str, Any],
                                           dict[str, Any]]:
    """(config, fused layers, vocab ids, float32 params as trained, metadata) of a checkpoint, not yet
    bound to a target (a trained head correction stays a separate entry)."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise HsdjaxError(f"drafter checkpoint not found: {path}")
    meta = read_meta(path)
    flat = load_file(str(path))
    vocab_ids = flat.pop("vocab_ids").astype(np.int32)
    net = unflatten({k[4:].replace(".", "/"): v.astype(np.float32) for k, v in flat.items() if k.startswith("net.")})
    return FeatureConfig(**meta["config"]), meta["layers"], vocab_ids, net, meta


def _check_target(path: Path, meta: dict[str, Any], target: Any) -> None:
    if meta["target_fingerprint"] != target.fingerprint:
        raise HsdjaxError(f"{path.name} was trained for {meta['target']} (weights {meta['target_fingerprint'][:12]}), "
                          f"not for {target.name} (weights {target.fingerprint[:12]}); train one with "
                          "`hsdjax train-drafter`")


def load_drafter(path: str | Path, target: Any, method: str, head_rows: bool = False
                 ) -> tuple[FeatureConfig, tuple[int, ...], dict[str, Any], dict[str, Any]]:
    """(config, fused layers, dparams, metadata) of a checkpoint, bound to ``target`` (``head_rows``: see
    ``bind``)."""
    path = Path(path)
    if path.is_file():
        _check_target(path, read_meta(path), target)  # before reading the tensors
    cfg, layers, vocab_ids, net, meta = read_drafter(path)
    if cfg.method != method:
        raise HsdjaxError(f"{path.name} is a {cfg.method} drafter, not {method}")
    return cfg, layers, bind(net, vocab_ids, target.params, target.cfg, head_rows), meta


def warm_start(path: str | Path, cfg: FeatureConfig, layers: tuple[int, ...], target: Any
               ) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
    """(vocab ids, params, metadata) of a checkpoint that training continues from (the train setting
    ``init``): it must be a drafter of the same shape, reading the same layers of the same target. A
    plain ``hsd`` may start an ``hsd`` that adds ``root_token`` (``root_token_passthrough``),
    ``chain_layer`` (the chain's layer starts as a copy of the one layer) or ``chain_g`` (the chain's
    output side a copy of the network's): each starts computing exactly what the plain drafter computed."""
    path = Path(path)
    if path.is_file():
        _check_target(path, read_meta(path), target)
    got, got_layers, vocab_ids, net, meta = read_drafter(path)
    mine, theirs = cfg.to_json(), got.to_json()
    differ = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    net, differ = grow_plain_hsd(net, cfg, differ)
    if differ:
        what = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in sorted(differ.items()))
        raise HsdjaxError(f"cannot start training from {path.name}: another drafter shape ({what})")
    if tuple(got_layers) != tuple(layers):
        raise HsdjaxError(f"cannot start training from {path.name}: it reads target layers {list(got_layers)}, "
                          f"the data record {list(layers)}")
    return vocab_ids, net, meta


def grow_plain_hsd(net: dict[str, Any], cfg: FeatureConfig, differ: dict[str, tuple[Any, Any]]
                   ) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """A trained ``hsd`` network grown into ``cfg``'s where ``cfg`` adds ``root_token`` (``fc`` passes
    the feature through, ``root_token_passthrough``), ``chain_layer`` (the chain's layer starts as
    a copy of the one layer) or ``chain_g`` (the chain's ``g`` and norms start as copies of the
    network's): either way it computes exactly what it did. Returns the network and the
    settings that still differ (``differ``: setting -> (the checkpoint's value, ``cfg``'s))."""
    differ = dict(differ)
    if cfg.method != "hsd":
        return net, differ
    if differ.get("root_token") == (False, True):
        net = {**net, "fc": root_token_passthrough(cfg)}
        del differ["root_token"]
    if differ.get("chain_layer") == (False, True):
        net = {**net, "chain": dict(net["layer"])}
        del differ["chain_layer"]
    if differ.get("chain_g") == (False, True):
        net = {**net, "chain_output": {k: net[k] for k in OUTPUT_SIDE if k in net}}
        del differ["chain_g"]
    return net, differ


def root_token_passthrough(cfg: FeatureConfig) -> np.ndarray:
    """``fc`` [W + E, W] that passes the fused feature through and ignores the token: an ``hsd``
    drafter trained without ``root_token`` computes exactly what it did, and training learns the rest."""
    w = cfg.state_width
    return np.concatenate([np.eye(w, dtype=np.float32), np.zeros((cfg.hidden, w), np.float32)])


def frozen_from_target(target: Any) -> dict[str, Any]:
    return frozen_from_params(target.params, target.cfg)


def frozen_from_params(params: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """The target's frozen pieces a drafter uses: token embeddings, LM head rows [V, E], final norm."""
    embed = params["embed"]
    head = embed if cfg.tie_embeddings else jnp.transpose(params["lm_head"])
    return {"embed": embed, "head_full": head, "final_norm": params["final_norm"]}


def bind(net: Any, vocab_ids: np.ndarray, params: dict[str, Any], cfg: Any, head_rows: bool = False
         ) -> dict[str, Any]:
    """``dparams`` of a feature drafter: its weights plus the target's frozen embeddings and head (with
    the checkpoint's trained head correction added, when it has one); ``head_rows``: also the head's
    rows [V, E] as they are (not packed for the CPU kernel), which an ``hsd`` shortlist gathers from."""
    frozen = frozen_from_params(params, cfg)
    ids = jnp.asarray(vocab_ids, jnp.int32)
    net = jax.tree_util.tree_map(jnp.asarray, net)
    rows = jnp.take(frozen["head_full"], ids, axis=0)
    head = draft_head(rows, net).astype(rows.dtype)
    kept = {"head_rows": head} if head_rows else {}
    net = {k: v for k, v in net.items() if k != HEAD_DELTA}
    if cfg.resolved_backend == "cpu-kernel":  # the target runs on the CPU kernels: so does the drafter
        net, head = pack_for_cpu(net, head, params.get("head_panels"), ids)
    return {"net": net, "embed": frozen["embed"], "head": head, "vocab_ids": ids, **kept}
