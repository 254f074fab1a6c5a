"""hsdjax's optional CPU kernels (one C++ library behind XLA FFI custom calls): the matmul for the
small-M products of decoding, with panel-packed weights, float32 or compressed, and its jnp reference;
the cache attention of ``cpu_attention.py`` lives in the same library.

Why: on a CPU a one-token step and a T-token tree pass both stream every weight from memory once, but
XLA's CPU dot grows much faster than that with T (SmolLM2's matmul chain, this 2-core machine: T = 8
costs ~1.9x T = 1). The kernel reads each 32-column panel of a weight (packed contiguous, ``pack``)
once for up to 8 rows, sharing the panels with XLA's own intra-op thread pool. Every output is the same
fused multiply-add chain over k whatever M is, so a tree pass and an `ar` step compute bitwise-equal
matmul outputs.

Compressed panels: a weight whose float32 values are exactly code * scale + offset per block of k (what
a block-quantized GGUF dequantizes to: SmolLM2's Q4_1 / Q8_0, Qwen's Q4_K / Q6_K) is stored as 4-bit or
int8 codes plus float32 block scales and decoded on the fly to the same float32 values (``compress_weight``
finds the codes from the file's scales, or searches float16 scales, and checks every value; anything
else stays float32). Same products, 4-6x fewer bytes per step: SmolLM2's `ar` step 33 -> 11 ms here.
Bfloat16 panels (``pack_exact``): a matrix whose values are all bfloat16 values (a drafter checkpoint's)
is stored in bfloat16 and widened exactly in the kernel: the float32 panels' products at half the bytes.

It is never built by ``pip install`` (which needs no compiler): ``hsdjax cpu-matmul build`` compiles
it once with the machine's C++ compiler into hsdjax's cache (``-march=native``: it runs where it was
built), after which ``load_model`` uses it on CPU (``cpu_matmul="auto"``; ``"float32"`` keeps every
weight float32; ``"off"`` keeps XLA's dot and attention).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

PANEL = 32  # output columns per panel: 2, 4 or 8 native vectors per row (AVX-512, AVX2, NEON)
SOURCE = Path(__file__).with_name("cpu_matmul.cc")
SOURCES = (SOURCE, Path(__file__).with_name("cpu_attention.cc"))  # one library: matmul and cache attention
TARGET = "hsdjax_panel_matmul"
COMPRESSED_TARGET = "hsdjax_compressed_matmul"
COMPRESSED_BF16X_TARGET = "hsdjax_compressed_matmul_bf16x"  # activations rounded to bfloat16 (opt-in)
COMPRESSED_INT8X_TARGET = "hsdjax_compressed_matmul_int8x"  # activations quantized to int8 per 32 k (opt-in)
COMPRESSED_INT16X_TARGET = "hsdjax_compressed_matmul_int16x"  # activations quantized to int16 per 32 k (opt-in)
SCREENED_ARGMAX_TARGET = "hsdjax_screened_argmax"  # exact greedy tokens of an 8-bit head through an int8 screen
BF16_TARGET = "hsdjax_bf16_matmul"  # bfloat16 panels (a drafter's trained matrices: exact, half the bytes)
ATTENTION_TARGET = "hsdjax_cache_attention"
ATTENTION_F16_TARGET = "hsdjax_cache_attention_f16"  # the same over a float16 KV cache
TREE_ATTENTION_TARGET = "hsdjax_tree_attention"  # cache and new tokens in position order (cpu_attention.cc)
TREE_ATTENTION_F16_TARGET = "hsdjax_tree_attention_f16"  # the same over a float16 KV cache
FLAGS = ("-O3", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-Wall")
HEADER_FILE = Path(__file__).with_name("cpu_simd.h")  # the native vector per instruction set, included by both
ARCH_ENV = "HSDJAX_CPU_ARCH"  # which -march the library is built and loaded for: "native" (default), "x86-64-v3", ...
BLOCK_ROWS = {4: 32, 8: 16}  # k per compressed block (see cpu_matmul.cc)
HEADER = {4: 2 * PANEL * 4, 8: PANEL * 4}  # a block's scales (and offsets), float32
BLOCK_BYTES = {b: HEADER[b] + BLOCK_ROWS[b] * PANEL * b // 8 for b in (4, 8)}  # 768 / 640
PACKED_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wqkv", "w_gate_up")

_state: dict[str, Any] = {"loaded": None}


class CpuMatmulError(RuntimeError):
    """The kernel cannot be built or loaded (the message says why)."""


def arch() -> str:
    """The ``-march`` of the library this process builds and loads (``HSDJAX_CPU_ARCH``, default native)."""
    return os.environ.get(ARCH_ENV) or "native"


def cpu_features() -> str:
    """This CPU's model and vector extensions as the OS reports them (part of the build's cache key, so
    a home folder shared by machines of different kinds never loads a library built for another one)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', platform.processor())} | {fields.get('flags', fields.get('Features', ''))}"


