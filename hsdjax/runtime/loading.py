"""Loading a target model: ``load_model`` (a registered name, a ``.gguf`` file or a Hugging Face folder)
returns a ``LoadedModel`` (config, device params, tokenizer, provenance), optionally sharded over a mesh.

Kept apart from ``hsdjax.frontends.api`` so that ``hsdjax.core.methods`` can load a draft model (``sps``) without
importing the generation API that uses it.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hsdjax.errors import HsdjaxError
from hsdjax.kernels import cpu_matmul as cpu_matmul_kernel
from hsdjax.paths import cache_dir
from hsdjax.runtime import registry, sharding
from hsdjax.runtime.config import ModelConfig, resolve_backend
from hsdjax.runtime.model import fuse_projections, stack_uniform_layers, unstack_layers
from hsdjax.runtime.tokenizer import Tokenizer
from hsdjax.runtime.weights import gguf_block_scales, load_weights

_compilation_cache_on = False


def enable_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache in ``cache_dir("jax")`` (once per process);
    ``HSDJAX_COMPILATION_CACHE=0`` leaves it off."""
    global _compilation_cache_on
    if _compilation_cache_on or os.environ.get("HSDJAX_COMPILATION_CACHE", "1") == "0":
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir("jax")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _compilation_cache_on = True


