"""Weights: GGUF / Hugging Face safetensors -> dequantized float32 parameter pytrees, with a disk cache.

The canonical parameter layout (what ``hsdjax.runtime.model.Transformer`` consumes) is::

    {"embed": [V, E], "final_norm": [E], "lm_head": [E, V] (untied only),
     "layers": {"attn_norm": [L, E], "wq": [L, E, H*D], "wk": [L, E, K*D], "wv": [L, E, K*D],
                "bq"/"bk"/"bv" (qkv bias only), "wo": [L, H*D, E], "mlp_norm": [L, E],
                "w_gate": [L, E, F], "w_up": [L, E, F], "w_down": [L, F, E]}}

Layer weights are stacked on a leading axis so the forward pass runs them under ``lax.scan``.
Converted float32 weights are cached as safetensors under ``cache_dir("weights")``; the cache key holds
the source file's sha256 and ``CONVERTER_VERSION``, so a converter fix never serves stale weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from hsdjax.errors import HsdjaxError
from hsdjax.paths import cache_dir
from hsdjax.runtime.config import ModelConfig, config_from_gguf_fields, config_from_hf

CONVERTER_VERSION = 1

Params = dict[str, Any]

# GGUF tensor name (per block) -> canonical name, and whether to transpose [out, in] -> [in, out].
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "attn_output.weight": ("wo", True),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}
_HF_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.weight": ("wo", True),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Q/K projections in Llama GGUF files.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)...; Hugging Face (and this engine) rotate the
    two halves of each head. The converter reorders rows per head so both agree; this reverses it.
    ``weight`` is in [out, in] (or [out]) layout.
    """
    out = weight.shape[0]
    half = out // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _stack_layers(per_layer: list[dict[str, np.ndarray]], cfg: ModelConfig, where: str) -> dict[str, np.ndarray]:
    names = set(per_layer[0])
    expected = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}
    if cfg.qkv_bias:
        expected |= {"bq", "bk", "bv"}
    missing = expected - names
    if missing:
        raise HsdjaxError(f"{where}: layer tensors missing: {', '.join(sorted(missing))}")
    for i, layer in enumerate(per_layer):
        if set(layer) != names:
            raise HsdjaxError(f"{where}: layer {i} has tensors {sorted(layer)}, layer 0 has {sorted(names)}")
    return {name: np.stack([layer[name] for layer in per_layer]) for name in sorted(expected)}


def _check_shapes(params: Params, cfg: ModelConfig, where: str) -> None:
    e, f, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {
        "embed": (v, e), "final_norm": (e,),
        "layers/attn_norm": (l, e), "layers/wq": (l, e, q), "layers/wk": (l, e, kv), "layers/wv": (l, e, kv),
        "layers/wo": (l, q, e), "layers/mlp_norm": (l, e), "layers/w_gate": (l, e, f),
        "layers/w_up": (l, e, f), "layers/w_down": (l, f, e),
    }
    if cfg.qkv_bias:
        expected |= {"layers/bq": (l, q), "layers/bk": (l, kv), "layers/bv": (l, kv)}
    if not cfg.tie_embeddings:
        expected["lm_head"] = (e, v)
    flat = flatten(params)
    for name, shape in expected.items():
        if name not in flat:
            raise HsdjaxError(f"{where}: tensor {name} is missing")
        if tuple(flat[name].shape) != shape:
            raise HsdjaxError(f"{where}: tensor {name} has shape {tuple(flat[name].shape)}, expected {shape}")


def read_gguf_fields(reader: Any) -> dict[str, Any]:
    """Decode a GGUFReader's metadata into plain Python values (token lists left out)."""
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "merges", "token_type", "scores"):
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # noqa: BLE001 - fields we cannot decode are not ones we need
            continue
    return fields


