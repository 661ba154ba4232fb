"""The frozen 4-bit codec (int8kv.quant4): golden bytes, a float64 reference on random ragged inputs, edges."""

from __future__ import annotations

import json
import pathlib
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


GOLDEN = json.loads(pathlib.Path(__file__).with_name("golden").joinpath("q4_codec.json").read_text())


def from_hex(hexes: list[str], dtype) -> np.ndarray:
    return np.array([int(h, 16) for h in hexes], dtype=dtype)


def test_golden_names_this_format():
    assert GOLDEN["name"] == quant4.NAME == "int4_kchan16_vtok_asym_f16_v1" and quant4.VERSION == 1


@pytest.mark.parametrize("case", GOLDEN["values"], ids=[c["name"] for c in GOLDEN["values"]])
def test_golden_values_lock_the_bytes(case):
    x = from_hex(case["x_f32"], np.uint32).view(np.float32)
    packed, scale, mn = quant4.encode_values(x)
    assert packed.tobytes().hex() == case["codes"]
    assert f"{int(scale.view(np.uint16)):04x}" == case["scale_f16"]
    assert f"{int(mn.view(np.uint16)):04x}" == case["min_f16"]
    decoded = quant4.decode_values(packed, scale, mn)
    assert np.array_equal(decoded.view(np.uint32), from_hex(case["decoded_f32"], np.uint32))


@pytest.mark.parametrize("case", GOLDEN["key_blocks"], ids=[c["name"] for c in GOLDEN["key_blocks"]])
def test_golden_key_blocks_lock_the_bytes(case):
    k = from_hex(case["x_f32"], np.uint32).view(np.float32).reshape(case["shape"])
    packed, scale, mn = quant4.encode_keys_block(k)
    assert packed.tobytes().hex() == case["codes"]
    assert np.array_equal(scale.reshape(-1).view(np.uint16), from_hex(case["scale_f16"], np.uint16))
    assert np.array_equal(mn.reshape(-1).view(np.uint16), from_hex(case["min_f16"], np.uint16))
    decoded = quant4.decode_keys_block(packed, scale, mn)
    assert np.array_equal(decoded.reshape(-1).view(np.uint32), from_hex(case["decoded_f32"], np.uint32))


@pytest.mark.parametrize("shape", [(quant4.BLOCK, 2), (quant4.BLOCK, 3, 64), (quant4.BLOCK, 1, 2, 10)])
def test_key_block_groups_per_channel_against_float64(shape):
    r = rng("keys", shape)
    k = ragged(r, shape) + r.normal(0, 30, shape[1:]).astype(np.float32)  # per-channel offsets, as in real keys
    packed, scale, mn = quant4.encode_keys_block(k)
    assert packed.shape == shape[:-1] + (shape[-1] // 2,) and scale.shape == mn.shape == shape[1:]
    rq, rs, rlo = reference_groups(np.moveaxis(k, 0, -1))
    assert np.array_equal(scale.astype(np.float64), rs) and np.array_equal(mn.astype(np.float64), rlo)
    q = np.moveaxis(quant4.unpack_nibbles(packed), 0, -1)
    assert np.abs(q.astype(np.float64) - rq).max() <= 1 and np.mean(q == rq) > 0.999
    y = quant4.decode_keys_block(packed, scale, mn).astype(np.float64)
    x16 = k.astype(np.float16).astype(np.float64)
    assert np.all(np.abs(y - x16) <= rs[None] * 0.5 * (1 + 1e-5) + np.abs(x16) * 2e-7 + 1e-30)


@pytest.mark.parametrize("shape", [(1, 2), (7, 3, 64), (5, 128), (2, 3, 4, 6)])
def test_values_round_trip_shapes_and_dtypes(shape):
    v = ragged(rng("values", shape), shape)
    for x in (v, v.astype(np.float16), v.astype(np.float64)):
        packed, scale, mn = quant4.encode_values(x)
        assert packed.shape == shape[:-1] + (shape[-1] // 2,) and scale.shape == mn.shape == shape[:-1]
        q, s, m = quant4.encode_groups(x.astype(np.float16).astype(np.float32))
        assert np.array_equal(packed, quant4.pack_nibbles(q)) and np.array_equal(s, scale)
        assert np.array_equal(quant4.decode_values(packed, scale, mn), quant4.decode_groups(q, s, m))


def test_format_shapes_refused():
    with pytest.raises(ShapeMismatch, match="even head_dim"):
        quant4.encode_values(np.ones((3, 5), dtype=np.float32))
    with pytest.raises(ShapeMismatch, match="key block"):
        quant4.encode_keys_block(np.ones((quant4.BLOCK - 1, 2, 4), dtype=np.float32))
    with pytest.raises(ShapeMismatch, match="key block"):
        quant4.encode_keys_block(np.ones(4, dtype=np.float32))
    k = np.ones((quant4.BLOCK, 4), dtype=np.float32)
    k[9, 1] = np.nan
    with pytest.raises(NonFiniteError, match=r"\(9, 1\)"):
        quant4.encode_keys_block(k)


def test_value_problem_accepts_what_the_encoder_writes_only():
    _, scale, mn = quant4.encode_values(ragged(rng("domain"), (40, 64)))
    assert quant4.value_problem(scale, mn) is None
    assert quant4.value_problem(np.zeros(3, np.float16), mn[:3]) is None  # constant groups
    for bad_scale in (-1.0, -0.0, np.inf, np.nan):
        s = scale.copy()
        s[3] = bad_scale
        assert "scale" in quant4.value_problem(s, mn)
    m = mn.copy()
    m[0] = np.nan
    assert "minimum" in quant4.value_problem(scale, m)
    assert "float16" in quant4.value_problem(scale.astype(np.float32), mn)
