"""int8kv.numba_cache: processes that compile one cached function at once share the work and the disk cache.

Each test writes a small module of cached numba functions into its own temporary directory, points
NUMBA_CACHE_DIR there, and runs child processes that wait on a common start file before their first call, so
their compiles overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numba
import pytest

from int8kv.numba_cache import _DIGESTS, SharedFunctionCache, numba_sources_digest, share_compiles

SRC = Path(__file__).resolve().parents[1] / "src"

MODULE = textwrap.dedent('''
    import importlib.util, os
    import numba
    import numpy as np

    # int8kv.numba_cache's file loaded on its own: importing the package would import torch (3 s a child)
    spec = importlib.util.spec_from_file_location("numba_cache", os.environ["NUMBA_CACHE_MODULE"])
    numba_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numba_cache)
    share_compiles = numba_cache.share_compiles

    @numba.njit(cache=True)
    def combine(x, y):
        total = x[0] * 0
        for i in range(x.shape[0]):
            total += x[i] * y + i
        return total * 100 + x.itemsize  # a build run on another dtype's data reads the wrong values

    share_compiles(globals())
''')

CHILD = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    from numba.core import caching
    if os.environ.get("SLOW_INDEX"):  # a slow disk: numba's read-pick-write of the index takes 0.3 s
        save_index = caching.IndexDataCacheFile._save_index
        def slow(self, overloads):
            time.sleep(0.3)
            save_index(self, overloads)
        caching.IndexDataCacheFile._save_index = slow
    import kernels
    start = sys.argv[1]
    while not os.path.exists(start):
        time.sleep(0.005)
    out = {}
    for kind in sys.argv[2:]:
        x = np.arange(5, dtype=kind)
        r = kernels.combine(x, x.dtype.type(3))
        out[kind] = [float(r), type(r).__name__]
    stats = kernels.combine.stats
    print(json.dumps({"result": out, "hits": sum(stats.cache_hits.values()),
                      "misses": sum(stats.cache_misses.values())}))
''')


def _children(tmp_path: Path, kinds: list[list[str]], slow_index: bool = False) -> list[dict]:
    """Run one child per entry of ``kinds`` (the dtypes it calls `combine` with), all released at once;
    ``slow_index``: each index write of numba's takes 0.3 s more, so unlocked saves would overlap."""
    (tmp_path / "kernels.py").write_text(MODULE)
    (tmp_path / "child.py").write_text(CHILD)
    start = tmp_path / f"start-{time.monotonic_ns()}"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_MODULE": str(SRC / "int8kv" / "numba_cache.py")}  # fmt: skip
    if slow_index:
        env["SLOW_INDEX"] = "1"
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(start), *k], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in kinds]
    time.sleep(0.5)  # the children import numba meanwhile; a late one only finds more in the cache
    start.write_text("")
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _expected(kind: str) -> list:
    """What `combine` returns for ``arange(5, dtype=kind)`` and 3: its value and Python type."""
    total = sum(v * 3 + i for i, v in enumerate(range(5)))
    return [float(total * 100 + int(kind[-2:]) // 8), "float" if kind.startswith("float") else "int"]


def test_one_process_compiles_a_signature_the_others_load(tmp_path):
    results = _children(tmp_path, [["int64"], ["int64"], ["int64"]])
    for r in results:
        assert r["result"]["int64"] == _expected("int64")
    assert sorted(r["misses"] for r in results) == [0, 0, 1]  # one compile; the others waited and loaded it
    assert sum(r["hits"] for r in results) == 2


def test_signatures_compiled_at_once_all_reach_the_index(tmp_path):
    kinds = ["int64", "float64", "int32", "float32"]
    first = _children(tmp_path, [[k] for k in kinds], slow_index=True)  # four signatures saved at once
    for kind, r in zip(kinds, first, strict=True):
        assert r["result"][kind] == _expected(kind), r
    (later,) = _children(tmp_path, [kinds])  # a later process finds every one of them, each its own build
    assert later["misses"] == 0 and later["hits"] == len(kinds), later
    for kind in kinds:
        assert later["result"][kind] == _expected(kind)


def _child_env(tmp_path: Path, **extra: str) -> dict:
    (tmp_path / "kernels.py").write_text(MODULE)
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "start").write_text("")
    return {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path),
            "NUMBA_CACHE_MODULE": str(SRC / "int8kv" / "numba_cache.py"), **extra}  # fmt: skip


