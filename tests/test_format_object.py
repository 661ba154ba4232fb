"""The storage format as an object: the registry, the parts, the value rules, and a format whose parts are not
(codes, scale) flowing through the pool, the write path, states, files, block values and the dispatcher.

The toy format below (two 4-bit codes per byte, a float16 scale and offset per row) stands in for the next
format: it is put in place of F16's object for one test (``KvStorageFormat.spec`` patched), so nothing else in
the tree may name codes and scales for the round trips to hold.
"""

import numpy as np
import pytest
import torch

from int8kv import KvStorageFormat
from int8kv.blockstore.codec import BlockSpec, decode_block, encode_block
from int8kv.cache.paged import PagedKvCache
from int8kv.codec import round_to_f16
from int8kv.errors import ShapeMismatch, UnsupportedFormat
from int8kv.formats import F16, INT8_V1, Int8V1Format, KvFormat, Part, format_names, get_format, register
from int8kv.ops import append_paged_kv, paged_decode_attention
from int8kv.store import load_kv, save_kv

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
SPEC = KvStorageFormat.spec  # the real property, before any test patches it


def test_registry_and_enum_name_the_same_objects():
    from int8kv.formats import INT4_SINK_WINDOW_V1 as Q4W

    assert format_names() == ("f16", "int8_per_token_head_f32_scale_v1", "int4_kchan64_vtok_asym_sink4_win64_v1")
    assert KvStorageFormat.F16.spec is F16 and INT8.spec is INT8_V1 and KvStorageFormat.INT4_SINK_WINDOW_V1.spec is Q4W
    assert [get_format(f.value) for f in KvStorageFormat] == [F16, INT8_V1, Q4W]
    assert [f.is_stateful for f in KvStorageFormat] == [False, False, True]
    with pytest.raises(ValueError, match="accepted: f16, int8_per_token_head_f32_scale_v1, int4_kchan64"):
        get_format("int4")
    with pytest.raises(ValueError, match="already registered"):
        register(Int8V1Format())  # another object under a taken name
    assert register(INT8_V1) is INT8_V1  # the same object again is a no-op


def test_parts_wire_order_and_sizes():
    assert INT8_V1.part_names == ("codes", "scales")
    assert INT8_V1.tensor_names() == ("k_scales", "v_scales", "k_codes", "v_codes")  # as V1 files lay them out
    assert F16.tensor_names() == ("k_codes", "v_codes")
    assert INT8_V1.part("scales").fill == 1.0 and INT8_V1.part("codes").fill == 0.0
    with pytest.raises(KeyError, match="stores no part 'offsets'"):
        INT8_V1.part("offsets")
    for head_dim in (5, 64, 128):
        assert INT8_V1.bytes_per_row(head_dim) == head_dim + 4 and F16.bytes_per_row(head_dim) == 2 * head_dim
        assert INT8.bytes_per_token(30, 3, head_dim) == 2 * 30 * 3 * (head_dim + 4)


def test_v1_value_rules():
    top = Int8V1Format.SCALE_MAX
    above = float(np.nextafter(np.float32(top), np.float32(np.inf)))
    assert top == float(np.float32(65504.0) / np.float32(127.0))
    assert INT8_V1.value_problem("k_scales", np.array([1e-30, top], np.float32)) is None
    for bad in (0.0, -1.0, above, np.inf, np.nan):
        assert "v_scales" in INT8_V1.value_problem("v_scales", np.array([1.0, bad], np.float32))
    assert INT8_V1.value_problem("k_codes", np.array([-127, 127], np.int8)) is None
    assert "-128" in INT8_V1.value_problem("k_codes", np.array([3, -128], np.int8))
    assert F16.value_problem("k_codes", np.array([65504, -0.0, 6e-8], np.float16)) is None
    for bad in (np.inf, -np.inf, np.nan):
        assert "NaN or inf" in F16.value_problem("v_codes", np.array([1.0, bad], np.float16))
    assert INT8_V1.value_problem("k_codes", np.array([], np.int8)) is None


def test_decode_needs_every_part():
    codes, scales = INT8_V1.encode(torch.randn(3, 8))
    with pytest.raises(ShapeMismatch, match="one tensor per part"):
        INT8_V1.decode((codes,))
    with pytest.raises(ShapeMismatch, match="k scales must be torch.float32"):
        INT8_V1.check_parts((codes, scales.double()), (3,), 8, "k")


