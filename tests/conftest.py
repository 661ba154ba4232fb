import os
from pathlib import Path

# Two pytest-xdist workers share this 2-core machine. After each parallel region numba's OpenMP threads spin
# (libgomp's default wait policy) on the core the other worker needs; passive threads sleep instead. Set before
# torch loads its own libgomp, which reads the variable then; every process a test starts inherits it. Measured
# (tests/test_ops_windows.py, test_ops_prepared.py, test_engine_models.py, test_engine_fork.py, test_hf.py, 305
# tests, `-n 2`, warm numba cache, two rounds taking turns): 64-110 s of pytest without it, 25.0 s with it. The
# library itself keeps the default: a model's per-layer parallel calls come microseconds apart.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Triton kernels run on the CPU under the interpreter when no GPU is present; the variable
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs two pytest-xdist workers on this 2-core machine. Each worker (and every server or child
# process it starts, through OMP_NUM_THREADS) keeps torch to one intra-op thread: two workers with two threads
# each would put four busy threads on two cores, and torch's many tiny ops wait for a descheduled second thread.
# Numba keeps its thread count, so the kernels' multi-thread work splits stay tested.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Modules whose module-scoped fixtures (a server, a tiny model, Valkey nodes, the Triton compile report: 250 s
# of CPU when it ran on both workers) must start once: every test of one of these runs on the same worker.
# Every other test is scheduled on its own, so the heavy ones spread over both workers. (pytest-xdist's
# xdist_group marker does nothing under pytest 9: xdist 3.8 renames `item._nodeid`, which pytest 9 no
# longer reads, so the grouping is done here, by the scheduler.)
ONE_WORKER_MODULES = {
    "test_blockstore_backends", "test_chat", "test_engine_errors", "test_engine_fork", "test_engine_q4w_store",
    "test_kvstore_engine",
    "test_prefix_engine", "test_server", "test_server_api", "test_server_limits", "test_server_replicas",
    "test_server_smollm2", "test_triton_compile",
}

# Tests that share one work unit (they run one after the other on one worker):
# - the two bench attention runs compile the same kernel specialisations and nothing else has compiled them
#   before: the second loads what the first wrote to numba's disk cache, instead of both workers compiling the
#   same code at once (each bench run needs the INT8 exact and int16-query and F16 kernels; split over the two
#   workers the two tests took 116 and 118 s in one run);
# - the README's OpenAI example joins test_server_smollm2.py's unit: both talk to the one `smollm2_server` of
#   the session (a SmolLM2 `int8kv serve` costs ~11 s of CPU to start).
SAME_UNIT_TESTS = {
    "tests/test_cli.py::test_bench_attention_plot": "bench attention",
    "tests/test_cli.py::test_bench_options_are_the_same_from_both_entry_points": "bench attention",
    "tests/test_readme.py::test_openai_example_runs_against_int8kv_serve": "tests/test_server_smollm2.py",
    "tests/test_readme.py::test_structured_output_example_follows_its_schema": "tests/test_server_smollm2.py",
    "tests/test_server_structured.py": "tests/test_server_smollm2.py",
}

# Work units sent before all others, in this order: the longest first (LPT), so that no long unit starts while the
# other worker is nearly done, and the first units of the two workers compile different numba kernels. Seconds:
# two runs from an empty numba cache on this 2-core VM (pytest 975 s at load 5-7, 625 s at load 2-4; most of a
# long unit's time is the kernels it is the first to compile: warm, the gemma2, fork, engine_errors and hybrid
# tests below took 1.3, 0.1, 0.0 and 0.2 s). In the first runs test_engine_fork and test_engine_errors started
# together and both compiled the INT8 decode and prefill kernels (4 kernel specialisations, 20-46 s each, on
# both workers); here the second worker starts on Triton work (the interpreter, no numba attention kernel) and
# reaches test_engine_errors after test_engine_fork has written those kernels to the disk cache.
# The small eval run goes third, to the worker done with the smoke: it is the first to load the packaged SmolLM2,
# so its one-time conversion from GGUF (~9 s of CPU, under a lock) happens there and then. Later in the list it
# ran beside the first SmolLM2 server, which waited ~20 s on that lock with its worker idle.
LONG_UNITS = (
    "tests/test_engine_fork.py",  # 152-191 s: the INT8 and F16 decode / prefill kernels
    "tests/test_cpu_variants.py",  # 75 s: a child pytest compiling the kernels for AVX2
    "tests/test_gpu_check.py::test_smoke_runs_end_to_end_under_the_interpreter",  # 34-102 s, Triton interpreter
    "tests/test_cli.py::test_eval_small_run",  # 8-34 s: the SmolLM2 conversion
    "tests/test_triton_compile.py",  # 23-52 s, Triton
    "tests/test_engine_models.py::test_engine_generates_like_transformers[gemma2]",  # 131-312 s: softcap kernels
    "tests/test_kvstore_engine.py",  # 88-134 s
    "tests/test_engine_errors.py",  # 79-117 s
    "bench attention",  # 60-121 s (SAME_UNIT_TESTS)
    "tests/test_bench_hybrid.py::test_pages_per_table_follow_the_window_and_the_baseline_keeps_every_block",  # 41-76 s
    "tests/test_server_api.py",  # 39-44 s
    "tests/test_server_replicas.py",  # 20-63 s
    "tests/test_server_smollm2.py",  # 25-50 s with the README's OpenAI example (SAME_UNIT_TESTS)
    "tests/test_blockstore_backends.py",  # 26-35 s
    "tests/test_server.py",  # 26-27 s
)

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is in the dev extra; without it the suite runs in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class ModuleFixtureScheduling(LoadScopeScheduling):
        """Single tests as work units, except ONE_WORKER_MODULES (one unit per module) and SAME_UNIT_TESTS
        (one unit per group; a key is a test or a whole module). LONG_UNITS go first, in their order; the rest
        follow largest first, by LoadScopeScheduling's ordering."""

        _long_units_sent = False

        def _assign_work_unit(self, node) -> None:
            if not self._long_units_sent:  # the queue is complete at the first assignment
                self._long_units_sent = True
                for scope in reversed(LONG_UNITS):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if Path(path).stem in ONE_WORKER_MODULES:
                return path
            return SAME_UNIT_TESTS.get(nodeid, SAME_UNIT_TESTS.get(path, nodeid))

    @pytest.hookimpl(optionalhook=True)  # `-p no:xdist` leaves xdist's hooks undeclared
    def pytest_xdist_make_scheduler(config, log):
        # `-n N` alone (dist "load"); an explicit --dist keeps xdist's own scheduler.
        return ModuleFixtureScheduling(config, log) if config.getvalue("dist") == "load" else None

# Block stores give up a read after 0.1 s (a stuck server costs an admission no more); on this shared 2-core
# machine a healthy loopback read can take that long now and then, which would turn an expected store hit into
# a miss. Tests (and the servers and children they start) wait 5 s; the fault tests set the 0.1 s themselves.
os.environ.setdefault("INT8KV_KV_STORE_READ_DEADLINE", "5")

settings.register_profile(
    "int8kv", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("int8kv")


def pytest_configure(config):
    # One converted copy of the packaged SmolLM2 for the whole run (and across runs, in pytest's cache),
    # whichever test loads it first; a user's own INT8KV_CACHE_DIR is left alone. With the cache plugin off
    # (`-p no:cacheprovider`) config has no `cache` attribute and the loader's default directory is used.
    cache = getattr(config, "cache", None)
    if "INT8KV_CACHE_DIR" not in os.environ and cache is not None:
        os.environ["INT8KV_CACHE_DIR"] = str(cache.mkdir("int8kv-models"))


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct (model, tokenizer), loaded once per test session."""
    from int8kv.models import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """`int8kv serve --memory 64MiB` (and "auto" tool choice read by the hermes parser) on the packaged SmolLM2 at
    a free loopback port, one per test session (its
    users share one work unit: SAME_UNIT_TESTS); stopped with SIGTERM at the end, which must exit 0."""
    from int8kv.server.launch import LocalServer

    proc = LocalServer("--memory", "64MiB", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                       log_path=tmp_path_factory.mktemp("smollm2-server") / "server.log")
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.output()


# The Triton kernels' tests run with every load and store checked against the memory of its launch
# (tests/triton_bounds.py; the interpreter checks nothing itself): a stray address fails the test that made it.
BOUNDS_CHECKED_MODULES = {"test_ops_triton", "test_triton_q4w", "test_engine_q4w_triton"}


@pytest.fixture(autouse=True)
def _triton_accesses_in_bounds(request):
    if request.module.__name__.rsplit(".", 1)[-1] not in BOUNDS_CHECKED_MODULES:
        yield
        return
    from triton_bounds import checked

    with checked() as seen:
        yield
    assert not seen.violations, seen.report()
