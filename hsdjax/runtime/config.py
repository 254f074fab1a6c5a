"""Model configuration: the architecture hyper-parameters read from a GGUF file or a HF config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hsdjax.errors import HsdjaxError

SUPPORTED_FAMILIES = ("llama", "qwen2")


CACHE_DTYPES = (None, "float32", "float16", "bfloat16")

# How a model's attention and matmuls run: its one backend setting (``ModelConfig.backend``), resolved
# once by ``load_model`` and read by the model, the drafters (``make_drafter`` gives them the target's)
# and the drafter-data recorder.
#   "reference":  XLA's dot and the jnp tree attention (``kernels.tree_attention.tree_attention_reference``)
#   "pallas":     XLA's dot and the Pallas tree-attention kernel (Mosaic on TPU, Triton on GPU)
#   "cpu-kernel": hsdjax's C++ CPU kernels: projections and LM head as packed panels
#                 (``kernels.cpu_matmul``; the params must be packed so), attention by ``kernels.cpu_attention``
#   "auto":       "pallas" on a GPU or TPU, "reference" elsewhere (``resolve_backend``); never "cpu-kernel",
#                 which needs packed params: ``load_model`` chooses it (``cpu_matmul``)
BACKENDS = ("auto", "reference", "pallas", "cpu-kernel")
ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")  # JAX platforms "auto" runs the Pallas kernel on


def resolve_backend(backend: str = "auto") -> str:
    """``backend`` with "auto" resolved for JAX's default device (the others are returned as they are)."""
    if backend not in BACKENDS:
        raise HsdjaxError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    if backend != "auto":
        return backend
    import jax  # here, not at the top: reading a config needs no JAX

    return "pallas" if jax.default_backend() in ACCELERATORS else "reference"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters (hashable, so it can be a static jit argument)."""

    family: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_context: int = 8192
    tie_embeddings: bool = True
    qkv_bias: bool = False
    dtype: str = "float32"  # compute dtype: float32 on CPU, bfloat16 on accelerators
    # Run layers under lax.scan (compile time independent of depth) or unrolled (separate per-layer
    # weights: faster decoding on XLA's CPU backend, which copies scanned weight slices).
    scan_layers: bool = True
    # How attention and matmuls run (``BACKENDS``): ``load_model`` stores it resolved; "auto" (a config
    # built by hand) is resolved where it is read (``resolved_backend``).
    backend: str = "auto"
    # q/k/v as one matmul (``wqkv``) and gate/up as one (``w_gate_up``): fewer, wider matmuls (see
    # ``hsdjax.runtime.model.fuse_projections``); unsharded models only (a split over heads needs them apart).
    # ``load_model`` sets it when the CPU kernels run and the parts' packed panels are stored alike.
    fused_projections: bool = False
    # With backend "cpu-kernel": "bfloat16": the compressed 4-bit matmuls round their inputs to bfloat16
    # (``load_model(cpu_matmul="bf16x")``); "int8": they quantize them to int8 per 32 k
    # (``cpu_matmul="int8x"``); "int16": to int16 (``"int16x"``)
    cpu_matmul_activations: str = "float32"
    # With backend "cpu-kernel": prompt chunks (passes of more new tokens per row than a decoding or tree
    # pass has, ``cpu_attention.MAX_NEW_TOKENS``) multiply through XLA's dot on the decoded weights (``load_model``
    # sets it where its measurement found XLA's dot faster for them; every method prefills alike).
    cpu_matmul_prefill_xla: bool = False
    # Those prompt chunks' dots in "bfloat16" (inputs and decoded weights rounded, float32 sums) instead of
    # "float32": ~3x the arithmetic rate where the CPU has bfloat16 units (AMX, AVX512-BF16). Not exact, so
    # only where a pass needs no equality with decoding: the drafter-data re-recording (``data.rerecord_dtype``).
    prefill_dot_dtype: str = "float32"
    # Greedy tokens of the LM head through an int8 screen (``cpu_matmul.screened_argmax``: the same index
    # as the float32 logits' argmax, most of the head's float32 products skipped); the params then carry
    # ``head_colabs``. Set by ``load_model`` when the head is an 8-bit compressed panel and the CPU has VNNI.
    screened_head: bool = False
    # KV cache storage dtype; None stores it in the compute dtype. "float16" on CPU halves the bytes a
    # long-context step reads (the cache kernel widens it as it reads); keys and values are rounded once
    # when written, identically for every method, so speculative output still equals `ar`'s.
    cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise HsdjaxError(
                f"unsupported model family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if self.backend not in BACKENDS:
            raise HsdjaxError(f"backend must be one of {', '.join(BACKENDS)} (got {self.backend!r})")
        if self.cache_dtype not in CACHE_DTYPES:
            raise HsdjaxError(f"cache_dtype must be one of float32, float16, bfloat16 (got {self.cache_dtype!r})")
        if self.prefill_dot_dtype not in ("float32", "bfloat16"):
            raise HsdjaxError(f"prefill_dot_dtype must be float32 or bfloat16 (got {self.prefill_dot_dtype!r})")
        if self.num_heads % self.num_kv_heads:
            raise HsdjaxError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def resolved_backend(self) -> str:
        """``backend`` as it runs here ("auto" resolved by ``resolve_backend``): what the model, the
        drafters and training read."""
        return resolve_backend(self.backend)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "ModelConfig":
        """A config from ``to_dict``'s fields, also as older versions wrote them (``attention`` and the
        ``cpu_matmul`` flag, since joined as ``backend``)."""
        fields = dict(fields)
        attention, kernels = fields.pop("attention", "auto"), fields.pop("cpu_matmul", False)
        if "backend" not in fields:
            fields["backend"] = "cpu-kernel" if kernels else attention
        return cls(**fields)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        e, f, l = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = e * q + 2 * e * kv + q * e + 3 * e * f + 2 * e
        if self.qkv_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tie_embeddings else self.vocab_size * e
        return self.vocab_size * e + l * per_layer + e + head


def config_from_gguf_fields(fields: dict[str, Any], tensor_names: set[str], vocab_size: int | None = None
                            ) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (already decoded to Python values); ``vocab_size`` from
    the embedding tensor's shape when known."""
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_FAMILIES:
        raise HsdjaxError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise HsdjaxError(f"GGUF file lacks the field {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = vocab_size or fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise HsdjaxError("GGUF file does not say its vocabulary size")
    head_dim = int(fields.get(f"{arch}.attention.key_length") or fields.get(f"{arch}.rope.dimension_count") or hidden // heads)
    return ModelConfig(
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(get("context_length", 4096)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
    )


def config_from_hf(path: Path) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json``."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HsdjaxError(f"cannot read {path}: {exc}") from None
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise HsdjaxError(f"{path}: model_type {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
    rope = raw.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise HsdjaxError(f"{path}: rope scaling {scaling} is not supported yet")
    rope_theta = raw.get("rope_theta") or rope.get("rope_theta") or 10000.0
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelConfig(
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=int(raw.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
    )
