"""hsdjax's CPU matmul kernel per instruction set, single-threaded, on SmolLM2-135M's shapes.

Builds the standalone self-test (``kernels/selftest.cc``: no XLA) for each instruction set this machine
can run (the native one, x86-64-v3 / AVX2, SSE with FMA), checks it (every product bitwise a scalar
fused multiply-add chain, attention against double precision) and times the product of a 4-bit
576 x 1536 layer weight (SmolLM2's gate / up, Q4_1) and of the 8-bit 576 x 49152 head (Q8_0) for 1 row (a
decoding step), 8 rows (a tree pass) and 64 rows (a prompt chunk): medians of 25 calls, microseconds.
For the kernel against XLA's dot inside the model (both threads, every layer): ``hsdjax cpu-matmul status``.

    python benchmarks/cpu_kernels.py
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from hsdjax.kernels import cpu_matmul

SELFTEST = Path(cpu_matmul.__file__).with_name("selftest.cc")
SHAPES = ((576, 1536, 4), (576, 49152, 8))  # (K, N, bits)
ROWS = (1, 8, 64)


def variants() -> list[tuple[str, list[str]]]:
    flags = set(cpu_matmul.cpu_features().partition(" | ")[2].split())
    out = [("native", ["-march=native"])]
    if platform.machine() == "x86_64":
        if {"avx2", "fma"} <= flags:
            out.append(("x86-64-v3 (AVX2)", ["-march=x86-64-v3"]))
        if "fma" in flags:
            out.append(("SSE + FMA", ["-march=x86-64-v2", "-mfma"]))
    return out


def main() -> int:
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        print("no C++ compiler", file=sys.stderr)
        return 1
    print(f"CPU: {cpu_matmul.cpu_summary()}; one thread; microseconds (median of 25)")
    columns = [f"{k}x{n} {b}-bit M={m}" for k, n, b in SHAPES for m in ROWS]
    header = "| build | instruction set | " + " | ".join(columns) + " |"
    print(header)
    print("|" + " --- |" * (2 + len(SHAPES) * len(ROWS)))
    with tempfile.TemporaryDirectory() as tmp:
        for name, march in variants():
            exe = Path(tmp) / "selftest"
            subprocess.run([cxx, "-O3", "-ffp-contract=fast", "-std=c++17", *march, "-isystem", jax.ffi.include_dir(),
                            str(SELFTEST), "-o", str(exe)], check=True)
            check = subprocess.run([str(exe)], capture_output=True, text=True)
            isa = check.stdout.splitlines()[0].removeprefix("instruction set ")
            if check.returncode:
                print(f"| {name} | {isa} | self-test FAILED: {check.stdout.splitlines()[-1]} |")
                continue
            cells = []
            for k, n, bits in SHAPES:
                for m in ROWS:
                    line = subprocess.run([str(exe), "bench", str(m), str(k), str(n), str(bits)], capture_output=True,
                                          text=True, check=True).stdout
                    cells.append(line.rsplit(":", 1)[1].strip().removesuffix(" us"))
            print(f"| {name} | {isa} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
