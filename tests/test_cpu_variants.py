"""The CPU kernels as on an AVX2-only CPU (Zen 2, Haswell), on whatever CPU runs the suite.

`INT8KV_CPU=avx2` (int8kv.cpu_target) compiles every kernel for AVX2 and picks the AVX2 variants, and makes torch
run its AVX2 kernels. It must be set before the process starts, so the kernel tests that depend on the variant run
again in a child pytest under it: every micro-kernel against float64 (test_ops_cpu_simd.py), the int16 query's
decode against float64 within its derived bound and its stated accuracy, and the exact path
(test_ops_cpu_quantized.py), and the GGUF weight kernels against float64 (test_gguf_weights.py). On a CPU with
nothing beyond AVX2 the suite itself is that run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from int8kv.cpu_target import reduced_features
from int8kv.ops import cpu_simd

HERE = Path(__file__).parent


def test_kernel_tests_pass_as_on_an_avx2_only_cpu():
    features = cpu_simd.target_features()
    if reduced_features(features) == features:
        pytest.skip("this CPU (or NUMBA_CPU_FEATURES) has nothing beyond AVX2: the whole suite runs as on one")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "ATEN_CPU_CAPABILITY",
                                                             "ONEDNN_MAX_CPU_ISA")}
    env["INT8KV_CPU"] = "avx2"
    tests = [
        "test_ops_cpu_simd.py",  # but test_qk16i_variants_compile (-k below): it compiles every variant anyway
        "test_ops_cpu_quantized.py::test_int16_query_accuracy_of_this_cpus_variant",
        "test_ops_cpu_quantized.py::test_decode_quantized_query_matches_reference_within_bound[8-128-16]",
        "test_gguf_weights.py::test_matmul_within_float32_rounding_of_float64",
    ]
    code = ("import sys, int8kv, pytest\nfrom int8kv.ops import cpu_simd\n"
            "assert cpu_simd.DOT in ('avx2', None), cpu_simd.DOT\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:xdist', '-p', 'no:cacheprovider', *sys.argv[1:]]))\n")
    done = subprocess.run([sys.executable, "-c", code, "-k", "not variants_compile", *tests], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=900)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
