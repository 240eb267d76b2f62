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

DEMO := .cache/demo
# Half of the demo model's routed experts as the fast tier holds them (packed at 3 bits: 4 layers x 32 experts = 3.5 MB).
FAST_TIER ?= 1.8MB

# The main job on the bundled defaults: calibrate the reference model on the bundled text (HAQ W8A8 attention,
# GPTQ replica banks for the experts), pack it at 3 bits per expert on average, then serve it with half of the
# experts' memory: perplexity on held-out text and a generated continuation, with the runtime's statistics.
demo: setup
	$(BIN)/hexq calibrate $(MODEL) --recipe experts-mixed --data bundled --samples 32 --out $(DEMO)/calibration
	$(BIN)/hexq pack $(DEMO)/calibration --bits 3 --out $(DEMO)/model.hexq --force
	$(BIN)/hexq inspect $(DEMO)/model.hexq
	$(BIN)/hexq run $(DEMO)/model.hexq --ppl austen --windows 50 --fast-tier $(FAST_TIER) --stats
	$(BIN)/hexq run $(DEMO)/model.hexq --prompt '"My dear Mr. Bennet," said his lady to him one day,' --fast-tier $(FAST_TIER) --stats

# ruff, then the import layers and the no-cycle rule of pyproject's [tool.importlinter] contracts.
lint: setup
	$(BIN)/ruff check hexq cli tests scripts benchmarks
	$(BIN)/lint-imports

# Unit and end-to-end tests (slow ones deselected; -rs lists why any test skipped), then the perplexity gate
# against tests/baselines/ppl. The tests run in one worker process per core, at most 4 (pytest-xdist): much of the
# suite waits on subprocesses and Python, so 2 workers on 2 cores took 11.8 min against 18.8 in one process; each
# worker builds the session's fixtures again, which is what caps the count.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$((n < 4 ? n : 4)))
test: lint
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS)
	$(BIN)/python scripts/ppl_gate.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
