"""int8kv.numba_threads: the parallel kernels on numba's workqueue layer, the one numba falls back to where the
system has no GNU OpenMP runtime (a slim container image). workqueue ends the process when two threads launch
parallel kernels at once, and drops an exception raised in a worker.

Each check runs in a child process with NUMBA_THREADING_LAYER=workqueue (the layer is fixed at a process's first
parallel launch), against the same kernels the suite loads from numba's disk cache; the fork check runs a child on
the layer int8kv chooses (tbb, int8kv.tbb_layer).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest
import torch

from int8kv import numba_threads
from int8kv.codec import quantize_int8

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="parallel launches need two threads")

# Three threads decode through ops.attention (parallel: fan_out), a fourth encodes and decodes INT8 rows
# (codec.quantize_int8 / dequantize_int8 above their serial size) and a fifth multiplies by Q8_0 weights
# (cpu_packed), all at once, each checking its result against its own first call. Without the lock every run of
# this on the 2-core dev VM ended in "Concurrent access has been detected" (exit status 134).
CONCURRENT = """
import threading, numba, numpy as np, torch
from int8kv import numba_threads
from int8kv.cache.paged import PagedKvCache
from int8kv.codec import dequantize_int8, quantize_int8
from int8kv.formats import KvStorageFormat
from int8kv.ops import attention, cpu, cpu_packed, plan_attention

gen = torch.Generator().manual_seed(0)
cache = PagedKvCache(257, 16, 1, 3, 64, KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1)
cache.k_codes[0].copy_(torch.randint(-127, 128, cache.k_codes[0].shape, dtype=torch.int8, generator=gen))
cache.v_codes[0].copy_(torch.randint(-127, 128, cache.v_codes[0].shape, dtype=torch.int8, generator=gen))
cache.k_scales[0].copy_(torch.rand(cache.k_scales[0].shape, generator=gen) * 0.01 + 0.005)
cache.v_scales[0].copy_(torch.rand(cache.v_scales[0].shape, generator=gen) * 0.01 + 0.005)
tables = (torch.randperm(256, generator=gen) + 1).to(torch.int32).reshape(1, 256)
plan = plan_attention(cache.pool, tables, torch.tensor([4096], dtype=torch.int32))
q = torch.randn(1, 9, 64, generator=gen)
rows = torch.randn(512, 256, generator=gen)
w = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
scale = np.abs(w.reshape(256, 16, 32)).max(axis=2) / 127
codes = np.clip(np.rint(w / np.repeat(scale, 32, axis=1)), -127, 127).astype(np.int8)
x = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)

def decode():
    return attention(cache, 0, q, plan, backend="cpu")

def codec():
    return dequantize_int8(*quantize_int8(rows))

def matmul():
    return torch.from_numpy(cpu_packed.matmul_q8_0(x, codes, scale))

cpu.ThreadChoice.parallel = lambda self, work, threads: True  # every decode through fan_out, whatever it measures
jobs = [decode, decode, decode, codec, matmul]
want = [job() for job in jobs]
bad = []

def loop(i):
    for _ in range(300):
        if not torch.equal(jobs[i](), want[i]):
            bad.append(i)

threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(jobs))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("layer", numba_threads.layer(), "mismatches", len(bad))
"""


def _child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_threads_launching_kernels_at_once_take_turns_on_workqueue():
    done = _child(CONCURRENT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "layer workqueue mismatches 0"


def test_a_refusal_in_a_worker_is_refused_to_the_caller_on_workqueue():
    # Two refusals raised inside a parallel worker, run in one child on workqueue, which drops a worker's
    # exception: the tag check of ops/calls.py (there the worker's TypeError used to be dropped and the call
    # returned the output buffer unwritten), and the CPU backend's own query check (cpu.CHECKS_QUERY), whose
    # NonFiniteError must reach the caller through fan_out's rerun of the failed range.
    tests = [
        "tests/test_ops_cpu.py::test_a_leaf_compiled_for_other_argument_types_is_refused_before_any_item_runs",
        "tests/test_ops_cpu.py::test_the_backend_refuses_a_non_finite_query_itself_and_is_unharmed",
    ]
    paths = ", ".join(repr(str(ROOT / t)) for t in tests)
    code = f"import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {paths}]))"
    done = _child(code)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "16 passed" in done.stdout  # 4 + 12


# A process that has run a parallel kernel forks, by os.fork and by multiprocessing's "fork", and each child runs
# one too. On GNU OpenMP (numba's omp layer, where the system has libgomp) the children ended at their first kernel
# ("Terminating: fork() called from a process already using GNU OpenMP, this is unsafe").
FORKS = """
import multiprocessing, os, sys, torch
from int8kv import numba_threads
from int8kv.codec import quantize_int8

