"""The one write path (int8kv.ops.write): split / QK-norm / RoPE / check / encode / store, for every caller.

Moved here from test_paged_cache.py, plus the rules every writer now shares: distinct slots, rows on the
pool's device, K and V encoded in one call before anything is stored, rows detached from autograd, and the
transformers cache writing through the same path.
"""

from __future__ import annotations

import pytest
import torch

import int8kv.ops.write as write_mod
from int8kv import _codec_cpu
from int8kv.cache.paged import PagedKvCache
from int8kv.codec import quantize_int8
from int8kv.errors import LayerOutOfRange, NonFiniteError, PositionOutOfRange, ShapeMismatch
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, paged_write, plan_attention
from int8kv.ops.write import prepare_qkv

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
FORMATS = [INT8, F16]


def state(cache: PagedKvCache) -> list[torch.Tensor]:
    return [p.clone() for p in cache.pool.storage() if p is not None]


def same_state(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def rope_tables(max_pos: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos(), angles.sin()


# -- append: bit-exact round trip -------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_stores_exactly_the_codec_output(fmt, dtype):
    gen = torch.Generator().manual_seed(1)
    c = PagedKvCache(8, 4, 2, 3, 16, fmt)
    slots = c.add_sequence(0, 11)
    k = (torch.randn(11, 3, 16, generator=gen) * 3).to(dtype)
    v = torch.randn(11, 3, 16, generator=gen).to(dtype)
    k[2, 1] = 0.0  # an all-zero row gets scale 1
    append_paged_kv(c, 1, k, v, slots)
    flat = (8 * 4, 3, 16)
    for x, codes, scales in ((k, c.k_codes[1], c.k_scales[1]), (v, c.v_codes[1], c.v_scales[1])):
        want_codes, *want_scales = fmt.spec.encode(x)
        assert torch.equal(codes.view(flat)[slots], want_codes)
        if fmt.is_quantized:
            assert torch.equal(scales.view(flat[:2])[slots], want_scales[0])
    assert not c.k_codes[0].any()  # other layers untouched
    rk, rv = c.read_rows(1, slots)
    assert torch.equal(rk, fmt.spec.decode(fmt.spec.encode(k)))


def test_append_validates_before_writing():
    c = PagedKvCache(4, 4, 2, 2, 8)
    slots = c.add_sequence(0, 3)
    good = torch.randn(3, 2, 8)
    before = state(c)
    bad_cases = [
        (LayerOutOfRange, lambda: append_paged_kv(c, 2, good, good, slots)),
        (ShapeMismatch, lambda: append_paged_kv(c, 0, torch.randn(3, 2, 4), good, slots)),
        (ShapeMismatch, lambda: append_paged_kv(c, 0, good, torch.randn(2, 2, 8), slots)),
        (ShapeMismatch, lambda: append_paged_kv(c, 0, good, good, slots[:2])),
        (ShapeMismatch, lambda: append_paged_kv(c, 0, good.int(), good, slots)),
        (PositionOutOfRange, lambda: append_paged_kv(c, 0, good, good, torch.tensor([0, 1, 16]))),
    ]
    for err, call in bad_cases:
        with pytest.raises(err):
            call()
    assert same_state(before, state(c))


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_or_f16_overflow_writes_nothing(fmt):
    c = PagedKvCache(4, 4, 1, 2, 8, fmt)
    slots = c.add_sequence(0, 3)
    append_paged_kv(c, 0, torch.randn(3, 2, 8), torch.randn(3, 2, 8), slots)
    before = state(c)
    good = torch.randn(3, 2, 8)
    for bad_value in (float("nan"), float("inf"), 1e6):  # 1e6 overflows float16
        bad = good.clone()
        bad[2, 1, 5] = bad_value
        with pytest.raises(NonFiniteError):
            append_paged_kv(c, 0, good, bad, slots)  # K is fine, V is not: K must not be stored either
        assert same_state(before, state(c))


# -- write path: split, QK-norm, RoPE ----------------------------------------------------------------------
def rope64(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Float64 RoPE written from the definition, one pair at a time."""
    out = x.clone()
    half = x.shape[-1] // 2
    for i in range(half):
        a, b = (i, i + half) if style == "neox" else (2 * i, 2 * i + 1)
        c, s = cos[pos, i][:, None], sin[pos, i][:, None]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def rms64(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    if w is None:
        return x
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_write_matches_float64_formula(style, qk_norm, fmt):
    gen = torch.Generator().manual_seed(2)
    hq, hkv, d, tokens = 4, 2, 16, 7
    c = PagedKvCache(8, 4, 2, hkv, d, fmt)
    c.add_sequence(0, 3)
    slots = c.grow(0, tokens)
    positions = torch.arange(3, 3 + tokens)
    cos, sin = rope_tables(64, d)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)
    qw = torch.rand(d, generator=gen) + 0.5 if qk_norm else None
    kw = torch.rand(d, generator=gen) + 0.5 if qk_norm else None
    q = paged_write(c, 1, qkv, positions, slots, cos.float(), sin.float(), hq, qw, kw, 1e-6, style)

    x = qkv.double()
    q64 = x[:, : hq * d].reshape(tokens, hq, d)
    k64 = x[:, hq * d : (hq + hkv) * d].reshape(tokens, hkv, d)
    v64 = x[:, (hq + hkv) * d :].reshape(tokens, hkv, d)
    q64 = rope64(rms64(q64, qw, 1e-6), positions, cos.float().double(), sin.float().double(), style)
    k64 = rope64(rms64(k64, kw, 1e-6), positions, cos.float().double(), sin.float().double(), style)
    assert q.dtype == torch.float32 and q.shape == (tokens, hq, d)
    assert (q.double() - q64).abs().max() / q64.abs().max() < 1e-5

    # What is stored is exactly the codec applied to the float32 k and v of the shared write path ...
    _, k32, v32 = prepare_qkv(c, qkv, positions, cos.float(), sin.float(), hq, qw, kw, 1e-6, style)
    assert (k32.double() - k64).abs().max() / k64.abs().max() < 1e-5
    rk, rv = c.read_rows(1, slots)
    assert torch.equal(rk, fmt.spec.decode(fmt.spec.encode(k32)))
    assert torch.equal(rv, fmt.spec.decode(fmt.spec.encode(v32)))
    # ... which is within the format's rounding of the float64 formula.
    # Half a quantization step (INT8) on top of the float16 rounding both formats start with.
    tol = (0.5 / 127 if fmt.is_quantized else 0.0) + 2.0**-11
    assert ((rk.double() - k64).abs() / k64.abs().amax(-1, keepdim=True)).max() <= tol * 1.01
    assert ((rv.double() - v64).abs() / v64.abs().amax(-1, keepdim=True)).max() <= tol * 1.01


def test_rope_at_position_zero_is_identity_and_preserves_norm():
    c = PagedKvCache(4, 4, 1, 1, 8, F16)
    slots = c.add_sequence(0, 2)
    cos, sin = rope_tables(16, 8)
    qkv = torch.randn(2, 3 * 8)
    for style in ("neox", "gptj"):
        q = paged_write(c, 0, qkv, torch.tensor([0, 9]), slots, cos, sin, 1, rope_style=style)
        assert torch.allclose(q[0, 0], qkv[0, :8], atol=1e-6)
        assert torch.allclose(q[1, 0].norm(), qkv[1, :8].norm(), rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_write_non_finite_writes_nothing(fmt):
    c = PagedKvCache(4, 4, 1, 2, 8, fmt)
    slots = c.add_sequence(0, 2)
    cos, sin = rope_tables(8, 8)
    before = state(c)
    for col in (3, 4 * 8 + 1, 6 * 8 - 1):  # in q, in k, in v
        qkv = torch.randn(2, 6 * 8)
        qkv[1, col] = float("nan")
        with pytest.raises(NonFiniteError):
            paged_write(c, 0, qkv, torch.tensor([0, 1]), slots, cos, sin, 2)
    qkv = torch.randn(2, 6 * 8)
    qkv[0, 5 * 8] = 7e4  # finite in float32, overflows float16 in V
    with pytest.raises(NonFiniteError):
        paged_write(c, 0, qkv, torch.tensor([0, 1]), slots, cos, sin, 2)
    bad_cos = cos.clone()
    bad_cos[1, 2] = float("inf")  # a RoPE row that position 1 uses
    with pytest.raises(NonFiniteError):
        paged_write(c, 0, torch.randn(2, 6 * 8), torch.tensor([0, 1]), slots, bad_cos, sin, 2)
    assert same_state(before, state(c))
    bad_cos = cos.clone()
    bad_cos[5, 0] = float("nan")  # a row no token here uses: nothing to refuse
    paged_write(c, 0, torch.randn(2, 6 * 8), torch.tensor([0, 1]), slots, bad_cos, sin, 2)
    assert not same_state(before, state(c))


def test_paged_write_shape_errors():
    c = PagedKvCache(4, 4, 1, 2, 8)
    slots = c.add_sequence(0, 2)
    cos, sin = rope_tables(8, 8)
    qkv = torch.randn(2, 6 * 8)
    pos = torch.tensor([0, 1])
    before = state(c)
    bad_cases = [
        (ShapeMismatch, lambda: paged_write(c, 0, qkv[:, :-1], pos, slots, cos, sin, 2)),
        (ShapeMismatch, lambda: paged_write(c, 0, qkv, pos, slots, cos, sin, 3)),  # 3 q heads, 2 kv heads
        (ShapeMismatch, lambda: paged_write(c, 0, qkv, pos[:1], slots, cos, sin, 2)),
        (ShapeMismatch, lambda: paged_write(c, 0, qkv, pos, slots, cos[:, :3], sin, 2)),
        (ShapeMismatch, lambda: paged_write(c, 0, qkv, pos, slots, cos, sin, 2, rope_style="llama")),
        (ShapeMismatch, lambda: paged_write(c, 0, qkv, pos, slots, cos, sin, 2, torch.ones(4))),
        (ShapeMismatch, lambda: paged_write(c, 0, qkv, pos, slots[:1], cos, sin, 2)),
        (PositionOutOfRange, lambda: paged_write(c, 0, qkv, torch.tensor([0, 8]), slots, cos, sin, 2)),
        (LayerOutOfRange, lambda: paged_write(c, 1, qkv, pos, slots, cos, sin, 2)),
    ]
    for err, call in bad_cases:
        with pytest.raises(err):
            call()
    assert same_state(before, state(c))


# -- rules shared by every writer ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_duplicate_slots_are_refused_on_every_backend(backend):
    c = PagedKvCache(4, 4, 1, 2, 8)
    c.add_sequence(0, 3)
    before = state(c)
    rows = torch.randn(3, 2, 8)
    with pytest.raises(ShapeMismatch, match="distinct"):
        append_paged_kv(c, 0, rows, rows, torch.tensor([0, 1, 1]), backend=backend)
    with pytest.raises(PositionOutOfRange):
        append_paged_kv(c, 0, rows, rows, torch.tensor([0, -1, 2]), backend=backend)
    assert same_state(before, state(c))


def test_rows_on_another_device_are_refused_not_moved():
    c = PagedKvCache(4, 4, 1, 2, 8)
    slots = c.add_sequence(0, 3)
    good = torch.randn(3, 2, 8)
    before = state(c)
    with pytest.raises(ShapeMismatch, match="device|on meta"):
        append_paged_kv(c, 0, good, good.to("meta"), slots)
    with pytest.raises(ShapeMismatch):
        append_paged_kv(c, 0, good, good, slots.to("meta"))
    assert same_state(before, state(c))


def test_int64_slots_beyond_int32_are_refused():
    c = PagedKvCache(4, 4, 1, 2, 8)
    c.add_sequence(0, 2)
    rows = torch.randn(2, 2, 8)
    with pytest.raises(PositionOutOfRange):
        append_paged_kv(c, 0, rows, rows, torch.tensor([0, 2**32 + 1]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_k_and_v_are_encoded_in_one_call(fmt, monkeypatch):
    calls = []
    real = type(fmt.spec).encode
    name = "quantize_store" if fmt is INT8 else "f16_store"  # the format's compiled store
    real_fused = getattr(_codec_cpu, name)

    def counting(self, x):
        calls.append(tuple(x.shape))
        return real(self, x)

    def counting_fused(k, *rest):
        calls.append(("fused",) + tuple(k.shape))
        return real_fused(k, *rest)

    monkeypatch.setattr(type(fmt.spec), "encode", counting)
    monkeypatch.setattr(_codec_cpu, name, counting_fused)
    c = PagedKvCache(4, 4, 1, 2, 8, fmt)
    slots = c.add_sequence(0, 3)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    append_paged_kv(c, 0, k, v, slots)
    # A few rows on the CPU: encoded and stored, K and V, in one call of the format's compiled store.
    assert calls == [("fused", 3, 2, 8)]
    rk, rv = c.read_rows(0, slots)
    assert torch.equal(rk, fmt.spec.decode(fmt.spec.encode(k))) and torch.equal(rv, fmt.spec.decode(fmt.spec.encode(v)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700 x 2 x 64 > SERIAL_ELEMENTS: encode, then index_copy_
def test_int8_fused_store_equals_encode_then_store(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, dim, blocks = 2, 64, -(-2 * tokens // 16)
    fused, twostep = (PagedKvCache(blocks, 16, 1, heads, dim, INT8) for _ in range(2))
    slots = torch.randperm(blocks * 16, generator=gen)[:tokens]  # scattered slots, int64
    # [heads, tokens, dim] transposed: rows with strides, as the transformers layer hands them
    k, v = (torch.randn(heads, tokens, dim, generator=gen).mul(40).to(dtype).transpose(0, 1) for _ in range(2))
    append_paged_kv(fused, 0, k, v, slots)
    codes, scales = quantize_int8(torch.stack((k, v)))
    for t, src in zip(flat(twostep), (codes[0], scales[0], codes[1], scales[1]), strict=True):
        t.index_copy_(0, slots, src)
    assert all(torch.equal(a, b) for a, b in zip(flat(fused), flat(twostep), strict=True))
    before = [t.clone() for t in flat(fused)]
    v = v.clone()
    v[tokens - 1, 1, 3] = float("inf")  # one bad value in the last row: nothing of the call is stored
    with pytest.raises(NonFiniteError):
        append_paged_kv(fused, 0, k * 0.5, v, slots)
    assert all(torch.equal(a, b) for a, b in zip(before, flat(fused), strict=True))


def flat(cache) -> list[torch.Tensor]:
    """Layer 0's K codes, K scales, V codes, V scales by slot."""
    return [t for side in cache.pool.layer_rows(0) for t in side]


def test_rows_with_autograd_history_are_stored_as_values():
    c = PagedKvCache(4, 4, 1, 2, 8)
    slots = c.add_sequence(0, 3)
    w = torch.randn(3, 2, 8, requires_grad=True)
    k, v = w * 2, w - 1  # carry a grad_fn
    append_paged_kv(c, 0, k, v, slots)
    rk, _ = c.read_rows(0, slots)
    assert not c.k_codes[0].requires_grad and c.k_codes[0].grad_fn is None
    assert torch.equal(rk, INT8.spec.decode(INT8.spec.encode(k.detach())))


@pytest.mark.parametrize("fmt", FORMATS)
def test_planned_write_equals_single_call_write(fmt):
    """A step planned once (slots and positions checked in the plan) stores what single calls store."""
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d, tokens = 4, 2, 8, 5
    cos, sin = rope_tables(32, d)
    qkv = [torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) for _ in range(2)]
    caches = [PagedKvCache(8, 4, 2, hkv, d, fmt) for _ in range(2)]
    slots = [c.add_sequence(0, tokens) for c in caches]
    pos = torch.arange(tokens)
    tables, lens = caches[0].batch_tensors([0])
    plan = plan_attention(
        caches[0].pool, tables, lens, cu_seqlens_q=torch.tensor([0, tokens]), slots=slots[0], positions=pos,
        max_position=len(cos),
    )
    for layer in range(2):
        q_plan = paged_write(caches[0], layer, qkv[layer], None, None, cos, sin, hq, plan=plan)
        q_one = paged_write(caches[1], layer, qkv[layer], pos, slots[1], cos, sin, hq)
        assert torch.equal(q_plan, q_one)
    assert same_state(state(caches[0]), state(caches[1]))
    with pytest.raises(ShapeMismatch):  # a plan without positions cannot stand in for them
        bare = plan_attention(caches[0].pool, tables, lens, cu_seqlens_q=torch.tensor([0, tokens]))
        paged_write(caches[0], 0, qkv[0], None, None, cos, sin, hq, plan=bare)


def test_transformers_cache_writes_through_the_write_path(monkeypatch):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from int8kv.hf import Int8KvCache

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    stored = []
    real = write_mod.store_kv

    def counting(pool, layer, k, v, slots, backend):
        stored.append(k.shape[0])
        return real(pool, layer, k, v, slots, backend)

    monkeypatch.setattr(write_mod, "store_kv", counting)
    cache = Int8KvCache(model.config)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    assert stored == [2 * 5] * 3  # every layer, batch x tokens rows, through ops.write


@pytest.mark.parametrize("tokens, heads, dim", [(1, 12, 64), (3, 5, 16), (64, 2, 128), (7, 1, 2)])
def test_compiled_rotation_of_few_rows_is_torchs_bit_for_bit(tokens, heads, dim):
    """A decode step's rows rotate in one compiled loop (ops/cpu_rope.py); more rows through torch's operations.
    Both are the same arithmetic in the same order: equal bits, on contiguous rows and on a strided view (q and k
    side by side inside the packed qkv, as the write path rotates them)."""
    g = torch.Generator().manual_seed(tokens * 1000 + heads)
    packed = torch.randn(tokens, heads * dim + 5, generator=g) * 3
    strided = packed[:, : heads * dim].view(tokens, heads, dim)  # row stride heads * dim + 5
    cos, sin = (torch.randn(80, dim // 2, generator=g) for _ in range(2))
    positions = torch.randint(0, 80, (tokens,), generator=g)
    for x in (strided, strided.contiguous()):
        got = write_mod.apply_rope(x, positions, cos, sin)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        a, b = x.chunk(2, dim=-1)
        want = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
        assert got.is_contiguous() and torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32))




@pytest.mark.parametrize("tokens, hq, hkv, d", [(1, 9, 3, 64), (8, 4, 2, 16), (64, 2, 1, 128), (3, 6, 3, 2)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_planned_few_rows_take_the_compiled_route_with_the_general_routes_bits(tokens, hq, hkv, d, fmt, monkeypatch):
    """A planned step of few rows without QK-norm ("neox") splits, rotates and stores in two compiled calls (both
    formats have a compiled store), never through prepare_qkv; its q and every stored part are the general
    route's bit for bit (that route forced by the compiled one declining), on ragged shapes and positions."""
    import int8kv.ops as ops_mod

    gen = torch.Generator().manual_seed(tokens * 100 + d)
    cos, sin = rope_tables(200, d)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 4
    positions = torch.randperm(200, generator=gen)[:tokens]
    general = []
    real_prepare = ops_mod.prepare_qkv
    monkeypatch.setattr(ops_mod, "prepare_qkv", lambda *a, **k: general.append(1) or real_prepare(*a, **k))
    out, states = [], []
    for route in ("compiled", "general"):
        if route == "general":
            monkeypatch.setattr(write_mod, "split_rotate_store", lambda *a, **k: None)
        cache = PagedKvCache(tokens + 2, 4, 1, hkv, d, fmt)
        slots = torch.tensor([cache.add_sequence(s, 1)[0] for s in range(tokens)])
        tables, lens = cache.batch_tensors(list(range(tokens)))
        plan = plan_attention(cache.pool, tables, lens, cu_seqlens_q=torch.arange(tokens + 1, dtype=torch.int32),
                              slots=slots, positions=positions, max_position=len(cos))  # fmt: skip
        general.clear()
        out.append(paged_write(cache, 0, qkv, None, None, cos, sin, hq, plan=plan))
        states.append(state(cache))
        assert len(general) == (0 if route == "compiled" else 1)
    assert out[0].shape == (tokens, hq, d) and torch.equal(out[0].view(torch.int32), out[1].view(torch.int32))
    assert same_state(*states)


def test_the_compiled_route_refuses_what_the_general_route_refuses_and_stores_nothing(monkeypatch):
    """NaN in q, k or v (qkv), an inf RoPE entry at a used position (q after the rotation) and a K value beyond
    float16 (the store): NonFiniteError with the general route's message, the cache unchanged."""
    hq, hkv, d, tokens = 4, 2, 8, 3
    cos, sin = rope_tables(16, d)
    bad_cos = cos.clone()
    bad_cos[2, 1] = float("inf")
    cases = []
    for col in (3, hq * d + 1, (hq + hkv) * d + 5):  # in q, in k, in v
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
        qkv[1, col] = float("nan")
        cases.append((qkv, cos))
    cases.append((torch.randn(tokens, (hq + 2 * hkv) * d), bad_cos))
    big = torch.randn(tokens, (hq + 2 * hkv) * d)
    big[2, hq * d + 3] = 7e4  # finite in float32; K overflows float16 after the rotation (position 0 or not)
    big[2, hq * d + 3 + d // 2] = 7e4
    cases.append((big, cos))
    messages = {}
    for route in ("compiled", "general"):
        if route == "general":
            monkeypatch.setattr(write_mod, "split_rotate_store", lambda *a, **k: None)
        cache = PagedKvCache(8, 4, 1, hkv, d, INT8)
        slots = torch.tensor([cache.add_sequence(s, 1)[0] for s in range(tokens)])
        tables, lens = cache.batch_tensors(list(range(tokens)))
        plan = plan_attention(cache.pool, tables, lens, cu_seqlens_q=torch.arange(tokens + 1, dtype=torch.int32),
                              slots=slots, positions=torch.tensor([0, 2, 5]), max_position=len(cos))  # fmt: skip
        before = state(cache)
        for i, (qkv, table) in enumerate(cases):
            plan_i = plan_attention(cache.pool, tables, lens, cu_seqlens_q=plan.cu_seqlens_q, slots=slots,
                                    positions=plan.positions, max_position=len(cos))  # fmt: skip
            with pytest.raises(NonFiniteError) as e:
                paged_write(cache, 0, qkv, None, None, table, sin, hq, plan=plan_i)
            messages.setdefault(i, set()).add(str(e.value))
            assert same_state(before, state(cache))
    assert all(len(m) == 1 for m in messages.values()), messages


def test_rms_norm_is_the_written_out_expression_bit_for_bit():
    """write.rms_norm of float32 rows (torch's rms_norm) equals x * rsqrt(mean(x^2) + eps) * w bit for bit, on
    ragged shapes (decode rows, prefill chunks, QK-norm's per-head rows), and the float64 formula within float32
    rounding; other dtypes keep the expression."""
    g = torch.Generator().manual_seed(11)
    for shape in [(1, 576), (3, 960), (8, 64), (517, 576), (5, 9, 64), (2, 3, 128), (1, 1, 2)]:
        x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 5
        w = torch.randn(shape[-1], generator=g)
        eps = float(torch.rand(1, generator=g)) * 1e-4 + 1e-6
        got = write_mod.rms_norm(x, w, eps)
        want = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), shape
        x64 = x.double()
        ref = x64 / torch.sqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps) * w.double()
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6), shape
    xb = torch.randn(4, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g)
    assert torch.equal(write_mod.rms_norm(xb, w, 1e-6), xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_few_rows_by_slot_take_the_compiled_store_with_the_pools_bits(tokens, fmt, monkeypatch):
    """append_rows of at most 64 float32 rows (contiguous or a transposed view, as the engine's transformers path
    hands them) stores through the format's compiled store, not the pool's encode_rows, the same codes and scales
    as encode_rows; a row beyond float16 is refused with nothing stored; float16 rows keep the pool's route."""
    from int8kv.cache.pool import KvPool
    from int8kv.cache.state import KvLayout

    g = torch.Generator().manual_seed(tokens)
    packed = torch.randn(1, 3, tokens, 16, generator=g) * 5
    k, v = packed[0].transpose(0, 1), torch.randn(tokens, 3, 16, generator=g)
    slots = torch.randperm(80, generator=g)[:tokens]
    routes = []
    real = KvPool.encode_rows
    monkeypatch.setattr(KvPool, "encode_rows", lambda self, *a: routes.append(1) or real(self, *a))
    pools = [KvPool(KvLayout(2, 3, 16, fmt), 10, 8) for _ in range(2)]
    write_mod.append_rows(pools[0], 1, k, v, slots, backend="cpu")
    assert routes == []
    real(pools[1], 1, slots, k, v)
    assert all(torch.equal(a, b) for a, b in zip(pools[0].storage(), pools[1].storage(), strict=True))
    before = [t.clone() for t in pools[0].storage()]
    bad = v.clone()
    bad[-1, 2, 3] = 7e4
    with pytest.raises(NonFiniteError):
        write_mod.append_rows(pools[0], 0, k, bad, slots, backend="cpu")
    assert all(torch.equal(a, b) for a, b in zip(before, pools[0].storage(), strict=True))
    write_mod.append_rows(pools[0], 0, k.half(), v.half(), slots, backend="cpu")
    assert routes == [1]