def _run_child(tmp_path: Path, env: dict, timeout: float = 120) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "start"), "int64"], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["result"]["int64"] == _expected("int64")
    return result, done.stderr


@pytest.mark.parametrize(("suffix", "damage"), [(".nbi", "empty"), (".nbi", "garbage"), (".nbc", "truncated")])
def test_a_damaged_cache_entry_is_a_miss_that_is_compiled_and_replaced(tmp_path, suffix, damage):
    env = _child_env(tmp_path)
    assert _run_child(tmp_path, env)[0]["misses"] == 1  # compiled and saved
    (entry,) = (tmp_path / "cache").rglob(f"*{suffix}")
    body = entry.read_bytes()
    entry.write_bytes({"empty": b"", "garbage": os.urandom(64), "truncated": body[: len(body) // 2]}[damage])
    result, err = _run_child(tmp_path, env)  # a bare EOFError / UnpicklingError at the first call before
    index = next((tmp_path / "cache").rglob("*.nbi"))
    assert result["misses"] == 1 and "unreadable" in err and str(index) in err, err
    result, err = _run_child(tmp_path, env)  # the entry was written again
    assert result["hits"] == 1 and result["misses"] == 0 and "unreadable" not in err, err


HOLDER = textwrap.dedent('''
    import os, signal, sys
    import numpy as np
    import kernels
    x = np.arange(5, dtype="int64")
    sig = tuple(kernels.combine.typeof_pyval(a) for a in (x, x.dtype.type(3)))  # what a call compiles
    with kernels.combine._cache.compiling(sig):
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # Ctrl-Z while compiling
''')


def test_a_compile_lock_held_by_a_stopped_process_is_waited_for_with_a_bound(tmp_path):
    env = _child_env(tmp_path, INT8KV_NUMBA_LOCK_TIMEOUT="1")
    (tmp_path / "holder.py").write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(tmp_path / "holder.py")], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        # Waited without limit or message before (still blocked after 45 s for a 3 s compile).
        result, err = _run_child(tmp_path, env, timeout=60)
        assert result["misses"] == 1, result  # compiled here, without the lock
        assert f"held by pid {holder.pid}" in err and "going on without numba cache lock" in err, err
    finally:
        holder.kill()
        holder.wait(30)
    result, _ = _run_child(tmp_path, env)  # the build saved under the index lock loads
    assert result["hits"] == 1 and result["misses"] == 0


def test_twin_builds_of_one_function_are_refused():
    def body(x):
        return x + 1

    namespace = {"a": numba.njit(cache=False)(body)}
    share_compiles(namespace)  # not cached: nothing to share, nothing refused
    twins = {"a": numba.njit(cache=True)(body), "b": numba.njit(cache=True, parallel=True)(body)}
    with pytest.raises(ValueError, match="a and b|b and a"):
        share_compiles(twins)


def test_the_kernel_modules_share_their_compiles():
    from int8kv import _codec_cpu
    from int8kv.ops import cpu, cpu_q4, cpu_q4w

    for module in (cpu, cpu_q4, cpu_q4w, _codec_cpu):
        cached = [v for v in vars(module).values() if isinstance(v, numba.core.registry.CPUDispatcher)
                  and v._cache.__class__.__name__ != "NullCache"]  # fmt: skip
        assert cached and all(isinstance(v._cache, SharedFunctionCache) for v in cached), module.__name__


def test_sources_digest_follows_the_numba_modules_only(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "kernels.py").write_text("import numba\nX = 1\n")
    (package / "sub" / "simd.py").write_text("from numba.extending import intrinsic\nY = 2\n")
    (package / "server.py").write_text("Z = 3\n")
    first = numba_sources_digest(str(package))
    assert numba_sources_digest(str(package)) == first
    (package / "server.py").write_text("Z = 4\n")  # no numba code: no kernel depends on it
    _DIGESTS.clear()
    assert numba_sources_digest(str(package)) == first
    (package / "sub" / "simd.py").write_text("from numba.extending import intrinsic\nY = 5\n")
    _DIGESTS.clear()
    assert numba_sources_digest(str(package)) != first


CALLER = textwrap.dedent('''
    import importlib.util, os, sys
    import numba
    sys.path.insert(0, os.path.dirname(__file__))
    spec = importlib.util.spec_from_file_location("numba_cache", os.environ["NUMBA_CACHE_MODULE"])
    numba_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numba_cache)
    from helper import value

    @numba.njit(cache=True)
    def call():
        return value()

    numba_cache.share_compiles(globals())
    print(call(), sum(call.stats.cache_hits.values()))
''')


def test_a_kernel_is_rebuilt_when_only_a_module_it_inlines_changes(tmp_path):
    """`call` lives in caller.py and inlines `value` from helper.py: after helper.py alone changes, numba's own
    key (call's bytecode, caller.py's stamp) would load the old build; the digest of the package's numba modules
    in the key makes the next process compile it again."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "numba_cache.py").write_text((SRC / "int8kv" / "numba_cache.py").read_text())
    (package / "caller.py").write_text(CALLER)
    helper = "import numba\n\n@numba.njit(inline='always')\ndef value():\n    return {}\n"
    # No bytecode files: helper.py rewritten within the same second at the same size would pass Python's own
    # (mtime, size) check of its .pyc, and the child would import the old helper whatever numba does.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1",
           "NUMBA_CACHE_MODULE": str(package / "numba_cache.py")}  # fmt: skip

    def run() -> list[str]:
        done = subprocess.run([sys.executable, str(package / "caller.py")], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    (package / "helper.py").write_text(helper.format(1))
    assert run() == ["1", "0"]  # compiled
    assert run() == ["1", "1"]  # loaded from the cache
    (package / "helper.py").write_text(helper.format(2))
    assert run() == ["2", "0"]  # compiled again, not the old build


def test_the_compiled_only_kernels_refuse_to_load_with_numbas_compiler_off():
    # NUMBA_DISABLE_JIT=1 (numba's debugging switch) runs njit functions as Python: the CPU backend's LLVM IR
    # kernels and calls by address then failed at the first call with an AttributeError from inside numba. They
    # refuse to load instead (UnknownBackend, by name), while the reference backend still answers, its q checked.
    code = textwrap.dedent("""
        import torch
        from int8kv.cache.paged import PagedKvCache
        from int8kv.errors import UnknownBackend
        from int8kv.formats import KvStorageFormat
        from int8kv.ops import attention, plan_attention

        cache = PagedKvCache(3, 16, 1, 2, 32, KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1)
        cache.k_scales[0].fill_(0.01)
        cache.v_scales[0].fill_(0.01)
        tables, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
        plan = plan_attention(cache.pool, tables, lens)
        q = torch.randn(1, 4, 32)
        print("reference", tuple(attention(cache, 0, q, plan, backend="reference").shape))
        for backend in (None, "cpu"):
            try:
                attention(cache, 0, q, plan, backend=backend)
            except UnknownBackend as e:
                print("refused", backend, e)
        q[0, 0, 0] = float("nan")
        try:
            attention(cache, 0, q, plan, backend="reference")
        except ValueError as e:
            print("nan", type(e).__name__)
        try:
            from int8kv.ops import cpu_packed
        except UnknownBackend:
            print("cpu_packed refused")
    """)
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONPATH=str(SRC))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "reference (1, 4, 32)"
    assert [line.split(" ", 2)[:2] for line in lines[1:3]] == [["refused", "None"], ["refused", "cpu"]]
    assert "NUMBA_DISABLE_JIT=1" in lines[1] and "backend='reference'" in lines[1]
    assert lines[3:] == ["nan NonFiniteError", "cpu_packed refused"]
