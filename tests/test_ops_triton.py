"""Triton paged kernels: compiled on a GPU, under the Triton interpreter on CPU tensors otherwise.

Attention is checked against the float64 reference (int8kv.ops.reference) over the same stored K/V, so the
only error measured is the kernel's own arithmetic; quantize-append is checked bit for bit against the V1 codec.
"""

from __future__ import annotations

import dataclasses
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
from int8kv.codec import quantize_int8  # noqa: E402
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


def t_attention(cache, layer, q, cu, bt, ctx, scale, starts, **options):
    """Triton's launcher with its tuning options over a validated plan (decode when ``cu`` is None)."""
    plan = ops.plan_attention(
        cache, bt, ctx, cu_seqlens_q=cu, kv_starts=starts, num_queries=q.shape[0], softmax_scale=scale
    )
    return tk.attention(cache, layer, q, plan, **options)


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
        cache.write_rows(0, slots.to(DEVICE), fmt.spec.encode(k.to(DEVICE)), fmt.spec.encode(v.to(DEVICE)))
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
    got = t_attention(cache, 0, q, None, bt, ctx, None, starts, num_splits=3)
    assert rel_err(got, ref.paged_decode_attention(cache, 0, q, bt, ctx, None, starts)) < TOL
    cu = torch.tensor([0, 6, 9, 10], dtype=torch.int32, device=DEVICE)
    q = torch.randn(10, 8, 64, generator=gen).to(DEVICE)
    got = t_attention(cache, 0, q, cu, bt, ctx, None, None, num_splits=4)
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
    if DEVICE.type == "cuda":
        # Compiled, prefill takes a 64-row tile (and wgmma on Hopper): another summation order, same values.
        assert rel_err(pre, dec) < TOL
    else:
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


