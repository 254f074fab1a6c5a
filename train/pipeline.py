"""`hsdjax train-drafter CONFIG`: data generation then training, reproducible from one JSON config.

A config (see ``configs/drafter-*.json``) names the target, the data (prompt files, per-source weights,
excluded sources, token budget, generation settings; see ``hsdjax.train.datagen``), the drafter's shape
and the training settings. Data live in the cache keyed by target + data settings (the budget and the
speed-only settings ``batch``, ``refill_every``, ``chunk``, ``shard_tokens`` left out), so the `hsd` and
`eagle` configs of one target share them;
a training run lives in ``cache/drafters/<config name>/`` (orbax checkpoints, history) and ends by
exporting a bfloat16 checkpoint that ``--drafter PATH`` loads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from hsdjax.errors import HsdjaxError

DRAFTER_DEFAULTS = {"mlp": 768, "vocab": 4096, "injection": "mlp", "inject_tokens": 2, "inject_hidden": 0,
                    "head_delta": False, "width": 0, "root_token": False, "chain_layer": False,
                    "chain_g": False}


def drafter_heads(mc: Any, width: int) -> tuple[int, int]:
    """(query heads, key/value heads) of a drafter layer ``width`` wide (0: the target's width): the
    target's head size, as many heads as fit, and the target's key/value grouping where it divides."""
    if not width or width == mc.hidden_size:
        return mc.num_heads, mc.num_kv_heads
    if width < 0 or width > mc.hidden_size or width % mc.head_dim:
        raise HsdjaxError(f"drafter width {width} must be a multiple of the target's head size {mc.head_dim} "
                          f"and at most its hidden size {mc.hidden_size}")
    heads = width // mc.head_dim
    kv = mc.num_kv_heads if heads % mc.num_kv_heads == 0 else 1
    return heads, kv


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise HsdjaxError(f"config not found: {path}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HsdjaxError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    for key in ("target", "method", "data"):
        if key not in cfg:
            raise HsdjaxError(f"{path}: missing {key!r}")
    if cfg["method"] not in ("hsd", "eagle"):
        raise HsdjaxError(f"{path}: method must be hsd or eagle (got {cfg['method']!r})")
    from hsdjax.train.train import TRAIN_DEFAULTS

    for section, known in (("drafter", DRAFTER_DEFAULTS), ("train", TRAIN_DEFAULTS)):
        unknown = sorted(set(cfg.get(section, {})) - set(known))
        if unknown:  # a misspelt setting would otherwise be silently ignored
            raise HsdjaxError(f"{path}: unknown {section} setting(s) {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(sorted(known))}")
    from hsdjax.core.drafters.feature import INJECTIONS

    injection = cfg.get("drafter", {}).get("injection", DRAFTER_DEFAULTS["injection"])
    if injection not in INJECTIONS:
        raise HsdjaxError(f"{path}: drafter injection {injection!r}: expected one of {', '.join(INJECTIONS)}")
    for key in ("mlp", "vocab", "inject_tokens", "inject_hidden", "width"):  # sizes; 0 means "the default width"
        value = cfg.get("drafter", {}).get(key, DRAFTER_DEFAULTS[key])
        least = 0 if key in ("inject_hidden", "width") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise HsdjaxError(f"{path}: drafter {key} must be a whole number >= {least} (got {value!r})")
    if cfg.get("drafter", {}).get("inject_tokens", 2) > 2:  # g sees a node's token and its parent's
        raise HsdjaxError(f"{path}: drafter inject_tokens must be 1 or 2 (the node's token, and its parent's)")
    hsd_only = {"root_token": "eagle's inputs always carry the next token",
                "chain_layer": "eagle's chain steps read a token, so its one layer sees no predicted state alone",
                "chain_g": "eagle has no g: its tokens enter through the layer's input"}
    for key, why in hsd_only.items():
        value = cfg.get("drafter", {}).get(key, False)
        if not isinstance(value, bool):
            raise HsdjaxError(f"{path}: drafter {key} must be true or false (got {value!r})")
        if value and cfg["method"] != "hsd":
            raise HsdjaxError(f"{path}: drafter {key} is an hsd setting ({why})")
    detach = cfg.get("train", {}).get("detach_chain", False)
    if not isinstance(detach, bool):
        raise HsdjaxError(f"{path}: train detach_chain must be true or false (got {detach!r})")
    if detach and not (cfg["method"] == "hsd" and cfg.get("drafter", {}).get("chain_layer") is True):
        raise HsdjaxError(f"{path}: train detach_chain needs an hsd drafter with chain_layer (without it the "
                          "chain's steps run the first layer, whose gradient it would cut only in part)")
    cfg["name"] = cfg.get("name", path.stem)
    return cfg


def data_folder(model: Any, data_cfg: dict[str, Any]) -> Path:
    from hsdjax.paths import cache_dir
    from hsdjax.train.datagen import data_key

    if data_cfg.get("dir"):
        return Path(data_cfg["dir"])
    return cache_dir("drafter-data") / f"{model.name}-{data_key(model.fingerprint, data_cfg)}"


def run(config_path: str | Path, *, stage: str = "all", out: str | None = None, token_budget: int | None = None,
        max_steps: int | None = None, epochs: float | None = None, progress: bool = True, log: Any = print,
        mesh: Any = None, init: str | None = None, new_data_only: bool = False,
        first_prompt: int | None = None, data_tokens: int | None = None,
        commit_answers_min: float | None = None) -> dict[str, Any]:
    """Run the stages of a config; returns a summary (data folder, checkpoint path, history).

    ``first_prompt`` overrides ``data.first_prompt`` (see ``hsdjax.train.datagen``). ``data_tokens``:
    train on the folder's first shards only, whole shards up to that many tokens. ``commit_answers_min``:
    commit the recorded answers (``data.answers``) to git at most every that many minutes while the data
    stage runs, and when it ends.

    ``mesh`` (a ``jax.sharding.Mesh`` with axes data/model, or None for one device): the target is
    sharded over it for data generation (``load_model(..., mesh=)``) and the drafter trains
    data-parallel over its ``data`` axis.
    """
    from hsdjax.frontends.api import load_model
    from hsdjax.runtime.loading import load_target_parts
    from hsdjax.train.datagen import generate_data
    from hsdjax.train.train import TRAIN_DEFAULTS, check_data_parallel

    cfg = read_config(config_path)
    if stage in ("train", "all"):  # before hours of data generation
        check_data_parallel(int({**TRAIN_DEFAULTS, **cfg.get("train", {})}["batch"]), mesh)
    if token_budget is not None:
        cfg["data"]["token_budget"] = token_budget
    if first_prompt is not None:
        cfg["data"]["first_prompt"] = first_prompt
    if stage == "train":  # the drafter trains on recorded states: of the target it needs the head only
        model = load_target_parts(cfg["target"])
    else:
        model = load_model(cfg["target"], mesh=mesh)
    drafter_heads(model.cfg, int({**DRAFTER_DEFAULTS, **cfg.get("drafter", {})}["width"]))  # before the data, too
    folder = data_folder(model, cfg["data"])
    summary: dict[str, Any] = {"data": str(folder)}
    if stage in ("data", "all"):
        every = None if commit_answers_min is None else 60.0 * commit_answers_min
        man = generate_data(model, cfg["data"], folder, progress=progress, commit_every_s=every, log=log)
        again = f"; {man['rerecorded_tokens']} re-recorded from {cfg['data']['answers']}" if man.get("rerecorded_tokens") else ""
        log(f"data: {man['tokens']} tokens ({man['answer_tokens']} generated by the target{again}) in {folder}")
    if stage in ("train", "all"):
        summary.update(train_from_config(cfg, model, folder, out=out, max_steps=max_steps, epochs=epochs,
                                         progress=progress, log=log, mesh=mesh, init=init,
                                         new_data_only=new_data_only, data_tokens=data_tokens))
    return summary


def _same_sequence_starts(init_info: dict[str, Any], data_cfg: dict[str, Any]) -> tuple[int, int] | None:
    """(this data's ``first_prompt``, the checkpoint's) when both come from the same seeded prompt sequence
    (same data settings, budget and start aside); None when they do not or the checkpoint has no record."""
    from hsdjax.train.datagen import PERF_KEYS

    old_data = dict((init_info.get("config") or {}).get("data") or {})
    strip = lambda d: {k: v for k, v in d.items() if k not in (*PERF_KEYS, "first_prompt")}  # noqa: E731
    if not old_data or strip(old_data) != strip(dict(data_cfg)):
        return None
    return int(data_cfg.get("first_prompt", 0)), int(old_data.get("first_prompt", 0))


def seen_answers(init_info: dict[str, Any], data_cfg: dict[str, Any]) -> int | None:
    """How many of this data's first answer tokens a warm start's checkpoint trained on: its
    ``answer_tokens`` when its data had the same settings (the budget aside), i.e. the same seeded prompt
    sequence from the same ``first_prompt``; 0 when this data starts (``first_prompt``) past the last prompt
    the checkpoint records having seen (``prompt_span``); None when that cannot be told. Answer tokens (what
    the target generated), not all tokens: a data format that counts prompts differently still reaches the
    same answers in the same order."""
    seen = init_info.get("answer_tokens")
    starts = _same_sequence_starts(init_info, data_cfg)
    if not seen or starts is None:
        return None
    first, old_first = starts
    if first == old_first:
        return int(seen)
    span = init_info.get("prompt_span")
    return 0 if span and first > int(span[1]) else None


def seen_data_note(init_info: dict[str, Any], data_cfg: dict[str, Any], answers: int) -> str | None:
    """A warning when a warm start trains on data its checkpoint has already seen (see ``seen_answers``;
    ``answers``: the answer tokens of the data this run trains on, from the start of the sequence)."""
    seen = seen_answers(init_info, data_cfg)
    first, old_first = _same_sequence_starts(init_info, data_cfg) or (0, 0)
    if seen is None and first != old_first:
        return (f"note: this data starts at prompt {first} of the sequence and the starting checkpoint's at prompt "
                f"{old_first}; its checkpoint does not record where its data ended, so whether this data is new to "
                "it cannot be told here (its answer_tokens and the data's manifest can)")
    if seen is None:
        return None
    if seen == 0:
        return (f"note: this data starts at prompt {first}, past the last prompt the starting checkpoint trained on "
                f"({init_info['prompt_span'][1]}): all of it is new")
    if answers <= seen:
        return (f"note: the starting checkpoint was trained on {seen} answer tokens of this same prompt sequence and "
                f"this data holds {answers}: all of it (held-out tail included) was seen, so this run adds epochs, "
                "not data, and its held-out figures flatter it (a larger --token-budget extends the data, "
                "--new-data-only trains on the extension alone)")
    return (f"note: the first {seen} of these {answers} answer tokens are the starting checkpoint's training data "
            f"(same prompt sequence); {answers - seen} are new (--new-data-only trains on those alone)")


def train_from_config(cfg: dict[str, Any], model: Any, folder: Path, *, out: str | None, max_steps: int | None,
                      epochs: float | None, progress: bool, log: Any, mesh: Any = None,
                      init: str | None = None, new_data_only: bool = False, data_tokens: int | None = None
                      ) -> dict[str, Any]:
    """Train the config's drafter on the data in ``folder`` (data-parallel over ``mesh``) and export it.

    ``new_data_only``: with a warm start, train on the shards past the checkpoint's own data alone (the
    same prompt sequence continued; ``seen_answers``); the held-out tail is then new to it as well."""
    from hsdjax.core.drafters.checkpoint import frozen_from_target, read_meta, save_drafter, shipped_path, warm_start
    from hsdjax.core.drafters.feature import FeatureConfig
    from hsdjax.paths import cache_dir
    from hsdjax.runtime.sharding import to_host
    from hsdjax.train.datagen import load_shards
    from hsdjax.train.train import TRAIN_DEFAULTS, draft_vocab, train

    t0 = time.perf_counter()
    opts = {**TRAIN_DEFAULTS, **cfg.get("train", {})}
    if init is not None:
        opts["init"] = init
    init_path = None
    if opts["init"]:
        init_path = shipped_path(model.name, cfg["method"]) if opts["init"] == "shipped" else Path(opts["init"])
        if not init_path.is_file():
            raise HsdjaxError(f"drafter checkpoint not found: {init_path}")
    skip = 0
    if new_data_only:
        if init_path is None:
            raise HsdjaxError("--new-data-only trains past a warm start's own data: give --init (or train.init)")
        skip = seen_answers(read_meta(init_path)["info"], cfg["data"])
        if skip is None:
            raise HsdjaxError(f"--new-data-only: cannot tell which data {init_path.name} has seen (it was trained "
                              "on other data settings, or its checkpoint has no record of them)")
    data = load_shards(folder, limit_tokens=data_tokens, skip_answers=skip)
    man = data.pop("manifest")
    if skip:
        log(f"--new-data-only: leaving out the first {man['skipped_tokens']} tokens ({man['skipped_answers']} "
            f"answer tokens, the starting checkpoint's {skip} included); training on the "
            f"{int(man['tokens']) - man['skipped_tokens']} after them")
    if man["target_fingerprint"] != model.fingerprint:
        raise HsdjaxError(f"data in {folder} were generated by another target")
    layers = tuple(man["layers"])
    dcfg = {**DRAFTER_DEFAULTS, **cfg.get("drafter", {})}
    mc = model.cfg
    heads, kv_heads = drafter_heads(mc, int(dcfg["width"]))
    width = int(dcfg["width"]) if int(dcfg["width"]) != mc.hidden_size else 0
    fc = FeatureConfig(method=cfg["method"], hidden=mc.hidden_size, heads=heads, kv_heads=kv_heads, width=width,
                       head_dim=mc.head_dim, mlp=int(dcfg["mlp"]), vocab=int(dcfg["vocab"]), fused=len(layers) - 1,
                       injection=dcfg["injection"], inject_tokens=int(dcfg["inject_tokens"]),
                       inject_hidden=int(dcfg["inject_hidden"]),
                       head_delta=bool(dcfg["head_delta"]), root_token=bool(dcfg["root_token"]),
                       chain_layer=bool(dcfg["chain_layer"]), chain_g=bool(dcfg["chain_g"]), eps=mc.rms_norm_eps,
                       rope_theta=mc.rope_theta)
    init_params, started_from = None, None
    if init_path is not None:  # continue from a trained drafter: its weights and its draft vocabulary
        vocab_ids, init_params, init_meta = warm_start(init_path, fc, layers[:-1], model)
        started_from = {"path": str(init_path), "data_tokens": init_meta["info"].get("data_tokens"),
                        "answer_tokens": init_meta["info"].get("answer_tokens"),
                        "steps": init_meta["info"].get("steps")}
        log(f"starting from {init_path} (trained {started_from['steps']} steps on {started_from['data_tokens']} "
            "tokens)")
        note = None if skip else seen_data_note(init_meta["info"], cfg["data"], int(man["answer_tokens"]))
        if note:
            log(note)
    else:
        vocab_ids = draft_vocab(data["top_ids"], fc.vocab, mc.vocab_size)
    coverage = float(np.isin(data["top_ids"][:, 0], vocab_ids).mean())
    log(f"draft vocabulary: {fc.vocab} tokens cover {coverage:.1%} of the target's top-1 predictions")
    frozen = frozen_from_target(model)
    frozen_np = {"embed": to_host(frozen["embed"]), "head": to_host(frozen["head_full"])[vocab_ids],
                 "final_norm": to_host(frozen["final_norm"])}  # whole on every process (the target may be sharded)
    if max_steps is not None:
        opts["max_steps"] = max_steps
    if epochs is not None:
        opts["epochs"] = epochs
    run_dir = cache_dir("drafters") / cfg["name"]
    result = train(fc, data, frozen_np, vocab_ids, opts, run_dir / "ckpt", progress=progress, log=log,
                   mesh=mesh, init_params=init_params)
    info = {"config": cfg, "sources": man.get("sources", []), "data_tokens": int(man["tokens"]),
            "answer_tokens": int(man["answer_tokens"]), "steps": result["steps"],
            "train_windows": result["train_windows"], "draft_vocab_coverage": round(coverage, 4),
            "history": result["history"], "train_seconds": round(time.perf_counter() - t0, 1),
            "data_seconds": round(man.get("seconds", 0.0), 1), "started_from": started_from,
            "skipped_tokens": man["skipped_tokens"], "skipped_answers": man["skipped_answers"],
            "prompt_span": man["prompt_span"]}
    path = Path(out) if out else run_dir / f"{model.name}-{cfg['method']}.safetensors"
    save_drafter(path, fc, result["params"], vocab_ids, layers[:-1], model, info)
    log(f"drafter written to {path} ({path.stat().st_size / 1e6:.1f} MB); held-out: {result['history'][-1]}")
    return {"checkpoint": str(path), "history": result["history"]}
