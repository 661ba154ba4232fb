"""PagedKvCache: layout, sizing, the write path (split / QK-norm / RoPE / encode), copy-on-write of real data."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from int8kv.cache.paged import PagedKvCache, tokens_per_format
from int8kv.codec import encode
from int8kv.errors import (
    KvPoolExhausted,
    LayerOutOfRange,
    NonFiniteError,
    PositionOutOfRange,
    ShapeMismatch,
)
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, paged_write
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


# -- layout and sizing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_matches_design(fmt):
    c = PagedKvCache(5, 8, 3, 2, 16, fmt)
    assert len(c.k_codes) == len(c.v_codes) == len(c.k_scales) == 3
    for layer in range(3):
        assert c.k_codes[layer].shape == (5, 8, 2, 16) and c.k_codes[layer].dtype == fmt.code_dtype
        if fmt.is_quantized:
            assert c.k_scales[layer].shape == (5, 8, 2) and c.k_scales[layer].dtype == torch.float32
        else:
            assert c.k_scales[layer] is None and c.v_scales[layer] is None
    assert c.memory_bytes() == 5 * 8 * fmt.bytes_per_token(3, 2, 16)


def test_sizing_helpers():
    per_block = 16 * INT8.bytes_per_token(4, 8, 128)
    assert PagedKvCache.blocks_for_memory(10 * per_block + 5, 16, 4, 8, 128, INT8) == 10
    assert PagedKvCache.tokens_for_memory(10 * per_block + 5, 4, 8, 128, INT8, block_size=16) == 160
    budget = 1 << 30
    caps = tokens_per_format(budget, 32, 8, 128)
    assert set(caps) == set(KvStorageFormat)
    # INT8 rows are 128 + 4 bytes against 256 for F16: nearly twice the tokens.
    assert caps[INT8] / caps[F16] == pytest.approx(256 / 132, rel=0.01)
    c = PagedKvCache.for_memory(budget // 64, 16, 2, 2, 64, F16)
    assert c.memory_bytes() <= budget // 64 < c.memory_bytes() + PagedKvCache.bytes_per_block(16, 2, 2, 64, F16)


def test_constructor_rejects_bad_shapes():
    with pytest.raises(ShapeMismatch):
        PagedKvCache(0, 16, 1, 1, 8)
    with pytest.raises(ValueError):
        PagedKvCache(4, 16, 1, 1, 8, "nope")


def test_batch_tensors_are_padded_int32():
    c = PagedKvCache(16, 4, 1, 1, 8)
    c.add_sequence("a", 9)
    c.add_sequence("b", 2)
    tables, lens = c.batch_tensors(["a", "b"])
    assert tables.dtype == lens.dtype == torch.int32
    assert tables.shape == (2, 3) and lens.tolist() == [9, 2]
    assert tables[0].tolist() == c.block_table("a") and tables[1].tolist() == c.block_table("b") + [0, 0]


def test_add_sequence_exhaustion_is_typed():
    c = PagedKvCache(2, 4, 1, 1, 8)
    with pytest.raises(KvPoolExhausted):
        c.add_sequence(0, 9)
    assert c.num_free_blocks == 2


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
        want_codes, want_scales = encode(fmt, x)
        assert torch.equal(codes.view(flat)[slots], want_codes)
        if fmt.is_quantized:
            assert torch.equal(scales.view(flat[:2])[slots], want_scales)
    assert not c.k_codes[0].any()  # other layers untouched
    rk, rv = c.read_rows(1, slots)
    from int8kv.codec import decode

    assert torch.equal(rk, decode(fmt, *encode(fmt, k)))


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
    from int8kv.codec import decode

    assert torch.equal(rk, decode(fmt, *encode(fmt, k32)))
    assert torch.equal(rv, decode(fmt, *encode(fmt, v32)))
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


# -- copy-on-write with real data ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_fork_copies_codes_and_scales_of_every_layer(fmt):
    gen = torch.Generator().manual_seed(3)
    c = PagedKvCache(8, 4, 3, 2, 8, fmt)
    slots = c.add_sequence("p", 6)
    for layer in range(3):
        append_paged_kv(c, layer, torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), slots)
    parent_rows = [c.read_rows(layer, c.slots("p")) for layer in range(3)]
    c.fork("p", "c")
    new_slot = c.grow("c", 1)
    assert c.block_table("c")[0] == c.block_table("p")[0]  # the full block is still shared
    assert c.block_table("c")[1] != c.block_table("p")[1]  # the partial one was copied
    for layer in range(3):
        # The child sees the parent's 6 rows in its own copy, for every layer, codes and scales alike.
        k, v = c.read_rows(layer, c.slots("c", 0, 6))
        assert torch.equal(k, parent_rows[layer][0]) and torch.equal(v, parent_rows[layer][1])
        append_paged_kv(c, layer, torch.full((1, 2, 8), 5.0), torch.full((1, 2, 8), -5.0), new_slot)
        k, v = c.read_rows(layer, c.slots("p"))
        assert torch.equal(k, parent_rows[layer][0]) and torch.equal(v, parent_rows[layer][1])


class CacheContentsMachine(RuleBasedStateMachine):
    """Every sequence reads back exactly the rows written to it, whatever add/grow/fork/free came before."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.c = PagedKvCache(10, 4, 2, 1, 4, F16)
        self.shadow: dict[int, list[float]] = {}  # per sequence: the value written at each position
        self.next_id = 0
        self.counter = 0.0

    def _write(self, sid: int, start: int, slots: torch.Tensor) -> None:
        n = len(slots)
        values = [self.counter + i for i in range(n)]  # small integers: exact in float16
        self.counter += n
        rows = torch.tensor(values).reshape(n, 1, 1).expand(n, 1, 4)
        for layer in range(2):
            append_paged_kv(self.c, layer, rows + layer, -rows, slots)
        self.shadow[sid][start:] = values

    @rule(target=seqs, n=st.integers(0, 9))
    def add(self, n):
        self.next_id += 1
        sid = self.next_id
        try:
            slots = self.c.add_sequence(sid, n)
        except KvPoolExhausted:
            return sid
        self.shadow[sid] = []
        self._write(sid, 0, slots)
        return sid

    @rule(sid=seqs, n=st.integers(1, 6))
    def grow(self, sid, n):
        if sid not in self.shadow:
            return
        start = self.c.context_len(sid)
        try:
            slots = self.c.grow(sid, n)
        except KvPoolExhausted:
            return
        self._write(sid, start, slots)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        self.next_id += 1
        if parent in self.shadow:
            self.c.fork(parent, self.next_id)
            self.shadow[self.next_id] = list(self.shadow[parent])
        return self.next_id

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.shadow:
            self.c.free(sid)
            del self.shadow[sid]

    @invariant()
    def contents_match(self):
        for sid, values in self.shadow.items():
            want = torch.tensor(values).reshape(-1, 1, 1).expand(-1, 1, 4)
            for layer in range(2):
                k, v = self.c.read_rows(layer, self.c.slots(sid))
                assert torch.equal(k, want + layer) and torch.equal(v, -want)

    def teardown(self):
        for sid in list(self.shadow):
            self.c.free(sid)
        assert self.c.num_free_blocks == self.c.num_blocks


TestCacheContentsMachine = CacheContentsMachine.TestCase


def test_sizes_scale_with_block_count():
    assert math.isclose(
        PagedKvCache(10, 16, 2, 4, 64).memory_bytes() / PagedKvCache(5, 16, 2, 4, 64).memory_bytes(), 2.0
    )
