"""The frozen 4-bit codec (int8kv.quant4): golden bytes, a float64 reference on random ragged inputs, edges."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from int8kv import quant4
from int8kv.errors import NonFiniteError, ShapeMismatch


def rng(*key: object) -> np.random.Generator:
    # crc32, not hash(): str hashes are salted per process, and a failure must reproduce.
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def ragged(r: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Rows of mixed magnitudes (a scale per row, one outlier channel), float32."""
    x = r.standard_normal(shape) * np.exp(r.uniform(-6, 6, shape[:-1] + (1,)))
    x[..., r.integers(shape[-1])] *= 20
    return x.astype(np.float32)


def reference_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 statement of the group rule, for comparison: exact min/max of the float16 values, the scale and
    minimum rounded to float16, codes the nearest level in float64."""
    x16 = x.astype(np.float16).astype(np.float64)
    lo, hi = x16.min(-1), x16.max(-1)
    scale = ((hi - lo) / 15).astype(np.float16).astype(np.float64)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.where(scale[..., None] > 0, np.clip(np.rint((x16 - lo[..., None]) / safe[..., None]), 0, 15), 0)
    return q, scale, lo


@pytest.mark.parametrize("shape", [(1, 2), (5, 64), (3, 7, 128), (17, 36), (2, 3, 4, 10)])
def test_groups_against_float64_reference(shape):
    x = ragged(rng("groups", shape), shape)
    q, scale, mn = quant4.encode_groups(quant4.round_input(x))
    assert q.dtype == np.uint8 and scale.dtype == np.float16 and mn.dtype == np.float16
    rq, rs, rlo = reference_groups(x)
    assert np.array_equal(scale.astype(np.float64), rs) and np.array_equal(mn.astype(np.float64), rlo)
    # Codes equal the float64 nearest level except where float32 division lands on the other side of a tie.
    x16 = x.astype(np.float16).astype(np.float64)
    t = (x16 - rlo[..., None]) / np.where(rs > 0, rs, 1.0)[..., None]
    near_tie = np.abs(t - np.floor(t) - 0.5) < 1e-5
    assert np.array_equal(q[~near_tie], rq[~near_tie])
    assert np.abs(q.astype(np.float64) - rq).max() <= 1
    y = quant4.decode_groups(q, scale, mn).astype(np.float64)
    exact = q.astype(np.float64) * rs[..., None] + rlo[..., None]
    assert np.all(np.abs(y - exact) <= 2 * np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64))
    # Error: half a step, or what the scale's rounding down leaves above the top level.
    top = rlo + 15 * rs
    bound = np.maximum(rs / 2, np.maximum(x16.max(-1) - top, 0))[..., None] * (1 + 1e-5) + 1e-30
    assert np.all(np.abs(y - x16) <= bound + 2 * np.spacing(np.abs(exact).astype(np.float32)))


finite = st.floats(-60000, 60000, width=32, allow_nan=False)


@given(arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 40).map(lambda n: 2 * n)), elements=finite))
def test_groups_hold_codes_in_range_and_hit_both_ends(x):
    x16 = quant4.round_input(x)
    q, scale, mn = quant4.encode_groups(x16)
    assert int(q.max()) <= 15
    assert np.array_equal(mn.astype(np.float32), x16.min(-1))  # the minimum is exact: code 0 decodes to it
    spread = scale > 0
    assert np.all(q.min(-1)[spread] == 0)


def test_zero_and_constant_rows_decode_exactly():
    x = np.array([[0.0] * 8, [3.25] * 8, [-65504.0] * 8], dtype=np.float32)
    q, scale, mn = quant4.encode_groups(quant4.round_input(x))
    assert not q.any() and not scale.astype(np.float32).any()
    assert np.array_equal(quant4.decode_groups(q, scale, mn), x)


def test_huge_values_stay_finite():
    x = np.array([[-65504.0, 65504.0, 0.0, 1.0], [65519.0, -65519.0, 3.0, -3.0]], dtype=np.float32)
    q, scale, mn = quant4.encode_groups(quant4.round_input(x))
    y = quant4.decode_groups(q, scale, mn)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(scale.astype(np.float32)))
    assert y[0, 0] == -65504.0 and y[1, 1] == -65504.0  # code 0 is the minimum itself
    assert np.allclose(y[:, :2], [[-65504.0, 65504.0], [65504.0, -65504.0]], rtol=1e-3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 65520.0, -1e6])
def test_non_finite_and_overflow_refused_with_location(bad):
    x = np.ones((4, 3, 8), dtype=np.float32)
    x[2, 1, 5] = bad
    with pytest.raises(NonFiniteError, match=r"\(2, 1, 5\)"):
        quant4.round_input(x)


def test_bad_inputs_refused():
    with pytest.raises(ShapeMismatch):
        quant4.round_input(np.ones(4, dtype=np.int32))
    with pytest.raises(ShapeMismatch):
        quant4.round_input([1.0, 2.0])
    with pytest.raises(ShapeMismatch):
        quant4.round_input(np.float32(1.0).reshape(()))
    with pytest.raises(ShapeMismatch):
        quant4.pack_nibbles(np.zeros((2, 3), dtype=np.uint8))


def test_nibble_order_low_first_and_round_trip():
    q = np.array([[1, 2, 15, 0, 7, 8]], dtype=np.uint8)
    packed = quant4.pack_nibbles(q)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    codes = rng("nibbles").integers(0, 16, (9, 5, 64)).astype(np.uint8)
    assert np.array_equal(quant4.unpack_nibbles(quant4.pack_nibbles(codes)), codes)