rows = torch.randn(1024, 128, generator=torch.Generator().manual_seed(0))  # above the serial size: parallel
want = quantize_int8(rows)

def again():
    codes, scales = quantize_int8(rows)
    return 0 if torch.equal(codes, want[0]) and torch.equal(scales, want[1]) else 3

pid = os.fork()
if pid == 0:
    code = 4  # an exception: not 0
    try:
        code = again()
    finally:
        os._exit(code)
forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
child = multiprocessing.get_context("fork").Process(target=lambda: sys.exit(again()))
child.start()
child.join(300)
print("layer", numba_threads.layer(), "os.fork", forked, "multiprocessing", child.exitcode)
"""


def test_a_process_that_ran_a_kernel_can_fork_a_child_that_runs_one():
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_THREADING_LAYER")}  # int8kv's choice
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-c", FORKS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.split()[2:] == ["os.fork", "0", "multiprocessing", "0"], done.stdout + done.stderr[-2000:]


def test_the_layer_is_named_once_a_parallel_kernel_has_run():
    quantize_int8(torch.randn(1024, 128))  # above the serial size: a parallel launch
    assert numba_threads.layer() == numba.threading_layer() and numba_threads.layer() in ("omp", "tbb", "workqueue")
    assert numba_threads.launch(lambda a, b: a + b, 2, 3) == 5


def test_int8kv_calls_leave_torchs_thread_count_alone():
    # numba and torch share one OpenMP runtime on omp: a thread count set through the runtime would move torch's.
    # The codec runs a small input's parallel kernel with numba on one thread (numba.set_num_threads), a large one
    # on all of numba's.
    from int8kv.codec import dequantize_int8

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (4, 2048):
            dequantize_int8(*quantize_int8(torch.randn(rows, 128)))
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def _parallel_kernels(tree: ast.Module) -> set[str]:
    """Names of the functions a module compiles with numba's ``parallel=True`` (decorated ``njit(parallel=True)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and any(
                    k.arg == "parallel" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in dec.keywords
                ):
                    names.add(node.name)
    return names


def _kernel_names_in(tree: ast.Module, module: str, kernels: dict[str, set[str]]) -> tuple[set[str], set[str]]:
    """(bare names that are parallel kernels in this module: its own and those imported from their modules,
    the names this module gives the kernel modules it imports)."""
    bare = set(kernels.get(module, ()))
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = (node.module or "").rsplit(".", 1)[-1]
            for alias in node.names:
                if alias.name in kernels.get(source, ()):
                    bare.add(alias.asname or alias.name)
                if alias.name in kernels:  # `from . import _codec_cpu`
                    aliases.add(alias.asname or alias.name)
    return bare, aliases


def test_every_parallel_kernel_is_launched_through_numba_threads():
    # A parallel kernel called directly from Python would skip the workqueue lock: on that layer two threads
    # reaching it at once end the process. Every call of one in the package names it as launch's first argument.
    trees = {path: ast.parse(path.read_text()) for path in (ROOT / "src" / "int8kv").rglob("*.py")}
    kernels = {path.stem: _parallel_kernels(tree) for path, tree in trees.items()}
    kernels = {module: names for module, names in kernels.items() if names}
    every = set().union(*kernels.values())
    assert {"fan_out", "quantize_rows", "dequantize_rows", "_matmul", "_encode", "_decode", "_ranges"} <= every
    direct, launched = [], set()
    for path, tree in trees.items():
        bare, aliases = _kernel_names_in(tree, path.stem, kernels)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (isinstance(func, ast.Name) and func.id in bare) or (
                isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in aliases
                and func.attr in kernels[func.value.id]
            ):
                direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(func, ast.Name) and func.id == "launch" and node.args:
                first = node.args[0]
                launched.add(first.attr if isinstance(first, ast.Attribute) else getattr(first, "id", None))
    assert not direct, "parallel kernels called without numba_threads.launch: " + ", ".join(direct)
    assert every <= launched  # and each one is launched somewhere


def test_thread_count_is_each_threads_own_numba_count():
    """`thread_count` answers what `numba.get_num_threads()` does, in the thread that asks, after each
    `numba.set_num_threads` (thread-local in numba): in this thread and in another one that sets its own."""
    import threading

    previous = numba.get_num_threads()
    try:
        for n in (1, 2, 1):
            numba.set_num_threads(n)
            assert numba_threads.thread_count() == numba.get_num_threads() == n
        seen = []

        def other() -> None:
            seen.append((numba_threads.thread_count(), numba.get_num_threads()))  # a new thread: numba's default
            numba.set_num_threads(2)
            seen.append((numba_threads.thread_count(), numba.get_num_threads()))

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert seen[0][0] == seen[0][1] >= 1 and seen[1] == (2, 2)
        assert numba_threads.thread_count() == 1  # the other thread's setting is its own
    finally:
        numba.set_num_threads(previous)
