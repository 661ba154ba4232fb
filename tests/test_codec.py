import json
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from int8kv import NonFiniteError, ShapeMismatch, dequantize_int8, quantize_int8
from int8kv.codec import quantize_int8_torch

GOLDEN = json.loads(pathlib.Path(__file__).with_name("golden").joinpath("v1_codec.json").read_text())


def from_bits(hexes: list[str]) -> torch.Tensor:
    return torch.tensor([int(h, 16) for h in hexes], dtype=torch.int64).to(torch.int32).view(torch.float32)


def numpy_v1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An independent statement of V1 in numpy, used as the oracle."""
    x16 = x.astype(np.float16).astype(np.float32)
    amax = np.abs(x16).max(axis=-1)
    scale = (amax / np.float32(127)).astype(np.float32)
    scale[scale == 0] = np.float32(1)
    q = np.clip(np.rint(x16 / scale[..., None]), -127, 127).astype(np.int8)
    return q, scale


@pytest.mark.parametrize("case", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_golden_vectors_lock_v1(case):
    x = from_bits(case["x_f32_bits"])
    q, s = quantize_int8(x)
    assert q.tolist() == case["codes"]
    assert s.reshape(1).view(torch.int32).item() & 0xFFFFFFFF == int(case["scale_f32_bits"], 16)
    assert torch.equal(dequantize_int8(q, s), q.to(torch.float32) * s)


def test_hand_derived_ties_and_float16_first():
    q, s = quantize_int8(torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5]))
    assert s.item() == 1.0
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 4, 126]
    # Without the float16 step first, 2.5004 would round to 3 and 127.02 would move the scale.
    q, s = quantize_int8(torch.tensor([127.02, 2.5004, 0.50024]))
    assert s.item() == 1.0 and q.tolist() == [127, 2, 0]


def test_zero_row_has_scale_one():
    q, s = quantize_int8(torch.zeros(3, 16))
    assert torch.equal(s, torch.ones(3)) and not q.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 128), (33, 5), (2, 4, 6, 17)])
def test_matches_numpy_oracle_and_torch_path(dtype, shape):
    gen = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 50).to(dtype)
    q, s = quantize_int8(x)
    assert q.shape == x.shape and q.dtype == torch.int8
    assert s.shape == x.shape[:-1] and s.dtype == torch.float32
    nq, ns = numpy_v1(x.to(torch.float32).numpy())
    assert np.array_equal(q.numpy(), nq) and np.array_equal(s.numpy(), ns)
    tq, ts = quantize_int8_torch(x)
    assert torch.equal(q, tq) and torch.equal(s, ts)


def test_cpu_kernel_equals_torch_path_on_random_bit_patterns():
    # Arbitrary float32 bit patterns cover float16 subnormals, ties and near-overflow values.
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(-(2**31), 2**31 - 1, (20000, 16), generator=gen, dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32)
    x = torch.where(x.abs() < 65519.0, x, torch.zeros(()))
    q, s = quantize_int8(x)
    tq, ts = quantize_int8_torch(x)
    assert torch.equal(q, tq) and torch.equal(s, ts)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 65520.0, -1e6])
@pytest.mark.parametrize("quant", [quantize_int8, quantize_int8_torch])
def test_non_finite_and_overflow_refused_with_location(bad, quant):
    x = torch.randn(4, 3, 8)
    x[2, 1, 5] = bad
    with pytest.raises(NonFiniteError, match=r"\(2, 1, 5\)"):
        quant(x)


def test_largest_float16_value_is_accepted():
    q, s = quantize_int8(torch.tensor([65519.0, -1.0]))  # rounds to 65504, not inf
    assert q.tolist() == [127, 0] and s.item() == np.float32(65504.0) / np.float32(127)


def test_bad_dtypes_and_shapes():
    with pytest.raises(ShapeMismatch):
        quantize_int8(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ShapeMismatch):
        quantize_int8(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ShapeMismatch):
        quantize_int8(torch.ones(3, 0))
    with pytest.raises(ShapeMismatch):
        dequantize_int8(torch.ones(2, 4, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ShapeMismatch):
        dequantize_int8(torch.ones(2, 4), torch.ones(2))


finite = st.floats(-60000, 60000, width=32, allow_nan=False)
rows = arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 80)), elements=finite)


@given(rows)
def test_error_at_most_half_a_step(x):
    x = torch.from_numpy(x)
    q, s = quantize_int8(x)
    x16 = x.to(torch.float16).to(torch.float64)
    err = (x16 - dequantize_int8(q, s).to(torch.float64)).abs()
    # Half a quantisation step, plus the two float32 roundings (x16/scale and q*scale),
    # each at most 2^-24 relative to a value of at most 127.5 steps.
    bound = s.to(torch.float64).unsqueeze(-1) * (0.5 + 128 * 2.0**-23)
    assert bool((err <= bound).all())


@given(rows)
def test_nonzero_row_has_a_code_of_127(x):
    x = torch.from_numpy(x)
    q, _ = quantize_int8(x)
    nonzero = x.to(torch.float16).abs().amax(-1) > 0
    assert bool((q.abs().amax(-1)[nonzero] == 127).all())
    assert int(q.min()) >= -127


# Re-encoding holds when the row's max |x| lies in float16's normal range [2^-14, 65504]:
# then float32(q*scale) rounds back onto the float16 grid at the max exactly (same scale),
# and every other element lands within 2^-10 relative of q*scale, far inside half a step.
normal_amax = st.floats(2.0**-14, 65504, width=32)


@given(rows, normal_amax)
def test_reencoding_decoded_values_is_stable(x, amax):
    x = torch.from_numpy(x)
    peak = x.abs().amax(-1, keepdim=True)
    x = torch.where(peak > 0, x / peak * amax, torch.full_like(x, amax))
    q, s = quantize_int8(x)
    q2, s2 = quantize_int8(dequantize_int8(q, s))
    assert torch.equal(q, q2) and torch.equal(s, s2)