def convert_gguf(path: Path, progress: bool = False) -> tuple[ModelConfig, Params]:
    """Read a GGUF file and dequantize every tensor to float32 in the canonical layout."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure means a bad file
        raise HsdjaxError(f"{path}: not a readable GGUF file ({exc})") from None
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise HsdjaxError(f"{path}: no token_embd.weight tensor")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes list the fastest axis first
    cfg = config_from_gguf_fields(read_gguf_fields(reader), set(tensors), vocab)

    def load(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as exc:  # noqa: BLE001
            raise HsdjaxError(f"{path}: cannot dequantize {name} ({t.tensor_type.name}): {exc}") from None

    bar = _progress(cfg.num_layers + 2, f"converting {Path(path).name}", progress)
    per_layer = []
    for i in range(cfg.num_layers):
        layer = {}
        for suffix, (name, transpose) in _GGUF_LAYER_NAMES.items():
            full = f"blk.{i}.{suffix}"
            if full not in tensors:
                continue
            w = load(full)
            if cfg.family == "llama" and name in ("wq", "bq"):
                w = unpermute_rope_rows(w, cfg.num_heads)
            elif cfg.family == "llama" and name in ("wk", "bk"):
                w = unpermute_rope_rows(w, cfg.num_kv_heads)
            layer[name] = np.ascontiguousarray(w.T) if transpose else w
        per_layer.append(layer)
        bar(1)
    params: Params = {
        "embed": load("token_embd.weight"),
        "final_norm": load("output_norm.weight"),
        "layers": _stack_layers(per_layer, cfg, str(path)),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(load("output.weight").T)
    bar(2)
    _check_shapes(params, cfg, str(path))
    return cfg, params


def convert_hf(folder: Path, progress: bool = False) -> tuple[ModelConfig, Params]:
    """Read a Hugging Face folder (config.json + *.safetensors) into the canonical layout, float32."""
    from safetensors.numpy import load_file

    cfg = config_from_hf(Path(folder) / "config.json")
    raw: dict[str, np.ndarray] = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise HsdjaxError(f"{folder}: no *.safetensors files")
    for f in files:
        try:
            for name, value in load_file(str(f)).items():
                raw[name] = value.astype(np.float32)
        except Exception as exc:  # noqa: BLE001
            raise HsdjaxError(f"{f}: cannot read safetensors ({exc})") from None
    per_layer = []
    for i in range(cfg.num_layers):
        layer = {}
        for suffix, (name, transpose) in _HF_LAYER_NAMES.items():
            full = f"model.layers.{i}.{suffix}"
            if full in raw:
                layer[name] = np.ascontiguousarray(raw[full].T) if transpose else raw[full]
        per_layer.append(layer)
    where = str(folder)
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        if key not in raw:
            raise HsdjaxError(f"{where}: tensor {key} is missing")
    params: Params = {
        "embed": raw["model.embed_tokens.weight"],
        "final_norm": raw["model.norm.weight"],
        "layers": _stack_layers(per_layer, cfg, where),
    }
    if not cfg.tie_embeddings:
        if "lm_head.weight" not in raw:
            raise HsdjaxError(f"{where}: lm_head.weight is missing and embeddings are not tied")
        params["lm_head"] = np.ascontiguousarray(raw["lm_head.weight"].T)
    _check_shapes(params, cfg, where)
    return cfg, params


def flatten(params: Params, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dict -> {"a/b": array}."""
    out = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def unflatten(flat: dict[str, Any]) -> Params:
    """{"a/b": array} -> nested dict."""
    out: Params = {}
    for key, v in flat.items():
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def load_weights(
    path: Path, kind: str, fingerprint: str, progress: bool = False, keys: Sequence[str] | None = None
) -> tuple[ModelConfig, Params, dict[str, float]]:
    """Load converted float32 weights, converting and caching them on the first call.

    Returns (config, params as numpy arrays, timings) where timings has ``load_s`` and ``cached``
    (1.0 when the cache was hit). ``keys`` (top-level names such as ``embed``): read only those from
    the cache (a drafter's training needs the embeddings and head, not 6 GB of layers); names not in the model
    are skipped.
    """
    from safetensors.numpy import save_file

    t0 = time.perf_counter()
    stem = f"{Path(path).name}-{fingerprint[:16]}-v{CONVERTER_VERSION}"
    cache_file = cache_dir("weights") / f"{stem}.safetensors"
    meta_file = cache_dir("weights") / f"{stem}.json"
    if cache_file.exists() and meta_file.exists():
        try:
            cfg = ModelConfig.from_dict(json.loads(meta_file.read_text()))
            params = unflatten(_read_cached(cache_file, keys))
            if keys is None:
                _check_shapes(params, cfg, str(cache_file))
            return cfg, params, {"load_s": time.perf_counter() - t0, "cached": 1.0}
        except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt, never trusted
            cache_file.unlink(missing_ok=True)
            meta_file.unlink(missing_ok=True)
    convert: Callable[..., tuple[ModelConfig, Params]] = convert_gguf if kind == "gguf" else convert_hf
    cfg, params = convert(path, progress=progress)
    tmp = cache_file.with_suffix(".tmp")
    # contiguous copies: safetensors' numpy writer stores a strided view's raw buffer (0.8.0)
    save_file({k: np.ascontiguousarray(v) for k, v in flatten(params).items()}, str(tmp))
    tmp.replace(cache_file)
    # the architecture (the runtime backend, always auto here, left out: versions before it read the file too)
    meta_file.write_text(json.dumps({k: v for k, v in cfg.to_dict().items() if k != "backend"}))
    if keys is not None:
        params = {k: v for k, v in params.items() if k in keys}
    return cfg, params, {"load_s": time.perf_counter() - t0, "cached": 0.0}