VECTOR_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "avx2",
                "fma", "f16c", "avx", "sse4_2", "asimd", "asimddp", "sve", "bf16", "i8mm")


def cpu_summary() -> str:
    """The CPU's model and the vector extensions that matter here, e.g. "AMD EPYC (avx2, fma, f16c)"."""
    model, _, flags = cpu_features().partition(" | ")
    have = set(flags.split())
    named = [f for f in VECTOR_FLAGS if f in have]
    return f"{model.strip() or platform.machine()} ({', '.join(named) or platform.machine()})"


def has_bf16_units() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AMX, AVX512-BF16, ARM BF16), where XLA's bfloat16
    dot runs ~3x its float32 rate (a Xeon with AMX: 800 against 264 GFLOP/s on 1,024 x 1,536 x 8,960)."""
    flags = set(cpu_features().partition(" | ")[2].split())
    return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})


def library_path(march: str | None = None) -> Path:
    """Where the built kernel lives: one file per source, flags, -march, JAX version, machine and CPU
    extensions."""
    from hsdjax.paths import cache_dir

    march = march or arch()
    key = hashlib.sha256(b"".join(f.read_bytes() for f in (*SOURCES, HEADER_FILE)) + " ".join(FLAGS).encode()
                         + march.encode() + jax.__version__.encode() + platform.machine().encode()
                         + platform.node().encode() + cpu_features().encode()).hexdigest()[:12]
    return cache_dir("cpu_matmul") / f"libhsdjax_panel_matmul-{march}-{key}.so"


def is_built() -> bool:
    return library_path().is_file()


def compile_command(cxx: str, out: Path, march: str | None = None) -> list[str]:
    """The compiler call that builds the library for ``-march=march`` (XLA's FFI headers as system
    headers: their warnings are theirs; ours are shown)."""
    return [cxx, *FLAGS, f"-march={march or arch()}", "-isystem", jax.ffi.include_dir(), *map(str, SOURCES), "-o",
            str(out), "-lpthread"]


def build(compiler: str | None = None, march: str | None = None) -> Path:
    """Compile the kernel (a few seconds) into hsdjax's cache; returns the library's path. Compiler
    warnings, if any, are kept in ``last_build_warnings``."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise CpuMatmulError("no C++ compiler found (install g++, or set CXX); hsdjax keeps XLA's matmul")
    out = library_path(march)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run(compile_command(cxx, tmp, march), capture_output=True, text=True)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        raise CpuMatmulError(f"compiling {', '.join(f.name for f in SOURCES)} failed:\n{done.stderr[-2000:]}")
    _state["warnings"] = done.stderr.strip()
    tmp.replace(out)  # atomic: a concurrent loader sees the old file or the new one
    return out


def last_build_warnings() -> str:
    return _state.get("warnings", "")


def load() -> bool:
    """Register the built kernel with XLA (once per process); False when it has not been built."""
    if _state["loaded"] is None:
        path = library_path()
        if not path.is_file():
            return False
        lib = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.HsdjaxPanelMatmul), platform="cpu")
        jax.ffi.register_ffi_target(COMPRESSED_TARGET, jax.ffi.pycapsule(lib.HsdjaxCompressedMatmul), platform="cpu")
        jax.ffi.register_ffi_target(BF16_TARGET, jax.ffi.pycapsule(lib.HsdjaxBf16Matmul), platform="cpu")
        jax.ffi.register_ffi_target(COMPRESSED_BF16X_TARGET, jax.ffi.pycapsule(lib.HsdjaxCompressedMatmulBf16x),
                                    platform="cpu")
        jax.ffi.register_ffi_target(COMPRESSED_INT8X_TARGET, jax.ffi.pycapsule(lib.HsdjaxCompressedMatmulInt8x),
                                    platform="cpu")
        jax.ffi.register_ffi_target(COMPRESSED_INT16X_TARGET, jax.ffi.pycapsule(lib.HsdjaxCompressedMatmulInt16x),
                                    platform="cpu")
        jax.ffi.register_ffi_target(SCREENED_ARGMAX_TARGET, jax.ffi.pycapsule(lib.HsdjaxScreenedArgmax),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.HsdjaxCacheAttention), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_F16_TARGET, jax.ffi.pycapsule(lib.HsdjaxCacheAttentionF16),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TREE_ATTENTION_TARGET, jax.ffi.pycapsule(lib.HsdjaxTreeAttention), platform="cpu")
        jax.ffi.register_ffi_target(TREE_ATTENTION_F16_TARGET, jax.ffi.pycapsule(lib.HsdjaxTreeAttentionF16),
                                    platform="cpu")
        lib.HsdjaxIsa.restype = ctypes.c_char_p
        _state["loaded"] = lib
    return True


