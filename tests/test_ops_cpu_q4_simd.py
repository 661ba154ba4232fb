"""The 4-bit decode kernel's vector micro-kernels (`int8kv.ops.cpu_q4_simd`) against float64 on fresh random
inputs (any offset, stride, row count, every head_dim the kernel takes), and their machine code for an AVX2-only
CPU (no AVX-512 register) beside this host's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zlib

import numpy as np
import pytest
from numba import njit, types

from int8kv.ops.cpu_q4_simd import expsum16, fold, max16, unpack16, weights16, widen16

DIMS = [16, 32, 48, 64, 80, 128, 144, 256]  # multiples of 16, odd multiples of 16 and 32 included


def seeded(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


@njit
def _fold(q, qoff, scale, minimum, soff, out, bias, boff, rows, dim):
    fold(q, qoff, scale, minimum, soff, out, bias, boff, rows, dim)


@njit
def _expsum(x, off, shift):
    return expsum16(x, off, shift)


@njit
def _max(x, off):
    return max16(x, off)


@njit
def _weights(s, soff, sstride, scale, minimum, voff, total, toff, rows):
    weights16(s, soff, sstride, scale, minimum, voff, total, toff, rows)


@njit
def _widen(bits, off, stride, out, ooff):
    widen16(bits, off, stride, out, ooff)


@njit
def _unpack(codes, off, stride, half, dst):
    unpack16(codes, off, stride, half, dst)


def unpacked_order(x: np.ndarray) -> np.ndarray:
    """Channels of the last axis reordered as the kernels keep them: even ones, then odd ones."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], -1)


@pytest.mark.parametrize("dim", DIMS)
def test_fold_matches_float64(dim):
    r = seeded("fold", dim)
    rows, qoff, soff, boff = (int(r.integers(lo, hi)) for lo, hi in ((1, 6), (0, 40), (0, 40), (0, 5)))
    q = r.standard_normal(qoff + rows * dim).astype(np.float32)
    scale = r.uniform(0.001, 0.05, soff + dim).astype(np.float16)
    minimum = r.normal(0, 2, soff + dim).astype(np.float16)
    out = np.full(rows * dim + 7, np.nan, np.float32)
    bias = np.full(boff + rows + 3, np.nan, np.float32)
    _fold(q, qoff, scale.view(np.int16), minimum.view(np.int16), soff, out, bias, boff, rows, dim)
    qs = q[qoff:].astype(np.float64).reshape(rows, dim)  # already in the unpacked order
    s = unpacked_order(scale[soff:].astype(np.float64))
    m = unpacked_order(minimum[soff:].astype(np.float64))
    assert np.allclose(out[: rows * dim].reshape(rows, dim), qs * s, rtol=1e-6, atol=0)
    assert np.all(np.abs(bias[boff : boff + rows] - qs @ m) <= 1e-5 * (np.abs(qs) @ np.abs(m)) + 1e-30)
    assert np.isnan(out[rows * dim :]).all() and np.isnan(bias[:boff]).all() and np.isnan(bias[boff + rows :]).all()


@pytest.mark.parametrize("seed", range(4))
def test_expsum16_matches_float64(seed):
    r = seeded("exp", seed)
    off = int(r.integers(0, 20))
    x = np.full(off + 20, np.nan, np.float32)
    x[off : off + 16] = r.uniform(-95, 0, 16)
    x[off + int(r.integers(16))] = -1e30  # a hidden key
    x[off + int(r.integers(16))] = 0.0  # the maximum itself
    shift = np.float32(r.uniform(-3, 3))
    x[off : off + 16] += shift
    y = x[off : off + 16].astype(np.float64) - np.float64(shift)
    want = np.where(y < -87, 0.0, np.exp(y))
    total = _expsum(x, off, shift)
    got = x[off : off + 16].astype(np.float64)
    assert np.all(np.abs(got - want) <= 4e-6 * want + 1e-30)  # y's own float32 rounding: |y| <= 95
    assert np.all(got[y < -87] == 0) and abs(total - want.sum()) <= 1e-6 * want.sum()
    assert np.isnan(x[:off]).all() and np.isnan(x[off + 16 :]).all()
    near = np.linspace(-5, 0, 16, dtype=np.float32)  # the weights that matter: float32 accuracy
    z = near.copy()
    _expsum(z, 0, np.float32(0))
    assert np.all(np.abs(z / np.exp(near.astype(np.float64)) - 1) < 1e-6)


def test_max16_and_widen16_match():
    r = seeded("max")
    x = r.standard_normal(40).astype(np.float32)
    for off in (0, 3, 24):
        assert _max(x, off) == x[off : off + 16].max()
    bits = r.normal(0, 100, 200).astype(np.float16)
    out = np.full(20, np.nan, np.float32)
    _widen(bits.view(np.int16), 5, 11, out, 2)
    assert np.array_equal(out[2:18], bits[5 : 5 + 16 * 11 : 11].astype(np.float32))
    assert np.isnan(out[:2]).all() and np.isnan(out[18:]).all()


def test_weights16_matches_float64():
    r = seeded("weights")
    rows, sstride, soff, voff = 4, 19, 3, 5
    s = r.uniform(0, 1, soff + rows * sstride).astype(np.float32)
    before = s.copy()
    scale = r.uniform(0.01, 0.1, voff + 16).astype(np.float32)
    minimum = r.normal(0, 1, voff + 16).astype(np.float32)
    total = r.normal(0, 1, rows + 2).astype(np.float32)
    start = total.copy()
    _weights(s, soff, sstride, scale, minimum, voff, total, 1, rows)
    for i in range(rows):
        p = before[soff + i * sstride : soff + i * sstride + 16].astype(np.float64)
        assert np.allclose(s[soff + i * sstride : soff + i * sstride + 16], p * scale[voff:], rtol=1e-6)
        want = start[1 + i] + p @ minimum[voff:].astype(np.float64)
        assert abs(total[1 + i] - want) <= 1e-5 * (abs(start[1 + i]) + np.abs(p) @ np.abs(minimum[voff:]))
        gap = slice(soff + i * sstride + 16, soff + (i + 1) * sstride)
        assert np.array_equal(s[gap], before[gap])  # the rows' padding is not touched
    assert total[0] == start[0] and total[-1] == start[-1]


