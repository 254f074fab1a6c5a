"""Repository layout: the top-level ``kernels/`` folder must not hijack the ``kernels`` module name."""

from __future__ import annotations

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
