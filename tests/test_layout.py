"""Repository layout: the top-level ``kernels/`` folder must not hijack the ``kernels`` module name,
hsdjax's modules import each other without a cycle, and every import goes down the layers the folders
draw (shared utilities, kernels, model runtime, decoding core, then training and the front ends)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_folder_imported_as_top_level_module_loads_nothing():
    """From the repository root, ``import kernels`` (as transformers' kernel-hub probe may do) must
    not import hsdjax or jax: in an environment without them it would fail."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('hsdjax', 'jax'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import kernels\n"
            "assert kernels.__all__ == [], kernels.__all__\n"
            "assert 'jax' not in sys.modules and 'hsdjax' not in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_kernels_reachable_as_hsdjax_kernels():
    import hsdjax.kernels as k

    assert callable(k.tree_attention) and callable(k.attention_fn)


def _module_names() -> dict[str, Path]:
    """``hsdjax`` module name -> file, for every ``.py`` under ``hsdjax/`` (a package by its ``__init__``)
    and under the top-level ``kernels/`` and ``train/`` folders (installed as ``hsdjax.kernels`` and
    ``hsdjax.train``)."""
    out = {}
    for folder, package in (("hsdjax", ()), ("kernels", ("hsdjax",)), ("train", ("hsdjax",))):
        for path in (ROOT / folder).rglob("*.py"):
            parts = package + path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The ``hsdjax`` modules one import statement of module ``name`` loads (``from pkg import mod`` names mod)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    found = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return found & set(modules)


def _imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ``hsdjax`` module ``name`` imports, function-local ones included, ``if TYPE_CHECKING:`` not."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for block in ast.walk(tree)
               if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for n in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
            found |= _imported(name, path, node, modules)
    return found - {name}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycle():
    """hsdjax's modules import each other without a cycle (function-local imports count), so every layer
    can be read, and imported, on its own terms."""
    modules = _module_names()
    graph = {name: _imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["hsdjax.frontends.api"] >= {"hsdjax.core.methods", "hsdjax.runtime.loading"}  # the walk sees real imports
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_names_the_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


# Layers, bottom up: what every layer may use, then the kernels, the model runtime, the decoding core, and
# on top training and the front ends (which use each other: the command line runs training, training
# drives the model through the Python API). A module imports only from its own layer or those below.
LAYERS = (("hsdjax.errors", "hsdjax.paths", "hsdjax.jsonl"), ("hsdjax.kernels",), ("hsdjax.runtime",),
          ("hsdjax.core",), ("hsdjax.train", "hsdjax.frontends", "hsdjax"))


def _layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest package prefix that holds ``module``."""
    best = max((p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def test_layers_import_only_downward():
    """The folders are the architecture: ``hsdjax/runtime`` (model, weights, tokenizer, loading) knows
    nothing of drafting, ``hsdjax/core`` (engine, trees, verification, drafters) nothing of the front ends
    or training, and the kernels nothing of either."""
    modules = _module_names()
    assert {m.split(".")[1] for m in modules if m.count(".")} >= {"core", "runtime", "frontends", "kernels", "train"}
    upward = sorted(f"{name} -> {dep}" for name, path in modules.items()
                    for dep in _imports_of(name, path, modules) if _layer(dep) > _layer(name))
    assert upward == []


def test_layer_check_sees_an_upward_import():
    assert _layer("hsdjax.runtime.model") == 2 and _layer("hsdjax.core.drafters.hsd") == 3
    assert _layer("hsdjax.frontends.serving.app") == 4 and _layer("hsdjax") == 4 and _layer("hsdjax.errors") == 0
    assert _layer("hsdjax.core.engine") > _layer("hsdjax.runtime.sharding")