def _read_cached(cache_file: Path, keys: Sequence[str] | None) -> dict[str, np.ndarray]:
    """The cached tensors (all, or those under the top-level ``keys``), one at a time from the file."""
    from safetensors import safe_open

    with safe_open(str(cache_file), framework="numpy") as f:
        names = [n for n in f.keys() if keys is None or n.split("/")[0] in keys]
        return {n: f.get_tensor(n) for n in names}


def _progress(total: int, desc: str, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda n: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="layer", leave=False)

    def update(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()

    return update


# ------------------------------------------------------------------------------------------ block scales


def _block_scales(t: Any) -> tuple[np.ndarray, np.ndarray, int] | None:
    """A GGUF tensor's per-block scale and offset as its dequantizer computes them (float32, one row
    per output feature, one column per block along the input), and the block length; None for types
    whose blocks are not a scale and offset over codes (or are not handled here)."""
    import gguf

    kind = t.tensor_type
    data = np.asarray(t.data)
    rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    raw = data.reshape(rows, -1).view(np.uint8)
    T = gguf.GGMLQuantizationType

    def f16(b: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]

    if kind in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1):
        size = {T.Q8_0: 34, T.Q4_0: 18, T.Q5_0: 22, T.Q4_1: 20, T.Q5_1: 24}[kind]
        blocks = raw.reshape(rows, -1, size)
        scale = f16(blocks[..., 0:2])
        offset = f16(blocks[..., 2:4]) if kind in (T.Q4_1, T.Q5_1) else np.zeros_like(scale)
        return scale, offset, 32
    if kind == T.Q4_K:
        blocks = raw.reshape(-1, 144)
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d[:, None] * sc.astype(np.float32)
        offset = -(dmin[:, None] * m.astype(np.float32))
        return scale.reshape(rows, -1), offset.reshape(rows, -1), 32
    if kind == T.Q6_K:
        blocks = raw.reshape(-1, 210)
        d = f16(blocks[:, 208:210])
        scale = d[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return scale.reshape(rows, -1), np.zeros((rows, scale.size // rows), np.float32), 16
    return None


def gguf_block_scales(path: Path, cfg: ModelConfig) -> dict[str, Any]:
    """Per projection of a GGUF model, the block scales and offsets its dequantizer used, in the
    canonical [in / block, out] layout: ``{"blocks_3/wq": (scale, offset, block), "head": ...}`` (layer
    names as after ``unstack_layers``; only tensors whose type has such blocks). The CPU matmul kernel
    uses them to store those weights compressed (``kernels.cpu_matmul.compress_weight``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    out: dict[str, Any] = {}

    def add(key: str, name: str, permute_heads: int | None = None) -> None:
        if name not in tensors:
            return
        found = _block_scales(tensors[name])
        if found is None:
            return
        scale, offset, block = found
        if permute_heads:
            scale, offset = unpermute_rope_rows(scale, permute_heads), unpermute_rope_rows(offset, permute_heads)
        out[key] = (np.ascontiguousarray(scale.T), np.ascontiguousarray(offset.T), block)

    for i in range(cfg.num_layers):
        for suffix, (name, transpose) in _GGUF_LAYER_NAMES.items():
            if not transpose:
                continue
            heads = None
            if cfg.family == "llama" and name == "wq":
                heads = cfg.num_heads
            elif cfg.family == "llama" and name == "wk":
                heads = cfg.num_kv_heads
            add(f"blocks_{i}/{name}", f"blk.{i}.{suffix}", heads)
    add("head", "token_embd.weight" if cfg.tie_embeddings else "output.weight")
    return out