def instruction_set() -> str:
    """What the loaded library was compiled for: "avx512", "avx2", "neon" or "generic" and its vector
    width, e.g. "avx2 (8 floats per vector)"; "" when no library is loaded."""
    if not load():
        return ""
    lib = _state["loaded"]
    return f"{lib.HsdjaxIsa().decode()} ({lib.HsdjaxLanes()} floats per vector)"


def has_bf16x() -> bool:
    """Whether the loaded kernel has the bfloat16-activation products (built on a CPU with AVX512-BF16
    and AVX512-VBMI)."""
    return bool(load() and _state["loaded"].HsdjaxHasBf16x())


def has_int8x() -> bool:
    """Whether the loaded kernel has the int8-activation products (built for AVX512-VNNI and AVX512-VBMI,
    AVX2, or NEON: the same results on each)."""
    return bool(load() and _state["loaded"].HsdjaxHasInt8x())


def screen_pays() -> bool:
    """Whether the int8 screen of the head is measured to beat the full float32 head on tree passes:
    with VNNI's four-k byte dot products (tree rounds 2-11% cheaper). The pair tiles of AVX2 builds
    measured 0.98-1.05x (`experiments/model_variants.py --compare screened`, x86-64-v3 build, 2-16
    rows), so there it is opt-in (``HSDJAX_SCREENED_HEAD=1``)."""
    return bool(load() and _state["loaded"].HsdjaxInt8KPerInstruction() == 4)


def has_int16x() -> bool:
    """Whether the loaded kernel has the int16-activation products (built for AVX512-VNNI and AVX512-BW,
    AVX2, or NEON)."""
    return bool(load() and _state["loaded"].HsdjaxHasInt16x())


def unsupported(cfg: Any) -> str | None:
    """Why a model config cannot use the kernel (None when it can)."""
    if jnp.dtype(cfg.dtype) != jnp.float32:
        return f"the kernel computes in float32, the model in {cfg.dtype}"
    d = cfg.head_dim
    sizes = {"hidden size": cfg.hidden_size, "query width": cfg.num_heads * d, "key/value width": cfg.num_kv_heads * d,
             "MLP width": cfg.intermediate_size, "vocabulary": cfg.vocab_size}
    bad = [f"{k} {v}" for k, v in sizes.items() if v % PANEL]
    return f"{', '.join(bad)} not a multiple of {PANEL}" if bad else None


# ------------------------------------------------------------------------------------------ weights


