"""Every Triton kernel and switch compiles for Hopper (sm_90) and Ampere (sm_80), GPU or not.

Runs ``python -m int8kv.bench.gpu_compile`` in a fresh process without ``TRITON_INTERPRET`` (this test
session may have the interpreter on), so a compile error, an argument a launch leaves unset, or a switch that
no longer compiles fails here instead of in the first minutes of a borrowed GPU. Measured on the shared
2-core VM (load ~10): 42 compiles in ~90 s with an empty Triton cache, 39 s with the cache warm (each kernel
is still loaded and disassembled); the 4-bit pool's kernel adds 10 (the module took 196 s at load 5-6, cold).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (90, 80)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton build carries no CUDA toolchain")


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its current default
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "compile.json"
    done = _run(["-m", "int8kv.bench.gpu_compile", "--arch", *map(str, ARCHS), "--json", str(out)])
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_every_kernel_and_switch_compiles(report):
    done, data = report
    failed = [r for r in data["results"] if r["error"]]
    assert not failed, "\n".join(f"{r['case']} {r['kernel']} sm_{r['arch']}: {r['error']}" for r in failed)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = _run(["-m", "int8kv.bench.gpu_compile", "--list"]).stdout.split("\n")
    cases = {line for line in listed if line}
    seen = {(r["case"], r["arch"]) for r in data["results"]}
    assert seen == {(c, a) for c in cases for a in ARCHS}
    kernels = {r["kernel"] for r in data["results"]}
    assert kernels == {"_append_kernel", "_attention_kernel", "_merge_kernel", "_q4w_kernel"}
    for r in data["results"]:
        assert 0 < r["regs"] <= 255 and r["sass"] > 0, r


def test_default_decode_does_not_spill(report):
    _, data = report
    for r in data["results"]:
        if r["case"] in ("decode int8", "decode f16") and r["arch"] == 90:
            assert r["local_ops"] == 0 and r["stack"] == 0, r


def test_magic_conversion_removes_int_to_float_instructions(report):
    _, data = report
    by = {(r["case"], r["kernel"], r["arch"]): r for r in data["results"]}
    for arch in ARCHS:
        plain = by[("decode int8", "_attention_kernel", arch)]["i2f"]
        magic = by[("decode int8 magic", "_attention_kernel", arch)]["i2f"]
        # One int8 -> float16 conversion per key and value code of a 64 x 128 tile pair, over 128 threads.
        assert plain >= 64 and magic <= 2, (arch, plain, magic)


def test_merge_offsets_are_int64():
    # num_splits x stride_ps passes 2^31 elements before any one split's plane does: the product must be
    # formed in 64 bits. Checked on the kernel's Triton IR, since no CPU test can allocate such a tensor.
    code = (
        "from int8kv.bench import gpu_compile as g\n"
        "launches = g.record_case('int8', 'decode', {'num_splits': 4})\n"
        "merge = [x for x in launches if x.kernel.__name__ == '_merge_kernel'][0]\n"
        "print(g.compile_launch(merge, 90).asm['ttir'])\n"
    )
    done = _run(["-c", code])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "arith.extsi %stride_ps : i32 to i64" in done.stdout