def default_dtype() -> str:
    """float32 on CPU (XLA's CPU bfloat16 matmuls are slow), bfloat16 on GPU/TPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass
class LoadedModel:
    """A target model ready to run: config, params (device arrays), tokenizer, provenance."""

    name: str
    cfg: ModelConfig
    params: dict[str, Any]
    tokenizer: Tokenizer
    source: registry.ModelSource
    fingerprint: str  # sha256 of the weights file(s): drafters are bound to it
    timings: dict[str, float]
    mesh: Any = None  # the jax.sharding.Mesh the params are placed on (None: one device)
    # How the matmuls and attention run and why, in one line (``backend_line``): the CPU kernels (their
    # instruction set, mode and measured speed against XLA's dot) or XLA's dot.
    backend: dict[str, Any] = dataclasses.field(default_factory=dict)

    def backend_line(self) -> str:
        return self.backend.get("why", "")


def _fingerprint(source: registry.ModelSource) -> str:
    """What drafters and cached weights are bound to: the registry's sha256, else the weight files' hashes."""
    if source.spec is not None:
        return source.spec.sha256
    if source.kind == "gguf":
        return registry.file_sha256(source.path)
    digest = hashlib.sha256()
    for f in sorted(Path(source.path).glob("*.safetensors")):
        digest.update(f.name.encode())
        digest.update(registry.file_sha256(f).encode())
    return digest.hexdigest()


def default_layer_loop(cpu_kernels: bool = True) -> str:
    """``scan`` (stacked weights under ``lax.scan``), except ``unrolled`` on XLA's own CPU path.

    Under ``lax.scan`` XLA's CPU backend copies each layer's weights out of the stacked arrays before
    its matmuls, which triples memory traffic once a layer outgrows the caches (Qwen2.5-Coder-1.5B
    decodes 2.2x faster unrolled on XLA's path). hsdjax's CPU kernels take the whole stacks and the
    layer index and read in place, so with them the scan decodes as fast as the unrolled loop, compiles
    ~3x faster and each compiled program holds ~6x less memory (``experiments/layer_loop_memory.py``).
    """
    return "unrolled" if jax.default_backend() == "cpu" and not cpu_kernels else "scan"


CPU_MATMUL_SETTINGS = ("auto", "on", "off", "float32", "bf16x", "int8x", "int16x")
ACTIVATIONS = {"bf16x": "bfloat16", "int8x": "int8", "int16x": "int16"}  # opt-in modes: how the compressed products see x


def cpu_matmul_setting(setting: str | None) -> str:
    return setting or os.environ.get("HSDJAX_CPU_MATMUL") or "auto"


def cpu_kernels_unavailable(setting: str | None, cfg: ModelConfig, mesh: Any) -> str | None:
    """Why a model cannot load with the CPU kernels under ``setting`` (None when it can)."""
    setting = cpu_matmul_setting(setting)
    if setting not in CPU_MATMUL_SETTINGS:
        raise HsdjaxError(f"cpu_matmul must be one of {', '.join(CPU_MATMUL_SETTINGS)} (got {setting!r})")
    why = cpu_matmul_kernel.unsupported(cfg)
    if setting == "off":
        why = "the CPU kernels are off"
    elif jax.default_backend() != "cpu":
        why = f"the backend is {jax.default_backend()}, not the CPU"
    elif mesh is not None:
        why = "the model is sharded over a mesh"
    elif why is None and not cpu_matmul_kernel.load():
        why = "the kernel is not built (run `hsdjax cpu-matmul build`)"
    elif why is None and setting == "bf16x" and not cpu_matmul_kernel.has_bf16x():
        why = "this CPU has no AVX512-BF16 / AVX512-VBMI (the bfloat16-activation products)"
    elif why is None and setting == "int8x" and not cpu_matmul_kernel.has_int8x():
        why = "this CPU has no integer products (AVX512-VNNI, AVX2 or NEON) for the int8-activation products"
    elif why is None and setting == "int16x" and not cpu_matmul_kernel.has_int16x():
        why = "this CPU has no integer products (AVX512-VNNI, AVX2 or NEON) for the int16-activation products"
    return why


def use_cpu_matmul(setting: str | None, cfg: ModelConfig, mesh: Any) -> bool:
    """Whether a model loads with the CPU matmul kernel (see ``load_model``); an explicit setting that
    cannot be met is refused with the reason."""
    why = cpu_kernels_unavailable(setting, cfg, mesh)
    if why and cpu_matmul_setting(setting) in ("on", "float32", "bf16x", "int8x", "int16x"):
        raise HsdjaxError(f"cpu_matmul={cpu_matmul_setting(setting)}, but {why}")
    return why is None


def _xla_backend(setting: str | None, cfg: ModelConfig, mesh: Any) -> dict[str, Any]:
    """The backend description of a model that does not use the CPU kernels, with the reason."""
    why = cpu_kernels_unavailable(setting, cfg, mesh)
    return {"path": "xla", "mode": cfg.dtype, "why": f"XLA's dot ({why})" if why else "XLA's dot"}


def _pack_for_cpu_kernels(params: Any, cfg: ModelConfig, source: registry.ModelSource, fingerprint: str,
                          compress: bool) -> Any:
    """``cpu_matmul.pack_params``, with the compressed panels cached on disk per model (finding the
    exact block codes of a 1.5B model takes ~45 s here; reading them back, a second or two)."""
    if not compress:
        return cpu_matmul_kernel.pack_params(params, cfg.tie_embeddings, compress=False)
    layout = "unrolled" if any(k.startswith("blocks_") for k in params) else "scan"
    key = f"{fingerprint[:24]}-{layout}{'-fused' if cfg.fused_projections else ''}-v{cpu_matmul_kernel.FORMAT_VERSION}"
    path = cache_dir("packed") / f"{key}.npz"
    cache: dict[str, Any] = {}
    if path.is_file():
        try:
            with np.load(path) as stored:
                cache = {k: stored[k] for k in stored.files}
        except Exception:  # noqa: BLE001 - a damaged cache file is rebuilt
            cache = {}
    known = set(cache)
    hints = gguf_block_scales(source.path, cfg) if source.kind == "gguf" and not known else None
    packed = cpu_matmul_kernel.pack_params(params, cfg.tie_embeddings, compress=True, hints=hints, cache=cache)
    if set(cache) != known:
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **cache)
        tmp.replace(path)  # atomic: a concurrent loader sees the old file or the new one
    return packed


def _convert_popping(tree: dict[str, Any], convert: Any) -> dict[str, Any]:
    """``tree_map(convert, tree)``, emptying ``tree`` as it goes so that each host array is freed once
    converted: loading peaks at about one copy of the weights, not two (Qwen2.5-Coder-1.5B: ~7 GB
    instead of ~14)."""
    out = {}
    for key in list(tree):
        leaf = tree.pop(key)
        out[key] = _convert_popping(leaf, convert) if isinstance(leaf, dict) else convert(leaf)
        del leaf
    return out


def load_target_parts(name_or_path: str | None = None) -> LoadedModel:
    """What a drafter's training needs of its target, without the layers: config, fingerprint, name
    and the float32 embeddings, LM head and final norm as host arrays (``params`` has only those;
    no tokenizer). A few hundred MB where ``load_model`` takes the whole model."""
    source = registry.resolve(name_or_path or registry.default_model())
    fingerprint = _fingerprint(source)
    cfg, params, timings = load_weights(source.path, source.kind, fingerprint, keys=("embed", "lm_head", "final_norm"))
    return LoadedModel(source.name, cfg.replace(dtype="float32"), params, None, source, fingerprint, timings)


def load_model(name_or_path: str | None = None, *, dtype: str | None = None, layer_loop: str | None = None,
               progress: bool = False, mesh: Any = None, fused_projections: bool | None = None,
               cpu_matmul: str | None = None, cache_dtype: str | None = None,
               screened_head: bool | None = None) -> LoadedModel:
    """Load a registered model by name, a local ``.gguf`` file, or a local Hugging Face folder.

    ``fused_projections``: q/k/v and gate/up as one matmul each (``hsdjax.runtime.model.fuse_projections``;
    unsharded models only; the same outputs bit for bit). None (default): fused when the CPU kernels run
    (``cpu_matmul``) and the parts' packed panels are stored alike in every layer (their panels are
    joined after packing): fewer kernel calls, the same x read once, measured 3-6% faster for 2- and
    8-node passes and equal or faster for a one-token step (``experiments/model_variants.py --compare fused``,
    2026-12-04); separate otherwise (on XLA's own CPU dot the fused form was 3-5% slower for trees).

    ``layer_loop`` is ``scan`` (stacked weights under ``lax.scan``) or ``unrolled`` (per-layer weights);
    default: see ``default_layer_loop``. With the CPU kernels the weights are packed per layer (a GGUF
    may store a projection in different formats in different layers) and stacked after packing where
    every layer's are stored alike; else the layers stay unrolled (``backend["layers"]`` says why).
    ``mesh`` (a ``jax.sharding.Mesh`` with axes data/model, a dict of axis sizes or a string like
    ``"data=1,model=8"``) shards the params tensor-parallel (see
    ``hsdjax.runtime.sharding``); None keeps them on one device.

    ``cpu_matmul``: ``auto`` runs the projections and the LM head through hsdjax's CPU matmul kernel
    (``hsdjax.kernels.cpu_matmul``) when it is built (``hsdjax cpu-matmul build``), the backend is the
    CPU, the model computes in float32 and is unsharded; ``on`` insists (an error says what is
    missing); ``off`` keeps XLA's dot. A weight whose float32 values are exactly 4- or 8-bit block codes
    (a Q4_1 / Q8_0 GGUF's) is stored compressed for the kernel (same products, 5-7x fewer bytes to
    stream per step); ``float32`` keeps every weight float32. ``bf16x``: compressed weights multiplied
    with activations rounded to bfloat16 (AVX512-BF16 dot products: tree passes about half the
    arithmetic; not the float32 model's outputs, but every method computes the same, so speculative
    output still equals `ar`'s). ``int8x``: the same with activations quantized to int8 per 32 k
    (AVX512-VNNI four k per instruction, AVX2 / NEON two; coarser than ``bf16x``). ``int16x``: quantized to int16 per
    32 k (AVX512-VNNI, AVX2 or NEON integer multiply-adds; within ~1e-5 of the float32 products). Default:
    ``$HSDJAX_CPU_MATMUL``, else ``auto``.

    ``screened_head``: greedy tokens of an 8-bit compressed LM head (SmolLM2's Q8_0) through an int8
    screen (``cpu_matmul.screened_argmax``): the same token as the float32 logits' argmax, computing
    the float32 products only for the few columns that could be the largest. None (default): on where it
    applies and pays (the kernels run in ``auto`` / ``bf16x`` mode, built with AVX512-VNNI's byte dot
    products; with AVX2 or NEON the screen is exact too but measured no faster, so it needs
    ``$HSDJAX_SCREENED_HEAD=1``), unless ``$HSDJAX_SCREENED_HEAD`` is ``0``; False: the argmax of the full
    logits.

    ``cache_dtype``: the KV cache's storage dtype (default: the compute dtype). ``float16`` halves what
    a long-context step reads; outputs may differ from a float32 cache's (each key and value is rounded
    once), but every method rounds the same way, so speculative output still equals `ar`'s.
    """
    mesh = sharding.make_mesh(mesh)
    if screened_head is None:  # on by default where it was measured to pay (VNNI builds)
        setting = os.environ.get("HSDJAX_SCREENED_HEAD", "")
        screened_head = setting == "1" or (setting != "0" and cpu_matmul_kernel.screen_pays())
    if layer_loop not in (None, "scan", "unrolled"):
        raise HsdjaxError(f"layer_loop must be 'scan' or 'unrolled' (got {layer_loop!r})")
    enable_compilation_cache()
    source = registry.resolve(name_or_path or registry.default_model())
    fingerprint = _fingerprint(source)
    cfg, np_params, timings = load_weights(source.path, source.kind, fingerprint, progress=progress)
    dtype = dtype or default_dtype()
    if cache_dtype not in (None, dtype) and jax.default_backend() != "cpu":
        raise HsdjaxError(f"--kv-cache {cache_dtype} is for CPU runs; on {jax.default_backend()} the cache is "
                          f"stored in the compute dtype ({dtype}), which the attention kernels read")
    cfg = cfg.replace(dtype=dtype, cache_dtype=cache_dtype)
    t0 = time.perf_counter()
    if fused_projections and mesh is not None:
        raise HsdjaxError("fused_projections needs an unsharded model (a split over heads keeps them apart)")
    use_kernels = use_cpu_matmul(cpu_matmul, cfg, mesh)
    if use_kernels or (layer_loop or default_layer_loop(False)) == "unrolled":  # kernels: packed per layer
        np_params = unstack_layers(np_params)  # numpy views: no copy
    cfg = cfg.replace(scan_layers="layers" in np_params)
    as_array = jnp.asarray if mesh is None else np.asarray  # sharded: straight from host to each device
    params = _convert_popping(np_params, lambda a: as_array(a, dtype=jnp.dtype(dtype)))
    del np_params
    if fused_projections:
        params = fuse_projections(params)
        cfg = cfg.replace(fused_projections=True)
    backend = _xla_backend(cpu_matmul, cfg, mesh)
    if use_kernels:
        setting = cpu_matmul_setting(cpu_matmul)
        compress = setting != "float32"
        plain, plain_cfg = params, cfg
        params = _pack_for_cpu_kernels(params, cfg, source, fingerprint, compress)
        fused = fuse_projections(params, packed=True) if fused_projections is None else None
        if fused is not None:  # the packed panels joined (the same formats only)
            params, cfg = fused, cfg.replace(fused_projections=True)
        activations = ACTIVATIONS.get(setting, "float32")
        cfg = cfg.replace(backend="cpu-kernel", cpu_matmul_activations=activations)
        isa = cpu_matmul_kernel.instruction_set()
        backend = {"path": "cpu-kernel", "isa": isa, "mode": setting if setting in ACTIVATIONS else "float32",
                   "why": f"hsdjax's CPU kernels ({isa}, {setting} as asked)"}
        if setting == "auto":  # kept only where this machine measured it faster than XLA's dot
            verdict = cpu_matmul_kernel.measured_verdict(params, plain, activations)
            backend = dict(backend, why=verdict["why"], ratios=verdict["ratios"])
            if not verdict["use"]:
                params, cfg = plain, plain_cfg
                use_kernels = False
                backend = dict(backend, path="xla", mode="float32")
            else:
                cfg = cfg.replace(cpu_matmul_prefill_xla=verdict["prefill_xla"])
        del plain
    if use_kernels:
        if screened_head and cpu_matmul_kernel.can_screen(params["head_panels"], activations):
            params = dict(params, head_colabs=jnp.asarray(cpu_matmul_kernel.column_abs_sums(params["head_panels"])))
            cfg = cfg.replace(screened_head=True)
    if not use_kernels:  # the one backend setting, resolved here: the Pallas kernel on GPU / TPU, else XLA's
        cfg = cfg.replace(backend=resolve_backend("auto"))
    if (layer_loop or default_layer_loop(use_kernels)) == "scan" and not cfg.scan_layers:
        stacked = stack_uniform_layers(params)
        if stacked is None:
            backend = dict(backend, layers="unrolled: the layers' weights are stored in different formats")
        else:
            params, cfg = stacked, cfg.replace(scan_layers=True)
    params = sharding.shard_params(cfg, params, mesh)
    if source.kind == "gguf":
        tokenizer = Tokenizer.from_gguf(source.path)
    else:
        tokenizer = Tokenizer.from_hf_folder(source.path)
    timings = dict(timings, device_put_s=time.perf_counter() - t0)
    # the weights of the path not taken and the conversion's intermediates sit in reference cycles until
    # the next full collection (SmolLM2 on XLA's path: RSS 1.1 GB after loading, 0.7 GB once collected)
    gc.collect()
    return LoadedModel(source.name, cfg, params, tokenizer, source, fingerprint, timings, mesh, backend)
