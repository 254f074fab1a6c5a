"""An optional CPU matmul for the small-M products of decoding: panel-packed float32 weights behind an
XLA FFI custom call (``cpu_matmul.cc``), with a jnp reference.

Why: on a CPU, a one-token step and a T-token tree pass both stream every weight from memory once,
but XLA's CPU dot grows much faster than that with T (SmolLM2's matmul chain, this 2-core machine:
T = 8 costs ~1.9x T = 1). The kernel reads each 32-column panel of a weight (packed contiguous,
``pack``) once for up to 8 rows, sharing the panels with XLA's own intra-op thread pool. Every output is the same multiply-add chain over k
whatever M is, so a tree pass and an `ar` step compute bitwise-equal matmul outputs.

It is never built by ``pip install`` (which needs no compiler): ``hsdjax cpu-matmul build`` compiles
it once with the machine's C++ compiler into hsdjax's cache (``-march=native``: it runs where it was
built), after which ``load_model`` uses it on CPU (``cpu_matmul="auto"``; ``"off"`` keeps XLA's dot).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

PANEL = 32  # output columns per panel: two 16-float vectors per row
SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "hsdjax_panel_matmul"
PACKED_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wqkv", "w_gate_up")

_state: dict[str, Any] = {"loaded": None}


class CpuMatmulError(RuntimeError):
    """The kernel cannot be built or loaded (the message says why)."""


def library_path() -> Path:
    """Where the built kernel lives: one file per source, JAX version and machine."""
    from hsdjax.paths import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + jax.__version__.encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:12]
    return cache_dir("cpu_matmul") / f"libhsdjax_panel_matmul-{key}.so"


def is_built() -> bool:
    return library_path().is_file()


def build(compiler: str | None = None) -> Path:
    """Compile the kernel (a few seconds) into hsdjax's cache; returns the library's path."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise CpuMatmulError("no C++ compiler found (install g++, or set CXX); hsdjax keeps XLA's matmul")
    out = library_path()
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
           str(SOURCE), "-o", str(tmp), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        raise CpuMatmulError(f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
    tmp.replace(out)  # atomic: a concurrent loader sees the old file or the new one
    return out


def load() -> bool:
    """Register the built kernel with XLA (once per process); False when it has not been built."""
    if _state["loaded"] is None:
        path = library_path()
        if not path.is_file():
            return False
        lib = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.HsdjaxPanelMatmul), platform="cpu")
        _state["loaded"] = lib
    return True


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


def unpack(wp: Float[Array, "... P K 32"]) -> Float[Array, "... K N"]:
    *lead, p, k, _ = wp.shape
    return jnp.swapaxes(wp, -3, -2).reshape(*lead, k, p * PANEL)


def pack_params(params: dict[str, Any], tie_embeddings: bool) -> dict[str, Any]:
    """Model params for a ``cpu_matmul`` config: every projection packed, plus ``head_panels`` (the LM
    head packed; ``embed`` and ``lm_head`` stay for embedding lookups and drafters)."""
    def layer(d: dict[str, Any]) -> dict[str, Any]:
        return {k: pack(v) if k in PACKED_WEIGHTS else v for k, v in d.items()}

    out = {k: layer(v) if (k == "layers" or k.startswith("blocks_")) else v for k, v in params.items()}
    head = jnp.transpose(params["embed"]) if tie_embeddings else params["lm_head"]
    out["head_panels"] = pack(head)
    return out


# ------------------------------------------------------------------------------------------ the product


def panel_matmul_reference(x: Float[Array, "... K"], wp: Float[Array, "P K 32"]) -> Float[Array, "... N"]:
    """``x @ unpack(wp)`` in jnp (the reference the kernel is tested against)."""
    y = jnp.einsum("...k,pkj->...pj", x, wp, preferred_element_type=jnp.float32)
    return y.reshape(*y.shape[:-2], -1)


def panel_matmul(x: Float[Array, "... K"], wp: Float[Array, "P K 32"]) -> Float[Array, "... N"]:
    """``x @ unpack(wp)`` through the kernel (float32; call ``load`` first)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = 1
    for s in lead:
        rows *= s
    n = wp.shape[0] * PANEL
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32), vmap_method="sequential")
    y = call(x.reshape(rows, k).astype(jnp.float32), wp.astype(jnp.float32))
    return y.reshape(*lead, n)
