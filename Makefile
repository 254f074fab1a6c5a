# Set-up and the two front-door commands. Everything a fresh machine needs is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HSDJAX := $(VENV)/bin/hsdjax
DEFAULT_MODEL := smollm2-135m
PYTEST_ARGS ?=

.PHONY: demo test test-slow setup model model-runtime cpu-matmul cross-tools bench-ar clean

# The runtime alone (what `make demo` needs: no torch, transformers or llama.cpp).
$(VENV)/.runtime: pyproject.toml
	@echo "== installing hsdjax and its runtime dependencies into $(VENV) (a first run takes a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# Test and peer extras on top (torch, transformers, llama.cpp built from source: ~4 min the first time).
# llama.cpp is built for this machine's own instruction set (GGML_NATIVE: AVX-512 where the CPU has it,
# AVX2 elsewhere, NEON on ARM), as hsdjax's kernels are, with AMX left out: ggml's AMX kernels
# segfaulted in the first matmul on the Xeons here. The wheel is kept in a folder named after the CPU's
# extensions (pip's wheel cache would hand back a build made for another machine) and found there.
CPU_KEY := $(shell (grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || uname -m) | cksum | cut -d' ' -f1)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CFLAGS := $(if $(filter x86_64,$(shell uname -m)),$(NO_AMX))
LLAMA_WHEELS := $(HOME)/.cache/hsdjax-build/llama-cpp-native-$(CPU_KEY)
$(VENV)/.installed: $(VENV)/.runtime
	@ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { \
	  echo "== building llama.cpp (the peer in hsdjax bench) for this CPU, once: a few minutes"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CFLAGS="$(LLAMA_CFLAGS)" CXXFLAGS="$(LLAMA_CFLAGS)" $(PY) -m pip wheel -q --no-cache-dir --no-deps -w $(LLAMA_WHEELS) \
	    "$$($(PY) -c "import tomllib; print([d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['llamacpp'] if d.startswith('llama-cpp-python')][0].split('#')[0].strip())")"; }
	$(PY) -m pip install -q --find-links $(LLAMA_WHEELS) -e '.[test,llamacpp]'
	touch $@

setup: $(VENV)/.installed

model-runtime: $(VENV)/.runtime
	$(HSDJAX) models pull $(DEFAULT_MODEL)

model: setup
	$(HSDJAX) models pull $(DEFAULT_MODEL)

# hsdjax's CPU matmul kernel (kernels/cpu_matmul.cc), compiled for this machine when a C++ compiler is
# present (seconds); without one, models keep XLA's matmul.
cpu-matmul: $(VENV)/.runtime
	$(HSDJAX) cpu-matmul build --optional

# The ARM build of the kernels' self-test runs under emulation in `make test` (tests/test_cpu_isa.py):
# Debian's aarch64 cross compiler and qemu's user-mode emulator, installed where apt can (as root).
cross-tools:
	@if [ "$$(uname -m)" = x86_64 ] && ! { command -v qemu-aarch64 && command -v aarch64-linux-gnu-g++; } >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "== installing g++-aarch64-linux-gnu and qemu-user (the kernels' ARM self-test), once"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null; } \
	      || echo "note: could not install them; the ARM self-test skips"; \
	  else echo "note: no aarch64 cross compiler / qemu-aarch64 (not root or no apt); the ARM self-test skips"; fi; fi

demo: model-runtime cpu-matmul
	$(HSDJAX) demo

# Where a C++ compiler exists (`$CXX`, else g++ or c++) the kernels' tests must run: a test that finds
# no compiler then fails instead of skipping (tests/conftest.py, HSDJAX_REQUIRE_CPU_KERNEL).
HAVE_CXX := $(if $(shell command -v $(CXX) 2>/dev/null || command -v c++ 2>/dev/null),1,0)
test: model cpu-matmul cross-tools
	HSDJAX_REQUIRE_CPU_KERNEL=$(HAVE_CXX) $(PY) -m pytest $(PYTEST_ARGS)

test-slow: model cpu-matmul
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

bench-ar: model
	$(PY) benchmarks/ar_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info