def pack(w: Float[Array, "... K N"]) -> Float[Array, "... P K 32"]:
    """A [..., K, N] weight as N/32 contiguous panels of [K, 32]."""
    *lead, k, n = w.shape
    return jnp.swapaxes(w.reshape(*lead, k, n // PANEL, PANEL), -3, -2)


def pack_exact(w: Float[Array, "... K N"]) -> Any:
    """``pack(w)``, in bfloat16 when every value of ``w`` is a bfloat16 value (the kernel reads half the
    bytes and computes the same float32 products), else float32."""
    w = jnp.asarray(w, jnp.float32)
    half = w.astype(jnp.bfloat16)
    return pack(half if bool(jnp.all(half.astype(jnp.float32) == w)) else w)


def unpack(wp: Float[Array, "... P K 32"]) -> Float[Array, "... K N"]:
    *lead, p, k, _ = wp.shape
    return jnp.swapaxes(wp, -3, -2).reshape(*lead, k, p * PANEL)


FORMAT_VERSION = 2  # of the compressed panels (part of the cache key of ``load_model``'s packed weights)


def pack_params(params: dict[str, Any], tie_embeddings: bool, compress: bool = True,
                hints: dict[str, Any] | None = None, cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """Model params for a ``cpu_matmul`` config: every projection packed, plus ``head_panels`` (the LM
    head packed; ``embed`` and ``lm_head`` stay for embedding lookups and drafters). With ``compress``,
    a weight whose every value is exactly a block code times a scale plus an offset is stored compressed
    (``compress_weight``; ``hints``: the GGUF's own block scales, ``weights.gguf_block_scales``, keyed
    ``blocks_3/wq`` / ``head``); any other stays float32. ``cache`` (same keys): compressed panels of an
    earlier call, used as they are (the caller keys it by model and ``FORMAT_VERSION``); the ones
    computed here are added to it, and a weight that stays float32 is recorded as an empty array."""
    hints = hints or {}

    def one(key: str, w: Any) -> Any:
        packed = None
        if compress and cache is not None and key in cache:
            packed = cache[key] if cache[key].size else None
        elif compress:
            packed = compress_weight(w, hints.get(key))
            if cache is not None:
                cache[key] = np.zeros(0, np.uint8) if packed is None else np.asarray(packed)
        return pack(w) if packed is None else jnp.asarray(packed)

    def layer(name: str, d: dict[str, Any]) -> dict[str, Any]:
        return {k: one(f"{name}/{k}", v) if k in PACKED_WEIGHTS else v for k, v in d.items()}

    out = {k: layer(k, v) if (k == "layers" or k.startswith("blocks_")) else v for k, v in params.items()}
    head = jnp.transpose(params["embed"]) if tie_embeddings else params["lm_head"]
    out["head_panels"] = one("head", head)
    return out


# ------------------------------------------------------------------------------------------ compressed panels


def _search_scales(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Without the file's own scales: per block of 32 k and column, a float16 scale and an offset that
    reproduce ``w`` [K, N] with 4-bit codes (offset = block minimum, Q4_1) or int8 codes (offset 0,
    Q8_0); the scale is searched among the float16 values next to the range over the code span."""
    k, n = w.shape
    v = w.reshape(k // 32, 32, n)
    for bits in (4, 8):
        if bits == 4:
            offset, lo, hi = v.min(axis=1), 0, 15
            span = v.max(axis=1).astype(np.float64) - offset
        else:
            offset, lo, hi = np.zeros((k // 32, n), np.float32), -128, 127
            span = np.abs(v).max(axis=1).astype(np.float64) * (hi - lo) / hi
        with np.errstate(over="ignore"):
            first = (span / (hi - lo)).astype(np.float16)
        if not np.isfinite(first).all():
            continue
        scale = np.zeros(offset.shape, np.float32)
        found = np.zeros(offset.shape, bool)
        for toward in (None, np.inf, -np.inf):  # the nearest float16, then its neighbours
            d = (first if toward is None else np.nextafter(first, np.float16(toward))).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.clip(np.nan_to_num(np.rint((v - offset[:, None]) / d[:, None])), lo, hi)
            ok = ((q * d[:, None]).astype(np.float32) + offset[:, None] == v).all(axis=1) & ~found
            scale = np.where(ok, d, scale)
            found |= ok
            if found.all():
                return scale, offset
    return None


@functools.partial(jax.jit, static_argnums=3)
def _codes(w, scale, offset, rows: int):
    """Codes for ``w`` [K, n] under per-block scale / offset [K / rows, n]; whether they reproduce it
    exactly (with an offset: codes of at most 4 bits and a scale whose low 4 significand bits are zero,
    so the product is exact and a fused decode agrees); the code range; whether every offset is 0."""
    s_full, o_full = jnp.repeat(scale, rows, axis=0), jnp.repeat(offset, rows, axis=0)
    q = jnp.where(s_full == 0, 0.0, jnp.rint((w - o_full) / jnp.where(s_full == 0, 1.0, s_full)))
    q = jnp.clip(q, -128, 127)
    exact = (o_full == 0) | (((jax.lax.bitcast_convert_type(s_full, jnp.int32) & 15) == 0) & (q >= 0) & (q <= 15))
    ok = jnp.all((q * s_full + o_full == w) & exact)
    by32 = s_full.reshape(-1, 32, w.shape[1])
    off32 = o_full.reshape(-1, 32, w.shape[1])
    uniform32 = jnp.all(by32 == by32[:, :1]) & jnp.all(off32 == off32[:, :1])  # one scale per 32 rows
    return q.astype(jnp.int8), ok, jnp.min(q), jnp.max(q), jnp.all(offset == 0), uniform32


ENCODE_COLUMNS = 4096  # columns per step of ``_encode`` (bounds its memory on large heads)


def _encode(w: np.ndarray, scale: np.ndarray, offset: np.ndarray, rows: int) -> np.ndarray | None:
    """Compressed panels of ``w`` [K, N] from per-block scale / offset [K / rows, N], or None when
    the codes do not reproduce every value (or fit neither format)."""
    k, n = w.shape
    if k % 32 or n % PANEL or k % rows or scale.shape != (k // rows, n):
        return None
    parts = []
    lo, hi, no_offset, uniform32 = 0, 0, True, True
    for c0 in range(0, n, ENCODE_COLUMNS):
        cols = slice(c0, min(n, c0 + ENCODE_COLUMNS))
        q, ok, q_lo, q_hi, zero, uni = _codes(w[:, cols], scale[:, cols], offset[:, cols], rows)
        if not bool(ok):
            return None
        parts.append(np.asarray(q))
        lo, hi = min(lo, int(q_lo)), max(hi, int(q_hi))
        no_offset, uniform32 = no_offset and bool(zero), uniform32 and bool(uni)
    q = np.concatenate(parts, axis=1)
    p = n // PANEL
    if lo >= 0 and hi <= 15 and uniform32:
        kb = k // 32
        first = np.arange(0, k // rows, 32 // rows) if rows < 32 else np.arange(k // rows)
        head = np.stack([scale[first], offset[first]])  # [2, KB, N]
        c = q.astype(np.uint8).reshape(kb, 32, p, PANEL).transpose(2, 0, 1, 3)
        c = c[..., :16] | (c[..., 16:] << 4)  # column j low nibble, j + 16 high
    elif no_offset:
        kb = k // 16
        head = np.repeat(scale, rows // 16, axis=0)[None] if rows >= 16 else None  # [1, KB, N]
        if head is None:
            return None
        c = q.reshape(kb, 16, p, PANEL).transpose(2, 0, 1, 3).view(np.uint8)
    else:
        return None
    head = head.reshape(len(head), kb, p, PANEL).transpose(2, 1, 0, 3)  # [P, KB, 1|2, 32]
    head = np.ascontiguousarray(head.astype(np.float32)).view(np.uint8).reshape(p, kb, -1)
    return np.concatenate([head, np.ascontiguousarray(c).reshape(p, kb, -1)], axis=-1)


def compress_weight(w: Float[Array, "... K N"], hint: Any = None) -> Any:
    """A [..., K, N] weight as compressed panels [..., N/32, K/L, 768 | 640] (uint8: 4-bit codes in
    blocks of L = 32 k, or int8 codes in blocks of 16) when every value is exactly reproduced, else
    None (then it stays float32). ``hint``: the file's (scale, offset, block) per [K / block, N] block
    (``weights.gguf_block_scales``); without it, Q4_1 / Q8_0-style float16 scales are searched."""
    a = np.asarray(w)
    *lead, k, n = a.shape
    if a.dtype != np.float32 or k % 32 or n % PANEL:
        return None
    parts = []
    for i, m in enumerate(a.reshape(-1, k, n)):
        if hint is not None:
            scale, offset, rows = hint
            scale, offset = np.asarray(scale).reshape(-1, k // rows, n)[i], np.asarray(offset).reshape(-1, k // rows, n)[i]
        else:
            found = _search_scales(m)
            if found is None:
                return None
            (scale, offset), rows = found, 32
        part = _encode(m, scale, offset, rows)
        if part is None or (parts and part.shape != parts[0].shape):
            return None
        parts.append(part)
    return jnp.asarray(np.stack(parts).reshape(*lead, *parts[0].shape))


def block_scales(wq: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """The per-column block scales and offsets [K / L, N] of compressed panels [N/32, K/L, B], and L."""
    wq = np.asarray(wq)
    p, kb, _ = wq.shape
    bits = compressed_bits(wq)
    header = np.ascontiguousarray(wq[..., :HEADER[bits]]).view(np.float32).reshape(p, kb, HEADER[bits] // 128, PANEL)
    per_column = header.transpose(1, 2, 0, 3).reshape(kb, -1, p * PANEL)  # [KB, 1 | 2, N]
    offset = per_column[:, 1] if bits == 4 else np.zeros_like(per_column[:, 0])
    return per_column[:, 0], offset, BLOCK_ROWS[bits]


def compress_columns(wq: Any, columns: Any, w: Float[Array, "K C"]) -> Any:
    """Compressed panels of ``w``, the ``columns`` of the weight that ``wq`` holds compressed (e.g. a
    drafter's rows of the target's LM head), from ``wq``'s own block scales; None when they do not
    reproduce ``w`` exactly (then the caller keeps another format)."""
    scale, offset, rows = block_scales(wq)
    ids = np.asarray(columns)
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= scale.shape[1]:
        return None
    part = _encode(np.asarray(w, np.float32), scale[:, ids], offset[:, ids], rows)
    return None if part is None else jnp.asarray(part)


def compressed_bits(wq: Any) -> int:
    return 4 if wq.shape[-1] == BLOCK_BYTES[4] else 8


def decompress(wq: Any) -> Float[Array, "... P K 32"]:
    """Compressed panels back to float32 panels (the jnp reference; bitwise the packed weight)."""
    *lead, p, kb, size = wq.shape
    bits = compressed_bits(wq)
    header = HEADER[bits]
    head = jax.lax.bitcast_convert_type(wq[..., :header].reshape(*lead, p, kb, header // 128, PANEL, 4), jnp.float32)
    codes = wq[..., header:].reshape(*lead, p, kb, BLOCK_ROWS[bits], -1)
    if bits == 4:
        q = jnp.concatenate([codes & 15, codes >> 4], axis=-1)
        w = q.astype(jnp.float32) * head[..., None, 0, :] + head[..., None, 1, :]
    else:
        w = jax.lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32) * head[..., None, 0, :]
    return w.reshape(*lead, p, kb * BLOCK_ROWS[bits], PANEL)


def is_compressed(wp: Any) -> bool:
    return jnp.dtype(wp.dtype) == jnp.uint8


def is_bf16(wp: Any) -> bool:
    return jnp.dtype(wp.dtype) == jnp.bfloat16


# ------------------------------------------------------------------------------------------ the product


def quantize_activations(x: Float[Array, "... K"], levels: int = 127) -> Float[Array, "... K"]:
    """x as the int8x products see it: per 32 k, round(x * 127 / max|x|) (half to even) times max|x| / 127;
    ``levels=32767``: as the int16x products see it."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(levels) / jnp.where(amax > 0, amax, 1), 0)
    q = jnp.round(blocks * inv)
    return (q * (amax / jnp.float32(levels))).reshape(x.shape)


def panel_matmul_reference(x: Float[Array, "... K"], wp: Any, activations: str = "float32",
                           layer: Int[Array, ""] | None = None, dot_dtype: str = "float32") -> Float[Array, "... N"]:
    """``x @ unpack(wp)`` in jnp (the reference the kernel is tested against); ``activations="bfloat16"``
    with 4-bit panels: x rounded to bfloat16 first (what the bf16x products compute, up to float32
    rounding; 8-bit panels keep the float32 products); ``"int8"``: x quantized per 32 k
    (``quantize_activations``, what the int8x products compute for 4-bit and 8-bit panels alike);
    ``"int16"``: 4-bit panels, x quantized to int16 per 32 k (int16x; 8-bit panels keep the float32 products).
    ``layer``: ``wp`` is a stack over layers and this layer's panels are used. ``dot_dtype="bfloat16"``:
    x and the decoded weights rounded to bfloat16, float32 sums (XLA's dot runs them on the CPU's
    bfloat16 units where it has them: AMX, AVX512-BF16)."""
    if layer is not None:
        wp = wp[layer]
    if activations == "bfloat16" and is_compressed(wp) and compressed_bits(wp) == 4:
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    if activations == "int8" and is_compressed(wp) and x.shape[-1] % 32 == 0:
        x = quantize_activations(x)
    if activations == "int16" and is_compressed(wp) and compressed_bits(wp) == 4:
        x = quantize_activations(x, 32767)
    if is_compressed(wp):
        wp = decompress(wp)
    dt = jnp.dtype(dot_dtype)
    wp = wp.astype(dt)  # float32 from bfloat16 panels: exact
    y = jnp.einsum("...k,pkj->...pj", x.astype(dt), wp, preferred_element_type=jnp.float32)
    return y.reshape(*y.shape[:-2], -1)


ROW_BLOCK_BYTES = 1 << 20  # a kernel call's float32 activations, at most (one core's L2 keeps them)


def rows_per_call(k: int) -> int:
    """Rows of x one kernel call takes: a power of two from 32 to 256 whose [rows, k] float32 block fits
    ``ROW_BLOCK_BYTES`` (256 at SmolLM2's k = 576: a 1,024-row prompt chunk in one call ran 1.5x slower
    on a 2-core Xeon with 2 MB of L2 per core; 128- and 512-row blocks were 1-10% slower than 256)."""
    rows = 256
    while rows > 32 and rows * k * 4 > ROW_BLOCK_BYTES:
        rows //= 2
    return rows



def panel_matmul(x: Float[Array, "... K"], wp: Any, activations: str = "float32",
                 layer: Int[Array, ""] | None = None) -> Float[Array, "... N"]:
    """``x @ unpack(wp)`` through the kernel, float32, bfloat16 or compressed panels (call ``load`` first).

    ``activations="bfloat16"`` (4-bit compressed panels; ``load_model(cpu_matmul="bf16x")``): x rounded
    to bfloat16 and multiplied with AVX512-BF16 dot products, fewer instructions where a pass is bound by
    arithmetic (tree passes), not the float32 product; still the same for every M. Other panels keep
    the float32 products. ``"int8"`` (``cpu_matmul="int8x"``): x quantized to int8 per 32 k and
    multiplied with AVX512-VNNI (four k per instruction) by 4-bit and 8-bit panels (K a multiple of 32),
    coarser still, same for every M too. ``"int16"`` (``cpu_matmul="int16x"``, 4-bit panels): x quantized
    to int16 per 32 k, two k per VNNI instruction, within ~1e-5 of the float32 products, same for every M.

    ``layer``: ``wp`` is a stack of panels over layers ([L, ...]) and the kernel reads this layer's in
    place (the scanned layer loop: nothing is copied out of the stack)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = 1
    for s in lead:
        rows *= s
    n = wp.shape[-3] * PANEL
    block = rows_per_call(k)
    if rows > block:  # a prompt chunk: row blocks whose activations stay in a core's L2 (same outputs)
        flat = x.reshape(rows, k)
        parts = [panel_matmul(flat[r:r + block], wp, activations, layer) for r in range(0, rows, block)]
        return jnp.concatenate(parts).reshape(*lead, n)
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    at = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    if is_compressed(wp):
        name = {"bfloat16": COMPRESSED_BF16X_TARGET, "int8": COMPRESSED_INT8X_TARGET,
                "int16": COMPRESSED_INT16X_TARGET}.get(activations, COMPRESSED_TARGET)
        y = jax.ffi.ffi_call(name, out, vmap_method="sequential")(x.reshape(rows, k).astype(jnp.float32), wp, at)
    elif is_bf16(wp):
        y = jax.ffi.ffi_call(BF16_TARGET, out, vmap_method="sequential")(x.reshape(rows, k).astype(jnp.float32), wp, at)
    else:
        y = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x.reshape(rows, k).astype(jnp.float32),
                                                                   wp.astype(jnp.float32), at)
    return y.reshape(*lead, n)


# ------------------------------------------------------------------------- greedy tokens of the LM head


def column_abs_sums(wq: Any) -> np.ndarray:
    """Per 32 k and column, the sum of |w| of 8-bit compressed panels [N/32, K/16, 640]: [N/32, K/32, 32]
    float32, what ``screened_argmax`` bounds the int8 screen's error with (rounded up, so it stays an
    upper bound). |w| = |code| * |scale| per block of 16 k, summed in float64 from the bytes."""
    raw = np.asarray(wq)
    p, kb, _ = raw.shape
    scales = np.abs(raw[..., :HEADER[8]].copy().view(np.float32)).astype(np.float64)  # [P, KB, 32]
    codes = np.abs(raw[..., HEADER[8]:].view(np.int8).reshape(p, kb, BLOCK_ROWS[8], PANEL).astype(np.int32))
    per_block = codes.sum(axis=2) * scales  # [P, KB, 32]
    sums = per_block.reshape(p, kb // 2, 2, PANEL).sum(axis=2)
    return np.nextafter(sums.astype(np.float32), np.float32(np.inf))


def can_screen(wq: Any, activations: str = "float32") -> bool:
    """Whether ``screened_argmax`` applies: 8-bit compressed panels whose logits are the float32 chains
    (not ``int8x``, where the int8 products are the model; ``int16x`` keeps 8-bit panels in float32), K a
    multiple of 32, a build with integer products (VNNI, AVX2 or NEON)."""
    return (activations != "int8" and is_compressed(wq) and compressed_bits(wq) == 8
            and wq.shape[-2] * BLOCK_ROWS[8] % 32 == 0 and has_int8x())


def screened_argmax(x: Float[Array, "... K"], wq: Any, colabs: Any) -> Int[Array, "..."]:
    """``argmax(panel_matmul(x, wq), -1)`` (first index of the largest; a NaN wins) without most of the
    float32 product: the int8 products (VNNI, AVX2 or NEON) bound every logit (``column_abs_sums``), and the float32
    chains run only on the panels holding a column that could be the largest (a handful per row on
    SmolLM2's head), so the index is that of the full product bit for bit. 8-bit panels (``can_screen``)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = 1
    for s in lead:
        rows *= s
    out = jax.ShapeDtypeStruct((rows,), jnp.int32)
    y = jax.ffi.ffi_call(SCREENED_ARGMAX_TARGET, out, vmap_method="sequential")(
        x.reshape(rows, k).astype(jnp.float32), wq, colabs)
    return y.reshape(lead)


# ------------------------------------------------------------------------------- a default by measurement

MEASURED_ROWS = (1, 8, 64)  # rows of x: a decoding step, a tree pass, a prefill chunk
MEASURE_VERSION = 7  # of how ``measure_against_xla`` times (part of the cached verdict's key)


def _median_pair(kernel, xla, args_k, args_x, reps: int) -> tuple[float, float]:
    """Medians of interleaved timings of kernel(*args_k) and xla(*args_x) (both compiled first)."""
    import time

    jax.block_until_ready(kernel(*args_k))
    jax.block_until_ready(xla(*args_x))
    ts_k, ts_x = [], []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(kernel(*args_k))
        ts_k.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(xla(*args_x))
        ts_x.append(time.perf_counter() - t)
    return float(np.median(ts_k)), float(np.median(ts_x))


def model_weights(params: dict[str, Any]) -> tuple[list[list[Any]], Any]:
    """A model's matmul weights as one step uses them: each layer's projections (packed panels in a
    packed model, [K, N] matrices in a plain one) and the LM head (``head_panels``, or the plain
    model's ``lm_head`` / transposed embedding)."""
    if "layers" in params:  # scanned: one stacked array per projection
        stacked = [v for k, v in params["layers"].items() if k in PACKED_WEIGHTS]
        layers = [[w[i] for w in stacked] for i in range(stacked[0].shape[0])]
    else:
        blocks = sorted((k for k in params if k.startswith("blocks_")), key=lambda k: int(k.split("_")[1]))
        layers = [[v for k, v in params[b].items() if k in PACKED_WEIGHTS] for b in blocks]
    if "head_panels" in params:
        head = params["head_panels"]
    else:
        head = params["lm_head"] if "lm_head" in params else jnp.transpose(params["embed"])
    return layers, head


def _step(matmul):
    """One model step's matmuls (every layer's projections, then the head) for rows of x, in one
    program (unrolled, as the model's layers are on CPU)."""

    def step(xs, layers, head, x_head):  # xs[i][j]: the rows for layer i's weight j (no two calls alike)
        outs = [matmul(x, w)[0, 0] for xl, wl in zip(xs, layers) for x, w in zip(xl, wl)]
        return jnp.sum(jnp.stack([*outs, matmul(x_head, head)[0, 0]]))

    return jax.jit(step)


def measure_against_xla(params: dict[str, Any], plain: dict[str, Any], activations: str = "float32",
                        rows: tuple[int, ...] = MEASURED_ROWS, reps: int = 5) -> dict[int, dict[str, float]]:
    """For each row count M: the seconds one step's matmuls take with every layer's own weights in one
    compiled program each (dispatch paid once, as in the model), through the kernel on the packed
    model ``params`` and through XLA's dot on the plain float32 model ``plain`` (what
    ``cpu_matmul="off"`` runs); medians of ``reps`` interleaved runs."""
    layers, head = model_weights(params)
    plain_layers, plain_head = model_weights(plain)
    kernel = _step(functools.partial(panel_matmul, activations=activations))
    xla = _step(lambda x, w: x @ w)
    rng = np.random.default_rng(0)
    out = {}
    for m in rows:
        def inputs(ls):
            return [[jnp.asarray(rng.standard_normal((m, w.shape[-2] if w.ndim == 2 else w.shape[-2] *
                                                       (BLOCK_ROWS[compressed_bits(w)] if is_compressed(w) else 1)),
                                                     np.float32)) for w in wl] for wl in ls]

        k_head = plain_head.shape[0]
        x_head = jnp.asarray(rng.standard_normal((m, k_head), np.float32))
        t_k, t_x = _median_pair(kernel, xla, (inputs(layers), layers, head, x_head),
                                (inputs(plain_layers), plain_layers, plain_head, x_head), reps)
        out[m] = {"kernel_s": t_k, "xla_s": t_x}
    return out


def verdict_from(timings: dict[int, dict[str, float]], isa: str) -> dict[str, Any]:
    """``measured_verdict``'s decision from the timings of ``measure_against_xla``."""
    ratios = {m: t["xla_s"] / t["kernel_s"] for m, t in timings.items()}
    decode_rows, prefill_rows = MEASURED_ROWS[:-1], MEASURED_ROWS[-1]
    use = all(ratios[m] > 1.0 for m in decode_rows)  # steps and tree passes alike, or a pass would not equal steps
    prefill_xla = use and ratios[prefill_rows] < 1.0
    shown = ", ".join(f"M={m} {r:.2f}x" for m, r in ratios.items())
    if not use:
        why = f"XLA's dot: on this CPU ({isa}) the kernel is slower for decoding ({shown} XLA's speed)"
    elif prefill_xla:
        why = (f"the kernel ({isa}) for decoding and tree passes, XLA's dot for prompt chunks "
               f"({shown} XLA's speed on this model's matmuls)")
    else:
        why = f"the kernel ({isa}): {shown} XLA's speed on this model's matmuls"
    return {"use": use, "prefill_xla": prefill_xla, "ratios": {str(m): r for m, r in ratios.items()},
            "isa": isa, "why": why, "timings": {str(m): t for m, t in timings.items()}}


def measured_verdict(params: dict[str, Any], plain: dict[str, Any], activations: str = "float32",
                     fresh: bool = False) -> dict[str, Any]:
    """Whether this machine's kernel beats XLA's dot on a model's own matmuls (``params`` packed,
    ``plain`` the same model's float32 params), measured once per library, model shapes and mode and
    cached under hsdjax's cache: ``verdict_from``'s {"use": the kernel is faster for one row and for a
    tree pass's rows (both, so that tree passes and steps take one path), "prefill_xla": XLA's dot is
    faster for a prompt chunk's rows, "ratios": {M: XLA's time / the kernel's}, "isa", "why": one line}."""
    import json

    from hsdjax.paths import cache_dir

    layers, head = model_weights(params)
    shapes = [(tuple(w.shape), str(w.dtype)) for w in (*layers[0], head)]
    sig = hashlib.sha256(repr((shapes, len(layers), MEASURE_VERSION)).encode() + activations.encode()
                         + repr(MEASURED_ROWS).encode()).hexdigest()[:12]
    path = cache_dir("cpu_matmul") / f"verdict-{library_path().stem}-{sig}.json"
    if path.is_file() and not fresh:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    timings = measure_against_xla(params, plain, activations)
    verdict = verdict_from(timings, instruction_set())
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(verdict, indent=1))
    tmp.replace(path)
    return verdict