class Toy4Bit(KvFormat):
    """Asymmetric 4-bit per row: codes round((x - lo) / s) in [0, 15], two per byte (even index in the low
    nibble), s = (hi - lo) / 15 and lo in float16 (s = 1 for a constant row)."""

    name = "f16"  # stands in for F16's object in these tests only
    version = 1
    parts = (
        Part("codes", torch.uint8, lambda d: (d // 2,)),
        Part("scales", torch.float16, lambda d: (), fill=1.0),
        Part("offsets", torch.float16, lambda d: ()),
    )
    wire_order = ("offsets", "scales", "codes")
    kernel = "toy4"

    def encode(self, x):
        x = round_to_f16(x).to(torch.float32)
        lo, hi = x.amin(-1), x.amax(-1)
        scale = ((hi - lo) / 15).to(torch.float16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        lo16 = lo.to(torch.float16)
        q = torch.round((x - lo16.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
        return q[..., 0::2] | (q[..., 1::2] << 4), scale, lo16

    def _decode(self, codes, scales, offsets):
        q = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).to(torch.float32)
        return q * scales.float()[..., None] + offsets.float()[..., None]

    def value_problem(self, part, values):
        if part.endswith("scales") and not (values.size == 0 or (values > 0).all() and np.isfinite(values).all()):
            return f"{part} holds a scale that is not finite and positive"
        return None


TOY = Toy4Bit()


@pytest.fixture
def toy(monkeypatch):
    """F16's member answering with the toy format's object, for this test."""
    monkeypatch.setattr(KvStorageFormat, "spec", property(lambda fmt: TOY if fmt.value == "f16" else SPEC.fget(fmt)))
    return KvStorageFormat.F16


def test_toy_codec_against_float64(toy):
    x32 = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1)) * 3
    codes, scales, offsets = TOY.encode(x32)
    back, x = TOY.decode((codes, scales, offsets)).double(), x32.double()
    # Rounding to the 4-bit grid: at most half a step, plus float16 rounding of the input, scale and offset.
    step = scales.double()[..., None]
    assert ((back - x).abs() <= 0.5 * step + 16 * 2**-11 * x.abs().amax(-1, keepdim=True) + 1e-6).all()


def test_a_format_of_other_parts_flows_through_the_tree(toy, tmp_path):
    layers, heads, dim, block = 2, 3, 8, 4
    assert toy.bytes_per_row(dim) == dim // 2 + 2 + 2
    cache = PagedKvCache(6, block, layers, heads, dim, toy)
    shapes = [tuple(t.shape) for t in cache.pool.layer_parts(1)[0]]
    assert shapes == [(6, block, heads, 4), (6, block, heads), (6, block, heads)]
    assert cache.pool.memory_bytes() == 6 * block * layers * 2 * heads * (4 + 2 + 2)
    assert cache.k_codes[0].dtype == torch.uint8 and cache.k_scales[0].dtype == torch.float16

    gen = torch.Generator().manual_seed(2)
    n = 7  # ragged: two blocks, the second partly filled
    slots = cache.add_sequence("a", n)
    rows = {}
    for layer in range(layers):
        k, v = torch.randn(n, heads, dim, generator=gen), torch.randn(n, heads, dim, generator=gen)
        append_paged_kv(cache, layer, k, v, slots)
        rows[layer] = (k, v)
        rk, rv = cache.read_rows(layer, slots)
        assert torch.equal(rk, TOY.decode(TOY.encode(k))) and torch.equal(rv, TOY.decode(TOY.encode(v)))

    state = cache.export_state("a")
    assert set(state.groups) == {"k_codes", "v_codes", "k_scales", "v_scales", "k_offsets", "v_offsets"}
    other = PagedKvCache(6, block, layers, heads, dim, toy)
    other.import_state("b", state)
    assert other.export_state("b").equal(state)

    save_kv(tmp_path / "toy.kv", cache, seq_id="a")
    loaded = load_kv(tmp_path / "toy.kv")
    assert loaded.cache.export_state().equal(state)
    assert torch.equal(loaded.cache.keys(1), TOY.decode(TOY.encode(rows[1][0])))

    spec = BlockSpec(state.layout, block, "toy-model")
    value = encode_block(spec, state.slice(0, block), b"key-0")
    assert len(value) == spec.value_bytes(key_bytes=5)
    assert decode_block(spec, value, b"key-0").equal(state.slice(0, block))

    q = torch.randn(1, 2 * heads, dim, generator=gen)
    tables, lens = cache.batch_tensors(["a"])
    out = paged_decode_attention(cache, 1, q, tables, lens, backend="reference")
    k = TOY.decode(TOY.encode(rows[1][0])).double().repeat_interleave(2, dim=1)
    v = TOY.decode(TOY.encode(rows[1][1])).double().repeat_interleave(2, dim=1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q[0].double(), k) / dim**0.5, dim=-1)
    torch.testing.assert_close(out[0].double(), torch.einsum("ht,thd->hd", p, v), rtol=1e-5, atol=1e-6)
    with pytest.raises(UnsupportedFormat, match="cpu backend has no kernels for the f16 format"):
        paged_decode_attention(cache, 1, q, tables, lens, backend="cpu")


def test_toy_value_rules_guard_files(toy, tmp_path):
    cache = PagedKvCache(2, 4, 1, 1, 4, toy)
    slots = cache.add_sequence("a", 2)
    append_paged_kv(cache, 0, torch.randn(2, 1, 4), torch.randn(2, 1, 4), slots)
    cache.pool.part("v", "scales")[0].zero_()  # a pre-encoded write the writer would never make
    with pytest.raises(Exception, match="v_scales holds a scale that is not finite and positive"):
        save_kv(tmp_path / "bad.kv", cache, seq_id="a")
    assert not (tmp_path / "bad.kv").exists()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_4bit_tokens_for_memory_is_the_longest_sequence_that_grows_within_it(head_dim):
    from itertools import accumulate

    from int8kv.formats import INT4_SINK_WINDOW_V1 as Q4W

    layers, heads, top = 3, 2, 1500
    cost = [layers * heads * Q4W.stored_bytes(n, head_dim) for n in range(top + 1)]
    peak = list(accumulate(cost, max))  # a sequence passes every length below its own
    assert peak == [layers * heads * Q4W.peak_bytes(n, head_dim) for n in range(top + 1)]
    assert cost[128] < cost[127]  # sealing a page frees its F16 rows: the stored form alone is not monotonic
    # budgets around the sinks, the window, a first sealed page and later ones, each checked by brute force
    for budget in sorted({0, 1, cost[3], cost[4] - 1, cost[127], cost[127] - 1, cost[500] + 7, peak[1200]}):
        want = max(n for n in range(top + 1) if peak[n] <= budget)
        assert Q4W.tokens_for_memory(budget, layers, heads, head_dim) == want, budget
