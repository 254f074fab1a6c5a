"""hsdjax's CPU kernels on every instruction set this machine can build and run: the standalone
self-test (``kernels/selftest.cc``: every matmul format equal to a scalar fused multiply-add chain bit for
bit, attention against a double-precision reference) built for the native CPU, for x86-64-v3 (AVX2), for
SSE with FMA (4-float vectors) and for aarch64 (NEON, under qemu's user-mode emulator), with their output
hashes compared: equal hashes mean the kernels give bitwise-equal results across instruction sets.
Then the library built for x86-64-v3 runs speculative decoding through the model and must equal `ar`.

What each test needs is installed by `make test` (a C++ compiler; on x86 Debian's g++-aarch64-linux-gnu
and qemu-user); a test whose tool is missing skips and says which."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from hsdjax.kernels import cpu_matmul
from tests.conftest import cxx_compiler, no_compiler

KERNELS = Path(cpu_matmul.__file__).parent
X86 = platform.machine() in ("x86_64", "AMD64")


def _cxx() -> str:
    cxx = cxx_compiler()
    if not cxx:
        no_compiler("the kernels' self-test")
    return cxx


def _flags() -> list[str]:
    return ["-O3", "-ffp-contract=fast", "-std=c++17", "-Wall", "-isystem", jax.ffi.include_dir()]


def _build(tmp: Path, name: str, cxx: str, *extra: str) -> Path:
    out = tmp / name
    done = subprocess.run([cxx, *_flags(), *extra, str(KERNELS / "selftest.cc"), "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stderr, done.stderr[-3000:]  # our sources compile without warnings
    return out


def _run(cmd: list[str]) -> dict[str, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " 0 failed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    hashes = {}
    for line in done.stdout.splitlines():
        if line.startswith(("matmul ", "attention ")):
            name, _, digest = line.rpartition(" ")
            hashes[name] = digest
    assert hashes
    return hashes


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("selftest")
    return _run([str(_build(tmp, "native", _cxx(), "-march=native"))]), tmp


def _same_bits(got: dict[str, str], want: dict[str, str]) -> None:
    """Every check both builds ran has the same hash; the float32 matmul formats and attention ran in both
    (a mode an instruction set lacks, e.g. int16x without AVX2 or AVX-512, is left out by its build)."""
    common = got.keys() & want.keys()
    assert {k for k in want if k.startswith(("matmul bits", "attention"))} <= common
    assert {k: got[k] for k in common} == {k: want[k] for k in common}


def _cpu_flags() -> set[str]:
    return set(cpu_matmul.cpu_features().partition(" | ")[2].split())


def test_the_native_build_equals_its_scalar_references(native):
    hashes, _ = native
    assert any(k.startswith("matmul bits=4") for k in hashes) and any(k.startswith("attention") for k in hashes)


@pytest.mark.skipif(not X86, reason="x86-64 variants are for x86 machines")
@pytest.mark.parametrize("march", [("-march=x86-64-v3",), ("-march=x86-64-v2", "-mfma")], ids=["avx2", "sse-fma"])
def test_x86_variants_give_the_native_builds_bits(native, march):
    if not {"avx2", "fma"} <= _cpu_flags() and march[0] == "-march=x86-64-v3":
        pytest.skip("this CPU has no AVX2 + FMA: the x86-64-v3 build cannot run here")
    if "fma" not in _cpu_flags():
        pytest.skip("this CPU has no FMA")
    hashes, tmp = native
    _same_bits(_run([str(_build(tmp, march[0].split("=")[1], _cxx(), *march))]), hashes)


def test_aarch64_build_under_emulation_gives_the_native_builds_bits(native):
    if platform.machine() == "aarch64":
        pytest.skip("the native build is the aarch64 one here")
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if not (cross and qemu):
        pytest.skip("no aarch64 cross compiler and qemu (Debian: g++-aarch64-linux-gnu qemu-user; `make test` "
                    "installs them where it can)")
    hashes, tmp = native
    binary = _build(tmp, "aarch64", cross, "-static")
    got = _run([qemu, str(binary)])
    # NEON has the integer-activation products and the screen, with the native build's bits
    assert {"matmul int16x k=576", "matmul int8x bits=8 k=576", "matmul screened argmax"} <= got.keys()
    _same_bits(got, hashes)


@pytest.mark.skipif(not X86, reason="x86-64 variants are for x86 machines")
def test_the_x86_64_v3_library_decodes_speculatively_as_ar():
    """The whole library built for x86-64-v3 (what an AVX2 machine gets) under the model: speculative
    decoding through the kernels equals `ar` (float32, the int8 screen, int8x and int16x activations), and
    a tree pass's logits equal one-token steps bit for bit."""
    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    _cxx()
    if cpu_matmul.load() and cpu_matmul.instruction_set().startswith("avx2"):
        pytest.skip("the native library is the AVX2 one here: tests/test_cpu_matmul.py runs it under the model")
    env = dict(os.environ, **{cpu_matmul.ARCH_ENV: "x86-64-v3"})
    code = ("from hsdjax.kernels import cpu_matmul; cpu_matmul.build(); assert cpu_matmul.load(); "
            "print(cpu_matmul.instruction_set())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("avx2"), done.stdout + done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "tests/test_cpu_matmul.py::test_speculative_decoding_through_the_kernel_equals_ar",
                           # (the float32 cache; the float16 one runs natively on AVX2 machines)
                           "tests/test_cpu_matmul.py::test_tree_pass_logits_are_bitwise_the_one_token_steps[None]",
                           "tests/test_cpu_matmul.py::test_speculative_decoding_with_the_screened_head_equals_ar",
                           # the pair tiles (int8x, int16x) under the model
                           "tests/test_cpu_matmul.py::test_speculative_decoding_with_bf16x_int8x_or_int16x_activations_equals_ar[int8]",
                           "tests/test_cpu_matmul.py::test_speculative_decoding_with_bf16x_int8x_or_int16x_activations_equals_ar[int16]"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]