@pytest.mark.parametrize("dim", DIMS)
def test_unpack16_splits_nibbles(dim):
    r = seeded("unpack", dim)
    half = dim // 2
    stride, off = half * int(r.integers(1, 4)) + int(r.integers(0, 5)), int(r.integers(0, 30))
    codes = r.integers(0, 256, off + 16 * stride + half, dtype=np.uint8)
    dst = np.full(16 * dim + 9, -1, np.int8)
    _unpack(codes, off, stride, half, dst)
    rows = np.stack([codes[off + t * stride : off + t * stride + half] for t in range(16)])
    assert np.array_equal(dst[: 16 * dim].reshape(16, dim), np.concatenate([rows & 15, rows >> 4], 1))
    assert (dst[16 * dim :] == -1).all()


def _callers():
    """Each micro-kernel behind a numba function and the signature to compile it with."""
    f32, i16, i8, u8 = (types.Array(t, 1, "C") for t in (types.float32, types.int16, types.int8, types.uint8))
    i64 = types.int64
    return {
        "fold": (_fold, (f32, i64, i16, i16, i64, f32, f32, i64, i64, i64), "vcvtph2ps"),
        "expsum16": (_expsum, (f32, i64, types.float32), "vfmadd"),
        "max16": (_max, (f32, i64), "vmaxps"),
        "weights16": (_weights, (f32, i64, i64, f32, f32, i64, f32, i64, i64), "vmulps"),
        "widen16": (_widen, (i16, i64, i64, f32, i64), "vcvtph2ps"),
        "unpack16": (_unpack, (u8, i64, i64, i64, i8), "vpand"),
    }


@pytest.mark.parametrize("name", list(_callers()))
@pytest.mark.parametrize("cpu", ["haswell", "sapphirerapids"])
def test_micro_kernels_compile_for_avx2_and_avx512(name, cpu):
    """The IR names no instruction of one CPU: emitted for an AVX2-only core (Haswell: no register wider than
    256 bits) and for an AVX-512 one, with the vector instruction that makes each kernel worth having."""
    from llvmlite import binding

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 targets")
    fn, sig, instruction = _callers()[name]
    fn.compile(sig)
    module = binding.parse_assembly(fn.inspect_llvm(sig))
    target = binding.Target.from_triple(module.triple or binding.get_process_triple())
    asm = target.create_target_machine(cpu=cpu, opt=2).emit_assembly(module)
    assert instruction in asm
    if cpu == "haswell":
        assert "zmm" not in asm


_AVX2_RUN = """
import numpy as np, torch
from int8kv import quant4
from int8kv.ops import cpu_q4, cpu_simd
from int8kv.ops.plan import AttentionVariant
assert cpu_simd.target_features().endswith("-avx512f") and cpu_simd.DOT == "avx2"  # the target took effect
from int8kv.ops.reference_q4 import attend_q4
r = np.random.default_rng(7)
seqs = [quant4.encode_sequence(r.standard_normal((n, 2, 64)).astype(np.float32),
                               r.standard_normal((n, 2, 64)).astype(np.float32)) for n in (300, 41)]
q = r.standard_normal((2, 6, 64)).astype(np.float32)
var = AttentionVariant(window=200, softcap=3.0, sinks=torch.tensor(r.normal(0, 1, 6), dtype=torch.float32))
got = cpu_q4.decode_attention(q, **cpu_q4.layout_from_rows(seqs), variant=var)
for b, rows in enumerate(seqs):
    want = attend_q4(torch.from_numpy(q[b : b + 1]).double(), rows, variant=var)[0].numpy()
    assert np.allclose(got[b], want, rtol=2e-4, atol=2e-5 * np.abs(want).max()), b
print("ok")
"""


def test_whole_kernel_runs_compiled_for_avx2(tmp_path):
    """The decode kernel compiled for an AVX2-only CPU (numba's target features) runs on this host (which has
    AVX2) and matches the float64 reference: minutes of compiling, so opt-in like the INT8 kernel's."""
    if not os.environ.get("INT8KV_TEST_ALL_VARIANTS"):
        pytest.skip("compiles the whole 4-bit decode kernel again for another CPU: INT8KV_TEST_ALL_VARIANTS=1")
    from llvmlite import binding

    if "+avx2" not in binding.get_host_cpu_features().flatten():
        pytest.skip("needs a host with AVX2 to run AVX2 code")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CACHE_DIR=str(tmp_path),
               NUMBA_CPU_FEATURES="+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt,-avx512f")
    done = subprocess.run([sys.executable, "-c", _AVX2_RUN], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_kernels_refuse_other_dtypes():
    from numba.core.errors import TypingError

    with pytest.raises(TypingError, match="codes must be a uint8"):
        _unpack(np.zeros(64, np.int8), 0, 4, 4, np.zeros(256, np.int8))
    with pytest.raises(TypingError, match="scale must be a int16"):
        _fold(np.zeros(16, np.float32), 0, np.zeros(16, np.float32), np.zeros(16, np.int16), 0,
              np.zeros(16, np.float32), np.zeros(1, np.float32), 0, 1, 16)
