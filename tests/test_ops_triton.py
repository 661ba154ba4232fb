"""Triton paged kernels: compiled on a GPU, under the Triton interpreter on CPU tensors otherwise.

Attention is checked against the float64 reference (int8kv.ops.reference) over the same stored K/V, so the
only error measured is the kernel's own arithmetic; quantize-append is checked bit for bit against the V1 codec.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton anywhere in the process.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from int8kv import ops  # noqa: E402
from int8kv.cache.paged import PagedKvCache  # noqa: E402
from int8kv.codec import encode, quantize_int8  # noqa: E402
from int8kv.errors import LayerOutOfRange, NonFiniteError, PositionOutOfRange, ShapeMismatch  # noqa: E402
from int8kv.formats import KvStorageFormat  # noqa: E402
from int8kv.ops import reference as ref  # noqa: E402
from int8kv.ops import triton as tk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
FORMATS = [INT8, F16]
TOL = 1e-5


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------
def make_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim, num_layers=1):
    return PagedKvCache(num_blocks, block_size, num_layers, num_kv_heads, head_dim, fmt, DEVICE)


def snapshot(cache):
    tensors = [*cache.k_codes, *cache.v_codes]
    if cache.format.is_quantized:
        tensors += [*cache.k_scales, *cache.v_scales]
    return [t.clone() for t in tensors]


def stored_rows(cache, layer, slots):
    """Codes (and scales) at ``slots`` as [tokens, heads, dim] / [tokens, heads]."""
    h, d = cache.num_kv_heads, cache.head_dim
    out = [cache.k_codes[layer].reshape(-1, h, d)[slots], cache.v_codes[layer].reshape(-1, h, d)[slots]]
    if cache.format.is_quantized:
        out += [cache.k_scales[layer].reshape(-1, h)[slots], cache.v_scales[layer].reshape(-1, h)[slots]]
    return out


def t_append(cache, layer, k, v, slots):
    """The write path (checks, then Triton's fused quantize-and-store kernel)."""
    ops.append_paged_kv(cache, layer, k, v, slots, backend="triton")


def t_decode(cache, layer, q, bt, ctx, scale, starts):
    return ops.paged_decode_attention(cache, layer, q, bt, ctx, scale, starts, backend="triton")


def t_prefill(cache, layer, q, cu, bt, ctx, scale, starts):
    return ops.paged_prefill_attention(cache, layer, q, cu, bt, ctx, scale, starts, backend="triton")


def rel_err(got, want):
    """Max abs error over max abs reference value."""
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def filled_cache(fmt, block_size, num_kv_heads, head_dim, context_lens, seed, spare_blocks=3):
    """A cache holding random K/V for each sequence in a shuffled set of blocks; returns (cache, block_tables)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [triton.cdiv(n, block_size) for n in context_lens]
    width = max(pages) + 1  # one padding column that must never be read
    num_blocks = sum(pages) + spare_blocks
    cache = make_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim)
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(context_lens), width), dtype=torch.int32)
    used = 0
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, n in enumerate(context_lens):
        block_tables[b, : pages[b]] = order[used : used + pages[b]].to(torch.int32)
        used += pages[b]
        pos = torch.arange(n)
        slots = block_tables[b].long()[pos // block_size] * block_size + pos % block_size
        written[slots] = True
        # Spread magnitudes per row so INT8 scales differ from row to row.
        mag = torch.exp(torch.randn((n, num_kv_heads, 1), generator=gen))
        k = torch.randn((n, num_kv_heads, head_dim), generator=gen) * mag
        v = torch.randn((n, num_kv_heads, head_dim), generator=gen) * mag
        # Encoded by the codec, not the kernel: append has its own tests and the interpreter is slow.
        cache.write_rows(0, slots.to(DEVICE), encode(fmt, k.to(DEVICE)), encode(fmt, v.to(DEVICE)))
    # Poison every slot no sequence owns (spare blocks, page tails past a context): a kernel that reads
    # one unmasked turns its output into NaN.
    unused = (~written).nonzero().squeeze(1).to(DEVICE)
    if fmt.is_quantized:
        for scales in (cache.k_scales[0], cache.v_scales[0]):
            scales.view(-1, num_kv_heads)[unused] = float("nan")
    else:
        for codes in (cache.k_codes[0], cache.v_codes[0]):
            codes.view(-1, num_kv_heads, head_dim)[unused] = float("nan")
    return cache, block_tables.to(DEVICE)


# --------------------------------------------------------------------------------------------------------
# quantize-append
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _rint_probe(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(y_ptr + i, tk._rint_to_int32(x), mask=i < n)


def test_rint_matches_torch_round_half_even():
    gen = torch.Generator().manual_seed(1)
    ties = torch.arange(-130, 130, dtype=torch.float32) + 0.5
    near = torch.cat([torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    uniform = (torch.rand(6000, generator=gen) * 300 - 150).float()
    tiny = torch.randn(500, generator=gen) * 1e-6
    special = torch.tensor([0.0, -0.0, 0.49999997, -0.49999997, 0.5, -0.5, 1.5, 2.5, 127.0, -127.0, 126.5])
    x = torch.cat([ties, near, uniform, tiny, special]).to(DEVICE)
    y = torch.empty(x.shape, dtype=torch.int32, device=DEVICE)
    _rint_probe[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.cpu(), torch.round(x.cpu()).to(torch.int32))


def _append_inputs(tokens, heads, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(3 * torch.randn((tokens, heads, 1), generator=gen))
    k = torch.randn((tokens, heads, dim), generator=gen) * mag
    v = torch.randn((tokens, heads, dim), generator=gen) * mag
    k[1, 0] = 0.0  # zero row: scale 1
    v[2, -1] = 0.0
    # Rows whose max is 127 * 2^e make scale a power of two, so every x.5 * 2^e is an exact tie.
    e = 2.0 ** torch.randint(-6, 6, (1,), generator=gen).item()
    tie_row = (torch.randint(-127, 127, (dim,), generator=gen).float() + 0.5) * e
    tie_row[0] = 127 * e
    k[0, 0] = tie_row
    v[0, 0] = -tie_row
    k[3, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.0])
    k[3, 0, 8:] = 0.0
    k[4, 0] = 1e-6 * torch.randn(dim, generator=gen)  # float16 subnormals
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size,heads,dim", [(8, 2, 64), (16, 3, 128)])
def test_append_matches_codec(fmt, dtype, block_size, heads, dim):
    tokens, num_blocks = 21, 6
    cache = make_cache(fmt, num_blocks, block_size, heads, dim, num_layers=2)
    k, v = _append_inputs(tokens, heads, dim, dtype, seed=block_size + heads)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(5))[:tokens]
    layer0 = [cache.k_codes[0].clone(), cache.v_codes[0].clone()]
    t_append(cache, 1, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(layer0[0], cache.k_codes[0]) and torch.equal(layer0[1], cache.v_codes[0])
    got = [t.cpu() for t in stored_rows(cache, 1, slots.to(DEVICE))]
    if fmt.is_quantized:
        qk, sk = quantize_int8(k)
        qv, sv = quantize_int8(v)
        assert torch.equal(got[0], qk) and torch.equal(got[1], qv)
        # Compare scale bits, not values: equal values with different bits would be a codec change.
        assert torch.equal(got[2].view(torch.int32), sk.view(torch.int32))
        assert torch.equal(got[3].view(torch.int32), sv.view(torch.int32))
        assert float(got[2][1, 0]) == 1.0 and float(got[3][2, -1]) == 1.0
    else:
        assert torch.equal(got[0], k.to(torch.float16)) and torch.equal(got[1], v.to(torch.float16))
    mask = torch.ones(num_blocks * block_size, dtype=torch.bool)
    mask[slots] = False
    flat = cache.k_codes[1].reshape(num_blocks * block_size, -1).cpu()
    assert not flat[mask].to(torch.float32).any()


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize(
    "where,value",
    [("k", float("nan")), ("v", float("inf")), ("v", float("-inf")), ("k", 70000.0)],
)
def test_append_non_finite_writes_nothing(fmt, where, value):
    cache = make_cache(fmt, 4, 8, 2, 64)
    k = torch.randn(5, 2, 64, device=DEVICE)
    v = torch.randn(5, 2, 64, device=DEVICE)
    (k if where == "k" else v)[4, 1, 7] = value
    before = snapshot(cache)
    with pytest.raises(NonFiniteError):
        t_append(cache, 0, k, v, torch.arange(5, device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(cache), strict=True))


def test_append_rejects_bad_arguments_without_writing():
    cache = make_cache(INT8, 4, 8, 2, 64)
    k = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    before = snapshot(cache)
    with pytest.raises(PositionOutOfRange):
        t_append(cache, 0, k, k, torch.tensor([0, 1, 32], device=DEVICE))
    with pytest.raises(PositionOutOfRange):
        t_append(cache, 0, k, k, torch.tensor([0, -1, 2], device=DEVICE))
    with pytest.raises(ShapeMismatch):
        t_append(cache, 0, k, k, torch.tensor([0, 1, 1], device=DEVICE))
    with pytest.raises(LayerOutOfRange):
        t_append(cache, 1, k, k, slots)
    with pytest.raises(ShapeMismatch):
        t_append(cache, 0, k[:, :1], k[:, :1], slots)
    with pytest.raises(ShapeMismatch):
        t_append(cache, 0, k, k[:2], slots)
    with pytest.raises(ShapeMismatch):
        t_append(cache, 0, k.double(), k.double(), slots)
    with pytest.raises(ShapeMismatch):
        t_append(cache, 0, k, k, slots.float())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(cache), strict=True))
    t_append(cache, 0, k[:0], k[:0], slots[:0])  # zero tokens is a no-op


# --------------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------------
# (block_size, head_dim, group, num_kv_heads): every block size, head dim and group appears with each format;
# the last shape has a head_dim that is not a power of two and a group of 3 (padded lanes and rows).
SHAPES = [
    (8, 64, 1, 2),
    (16, 128, 4, 1),
    (32, 64, 8, 1),
    (8, 128, 8, 1),
    (16, 64, 4, 2),
    (32, 128, 1, 2),
    (16, 96, 3, 2),
]
SHAPE_IDS = [f"bs{b}-d{d}-g{g}-h{h}" for b, d, g, h in SHAPES]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("block_size,head_dim,group,kv_heads", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(fmt, block_size, head_dim, group, kv_heads):
    context_lens = [37, 1, 70]
    cache, bt = filled_cache(fmt, block_size, kv_heads, head_dim, context_lens, seed=block_size + head_dim + group)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([3, 0, 20], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    for kv_starts in (None, starts):
        got = t_decode(cache, 0, q, bt, ctx, None, kv_starts)
        assert got.dtype == torch.float32 and got.shape == q.shape
        want = ref.paged_decode_attention(cache, 0, q, bt, ctx, None, kv_starts)
        assert rel_err(got, want) < TOL


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("block_size,head_dim,group,kv_heads", SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_reference(fmt, block_size, head_dim, group, kv_heads):
    context_lens = [30, 9, 45]
    n_q = [7, 9, 1]  # a chunk after a cached prefix, a whole prompt, one token
    cache, bt = filled_cache(fmt, block_size, kv_heads, head_dim, context_lens, seed=3 * block_size + group)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 7, 16, 17], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(sum(n_q), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    # kv_start 25 hides every key from the first rows of sequence 0 (they must come out as zeros).
    starts = torch.tensor([25, 2, 0], dtype=torch.int32, device=DEVICE)
    for kv_starts in (None, starts):
        got = t_prefill(cache, 0, q, cu, bt, ctx, 0.3, kv_starts)
        assert got.dtype == torch.float32 and got.shape == q.shape
        want = ref.paged_prefill_attention(cache, 0, q, cu, bt, ctx, 0.3, kv_starts)
        assert rel_err(got, want) < TOL


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_split_kv_matches_reference(fmt):
    """Flash-decoding path: the KV range split over programs, then merged."""
    context_lens = [70, 3, 40]
    cache, bt = filled_cache(fmt, 16, 2, 64, context_lens, seed=11)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([5, 0, 39], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 8, 64, generator=gen).to(DEVICE)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    got = tk._attention(cache, 0, q, cu, 1, bt, ctx, None, starts, num_splits=3)
    assert rel_err(got, ref.paged_decode_attention(cache, 0, q, bt, ctx, None, starts)) < TOL
    cu = torch.tensor([0, 6, 9, 10], dtype=torch.int32, device=DEVICE)
    q = torch.randn(10, 8, 64, generator=gen).to(DEVICE)
    got = tk._attention(cache, 0, q, cu, 6, bt, ctx, None, None, num_splits=4)
    assert rel_err(got, ref.paged_prefill_attention(cache, 0, q, cu, bt, ctx, None, None)) < TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_queries(dtype):
    cache, bt = filled_cache(INT8, 16, 2, 64, [20, 33], seed=4)
    ctx = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, device=DEVICE).to(dtype)
    got = t_decode(cache, 0, q, bt, ctx, None, None)
    assert rel_err(got, ref.paged_decode_attention(cache, 0, q, bt, ctx, None, None)) < TOL


def test_dispatcher_reaches_triton_backend():
    cache, bt = filled_cache(INT8, 8, 2, 64, [12, 30], seed=12)
    ctx = torch.tensor([12, 30], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 8, 64, device=DEVICE)
    got = ops.paged_decode_attention(cache, 0, q, bt, ctx, backend="triton")
    assert torch.equal(got, t_decode(cache, 0, q, bt, ctx, None, None))
    k = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([40, 41, 42], device=DEVICE)
    ops.append_paged_kv(cache, 0, k, -k, slots, backend="triton")
    qk, sk = quantize_int8(k.cpu())
    assert torch.equal(cache.k_codes[0].reshape(-1, 2, 64)[slots].cpu(), qk)


def test_decode_equals_one_token_prefill_and_empty_range_is_zero():
    cache, bt = filled_cache(INT8, 8, 2, 64, [17, 24], seed=6)
    ctx = torch.tensor([17, 24], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, device=DEVICE)
    cu = torch.arange(3, dtype=torch.int32, device=DEVICE)
    dec = t_decode(cache, 0, q, bt, ctx, 0.2, None)
    pre = t_prefill(cache, 0, q, cu, bt, ctx, 0.2, None)
    assert torch.equal(dec, pre)
    # kv_start at the context length leaves nothing to attend to: zeros, not NaN.
    starts = torch.tensor([17, 0], dtype=torch.int32, device=DEVICE)
    out = t_decode(cache, 0, q, bt, ctx, 0.2, starts)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.allclose(out[1], dec[1])


def test_attention_rejects_bad_arguments():
    cache, bt = filled_cache(INT8, 8, 2, 64, [10], seed=2)
    ctx = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    with pytest.raises(ShapeMismatch):  # 3 query heads over 2 KV heads
        t_decode(cache, 0, q[:, :3], bt, ctx, None, None)
    with pytest.raises(ShapeMismatch):
        t_decode(cache, 0, q[..., :32], bt, ctx, None, None)
    with pytest.raises(LayerOutOfRange):
        t_decode(cache, 3, q, bt, ctx, None, None)
    with pytest.raises(PositionOutOfRange):  # longer than the block table can address
        t_decode(cache, 0, q, bt, ctx + 100, None, None)
    with pytest.raises(PositionOutOfRange):
        t_decode(cache, 0, q, bt + cache.num_blocks, ctx, None, None)
    with pytest.raises(ShapeMismatch):
        t_prefill(cache, 0, q, torch.tensor([0, 2], device=DEVICE), bt, ctx, None, None)
    with pytest.raises(ShapeMismatch):  # more queries than stored positions
        many = torch.randn(11, 4, 64, device=DEVICE)
        t_prefill(cache, 0, many, torch.tensor([0, 11], device=DEVICE), bt, ctx, None, None)
