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

DEMO_OUT ?= .cache/demo-haq-w8a8

# The main job on the bundled defaults: full-precision perplexity, HAQ W8A8 calibration on the bundled text,
# perplexity of the calibrated model on the same windows.
demo: setup
	$(BIN)/hexq eval $(MODEL) --windows 200
	$(BIN)/hexq calibrate $(MODEL) --recipe haq-w8a8 --data bundled --samples 32 --out $(DEMO_OUT)
	$(BIN)/hexq eval $(DEMO_OUT) --windows 200

lint: setup
	$(BIN)/ruff check hexq cli tests scripts benchmarks

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .cache .pytest_cache