# --------------------------------------------------------------------------------------------------------
# kernel switches (issue 12): each against the float64 reference
# --------------------------------------------------------------------------------------------------------
# (options, tolerance). Without the hi/lo split each product rounds q (or p) to float16 once: ~2^-11 relative.
SWITCHES = [
    ({"magic": True}, TOL),
    ({"hilo": False}, 2e-3),
    ({"magic": True, "hilo": False}, 2e-3),
    ({"block_n": 32, "num_stages": 2}, TOL),
    ({"block_n": 64, "num_stages": 3}, TOL),
    ({"block_n": 64, "magic": True, "num_splits": 3}, TOL),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("options,tol", SWITCHES, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_switches_match_reference(fmt, options, tol):
    context_lens = [75, 2, 130]
    n_q = [5, 1, 12]
    cache, bt = filled_cache(fmt, 16, 2, 64, context_lens, seed=21)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([4, 0, 60], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(22)
    qd = torch.randn(3, 8, 64, generator=gen).to(DEVICE)
    qp = torch.randn(sum(n_q), 8, 64, generator=gen).to(DEVICE)
    cu_p = torch.tensor([0, 5, 6, 18], dtype=torch.int32, device=DEVICE)
    for kv_starts in (None, starts):
        got = t_attention(cache, 0, qd, None, bt, ctx, None, kv_starts, **options)
        want = ref.paged_decode_attention(cache, 0, qd, bt, ctx, None, kv_starts)
        assert rel_err(got, want) < tol
        got = t_attention(cache, 0, qp, cu_p, bt, ctx, 0.2, kv_starts, **options)
        want = ref.paged_prefill_attention(cache, 0, qp, cu_p, bt, ctx, 0.2, kv_starts)
        assert rel_err(got, want) < tol


def test_hilo_split_is_what_keeps_float32_accuracy():
    """The tolerance above for hilo off is not slack: with the split the error is far smaller."""
    cache, bt = filled_cache(F16, 16, 2, 64, [90], seed=23)
    ctx = torch.tensor([90], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(24)).to(DEVICE)
    want = ref.paged_decode_attention(cache, 0, q, bt, ctx, None, None)
    on = rel_err(t_attention(cache, 0, q, None, bt, ctx, None, None, hilo=True), want)
    off = rel_err(t_attention(cache, 0, q, None, bt, ctx, None, None, hilo=False), want)
    assert on < TOL < off


def test_kv_bound_from_the_host_matches_reference():
    # The caller knows the longest context (70) below the table's reach (width 6 x 16 = 96): fewer splits,
    # same result.
    cache, bt = filled_cache(INT8, 16, 2, 64, [70, 33], seed=25)
    ctx = torch.tensor([70, 33], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(26)).to(DEVICE)
    want = ref.paged_decode_attention(cache, 0, q, bt, ctx, None, None)
    for splits in (1, 2, 5):
        got = t_attention(cache, 0, q, None, bt, ctx, None, None, kv_bound=70, num_splits=splits, block_n=16)
        assert rel_err(got, want) < TOL


# --------------------------------------------------------------------------------------------------------
# launch shape and host side (issue 12)
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _kv_range_probe(args_ptr, out_ptr, TOKENS: tl.constexpr, SPLIT: tl.constexpr):
    i = tl.program_id(0)
    a = args_ptr + 6 * i
    lo, hi = tk._kv_range(
        tl.load(a), tl.load(a + 1), tl.load(a + 2), tl.load(a + 3), tl.load(a + 4), tl.load(a + 5), TOKENS, SPLIT
    )
    tl.store(out_ptr + 2 * i, lo)
    tl.store(out_ptr + 2 * i + 1, hi)


@pytest.mark.parametrize("split", [False, True])
def test_query_block_past_the_last_query_scans_nothing(split):
    tokens, chunk = 4, 32
    rows = []
    for n_q in (1, 3, 4, 9):
        for t0 in range(0, 16, tokens):
            for kv_lo, pid_s in ((0, 0), (5, 1), (0, 2)):
                rows.append((t0, n_q, 100, kv_lo, pid_s, chunk))
    args = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    out = torch.empty((len(rows), 2), dtype=torch.int32, device=DEVICE)
    _kv_range_probe[(len(rows),)](args, out, TOKENS=tokens, SPLIT=split)
    for (t0, n_q, ctx, kv_lo, pid_s, ch), (lo, hi) in zip(rows, out.tolist(), strict=True):
        want_lo = kv_lo + pid_s * ch if split else kv_lo
        want_hi = ctx - n_q + min(t0 + tokens, n_q)
        if split:
            want_hi = min(want_hi, want_lo + ch)
        assert lo == want_lo
        if t0 >= n_q:
            assert hi == lo  # no query row in this block: empty range, not a masked full scan
        else:
            assert hi == want_hi


def test_mixed_prefill_and_decode_batch_matches_reference():
    # Sequence 0 decodes (1 query) beside a 40-token chunk: its query blocks 1.. hold no query.
    cache, bt = filled_cache(INT8, 8, 1, 64, [50, 60], seed=27)
    ctx = torch.tensor([50, 60], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1, 41], dtype=torch.int32, device=DEVICE)
    q = torch.randn(41, 8, 64, generator=torch.Generator().manual_seed(28)).to(DEVICE)
    got = t_prefill(cache, 0, q, cu, bt, ctx, None, None)
    assert rel_err(got, ref.paged_prefill_attention(cache, 0, q, cu, bt, ctx, None, None)) < TOL


def test_grid_stays_inside_cuda_limits_for_long_mqa_prefill():
    # MQA, group 8: a 64-row tile holds 8 tokens, so a 1M-token chunk needs 131,072 query blocks, past the
    # 65,535 a grid's y and z axes allow; x allows 2^31 - 1.
    plan = tk.launch_plan(
        torch.device("cpu"), batch=2, num_kv_heads=1, group=8, max_q=1 << 20, kv_bound=1 << 20,
        is_int8=True, block_m=64, gpu=True,
    )  # fmt: skip
    x, *rest = plan.grid(2, 1)
    assert plan.m_blocks == 131072
    assert x == 2 * 131072 < 2**31 and all(n <= 65535 for n in rest)


@pytest.mark.parametrize("sms,ctas", [(132, 2), (132, 3), (108, 2), (16, 2)])
@pytest.mark.parametrize("batch,kv_heads,context", [(1, 8, 4096), (8, 8, 16384), (32, 8, 32768), (8, 2, 4096)])
def test_split_count_fills_whole_waves(sms, ctas, batch, kv_heads, context):
    slots = sms * ctas
    programs = batch * kv_heads
    splits = tk._num_splits(programs, context, 64, slots)
    real, chunk = tk._split_chunk(context, splits, 64)
    assert real == splits  # the count reported is the count launched
    assert 1 <= splits <= min(context // 256, 64) and chunk % 64 == 0 and splits * chunk >= context
    work = programs * splits
    fill = work / (triton.cdiv(work, slots) * slots)
    if programs >= slots:
        assert fill >= 0.5
    else:
        # The last wave is at least 80 % full unless the splits ran out (too short a context to cut further).
        assert fill >= 0.8 or splits == min(context // 256, 64), (splits, fill)


def test_split_plan_reads_the_sm_count_once(monkeypatch):
    calls = []

    class Props:
        multi_processor_count = 132

    def props(index):
        calls.append(index)
        return Props()

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    tk._sm_count_of.cache_clear()
    try:
        plans = [
            tk.launch_plan(
                torch.device("cuda", 0), batch=8, num_kv_heads=8, group=4, max_q=1, kv_bound=16384, is_int8=True
            )
            for _ in range(3)
        ]
    finally:
        tk._sm_count_of.cache_clear()
    assert calls == [0]
    # 64 programs on 132 x 2 slots: 4 splits fill one wave (256 of 264), where 9 gave 2.18 waves.
    assert {p.num_splits for p in plans} == {4}


def test_metadata_must_have_unit_stride():
    """The kernels read metadata row i at ``ptr + i``: a strided view never reaches them.

    plan_attention copies strided metadata (same result as contiguous); a plan built by hand with strided
    tensors, and strided slots handed to the store, are refused before anything is read or written.
    """
    cache, bt = filled_cache(INT8, 8, 2, 64, [10, 12], seed=29)
    q = torch.randn(2, 4, 64, device=DEVICE)
    ctx_wide = torch.tensor([10, 99, 12, 99], dtype=torch.int32, device=DEVICE)[::2]
    bt_wide = torch.stack([bt, bt], dim=2).reshape(2, -1)[:, ::2]
    starts_wide = torch.zeros_like(ctx_wide[:1]).expand(2)
    cu_wide = torch.tensor([0, 9, 1, 9, 2], dtype=torch.int32, device=DEVICE)[::2]
    assert torch.equal(bt_wide, bt) and torch.equal(ctx_wide, ctx_wide.contiguous())
    ctx = ctx_wide.contiguous()
    decode = ops.plan_attention(cache, bt, ctx)
    for name, wide in (("context_lens", ctx_wide), ("block_tables", bt_wide), ("kv_starts", starts_wide)):
        with pytest.raises(ShapeMismatch, match="unit stride"):
            dataclasses.replace(decode, **{name: wide})
    prefill = ops.plan_attention(cache, bt, ctx, cu_seqlens_q=cu_wide.contiguous(), num_queries=2)
    with pytest.raises(ShapeMismatch, match="unit stride"):
        dataclasses.replace(prefill, cu_seqlens_q=cu_wide)
    planned = ops.plan_attention(cache, bt_wide, ctx_wide, cu_seqlens_q=cu_wide, kv_starts=starts_wide, num_queries=2)
    tensors = (planned.block_tables, planned.context_lens, planned.kv_starts, planned.cu_seqlens_q)
    assert all(t.stride(-1) == 1 for t in tensors)
    starts = starts_wide.contiguous()
    want = t_decode(cache, 0, q, bt, ctx, None, starts)
    assert torch.equal(t_decode(cache, 0, q, bt_wide, ctx_wide, None, starts_wide), want)
    want = t_prefill(cache, 0, q, cu_wide.contiguous(), bt, ctx, None, None)
    assert torch.equal(t_prefill(cache, 0, q, cu_wide, bt_wide, ctx_wide, None, None), want)
    assert rel_err(want, ref.paged_prefill_attention(cache, 0, q, cu_wide, bt, ctx, None, None)) < TOL

    fresh = make_cache(INT8, 4, 8, 2, 64)
    slots_wide = torch.tensor([1, 0, 2, 0], device=DEVICE)[::2]
    rows = q[:, :2].to(torch.float16)
    with pytest.raises(ShapeMismatch, match="unit stride"):
        tk.store_rows(fresh, 0, rows, rows, slots_wide)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(make_cache(INT8, 4, 8, 2, 64)), snapshot(fresh), strict=True))
    # Through the write path the slots are checked and copied: the rows land where the values say.
    t_append(fresh, 0, q[:, :2], q[:, :2], slots_wide)
    other = make_cache(INT8, 4, 8, 2, 64)
    t_append(other, 0, q[:, :2], q[:, :2], slots_wide.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(snapshot(other), snapshot(fresh), strict=True))
    assert not torch.equal(snapshot(other)[0], snapshot(make_cache(INT8, 4, 8, 2, 64))[0])


_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def test_steady_state_decode_step_reads_nothing_back(monkeypatch):
    """Two decode steps as a CUDA-graph caller runs them: an unvalidated plan, then store + attend per layer.

    Launches are recorded, not run, so every tensor method the host side calls is its own; a host read
    (``bool(t)``, ``.item()``, ``.tolist()``, ``.cpu()``, ...) raises.
    """
    cache, bt = filled_cache(INT8, 8, 2, 64, [10, 12], seed=30)
    ctx = torch.tensor([10, 12], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, device=DEVICE)
    kv = torch.randn(2, 2, 64, device=DEVICE).to(torch.float16)
    slots = torch.tensor([10, 20], device=DEVICE)

    def refuse(*args, **kwargs):
        raise AssertionError("host read in the steady-state decode path")

    with tk.record_launches() as launches:
        for _ in range(2):
            # A plan on a CPU pool also builds the CPU backend's numpy index (a copy of host memory, never
            # made for a CUDA pool, where .numpy() cannot even be called): numpy is refused from the layer on.
            for name in _HOST_READS:
                if name != "numpy":
                    monkeypatch.setattr(torch.Tensor, name, refuse)
            plan = ops.plan_attention(cache, bt, ctx, slots=slots, validate=False)
            monkeypatch.setattr(torch.Tensor, "numpy", refuse)
            tk.store_rows(cache, 0, kv, kv, plan.slots)
            tk.attend(cache, 0, q, plan)
            monkeypatch.undo()
    kernels = [x.kernel for x in launches]
    assert kernels == [tk._append_kernel, tk._attention_kernel] * 2
    # The decode query offsets of both steps come from one kept tensor, not an arange launched per plan.
    cu = [x.args[x.kernel.arg_names.index("cu_ptr")] for x in launches if x.kernel is tk._attention_kernel]
    assert cu[0].data_ptr() == cu[1].data_ptr()
    assert torch.equal(cu[0], torch.arange(3, dtype=torch.int32, device=DEVICE))
