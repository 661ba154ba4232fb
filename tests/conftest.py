import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton kernels run on the CPU under the interpreter when no GPU is present; the variable
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs two pytest-xdist workers on this 2-core machine. Each worker (and every server or child
# process it starts, through OMP_NUM_THREADS) keeps torch to one intra-op thread: two workers with two threads
# each would put four busy threads on two cores, and torch's many tiny ops wait for a descheduled second thread.
# Numba keeps its thread count, so the kernels' multi-thread work splits stay tested. Workers take single tests
# (--dist loadgroup); a module with module-scoped fixtures (a server, a model, a Valkey) sets
# `pytestmark = pytest.mark.xdist_group("<module>")` so that they start once, on one worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

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
