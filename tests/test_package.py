"""The package's top level: every public name loads from its module on first use, and importing the package (or
a submodule that needs no torch, as the gpu_check tool's child processes do) imports no torch."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import int8kv

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_importing_the_package_imports_no_torch():
    code = (
        "import sys, int8kv, int8kv.errors, int8kv.bench.gpu_check\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "int8kv.KvStorageFormat\n"
        "assert 'torch' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_public_name_loads():
    for name in int8kv.__all__:
        value = getattr(int8kv, name)
        assert getattr(value, "__module__", getattr(value, "__name__", "")).startswith("int8kv"), name
    assert set(int8kv.__all__) <= set(dir(int8kv))
    namespace: dict = {}
    exec("from int8kv import *", namespace)
    assert set(int8kv.__all__) <= set(namespace)
    assert int8kv.PagedKvCache is importlib.import_module("int8kv.cache.paged").PagedKvCache
