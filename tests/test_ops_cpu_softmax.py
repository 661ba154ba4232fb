"""The decode row kernel's softmax in vectors (`cpu_simd.logits16`, `weights16`, `gather16`) against float64 on
fresh random inputs, tiles of every length from 1 to 64 keys, and bit for bit against the numba loops they stand
in for (`cpu._softmax_step` and the fold of the value scales, which the prefill kernel still runs)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from int8kv.ops import cpu, cpu_simd
from int8kv.ops.cpu_simd import LANES

NEG = np.float32(-1e30)


@njit
def _logits(s, soff, n, kscale, koff, qscale, floor):
    return cpu_simd.logits16(s, soff, n, kscale, koff, qscale, floor)


@njit
def _weights(s, soff, n, mx, vscale, voff):
    return cpu_simd.weights16(s, soff, n, mx, vscale, voff)


@njit
def _gather(src, first, stride, heads, hstep, dst, doff, dstride):
    cpu_simd.gather16(src, first, stride, heads, hstep, dst, doff, dstride)


def _padded(n: int) -> int:
    return -(-n // LANES) * LANES


@pytest.mark.parametrize("seed", range(8))
def test_logits16_matches_float64(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 65))
    soff, koff = int(rng.integers(0, 9)), int(rng.integers(0, 9))
    end = soff + _padded(n)
    s = np.full(end + LANES, np.nan, np.float32)
    s[soff : soff + n] = rng.standard_normal(n).astype(np.float32) * float(rng.choice([1, 300, 3e4]))
    s[soff + n : end] = np.float32(rng.standard_normal())  # stale lanes of the tile: overwritten with NEG
    raw = s.copy()
    kscale = (rng.random(koff + _padded(n)) * 0.02).astype(np.float32)
    qscale = np.float32(rng.random() * 0.01)
    floor = np.float32(rng.standard_normal() * 3) if seed % 2 else NEG
    top = _logits(s, soff, n, kscale, koff, qscale, floor)
    logits = raw[soff : soff + n].astype(np.float64) * kscale[koff : koff + n] * np.float64(qscale)
    got = s[soff : soff + n]
    assert np.all(np.abs(got - logits) <= 2.5e-7 * np.abs(logits))
    assert top == max(floor, got.max())
    assert np.all(s[soff + n : end] == NEG)
    assert np.isnan(s[:soff]).all() and np.isnan(s[end:]).all()


@pytest.mark.parametrize("seed", range(8))
def test_weights16_matches_float64(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 65))
    soff, voff = int(rng.integers(0, 9)), int(rng.integers(0, 9))
    end = soff + _padded(n)
    s = np.full(end + LANES, np.nan, np.float32)
    logits = (rng.standard_normal(n) * float(rng.choice([0.5, 5, 50]))).astype(np.float32)
    logits[rng.integers(0, n)] = -200.0  # below exp's clamp: weight ~0
    s[soff : soff + n] = logits
    s[soff + n : end] = NEG
    mx = np.float32(logits.max() + rng.random())
    vscale = (rng.random(voff + _padded(n)) * 0.02 + 0.001).astype(np.float32)
    total = _weights(s, soff, n, mx, vscale, voff)
    e = np.exp((logits - mx).astype(np.float64))  # of the float32 difference, as the kernel rounds it
    want = e * vscale[voff : voff + n]
    got = s[soff : soff + n]
    assert np.all(np.abs(got - want) <= 1e-6 * want + 1e-38)
    assert abs(total - e.sum()) <= 1e-6 * e.sum()
    assert np.all(s[soff + n : end] == 0)  # the padding lanes weigh nothing
    assert np.isnan(s[:soff]).all() and np.isnan(s[end:]).all()


def test_weights16_exp_over_its_whole_range():
    """exp(x) for x <= 0 within 5e-7 of float64 (`cpu._exp_nonpos`'s bound), arguments below -87 clamped there."""
    rng = np.random.default_rng(7)
    x = np.concatenate([
        -np.abs(rng.standard_normal(4000).astype(np.float32)) * 20,
        -rng.random(1000).astype(np.float32) * 1e-6,
        np.array([0.0, -0.0, -87.0, -86.99, -88.0, -1e30, -1e-38, -0.5, -1.0], np.float32),
    ]).astype(np.float32)
    n = _padded(len(x))
    s = np.full(n, NEG, np.float32)
    s[: len(x)] = x
    _weights(s, 0, n, np.float32(0.0), np.ones(n, np.float32), 0)
    want = np.exp(np.maximum(x.astype(np.float64), -87.0))
    assert np.all(np.abs(s[: len(x)] - want) <= 5e-7 * want)


@njit(fastmath=True)
def _both_paths(s_loops, s_vectors, k_scale, v_scale, q_scales, nt, m1, d1, a1, m2, d2, a2):
    for r in range(s_loops.shape[0]):
        cpu._softmax_step(s_loops[r], k_scale, q_scales[r], nt, r, m1, d1, a1, None)
        w = s_loops[r]
        for j in range(nt):
            w[j] *= v_scale[j]
        cpu._tile_weights(s_vectors[r], k_scale, v_scale, q_scales[r], nt, r, m2, d2, a2, None)


@pytest.mark.parametrize("seed", range(6))
def test_vector_softmax_is_the_loops_bit_for_bit(seed):
    """Two tiles in a row through both paths: the running max and the weights are identical, the denominators
    (a sum in another order) and the rescaled accumulators agree to float32 rounding."""
    rng = np.random.default_rng(200 + seed)
    rows = int(rng.integers(1, 5))
    m1, d1 = np.full(rows, NEG, np.float32), np.zeros(rows, np.float32)
    a1 = rng.standard_normal((rows, 64)).astype(np.float32)
    m2, d2, a2 = m1.copy(), d1.copy(), a1.copy()
    for _tile in range(2):
        nt = int(rng.integers(1, 65))
        s = (rng.standard_normal((rows, cpu.TILE)) * float(rng.choice([10, 300, 3000]))).astype(np.float32)
        k_scale = (rng.random(cpu.TILE) * 0.02).astype(np.float32)
        v_scale = (rng.random(cpu.TILE) * 0.02).astype(np.float32)
        q_scales = (rng.random(rows) * 0.01).astype(np.float32)
        s_loops, s_vectors = s.copy(), s.copy()
        _both_paths(s_loops, s_vectors, k_scale, v_scale, q_scales, nt, m1, d1, a1, m2, d2, a2)
        assert np.array_equal(s_loops[:, :nt], s_vectors[:, :nt])
        assert np.array_equal(m1, m2)
        np.testing.assert_allclose(d2, d1, rtol=1e-6)
        np.testing.assert_allclose(a2, a1, rtol=1e-6)


@pytest.mark.parametrize("layout", ["rows", "heads_major"])
@pytest.mark.parametrize("heads", range(1, 10))
def test_gather16_reads_every_heads_scales(heads, layout):
    """Every head's 16 scales of a run, into its own slot and nowhere else: rows of heads contiguous (the pool's
    layout: one vector load split by shuffles for the head counts in `_WIDE_HEADS`, strided loads for the rest)
    and a heads-major view (strided loads)."""
    rng = np.random.default_rng(300 + heads)
    blocks, bs = int(rng.integers(2, 5)), 16 * int(rng.integers(1, 3))
    scales = rng.random((blocks, bs, heads)).astype(np.float32)
    if layout == "heads_major":  # the same values, each head's tokens contiguous
        scales = np.ascontiguousarray(scales.transpose(0, 2, 1)).transpose(0, 2, 1)
    block, offset = int(rng.integers(0, blocks)), int(rng.integers(0, bs - 15))
    doff, dstride = int(rng.integers(0, 8)), LANES + int(rng.integers(0, 9))
    dst = np.full(doff + heads * dstride + LANES, np.nan, np.float32)
    size = scales.itemsize
    first = (block * scales.strides[0] + offset * scales.strides[1]) // size
    _gather(scales, first, scales.strides[1] // size, heads, scales.strides[2] // size, dst, doff, dstride)
    written = np.zeros(dst.shape, bool)
    for h in range(heads):
        at = doff + h * dstride
        assert np.array_equal(dst[at : at + LANES], scales[block, offset : offset + LANES, h])
        written[at : at + LANES] = True
    assert np.isnan(dst[~written]).all()


def test_kernels_refuse_other_types():
    """float64 scalars or arrays would not match the kernels' float32 vectors: refused when typed."""
    from numba.core.errors import TypingError

    s = np.zeros(LANES, np.float32)
    with pytest.raises(TypingError, match="float32"):
        _logits(s, 0, 4, s, 0, 0.5, NEG)  # a Python float: float64
    with pytest.raises(TypingError, match="float32"):
        _weights(s.astype(np.float64), 0, 4, np.float32(0.0), s, 0)
    with pytest.raises(TypingError, match="float32"):
        _gather(s, 0, 1, 1, 1, s.astype(np.float64), 0, 16)
