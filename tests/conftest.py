"""Shared fixtures: tiny random models for breadth, the real default model for end-to-end checks."""

from __future__ import annotations

import os

import jax
import pytest

from hsdjax.api import enable_compilation_cache
from hsdjax.config import ModelConfig
from hsdjax.model import init_params

jax.config.update("jax_enable_x64", False)
enable_compilation_cache()

TINY_LLAMA = ModelConfig(family="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=3,
                         num_heads=6, num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_context=512)
TINY_QWEN = ModelConfig(family="qwen2", vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=1e6, max_context=512,
                        tie_embeddings=False, qkv_bias=True)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request):
    """(config, params) of a tiny random model of each family."""
    cfg = TINY_LLAMA if request.param == "llama" else TINY_QWEN
    return cfg, init_params(cfg, seed=1)


@pytest.fixture(scope="session")
def smollm():
    """The real default model (installed by `make test`)."""
    from hsdjax.api import load_model

    return load_model("smollm2-135m")


def pytest_report_header(config):
    return f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} devices); " \
           f"HSDJAX_HOME={os.environ.get('HSDJAX_HOME', '~/.cache/hsdjax')}"
