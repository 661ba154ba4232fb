import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton kernels run on the CPU under the interpreter when no GPU is present; the variable
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
