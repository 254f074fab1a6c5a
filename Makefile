# Set-up and the two front-door commands. Everything a fresh machine needs is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HSDJAX := $(VENV)/bin/hsdjax
DEFAULT_MODEL := smollm2-135m
PYTEST_ARGS ?=

.PHONY: demo test test-slow setup model bench-ar clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,llamacpp]'
	touch $@

setup: $(VENV)/.installed

model: setup
	$(HSDJAX) models pull $(DEFAULT_MODEL)

demo: model
	$(HSDJAX) demo

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: model
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

bench-ar: model
	$(PY) benchmarks/ar_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info
