"""Small compiled loops of the decode path vectorise with plain loads and stores: numba indexing that LLVM cannot
prove non-negative (x[h * d + i] over a range(a, b)), a loop over an array's own iterator or over strided slices
compiled to gathers and scattered stores, 3.6-11x slower than the same loops indexed from 0
(docs/archive/benchmarks-2026.md, "Loops that numba indexed with gathers"). Read from the machine code of a fresh
wrapper around each (numba links the callee's code into it); numbers are the float64-checked tests' business
(test_ops_cpu_quantized.py, test_ops_cpu.py, test_write.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from numba import njit

from int8kv.ops import cpu, cpu_rope, cpu_simd

pytestmark = pytest.mark.skipif("+avx2" not in cpu_simd.target_features().split(","),
                                reason="gathers exist from AVX2 on; below it nothing can regress this way")
GATHERS = re.compile(r"\bv(p)?(gather|scatter)")


def _machine_code(fn, *args) -> str:
    fn(*args)
    return fn.inspect_asm(fn.signatures[0])


def test_the_query_quantizer_has_no_gathers():
    @njit(fastmath=True)
    def quantize(x, d, sm, codes, scale):
        cpu._quantize_rows(x, d, sm, codes, scale)

    asm = _machine_code(quantize, np.ones(576, np.float32), 64, np.float32(0.125), np.empty(576, np.int16),
                        np.empty(9, np.float32))
    assert not GATHERS.search(asm)
    assert re.search(r"\bvmaxps\s+%[yz]mm", asm)  # the range in vectors, not one value at a time


def test_the_query_check_has_no_gathers():
    @njit
    def check(a):
        return cpu.all_finite(a)

    assert not GATHERS.search(_machine_code(check, np.ones((2, 9, 64), np.float32)))


def test_the_decode_rotation_has_no_gathers():
    @njit
    def rotate(qkv, c, s, q, k, v):
        return cpu_rope.split_rotate(qkv, c, s, q, k, v)

    tokens, hq, hkv, d = 2, 9, 3, 64
    asm = _machine_code(rotate, np.ones((tokens, (hq + 2 * hkv) * d), np.float32),
                        *(np.ones((tokens, d // 2), np.float32) for _ in range(2)),
                        *(np.empty((tokens, h, d), np.float32) for h in (hq, hkv, hkv)))
    assert not GATHERS.search(asm)
