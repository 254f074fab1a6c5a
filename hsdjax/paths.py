"""Where hsdjax keeps its files: assembled models, converted weights, the JAX compilation cache."""

import os
from pathlib import Path


def cache_home() -> Path:
    """Root of hsdjax's cache (``$HSDJAX_HOME``, default ``~/.cache/hsdjax``)."""
    root = os.environ.get("HSDJAX_HOME") or os.path.join(Path.home(), ".cache", "hsdjax")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(kind: str) -> Path:
    """A subfolder of the cache (``models``, ``weights``, ``jax``...), created on demand."""
    path = cache_home() / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
