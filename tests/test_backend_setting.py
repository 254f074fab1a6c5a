"""One switch per concept: how attention and matmuls run is one setting, ``ModelConfig.backend``
(``hsdjax.runtime.config.BACKENDS``), resolved once by ``load_model``; the model, the drafters and the drafter-data
recorder read it from the config, and nothing decides it by looking at the device, a dtype or an
array's rank. The source is read here to find every place that reads it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hsdjax.runtime.config import BACKENDS, ModelConfig, resolve_backend
from tests.conftest import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {str(p.relative_to(ROOT)): p.read_text() for folder in ("hsdjax", "kernels", "train")
           for p in sorted((ROOT / folder).rglob("*.py"))}

# Every module that reads the backend setting, and what for. A new reader belongs here, and reads it
# through the config (``cfg.backend`` / ``cfg.resolved_backend``) or a drafter's copy of its target's.
READERS = {
    "hsdjax/runtime/config.py": "defines BACKENDS, resolve_backend and ModelConfig.backend",
    "hsdjax/runtime/loading.py": "resolves it once: cpu-kernel where the CPU kernels run, else what auto means here",
    "hsdjax/runtime/model.py": "the target's matmuls (panels or XLA's dot), attention (attention_for), packed LM head",
    "hsdjax/core/drafters/feature.py": "hsd / eagle: the network's panels, the ingest's and the local attention",
    "hsdjax/core/drafters/hsd.py": "the attn injection's context read (through the drafter network's copy)",
    "hsdjax/core/drafters/checkpoint.py": "a drafter binds its matrices as panels beside a cpu-kernel target",
    "hsdjax/core/methods.py": "make_drafter gives the feature drafters their target's setting",
    "train/datagen.py": "the recorder reads the LM head's panels beside a cpu-kernel target",
    "hsdjax/core/batch.py": "pooled_cache: the row pool keeps the largest bucket's rows where the CPU kernels read by row",
}


def reads_backend(source: str) -> bool:
    """Whether code (not prose) reads the setting: ``resolve_backend``, ``<x>.resolved_backend``, or the
    ``backend`` of a config, a drafter or a drafter network (``LoadedModel.backend`` is not the setting:
    it describes, for people, how the model runs)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "resolve_backend":
            return True
        if isinstance(node, ast.Attribute) and node.attr in ("resolve_backend", "resolved_backend"):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "backend":
            if ast.unparse(node.value).split(".")[-1] in ("cfg", "config", "net", "mod", "self", "drafter"):
                return True
    return False


def test_the_backend_is_read_only_through_the_config_by_the_known_readers():
    readers = {path for path, text in SOURCES.items() if reads_backend(text)}
    assert readers == set(READERS), "update READERS (and read the setting through the config)"


def _code_lines(text: str) -> list[str]:
    """The source's lines without comments and docstrings."""
    tree = ast.parse(text)
    prose = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            prose |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return [line.split("#", 1)[0] for i, line in enumerate(text.splitlines(), 1) if i not in prose]


RUNTIME = ("hsdjax/runtime/model.py", "hsdjax/core/engine.py", "hsdjax/core/tree.py", "hsdjax/core/verify.py", "hsdjax/core/drafters/",
           "kernels/", "train/")


@pytest.mark.parametrize("pattern,where", [
    # the device decides only through resolve_backend (and load_model, which resolves it)
    (r"default_backend\(", RUNTIME),
    # the old flag and field (the cpu_matmul_* modes of the CPU kernels stay; so does load_model's option)
    (r"\b(cfg|config)\.(cpu_matmul|attention)\b(?!_)|\bcpu_matmul\s*=\s*(True|False)"
     r"|getattr\((\w+\.)*(cfg|config), \"(cpu_matmul|attention)\"", ("",)),
    # the old resolvers at trace time, and a drafter's own attention setting
    (r"\btree_attention_auto\b|\battention_backend\b|\bself\.attention\b|\battention\s*=\s*\"", ("",)),
    # rank sniffing for packed panels
    (r"\.ndim\s*==\s*3", ("hsdjax/core/drafters/", "hsdjax/runtime/model.py", "train/")),
])
def test_no_other_switch_decides_the_backend(pattern, where):
    found = [f"{path}: {line.strip()}" for path, text in SOURCES.items() if path.startswith(where)
             for line in _code_lines(text) if re.search(pattern, line)]
    assert not found, found


def test_auto_resolves_for_the_device_and_the_others_are_kept():
    import jax

    assert set(BACKENDS) == {"auto", "reference", "pallas", "cpu-kernel"}
    here = "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "reference"
    assert TINY_LLAMA.backend == "auto" and TINY_LLAMA.resolved_backend == here
    for backend in ("reference", "pallas", "cpu-kernel"):
        assert TINY_LLAMA.replace(backend=backend).resolved_backend == resolve_backend(backend) == backend


def test_configs_written_before_the_backend_setting_still_read():
    """The weights cache stores a model's config (``to_dict``); one written with the old ``attention``
    and ``cpu_matmul`` fields reads into ``backend``."""
    fields = {k: v for k, v in TINY_LLAMA.to_dict().items() if k != "backend"}
    assert ModelConfig.from_dict(fields | {"attention": "auto", "cpu_matmul": False}) == TINY_LLAMA
    assert ModelConfig.from_dict(fields | {"attention": "pallas", "cpu_matmul": False}).backend == "pallas"
    assert ModelConfig.from_dict(fields | {"attention": "auto", "cpu_matmul": True}).backend == "cpu-kernel"
    assert ModelConfig.from_dict(TINY_LLAMA.replace(backend="reference").to_dict()).backend == "reference"
