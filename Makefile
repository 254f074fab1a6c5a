# Set-up and the two front-door commands. Everything a fresh machine needs is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HSDJAX := $(VENV)/bin/hsdjax
DEFAULT_MODEL := smollm2-135m
PYTEST_ARGS ?=

.PHONY: demo test test-slow setup model model-runtime bench-ar clean

# The runtime alone (what `make demo` needs: no torch, transformers or llama.cpp).
$(VENV)/.runtime: pyproject.toml
	@echo "== installing hsdjax and its runtime dependencies into $(VENV) (a first run takes a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# Test and peer extras on top (torch, transformers, llama.cpp built from source: ~4 min the first time).
$(VENV)/.installed: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test,llamacpp]'
	touch $@

setup: $(VENV)/.installed

model-runtime: $(VENV)/.runtime
	$(HSDJAX) models pull $(DEFAULT_MODEL)

model: setup
	$(HSDJAX) models pull $(DEFAULT_MODEL)

demo: model-runtime
	$(HSDJAX) demo

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: model
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

bench-ar: model
	$(PY) benchmarks/ar_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info
