"""Tensor-parallel (and data-parallel) placement of the target model on a ``jax.sharding.Mesh``.

The mesh has two axes: ``data`` (batch rows) and ``model`` (tensor parallelism). Nothing in the engine
knows about it: parameters, the batch inputs and the decoding state are placed with ``NamedSharding``s
and ``jax.jit`` propagates them through ``prefill``, ``start_decoding`` and the ``decode`` while-loop.

Target parameters (Megatron-style, ``L`` = the stacked layer axis when layers are scanned):

- attention: ``wq``/``wk``/``wv`` (and biases) split by heads (output columns) on ``model``, ``wo``
  split by its input rows; only when both the query and the KV heads divide by the ``model`` size, so
  every device holds whole GQA groups. Otherwise attention is replicated.
- MLP: ``w_gate``/``w_up`` split on the hidden (intermediate) columns, ``w_down`` on its rows.
- ``embed`` [V, E] and ``lm_head`` [E, V]: split on the vocabulary when it divides, else on the
  embedding width when that divides, else replicated. Norm scales are replicated.

The KV cache is split by KV heads on ``model`` (when attention is split) and by rows on ``data``;
every other per-row array of the state is split by rows on ``data`` when the batch divides. Drafter
params are replicated. Multi-host runs call ``maybe_initialize_distributed`` first (see README).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from hsdjax.errors import HsdjaxError
from hsdjax.runtime.config import ModelConfig

AXES = ("data", "model")
MeshLike = Mesh | Mapping[str, int] | str | None

_COLUMN = ("wq", "wk", "wv", "bq", "bk", "bv")  # split on their last axis when attention is split
_VECTORS = ("bq", "bk", "bv", "attn_norm", "mlp_norm")  # per-layer 1-D params
_MLP_COLUMN = ("w_gate", "w_up")
_MLP_ROW = "w_down"


def row_axis(path: tuple[Any, ...], leaf: Any) -> int | None:
    """The batch axis of a ``DecodeState`` leaf: 1 for stacked KV-cache keys/values [L, B, K, S, D],
    None for the shared ``stop_ids``, 0 for everything else (the drafter-state convention)."""
    names = [getattr(p, "name", None) for p in path]
    if names and names[-1] == "stop_ids":
        return None
    if any(n in ("k", "v") for n in names) and getattr(leaf, "ndim", 0) == 5:
        return 1
    return 0


# ------------------------------------------------------------------------------------------ meshes
def parse_mesh(spec: str, devices: int | None = None) -> dict[str, int]:
    """``"data=1,model=8"`` -> ``{"data": 1, "model": 8}``; an axis left out is 1.

    The product must equal ``devices`` (default: ``jax.device_count()``, all processes together).
    """
    text = (spec or "").strip()
    if not text:
        raise HsdjaxError("empty mesh: expected e.g. --mesh data=1,model=8")
    shape = dict.fromkeys(AXES, 1)
    seen: set[str] = set()
    for part in text.split(","):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            raise HsdjaxError(f"bad mesh entry {part.strip()!r} in {spec!r}: expected AXIS=SIZE, e.g. data=1,model=8")
        if name not in AXES:
            raise HsdjaxError(f"unknown mesh axis {name!r} in {spec!r}; axes: {', '.join(AXES)}")
        if name in seen:
            raise HsdjaxError(f"mesh axis {name!r} given twice in {spec!r}")
        try:
            size = int(value)
        except ValueError:
            raise HsdjaxError(f"mesh axis {name}: size must be a whole number (got {value!r})") from None
        if size < 1:
            raise HsdjaxError(f"mesh axis {name}: size must be at least 1 (got {size})")
        shape[name] = size
        seen.add(name)
    check_mesh_shape(shape, devices)
    return shape


def check_mesh_shape(shape: Mapping[str, int], devices: int | None = None) -> None:
    """The axes are ``data`` and ``model`` and their product is the number of devices."""
    unknown = [a for a in shape if a not in AXES]
    if unknown:
        raise HsdjaxError(f"unknown mesh axis {unknown[0]!r}; axes: {', '.join(AXES)}")
    devices = jax.device_count() if devices is None else devices
    total = math.prod(shape.values())
    if total != devices:
        described = ",".join(f"{a}={shape.get(a, 1)}" for a in AXES)
        raise HsdjaxError(f"mesh {described} needs {total} devices, but {devices} "
                          f"{'is' if devices == 1 else 'are'} available (the sizes must multiply to {devices})")


def make_mesh(mesh: MeshLike) -> Mesh | None:
    """A ``Mesh`` with axes (``data``, ``model``) from a string, a dict of sizes, or a Mesh (returned
    as is); None stays None (single device, no sharding)."""
    if mesh is None or isinstance(mesh, Mesh):
        if isinstance(mesh, Mesh) and tuple(mesh.axis_names) != AXES:
            raise HsdjaxError(f"the mesh must have the axes {AXES} (got {tuple(mesh.axis_names)})")
        return mesh
    # a dict goes through the same checks as a --mesh string
    shape = parse_mesh(mesh if isinstance(mesh, str) else ",".join(f"{k}={v}" for k, v in dict(mesh).items()))
    sizes = tuple(shape[a] for a in AXES)
    return jax.make_mesh(sizes, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def mesh_shape(mesh: Mesh | None) -> dict[str, int]:
    """``{"data": .., "model": ..}`` (all 1 without a mesh)."""
    if mesh is None:
        return dict.fromkeys(AXES, 1)
    return {a: int(mesh.shape[a]) for a in AXES}


def mesh_devices(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.devices.size)


# ------------------------------------------------------------------------------------------ params
def attention_split(cfg: ModelConfig, mesh: Mesh) -> bool:
    """Whether attention heads are split on ``model``: query and KV heads must both divide."""
    m = mesh.shape["model"]
    return m > 1 and cfg.num_heads % m == 0 and cfg.num_kv_heads % m == 0


def _embedding_spec(cfg: ModelConfig, m: int, vocab_axis: int) -> P:
    """Vocabulary split when it divides, else the embedding width, else replicated."""
    axes: list[str | None] = [None, None]
    if m > 1 and cfg.vocab_size % m == 0:
        axes[vocab_axis] = "model"
    elif m > 1 and cfg.hidden_size % m == 0:
        axes[1 - vocab_axis] = "model"
    return P(*axes)


def _layer_spec(name: str, ndim: int, cfg: ModelConfig, mesh: Mesh) -> P:
    """The spec of one layer weight (``ndim`` counts a leading stacked-layer axis if there is one)."""
    m = mesh.shape["model"]
    vector = name in _VECTORS
    lead = (None,) * (ndim - (1 if vector else 2))
    if name in _COLUMN and attention_split(cfg, mesh):
        return P(*lead, *(("model",) if vector else (None, "model")))
    if name == "wo" and attention_split(cfg, mesh):
        return P(*lead, "model", None)
    if name in _MLP_COLUMN and m > 1 and cfg.intermediate_size % m == 0:
        return P(*lead, None, "model")
    if name == _MLP_ROW and m > 1 and cfg.intermediate_size % m == 0:
        return P(*lead, "model", None)
    return P()


def param_specs(cfg: ModelConfig, params: Mapping[str, Any], mesh: Mesh) -> dict[str, Any]:
    """A ``PartitionSpec`` for every target parameter (same tree as ``params``; stacked or unrolled)."""
    m = mesh.shape["model"]
    specs: dict[str, Any] = {}
    for key, value in params.items():
        if key == "embed":
            specs[key] = _embedding_spec(cfg, m, vocab_axis=0)
        elif key == "lm_head":
            specs[key] = _embedding_spec(cfg, m, vocab_axis=1)
        elif key == "layers" or key.startswith("blocks_"):
            specs[key] = {name: _layer_spec(name, np.ndim(w), cfg, mesh) for name, w in value.items()}
        else:
            specs[key] = P()
    return specs


def shard_params(cfg: ModelConfig, params: Mapping[str, Any], mesh: Mesh | None) -> dict[str, Any]:
    """Place the target's params on the mesh (a no-op without one)."""
    if mesh is None:
        return dict(params)
    specs = param_specs(cfg, params, mesh)
    return jax.tree_util.tree_map(lambda w, s: jax.device_put(w, NamedSharding(mesh, s)), dict(params), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def replicate(tree: Any, mesh: Mesh | None) -> Any:
    """Place every array of ``tree`` whole on every device of the mesh (drafter params)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, P()))


# ------------------------------------------------------------------------------------------ batch / state
def _rows(mesh: Mesh, batch: int) -> str | None:
    """``data`` when the batch divides by its size, else None (rows replicated)."""
    d = mesh.shape["data"]
    return "data" if d > 1 and batch % d == 0 else None


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], axis: int = 0) -> NamedSharding:
    """Rows (``axis``) on ``data`` when they divide, everything else replicated."""
    axes: list[str | None] = [None] * len(shape)
    if shape:
        axes[axis] = _rows(mesh, shape[axis])
    return NamedSharding(mesh, P(*axes))


def shard_batch(tree: Any, mesh: Mesh | None) -> Any:
    """Place per-row inputs on the mesh: every array's leading axis is its batch axis (scalars go whole).

    Arrays may be NumPy (identical on every process in a multi-host run) or JAX arrays.
    """
    if mesh is None:
        return tree
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, batch_sharding(mesh, np.shape(a))), tree)


def place_inputs(inputs: dict[str, Any], mesh: Mesh | None) -> dict[str, Any]:
    """``Generator``'s prefill inputs: per-row arrays by rows, the shared ``stop_ids`` whole."""
    if mesh is None:
        return inputs
    placed = shard_batch({k: v for k, v in inputs.items() if k != "stop_ids"}, mesh)
    placed["stop_ids"] = replicate(inputs.get("stop_ids"), mesh)
    return {k: placed[k] for k in inputs}  # the caller's order (tree_map sorts dict keys)


def cache_spec(cfg: ModelConfig, mesh: Mesh, ndim: int, batch: int) -> P:
    """KV cache keys/values ([B, K, S, D] per layer, or stacked [L, B, K, S, D]): rows on ``data``,
    KV heads on ``model`` when attention is split."""
    heads = "model" if attention_split(cfg, mesh) else None
    spec = (_rows(mesh, batch), heads, None, None)
    return P(*((None,) * (ndim - 4) + spec))


def decode_state_shardings(state: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """``NamedSharding``s for a ``DecodeState`` (or ``GenState``): the target cache as ``cache_spec``,
    ``stop_ids`` replicated, every other leaf split by rows (axis 0) on ``data`` when they divide.

    The drafter's own caches (e.g. ``sps``'s draft model) have their rows split but their heads
    replicated, like the drafter's params.
    """
    def place(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        names = [getattr(p, "name", None) for p in path]
        shape = np.shape(leaf)
        axis = row_axis(path, leaf)
        if axis is None or not shape:
            return NamedSharding(mesh, P())
        kv = "cache" in names and ("k" in names or "v" in names) and len(shape) >= 4
        if kv and "draft" not in names:
            return NamedSharding(mesh, cache_spec(cfg, mesh, len(shape), shape[axis]))
        axes: list[str | None] = [None] * len(shape)
        axes[axis] = _rows(mesh, shape[axis])
        return NamedSharding(mesh, P(*axes))

    return jax.tree_util.tree_map_with_path(place, state)


def shard_state(state: Any, cfg: ModelConfig, mesh: Mesh | None) -> Any:
    """Place a ``DecodeState`` as ``decode_state_shardings`` says (a no-op without a mesh)."""
    if mesh is None:
        return state
    return jax.device_put(state, decode_state_shardings(state, cfg, mesh))


def to_host(x: Array | Any) -> np.ndarray:
    """A NumPy copy of a (possibly sharded, possibly multi-host) array: every process gets it whole."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ------------------------------------------------------------------------------------------ multi-host
def distributed_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``jax.distributed.initialize`` arguments from ``HSDJAX_COORDINATOR`` (host:port),
    ``HSDJAX_NUM_PROCESSES`` and ``HSDJAX_PROCESS_ID``; the ones not set are left to JAX's own
    detection (TPU pod slices, SLURM, Open MPI, or JAX's ``JAX_COORDINATOR_ADDRESS`` etc.)."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    if env.get("HSDJAX_COORDINATOR"):
        out["coordinator_address"] = env["HSDJAX_COORDINATOR"].strip()
    for var, key in (("HSDJAX_NUM_PROCESSES", "num_processes"), ("HSDJAX_PROCESS_ID", "process_id")):
        value = env.get(var, "").strip()
        if not value:
            continue
        try:
            number = int(value)
        except ValueError:
            raise HsdjaxError(f"{var} must be a whole number (got {value!r})") from None
        if number < 0 or (key == "num_processes" and number < 1):
            raise HsdjaxError(f"{var} must be {'at least 1' if key == 'num_processes' else '>= 0'} (got {number})")
        out[key] = number
    if "num_processes" in out and "process_id" in out and out["process_id"] >= out["num_processes"]:
        raise HsdjaxError(f"HSDJAX_PROCESS_ID ({out['process_id']}) must be below HSDJAX_NUM_PROCESSES "
                          f"({out['num_processes']})")
    return out


_distributed_on = False


def maybe_initialize_distributed(enabled: bool = False) -> bool:
    """Join a multi-process run when ``enabled`` (``--distributed``) or ``HSDJAX_COORDINATOR`` is set.

    Must run before anything else touches JAX's devices; every process then runs the same command
    and sees all devices of all processes (``jax.device_count()``). Returns whether it initialized.
    """
    global _distributed_on
    settings = distributed_settings()
    if _distributed_on or not (enabled or "coordinator_address" in settings):
        return _distributed_on
    try:
        jax.distributed.initialize(**settings)
    except (RuntimeError, ValueError) as exc:
        given = ", ".join(f"{k}={v}" for k, v in settings.items()) or "auto-detected settings"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HsdjaxError(f"jax.distributed.initialize failed ({given}): {reason}") from None
    _distributed_on = True
    return True


# ------------------------------------------------------------------------------------------ CLI helpers
def add_mesh_args(parser: Any) -> None:
    """``--mesh data=D,model=M`` and ``--distributed`` on an argparse parser."""
    parser.add_argument("--mesh", default=None, metavar="data=D,model=M",
                        help="shard the target over a device mesh, e.g. data=1,model=8 (sizes multiply to the "
                             "number of devices; default: one device, no sharding)")
    parser.add_argument("--distributed", action="store_true",
                        help="multi-host: call jax.distributed.initialize first (settings from HSDJAX_COORDINATOR, "
                             "HSDJAX_NUM_PROCESSES, HSDJAX_PROCESS_ID, or auto-detected on TPU pods / SLURM)")


def mesh_from_args(args: Any) -> Mesh | None:
    """Initialize multi-host JAX if asked, then build the ``--mesh`` (None when not given)."""
    maybe_initialize_distributed(bool(getattr(args, "distributed", False)))
    spec = getattr(args, "mesh", None)
    return make_mesh(spec) if spec else None
