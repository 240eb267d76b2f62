# hexq: `make demo` sets everything up and runs the main job; `make test` runs the checks CI runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= models/hexq-tiny-qwen3moe

.PHONY: setup demo test lint clean

# torch goes first, pinned: this pulls the CPU wheel; left to the resolver, pip would pick a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/hexq eval $(MODEL)

lint: setup
	$(BIN)/ruff check hexq cli tests scripts benchmarks

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .cache .pytest_cache
