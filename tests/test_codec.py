import json
import pathlib
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from int8kv import NonFiniteError, ShapeMismatch, dequantize_int8, quantize_int8
from int8kv._codec_cpu import SERIAL_ELEMENTS
from int8kv.codec import quantize_int8_torch, round_to_f16
from int8kv.formats import KvStorageFormat

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
    # crc32, not hash(): str hashes are salted per process, and a failure must reproduce.
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), shape)).encode()))
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 50).to(dtype)
    q, s = quantize_int8(x)
    assert q.shape == x.shape and q.dtype == torch.int8
    assert s.shape == x.shape[:-1] and s.dtype == torch.float32
    nq, ns = numpy_v1(x.to(torch.float32).numpy())
    assert np.array_equal(q.numpy(), nq) and np.array_equal(s.numpy(), ns)
    tq, ts = quantize_int8_torch(x)
    assert torch.equal(q, tq) and torch.equal(s, ts)


@pytest.mark.parametrize("rows", [20000, 4000])  # the parallel kernel, and the serial one below SERIAL_ELEMENTS
def test_cpu_kernel_equals_torch_path_on_random_bit_patterns(rows):
    assert (rows * 16 < SERIAL_ELEMENTS) == (rows == 4000)
    # Arbitrary float32 bit patterns cover float16 subnormals, ties and near-overflow values.
    gen = torch.Generator().manual_seed(7 + rows)
    x = torch.randint(-(2**31), 2**31 - 1, (rows, 16), generator=gen, dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32)
    x = torch.where(x.abs() < 65519.0, x, torch.zeros(()))
    q, s = quantize_int8(x)
    tq, ts = quantize_int8_torch(x)
    assert torch.equal(q, tq) and torch.equal(s, ts)
    x[rows // 3, 7] = float("nan")  # one bad row, counted by whichever kernel ran
    with pytest.raises(NonFiniteError, match=rf"\({rows // 3}, 7\)"):
        quantize_int8(x)


def test_the_f16_compiled_store_is_torchs_float16_rounding():
    """`_codec_cpu.f16_store` (the F16 format's compiled store) writes torch's float16 bits for random float32 bit
    patterns (subnormals, near-overflow values), exact ties between adjacent float16 values and the edges (+-0,
    65504, 65519.99, the smallest normal and what rounds up to it); a row holding NaN, inf or a value that rounds
    past 65504 (65520 up) is refused, counted once per row, and nothing of the call is stored."""
    from int8kv._codec_cpu import f16_store

    gen = torch.Generator().manual_seed(29)
    x = torch.randint(-(2**31), 2**31 - 1, (4000, 16), generator=gen, dtype=torch.int64).to(torch.int32)
    x = x.view(torch.float32)
    x = torch.where(x.abs() < 65519.99, x, torch.zeros(()))
    lo = torch.randint(0, 0x7BFF, (3000,), generator=gen, dtype=torch.int32).to(torch.int16)
    ties = (lo.view(torch.float16).float() + (lo + 1).view(torch.float16).float()) / 2  # exact in float32
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.99, -65519.99, 2.0**-14, 2.0**-14 - 2.0**-25, 2.0**-24,
                          2.0**-25, 3 * 2.0**-25, 2.0**-26, 1e-30, -1e-45] * 2, dtype=torch.float32)  # fmt: skip
    rows = torch.cat([x.reshape(-1), ties, edges])
    rows = rows[: rows.numel() // 16 * 16].reshape(-1, 2, 8).contiguous()
    n = rows.shape[0]
    k_codes, v_codes = np.zeros((n + 3, 2, 8), np.uint16), np.zeros((n + 3, 2, 8), np.uint16)
    slots = np.random.default_rng(3).permutation(n + 3)[:n].astype(np.int64)
    assert f16_store(rows.numpy(), (-rows).numpy(), slots, k_codes, v_codes) == 0
    want = rows.half().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(k_codes[slots], want)
    assert np.array_equal(v_codes[slots], (-rows).half().view(torch.int16).numpy().view(np.uint16))
    before = k_codes.copy(), v_codes.copy()
    for bad in (float("nan"), float("inf"), -float("inf"), 65520.0, -1e6):
        poisoned = rows.clone()
        poisoned[n // 2, 1, 3] = bad
        poisoned[n // 2, 1, 5] = bad  # two bad values in one row count as one row
        assert f16_store(rows.numpy(), poisoned.numpy(), slots, k_codes, v_codes) == 1
        assert np.array_equal(k_codes, before[0]) and np.array_equal(v_codes, before[1])


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


# Hand-derived vectors: inputs sit exactly on float16 ties and on int8 rounding ties; the expected codes and
# scales were worked out by hand (below), not by running the codec. Every input is exact in float32.
# Float16 spacing: 2^-10 in [1, 2), 2^-9 in [2, 4), 2^-8 in [4, 8), 2^-4 in [64, 128), 2^-3 in [128, 256),
# 2^-24 below 2^-14. A value halfway between two float16 neighbours goes to the one with an even mantissa.
# float32(1/127): 1/127 = 2^-7 * (1 + 1/127), and 1/127 = 0.0000001 0000001 0000001 0000001... in binary,
# so the 23-bit mantissa is 2^16 + 2^9 + 2^2 = 0x010204 (the next set bit, 2^-28 of the significand, is far
# below half an ulp: round down); exponent -7 -> 120 -> 0x3C000000; float32(1/127) = 0x3C010204.
HAND_VECTORS = [
    {
        "name": "float16_and_code_ties_at_scale_1",
        "x": [127 + 2**-5, 2.5 + 2**-10, -(2.5 + 2**-10), 1.5 - 2**-11, 0.5, -0.5, 1.5, 2.5, -2.5, 126.5, 0.0],
        # x16: 127 + 2^-5 = 64 + 1008.5 * 2^-4 -> 1008 (even) -> 127, so amax = 127 and scale = 1 exactly
        #      (ties away from zero would give 127.0625 and scale 127.0625/127).
        #      2.5 + 2^-10 = 2 + 256.5 * 2^-9 -> 256 -> 2.5, then code RNE(2.5) = 2 (ties up: 257 -> 2.5020 -> 3).
        #      1.5 - 2^-11 = 1 + 511.5 * 2^-10 -> 512 -> 1.5, code 2 (truncation would give 511 -> code 1).
        #      .5 values are exact in float16; codes round half to even: 0, 0, 2, 2, -2, 126.
        "codes": [127, 2, -2, 2, 0, 0, 2, 2, -2, 126, 0],
        "scale_f32_bits": "3f800000",  # 1.0
    },
    {
        "name": "negative_float16_tie_is_the_max",
        "x": [-(127 + 2**-5), 64 + 2**-5, -(64 + 2**-5), 0.5],
        # -(127 + 2^-5) -> -127 (as above), 64 + 2^-5 = 64 + 0.5 * 2^-4 -> 64 (mantissa 0, even); scale 1.
        "codes": [-127, 64, -64, 0],
        "scale_f32_bits": "3f800000",
    },
    {
        "name": "scale_2_code_ties",
        "x": [254 + 2**-4, 5 + 2**-9, -(5 + 2**-9), 1.0, -1.0, 3.0, 7.0, 253.0],
        # 254 + 2^-4 = 128 + 1008.5 * 2^-3 -> 1008 -> 254: amax 254, scale = 254/127 = 2 exactly.
        # 5 + 2^-9 = 4 + 256.5 * 2^-8 -> 256 -> 5.0. Then x16/2 = 127, 2.5, -2.5, 0.5, -0.5, 1.5, 3.5, 126.5,
        # all exact in float32, rounded half to even.
        "codes": [127, 2, -2, 0, 0, 2, 4, 126],
        "scale_f32_bits": "40000000",  # 2.0
    },
    {
        "name": "float16_tie_at_one_scale_1_over_127",
        "x": [1 + 2**-11, -0.5, 0.25],
        # 1 + 2^-11 = 1 + 0.5 * 2^-10 -> 1.0 (mantissa 0): amax 1, scale float32(1/127) = s = 8454660 * 2^-30.
        # 1/s = 2^30 / 8454660 = 127 + 4/8454660: float32 127.0 (ulp 2^-17), code 127.
        # -0.5/s = -(63.5 + 2/8454660): the excess 2.4e-7 is under half an ulp (2^-19 = 1.9e-6), so the float32
        # quotient is -63.5 exactly and its code -64 (even). 0.25/s -> 31.75 -> 32.
        "codes": [127, -64, 32],
        "scale_f32_bits": "3c010204",
    },
    {
        "name": "float16_subnormal_ties",
        "x": [5 * 2**-25, 2**-25, -3 * 2**-25, 0.0],
        # In units of 2^-24: 2.5 -> 2, 0.5 -> 0, -1.5 -> -2 (ties to even). amax = 2^-23, scale = float32(2^-23/127)
        # = 2^-30 * (1 + 1/127): mantissa 0x010204, exponent -30 -> 97 -> 0x30800000, so 0x30810204.
        # Codes: 2^-23/s = 127 + 4/8454660 -> 127; 0; -127; 0.
        "codes": [127, 0, -127, 0],
        "scale_f32_bits": "30810204",
    },
]


@pytest.mark.parametrize("case", HAND_VECTORS, ids=[c["name"] for c in HAND_VECTORS])
@pytest.mark.parametrize("quant", [quantize_int8, quantize_int8_torch])
def test_hand_derived_float16_and_code_ties(case, quant):
    x = torch.tensor(case["x"], dtype=torch.float32)
    assert x.double().tolist() == case["x"]  # every input is exact in float32: the tie is really there
    for rows in (x, x.repeat(3, 1)):  # one row, and a batch (the CPU kernel splits rows across threads)
        q, s = quant(rows)
        assert (q.reshape(-1, x.shape[0]) == torch.tensor(case["codes"], dtype=torch.int8)).all()
        assert {int(b) & 0xFFFFFFFF for b in s.reshape(-1).view(torch.int32)} == {int(case["scale_f32_bits"], 16)}


def test_inputs_that_require_grad_are_encoded_detached():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 3, 16, generator=gen)
    want_q, want_s = quantize_int8(x)
    for quant in (quantize_int8, quantize_int8_torch):
        leaf = x.clone().requires_grad_()
        for inp in (leaf, leaf * 1.0):  # a leaf and a non-leaf with a graph behind it
            q, s = quant(inp)
            assert torch.equal(q, want_q) and torch.equal(s, want_s)
            assert not q.requires_grad and not s.requires_grad
    for fmt in KvStorageFormat:  # the 4-bit format's encode is its F16 rows (sealing is its pool's)
        parts = fmt.spec.encode(x.clone().requires_grad_())
        assert all(t.grad_fn is None and not t.requires_grad for t in parts)
        assert not fmt.spec.decode(parts).requires_grad
    out = dequantize_int8(want_q, want_s.clone().requires_grad_())
    assert torch.equal(out, want_q.float() * want_s.unsqueeze(-1)) and not out.requires_grad


@pytest.mark.parametrize(
    "call",
    [
        lambda: dequantize_int8(torch.tensor(3, dtype=torch.int8), torch.tensor(1.0)),
        lambda: quantize_int8(torch.tensor(1.5)),
        lambda: quantize_int8_torch(torch.tensor(1.5)),
        lambda: round_to_f16(torch.tensor(1.5)),
        lambda: quantize_int8(torch.empty(2, 8, device="meta")),
        lambda: quantize_int8_torch(torch.empty(2, 8, device="meta")),
        lambda: round_to_f16(torch.empty(2, 8, device="meta")),
        lambda: dequantize_int8(torch.empty(2, 8, dtype=torch.int8, device="meta"), torch.empty(2, device="meta")),
        lambda: dequantize_int8(torch.zeros(2, 8, dtype=torch.int8), torch.empty(2, device="meta")),
        lambda: quantize_int8([1.0, 2.0]),
        lambda: dequantize_int8([1, 2], torch.ones(())),
        lambda: KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1.spec.decode((torch.zeros(2, 8, dtype=torch.int8),)),
    ],
    ids=["dequant-0d", "quant-0d", "torch-0d", "f16-0d", "quant-meta", "torch-meta", "f16-meta", "dequant-meta",
         "dequant-meta-scale", "quant-list", "dequant-list", "decode-no-scales"],
)
def test_unusable_tensors_are_refused_with_a_typed_error(call):
    with pytest.raises(ShapeMismatch):
        call()
