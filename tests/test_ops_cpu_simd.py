"""The vector micro-kernels of the CPU backend (`int8kv.ops.cpu_simd`) against float64, on fresh random inputs:
INT8 codes and F16 bits, any number of rows, head_dims of one to eight vectors, keys at arbitrary strides and
offsets, accumulators that already hold values."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from int8kv.ops import cpu_simd
from int8kv.ops.cpu_simd import LANES, pv16, qk16


@njit
def _scores(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):
    qk16(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf)


@njit
def _accumulate(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim):
    pv16(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim)


def _codes(rng, n: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat codes as the kernels take them and their float64 values."""
    if kind == "int8":
        codes = rng.integers(-127, 128, n, dtype=np.int8)
        return codes, codes.astype(np.float64)
    half = (rng.standard_normal(n) * 3).astype(np.float16)
    return half.view(np.int16), half.astype(np.float64)


def _key_rows(values: np.ndarray, koff: int, kstride: int, dim: int) -> np.ndarray:
    return np.stack([values[koff + t * kstride : koff + t * kstride + dim] for t in range(LANES)])


@pytest.mark.parametrize("kind", ["int8", "f16"])
@pytest.mark.parametrize("seed", range(6))
def test_qk16_matches_float64(kind, seed):
    rng = np.random.default_rng(seed)
    dim = LANES * int(rng.integers(1, 9))
    rows = int(rng.integers(1, 9))
    kstride = dim * int(rng.integers(1, 5)) + LANES * int(rng.integers(0, 3))  # heads apart, or padded
    koff = int(rng.integers(0, 50))
    codes, values = _codes(rng, koff + LANES * kstride + dim, kind)
    qoff, ooff, ostride = int(rng.integers(0, 20)), int(rng.integers(0, 20)), LANES + int(rng.integers(0, 9))
    q = rng.standard_normal(qoff + rows * dim).astype(np.float32)
    out = np.full(ooff + rows * ostride + LANES, np.nan, np.float32)
    _scores(q, qoff, codes, koff, kstride, out, ooff, ostride, rows, dim, np.empty(LANES * dim, np.float32))
    keys = _key_rows(values, koff, kstride, dim)
    qs = q[qoff : qoff + rows * dim].astype(np.float64).reshape(rows, dim)
    want = qs @ keys.T  # [rows, 16]
    got = np.stack([out[ooff + r * ostride : ooff + r * ostride + LANES] for r in range(rows)])
    scale = np.abs(qs) @ np.abs(keys).T  # float32 error bound: relative to the sum of |terms|
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    untouched = np.ones(out.shape, bool)
    for r in range(rows):
        untouched[ooff + r * ostride : ooff + r * ostride + LANES] = False
    assert np.isnan(out[untouched]).all()  # nothing written outside the rows' 16 scores


@pytest.mark.parametrize("kind", ["int8", "f16"])
@pytest.mark.parametrize("seed", range(6))
def test_pv16_matches_float64(kind, seed):
    rng = np.random.default_rng(100 + seed)
    dim = LANES * int(rng.integers(1, 9))
    rows = int(rng.integers(1, 9))
    vstride = dim * int(rng.integers(1, 5))
    voff = int(rng.integers(0, 50))
    codes, values = _codes(rng, voff + LANES * vstride + dim, kind)
    woff, wstride = int(rng.integers(0, 20)), LANES + int(rng.integers(0, 9))
    w = rng.random(woff + rows * wstride).astype(np.float32) * 0.01
    aoff = int(rng.integers(0, 20))
    acc = rng.standard_normal(aoff + rows * dim + 7).astype(np.float32)
    before = acc.astype(np.float64)
    _accumulate(w, woff, wstride, codes, voff, vstride, acc, aoff, rows, dim)
    vals = _key_rows(values, voff, vstride, dim)
    weights = np.stack([w[woff + r * wstride : woff + r * wstride + LANES] for r in range(rows)]).astype(np.float64)
    want = before.copy()
    want[aoff : aoff + rows * dim] += (weights @ vals).reshape(-1)
    scale = np.abs(before).copy()
    scale[aoff : aoff + rows * dim] += (weights @ np.abs(vals)).reshape(-1)
    assert np.all(np.abs(acc - want) <= 1e-5 * scale + 1e-30)
    assert np.array_equal(acc[:aoff], before[:aoff].astype(np.float32))  # outside the rows: unchanged
    assert np.array_equal(acc[aoff + rows * dim :], before[aoff + rows * dim :].astype(np.float32))


def test_fits_only_whole_vectors():
    assert cpu_simd.fits(64) and cpu_simd.fits(16) and cpu_simd.fits(256)
    assert not cpu_simd.fits(8) and not cpu_simd.fits(40) and not cpu_simd.fits(0)


def test_kernels_refuse_float_codes():
    with pytest.raises(TypingError, match="int8 or int16"):
        _scores(np.zeros(16, np.float32), 0, np.zeros(256, np.float32), 0, 16, np.zeros(16, np.float32), 0, 16, 1,
                16, np.zeros(256, np.float32))


def test_prefetch_reads_nothing_it_changes():
    """A hint only: the array is unchanged and no element outside it is touched (a range past the end is not
    allowed by the callers, so only in-range ranges are tried, from one element to a few lines)."""

    @njit
    def hint(a, offset, count):
        cpu_simd.prefetch(a, offset, count)
        return a.sum()

    rng = np.random.default_rng(3)
    a = rng.integers(-127, 128, 4096, dtype=np.int8)
    before = a.copy()
    for offset, count in ((0, 1), (5, 64), (100, 1000), (4000, 96), (0, 4096)):
        assert hint(a, offset, count) == before.astype(np.int64).sum()
    assert np.array_equal(a, before)
