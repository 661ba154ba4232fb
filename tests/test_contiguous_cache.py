import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from int8kv import (
    CapacityExceeded,
    HeadOutOfRange,
    KvCacheError,
    KvStorageFormat,
    LayerOutOfRange,
    NonFiniteError,
    PositionOutOfRange,
    QuantizedKvCache,
    ShapeMismatch,
    dequantize_int8,
    quantize_int8,
)

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
L, CAP, H, D = 3, 12, 2, 16


def step(gen, tokens=None):
    shape = (H * D,) if tokens is None else (tokens, H, D)
    return [torch.randn(shape, generator=gen) for _ in range(L)], [torch.randn(shape, generator=gen) for _ in range(L)]


def snapshot(cache):
    out = [cache.seq_len]
    for layer in cache.layers:
        for t in (layer.k_codes, layer.v_codes, layer.k_scales, layer.v_scales):
            out.append(None if t is None else t.clone())
    return out


def same(a, b):
    pairs = zip(a[1:], b[1:], strict=True)
    return a[0] == b[0] and all((x is None and y is None) or torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("fmt", [INT8, F16])
def test_push_steps_and_prefill_read_back_exactly(fmt):
    gen = torch.Generator().manual_seed(1)
    cache = QuantizedKvCache(L, CAP, H, D, format=fmt)
    pk, pv = step(gen, tokens=5)
    cache.push_step(pk, pv)
    steps = [step(gen) for _ in range(3)]
    for k, v in steps:
        cache.push_step(k, v)
    assert cache.seq_len == 8 and cache.capacity == CAP
    for layer in range(L):
        want_k = torch.cat([pk[layer]] + [s[0][layer].reshape(1, H, D) for s in steps])
        want_v = torch.cat([pv[layer]] + [s[1][layer].reshape(1, H, D) for s in steps])
        if fmt is INT8:
            want_k, want_v = dequantize_int8(*quantize_int8(want_k)), dequantize_int8(*quantize_int8(want_v))
        else:
            want_k, want_v = want_k.half().float(), want_v.half().float()
        assert torch.equal(cache.keys(layer), want_k) and torch.equal(cache.values(layer), want_v)
        assert torch.equal(cache.get_key(layer, 6, 1), want_k[6, 1])
        assert torch.equal(cache.get_value(layer, 0, 0), want_v[0, 0])
        # Error against the float64 input is within half a step of each row's scale.
        x64 = torch.cat([pk[layer]] + [s[0][layer].reshape(1, H, D) for s in steps]).double()
        # INT8: half a code step, plus the float16 rounding first (2^-11 relative, at most 127 steps).
        # F16: half a float16 spacing (2^-10 relative at most), 2^-25 absolute among subnormals.
        if fmt is INT8:
            step_size = x64.abs().amax(-1, keepdim=True) / 127
            bound = step_size * (0.5 + 127 * 2.0**-11 + 1e-6)
        else:
            bound = x64.abs() * 2.0**-11 + 2.0**-25
        assert bool(((cache.keys(layer).double() - x64).abs() <= bound).all())


@pytest.mark.parametrize("shape", [(H * D,), (H, D)])
def test_step_shapes_accepted(shape):
    cache = QuantizedKvCache(L, CAP, H, D)
    cache.push_step([np.ones(shape, np.float32)] * L, [torch.ones(shape)] * L)
    assert cache.seq_len == 1
    assert torch.equal(cache.get_key(2, 0, 1), torch.ones(D))


def test_memory_accounting_and_compression():
    cache = QuantizedKvCache(L, CAP, H, D)
    assert cache.compression_ratio() == pytest.approx(64 / 20)  # 16 fp32 = 64 bytes vs 16 codes + 4
    assert cache.total_memory_bytes() == 0
    gen = torch.Generator().manual_seed(2)
    cache.push_step(*step(gen, tokens=4))
    assert cache.total_memory_bytes() == L * 4 * 2 * H * (D + 4)
    assert cache.total_fp32_memory_bytes() == L * 4 * 2 * H * D * 4
    assert cache.compression_ratio() == pytest.approx(64 / 20)
    f16 = QuantizedKvCache(L, CAP, H, D, format=F16)
    f16.push_step(*step(gen, tokens=4))
    assert f16.compression_ratio() == pytest.approx(2.0)


def test_no_hidden_full_precision_copy():
    cache = QuantizedKvCache(L, CAP, H, D)
    gen = torch.Generator().manual_seed(3)
    cache.push_step(*step(gen, tokens=3))
    for layer in cache.layers:
        held = [t for v in vars(layer).values() for t in (v if isinstance(v, tuple) else (v,))]
        tensors = [t for t in held if isinstance(t, torch.Tensor)]
        assert sorted((str(t.dtype), tuple(t.shape)) for t in tensors) == sorted(
            [("torch.int8", (CAP, H, D))] * 2 + [("torch.float32", (CAP, H))] * 2
        )


def test_truncate_and_reset():
    gen = torch.Generator().manual_seed(4)
    cache = QuantizedKvCache(L, CAP, H, D)
    cache.push_step(*step(gen, tokens=6))
    kept = cache.keys(1)[:4].clone()
    cache.truncate(4)
    assert cache.seq_len == 4 and torch.equal(cache.keys(1), kept)
    k, v = step(gen)
    cache.push_step(k, v)
    assert torch.equal(cache.get_key(0, 4, 0), dequantize_int8(*quantize_int8(k[0].reshape(H, D)))[0])
    with pytest.raises(PositionOutOfRange):
        cache.truncate(6)
    cache.reset()
    assert cache.seq_len == 0 and cache.total_memory_bytes() == 0


def test_errors_are_typed():
    cache = QuantizedKvCache(L, 2, H, D)
    gen = torch.Generator().manual_seed(5)
    cache.push_step(*step(gen))
    with pytest.raises(LayerOutOfRange):
        cache.get_key(L, 0, 0)
    with pytest.raises(PositionOutOfRange):
        cache.get_value(0, 1, 0)
    with pytest.raises(HeadOutOfRange):
        cache.get_key(0, 0, H)
    with pytest.raises(LayerOutOfRange):
        cache.push_step(*[x[:-1] for x in step(gen)])
    with pytest.raises(CapacityExceeded):
        cache.push_step(*step(gen, tokens=2))
    with pytest.raises(ShapeMismatch):
        cache.push_step([torch.ones(H * D + 1)] * L, [torch.ones(H * D + 1)] * L)
    for err in (LayerOutOfRange, PositionOutOfRange, HeadOutOfRange, CapacityExceeded, ShapeMismatch, NonFiniteError):
        assert issubclass(err, KvCacheError)


def bad_step(kind, gen, layer, free):
    k, v = step(gen, tokens=2)
    if kind == "nan":
        k[layer][1, 0, 3] = float("nan")
    elif kind == "inf":
        v[layer][0, 1, 0] = float("inf")
    elif kind == "overflow":
        v[layer][1, 1, 1] = 1e5
    elif kind == "shape":
        k[layer] = torch.ones(2, H, D + 1)
    elif kind == "tokens":
        v[layer] = torch.ones(3, H, D)
    elif kind == "ragged":
        k[layer], v[layer] = torch.ones(1, H, D), torch.ones(1, H, D)
    elif kind == "layers":
        k, v = k[:-1], v[:-1]
    elif kind == "capacity":
        k, v = step(gen, tokens=free + 1)
    elif kind == "dtype":
        k[layer] = torch.ones(2, H, D, dtype=torch.int64)
    return k, v


@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["ok", "nan", "inf", "overflow", "shape", "tokens", "ragged", "layers", "capacity", "dtype"]
            ),
            st.integers(0, L - 1),
        ),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from([INT8, F16]),
    st.integers(0, 2**31 - 1),
)
def test_every_error_path_leaves_the_cache_unchanged(ops, fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = QuantizedKvCache(L, CAP, H, D, format=fmt)
    for kind, layer in ops:
        if kind == "ok":
            if cache.seq_len < CAP:
                cache.push_step(*step(gen))
            continue
        before = snapshot(cache)
        with pytest.raises(KvCacheError):
            cache.push_step(*bad_step(kind, gen, layer, CAP - cache.seq_len))
        assert same(before, snapshot(cache))


@pytest.mark.parametrize("fmt", [INT8, F16])
def test_pushes_store_values_not_autograd_graphs(fmt):
    import gc
    import weakref

    gen = torch.Generator().manual_seed(6)
    cache = QuantizedKvCache(L, CAP, H, D, format=fmt)
    plain = QuantizedKvCache(L, CAP, H, D, format=fmt)
    leaf = torch.randn(2, H, D, generator=gen, requires_grad=True)
    alive = weakref.ref(leaf)
    for _ in range(3):
        k, v = step(gen, tokens=2)
        plain.push_step(k, v)
        cache.push_step([x.requires_grad_() * 1.0 for x in k], [x + 0 * leaf for x in v])
    for layer in cache.layers:
        for t in (layer.k_codes, layer.v_codes, layer.k_scales, layer.v_scales):
            assert t is None or (t.grad_fn is None and not t.requires_grad)
    assert not cache.keys(0).requires_grad and not cache.get_value(1, 5, 1).requires_grad
    assert same(snapshot(cache), snapshot(plain))  # the same values as from plain tensors
    del leaf, k, v
    gc.collect()
    assert alive() is None  # nothing in the cache keeps the inputs' graph (and its leaf) alive


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c: c.get_key(0, True, 1), PositionOutOfRange),  # a bool would be taken as a mask
        (lambda c: c.get_key(0, 1, False), HeadOutOfRange),
        (lambda c: c.get_value(True, 0, 0), LayerOutOfRange),
        (lambda c: c.get_key(0, 1.0, 0), PositionOutOfRange),
        (lambda c: c.get_key(0, None, 0), PositionOutOfRange),
        (lambda c: c.get_value(0, 0, 0.5), HeadOutOfRange),
        (lambda c: c.get_key(0, torch.tensor([1]), 0), PositionOutOfRange),
        (lambda c: c.get_key(0, torch.tensor(1.0), 0), PositionOutOfRange),
        (lambda c: c.get_key(0, torch.tensor(True), 0), PositionOutOfRange),
        (lambda c: c.get_key(0, np.bool_(True), 0), PositionOutOfRange),
        (lambda c: c.get_key(0, "1", 0), PositionOutOfRange),
        (lambda c: c.keys(None), LayerOutOfRange),
        (lambda c: c.values(1.5), LayerOutOfRange),
        (lambda c: c.truncate(2.5), PositionOutOfRange),
        (lambda c: c.truncate(None), PositionOutOfRange),
        (lambda c: c.truncate(True), PositionOutOfRange),
        (lambda c: c.layers[0].truncate(1.0), PositionOutOfRange),
        (lambda c: c.push_step(None, None), ShapeMismatch),
        (lambda c: c.push_step([None] * L, [None] * L), ShapeMismatch),
        (lambda c: c.push_step([["a"] * H * D] * L, [["a"] * H * D] * L), ShapeMismatch),
    ],
)
def test_bad_indices_raise_typed_errors_and_change_nothing(call, error):
    gen = torch.Generator().manual_seed(8)
    cache = QuantizedKvCache(L, CAP, H, D)
    cache.push_step(*step(gen, tokens=4))
    before = snapshot(cache)
    with pytest.raises(error, match="must be|outside"):
        call(cache)
    assert same(before, snapshot(cache))
    # Still usable: the next push lands at position 4 and reads back.
    k, v = step(gen)
    cache.push_step(k, v)
    assert cache.seq_len == 5
    assert torch.equal(cache.get_key(2, 4, 1), dequantize_int8(*quantize_int8(k[2].reshape(H, D)))[1])


def test_integer_like_indices_are_accepted():
    gen = torch.Generator().manual_seed(9)
    cache = QuantizedKvCache(L, CAP, H, D)
    cache.push_step(*step(gen, tokens=4))
    want = cache.get_key(1, 3, 1)
    assert want.shape == (D,)
    for index in ((np.int64(1), np.int32(3), np.int8(1)), (torch.tensor(1), torch.tensor(3, dtype=torch.int32), 1)):
        assert torch.equal(cache.get_key(*index), want)
    cache.truncate(torch.tensor(2))
    assert cache.seq_len == 2
    cache.truncate(np.int64(1))
    assert cache.seq_len == 1


@pytest.mark.parametrize(
    "args", [(2.0, CAP, H, D), (L, 3.5, H, D), (L, CAP, True, D), (L, CAP, H, None), (L, CAP, H, "16")]
)
def test_constructor_sizes_are_checked_ints(args):
    with pytest.raises(ShapeMismatch, match="must be an int"):
        QuantizedKvCache(*args)
