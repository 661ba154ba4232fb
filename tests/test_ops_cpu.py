"""The numba CPU attention kernels against the float64 reference, and the dispatcher.

Every pool is poisoned (NaN) before the real rows are written, so a kernel that reads a padding entry of a block
table, a slot past a sequence's context or a position outside its window returns NaN and fails loudly.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from int8kv.cache.paged import PagedKvCache
from int8kv.errors import KvCacheError, LayerOutOfRange, NonFiniteError, PositionOutOfRange, ShapeMismatch
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, cpu, paged_decode_attention, paged_prefill_attention, plan_attention, reference

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
FORMATS = [INT8, F16]
TOL = 1e-5


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The reference runs many tiny torch ops; on a busy 2-core machine each multi-threaded one can wait
    milliseconds for a second thread. One thread keeps this file fast; the setting is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all(), "NaN: the kernel read a slot outside the sequence's window"
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def kernel_query(cache, q: torch.Tensor, tables: torch.Tensor, context: torch.Tensor, precision=None) -> torch.Tensor:
    """The decode query the CPU kernel multiplies under ``precision`` (None: the default): on an INT8 cache whose
    head_dim this CPU's integer kernel takes, each (row, head) rounded to int16 codes x scale (the int16 path, whose
    rounding is its only change from exact: tests/test_ops_cpu_quantized.py bounds it against the true q); q
    itself otherwise. The reference run on it checks everything after the rounding to float32 tolerance."""
    pool = cache.pool if isinstance(cache, PagedKvCache) else cache
    if cpu._query_path(plan_attention(pool, tables, context, precision=precision), pool) != "int16":
        return q
    codes, scale = cpu.quantize_query_int16(q)
    return (codes.double() * scale.double().unsqueeze(2)).float()


def poison(cache: PagedKvCache) -> None:
    storage = cache.pool.storage()  # K and V of each part: (k codes, v codes[, k scales, v scales])
    for t in storage[2:] if cache.format.is_quantized else storage:
        t.fill_(float("nan"))


def build(fmt, block_size, head_dim, num_kv_heads, lens, seed, layer=1, value_scale=1.0):
    """A 2-layer cache holding random rows for sequences of `lens` tokens, grown in interleaved chunks so the
    block tables are scattered; block 0 belongs to no sequence (it backs the padding entries)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = PagedKvCache(blocks, block_size, 2, num_kv_heads, head_dim, fmt)
    poison(cache)
    cache.add_sequence("padding", 1)
    ids = list(range(len(lens)))
    for i in ids:
        cache.add_sequence(i)
    todo = dict(zip(ids, lens, strict=True))
    while any(todo.values()):  # grow in interleaved chunks: each sequence's blocks end up scattered
        i = int(rng.choice([j for j in ids if todo[j]]))
        n = int(min(todo[i], rng.integers(1, 2 * block_size)))
        cache.grow(i, n)
        todo[i] -= n
    for i, n in zip(ids, lens, strict=True):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen) * 2
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen) * value_scale
        append_paged_kv(cache, layer, k, v, cache.slots(i))
    tables, context = cache.batch_tensors(ids, min_blocks=1)
    return cache, tables, context


def starts_for(context: torch.Tensor, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor([int(rng.integers(0, n // 2 + 1)) for n in context.tolist()], dtype=torch.int32)


# -- decode ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [40, 64, 128])  # 40: not whole 16-lane vectors, the per-key path alone
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(fmt, block_size, head_dim, group):
    seed = block_size * 1000 + head_dim * 10 + group
    lens = [1, 37, 150, 0, 64 + block_size]
    cache, tables, context = build(fmt, block_size, head_dim, 2, lens, seed)
    q = torch.randn(len(lens), 2 * group, head_dim, generator=torch.Generator().manual_seed(seed))
    for starts in (None, starts_for(context, seed)):
        out = paged_decode_attention(cache, 1, q, tables, context, kv_starts=starts, backend="cpu")
        ref = reference.paged_decode_attention(cache, 1, kernel_query(cache, q, tables, context), tables, context,
                                               kv_starts=starts)
        assert rel_err(out, ref) < TOL
        assert not out[3].any()  # the empty sequence attends to nothing
        # The float32 query path, selectable on any CPU and the default where no integer kernel fits.
        out = paged_decode_attention(cache, 1, q, tables, context, kv_starts=starts, backend="cpu", precision="exact")
        assert rel_err(out, reference.paged_decode_attention(cache, 1, q, tables, context, kv_starts=starts)) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [100, 256])
def test_decode_over_blocks_longer_than_a_tile_matches_reference(fmt, block_size):
    """Blocks longer than the kernel's tile (the transformers drop-in keeps a batch row in one block): runs
    inside a block prefetch the keys after them instead of the next block; sequences of one block, several,
    none, cut mid-run, from kv_starts mid-block and split across work items."""
    seed = block_size + 3
    lens = [1, 70, block_size, 2 * block_size + 37, 0, 3000]
    cache, tables, context = build(fmt, block_size, 64, 3, lens, seed)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(seed))
    for starts in (None, starts_for(context, seed)):
        out = paged_decode_attention(cache, 1, q, tables, context, kv_starts=starts, backend="cpu")
        ref = reference.paged_decode_attention(cache, 1, kernel_query(cache, q, tables, context), tables, context,
                                               kv_starts=starts)
        assert rel_err(out, ref) < TOL
        assert not out[4].any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_split_keys_match_reference(fmt):
    """Few (sequence, KV head) pairs and long contexts: the keys are split across work items and merged."""
    cache, tables, context = build(fmt, 32, 64, 1, [3000, 700], seed=7)
    lens = context.numpy().astype(np.int64)
    items, splits = cpu._decode_items(lens, np.zeros(2, np.int64), numba.get_num_threads())
    if numba.get_num_threads() > 1:
        assert splits > 1
    q = torch.randn(2, 4, 64)
    for starts in (None, torch.tensor([2500, 10], dtype=torch.int32), torch.tensor([3000, 700], dtype=torch.int32)):
        out = paged_decode_attention(cache, 1, q, tables, context, kv_starts=starts, backend="cpu")
        ref = reference.paged_decode_attention(cache, 1, kernel_query(cache, q, tables, context), tables, context,
                                               kv_starts=starts)
        if starts is not None and starts[0] == 3000:
            assert not out.any() and not ref.any()  # empty windows give zeros
        else:
            assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fmt", FORMATS, ids=["int8", "f16"])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "flash"])
def test_the_backend_refuses_a_non_finite_query_itself_and_is_unharmed(monkeypatch, fmt, parallel, kind):
    """The CPU backend checks q's values itself (`cpu.CHECKS_QUERY`: `ops.check_query` leaves it that pass): NaN,
    +inf or -inf at any one place of q raises NonFiniteError through the serial item loop, the parallel one (each
    worker checks before it writes; a worker's failure is raised on the calling thread), and a prefill whose
    rows all take the flash path (no item loop runs); the next call with the finite q returns what it did
    before. test_numba_threads.py runs this under workqueue, which drops a worker's exception."""
    if parallel and numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("a parallel call needs two numba threads")
    lens = [1024] if kind == "flash" else [90, 200]
    cache, tables, context = build(fmt, 16, 64, 2, lens, seed=21)
    gen = torch.Generator().manual_seed(21)
    if kind == "decode":
        q = torch.randn(len(lens), 4, 64, generator=gen)

        def call(q):
            return paged_decode_attention(cache, 1, q, tables, context, backend="cpu")
    else:
        counts = [64] if kind == "flash" else [5, 7]  # 64 queries over 1,024 keys: past both flash thresholds
        assert kind != "flash" or (counts[0] >= cpu.FLASH_MIN_QUERIES and counts[0] * 960 >= cpu.FLASH_MIN_PAIRS)
        cu = torch.tensor([0, *np.cumsum(counts)], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), 4, 64, generator=gen)

        def call(q):
            return paged_prefill_attention(cache, 1, q, cu, tables, context, backend="cpu")

    previous = numba.get_num_threads()
    numba.set_num_threads(2 if parallel else 1)
    monkeypatch.setattr(cpu.ThreadChoice, "parallel", lambda self, work, threads: parallel)
    try:
        good = call(q)
        rng = np.random.default_rng(21)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for _ in range(3):
                broken = q.clone()
                broken[tuple(int(rng.integers(0, n)) for n in q.shape)] = bad
                with pytest.raises(NonFiniteError, match="q holds NaN or inf"):
                    call(broken)
        assert torch.equal(call(q), good)
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("tags", [[1, 3], [5]], ids=["leaves", "row-kernel"])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_a_leaf_compiled_for_other_argument_types_is_refused_before_any_item_runs(monkeypatch, parallel, tags):
    """The item loop calls its per-item kernels by address (ops/calls.py), and the row leaf its kernel
    `_attend_row`: a function whose signature tag is not the tag of the argument types it is called with raises
    TypeError before it runs, and the next call with the right kernels is unharmed. Through the parallel loop the
    worker's failure is reported back and its range run again on the calling thread (`calls.fan_out`), so the
    TypeError is the caller's on every numba threading layer (test_numba_threads.py runs this under workqueue,
    which drops a worker's exception)."""
    if parallel and numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("a parallel call needs two numba threads")
    cache, tables, context = build(INT8, 16, 64, 2, [90, 200], seed=12)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(12))
    previous = numba.get_num_threads()
    numba.set_num_threads(2 if parallel else 1)
    monkeypatch.setattr(cpu.ThreadChoice, "parallel", lambda self, work, threads: parallel)
    try:
        good = paged_decode_attention(cache, 1, q, tables, context, backend="cpu")
        real = cpu._leaves

        def other_tags(*args):
            leaves = real(*args).copy()
            assert leaves[tags[0] - 1] != 0  # a decode call: the row leaf and its kernel are in use
            leaves[tags] += 1
            return leaves

        monkeypatch.setattr(cpu, "_leaves", other_tags)
        with pytest.raises(TypeError, match="other argument types"):
            paged_decode_attention(cache, 1, q, tables, context, backend="cpu")
        monkeypatch.setattr(cpu, "_leaves", real)
        assert torch.equal(paged_decode_attention(cache, 1, q, tables, context, backend="cpu"), good)
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("window", [None, 40], ids=["plain", "window"])
def test_the_several_row_kernel_compiled_for_other_argument_types_is_refused(monkeypatch, window):
    """The several-row leaf calls `_attend_item` by address, specialised without the rows' lowest keys (slots 6,
    7 of the leaves) or, under a window, with them (slots 8, 9): with the tag behind the address in use not the
    tag of the arguments it passes, a prefill call raises TypeError before the kernel runs; the next call is
    unharmed."""
    cache, tables, context = build(INT8, 16, 64, 2, [90, 200], seed=13)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q = torch.randn(12, 4, 64, generator=torch.Generator().manual_seed(13))
    monkeypatch.setattr(cpu.ThreadChoice, "parallel", lambda self, work, threads: False)  # serial: a plain TypeError
    good = paged_prefill_attention(cache, 1, q, cu, tables, context, backend="cpu", window=window)
    real = cpu._leaves
    used, unused = (6, 8) if window is None else (8, 6)

    def other_tag(*args):
        leaves = real(*args).copy()
        # several rows per item: the general leaf and one of the two kernels are in use
        assert leaves[2] != 0 and leaves[used] != 0 and leaves[unused] == 0
        leaves[used + 1] += 1
        return leaves

    monkeypatch.setattr(cpu, "_leaves", other_tag)
    with pytest.raises(TypeError, match="other argument types"):
        paged_prefill_attention(cache, 1, q, cu, tables, context, backend="cpu", window=window)
    monkeypatch.setattr(cpu, "_leaves", real)
    assert torch.equal(paged_prefill_attention(cache, 1, q, cu, tables, context, backend="cpu", window=window), good)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_decode_softmax_scale(fmt, scale):
    """From nearly uniform to nearly one-hot weights (the online max and the exp approximation at both ends)."""
    cache, tables, context = build(fmt, 16, 64, 2, [90, 200], seed=11)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(int(scale * 100)))
    out = paged_decode_attention(cache, 1, q, tables, context, softmax_scale=scale, backend="cpu")
    ref = reference.paged_decode_attention(cache, 1, kernel_query(cache, q, tables, context), tables, context,
                                           softmax_scale=scale)
    # At scale 30 the logits reach several hundred: rounding them to float32 alone moves the weights by ~1e-5,
    # for any float32 kernel, so that case gets a tolerance to match.
    assert rel_err(out, ref) < (TOL if scale <= 1.0 else 1e-4)


def test_f16_subnormal_values_are_read_exactly():
    cache, tables, context = build(F16, 16, 64, 2, [40, 70], seed=12, value_scale=1e-6)
    assert (cache.v_codes[1].abs() < 6.1e-5).logical_and(cache.v_codes[1] != 0).any()  # float16 subnormals are stored
    q = torch.randn(2, 4, 64)
    out = paged_decode_attention(cache, 1, q, tables, context, backend="cpu")
    ref = reference.paged_decode_attention(cache, 1, q, tables, context)
    assert rel_err(out, ref) < TOL


def test_decode_reads_only_its_layer():
    cache, tables, context = build(INT8, 16, 64, 2, [20, 33], seed=13, layer=0)
    q = torch.randn(2, 4, 64)
    out = paged_decode_attention(cache, 0, q, tables, context, backend="cpu")
    ref = reference.paged_decode_attention(cache, 0, kernel_query(cache, q, tables, context), tables, context)
    assert rel_err(out, ref) < TOL


# -- prefill -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(fmt, block_size, group):
    seed = block_size * 100 + group
    head_dim = 64 if group != 4 else 128
    lens = [70, 5, 130, 40]
    q_lens = [70, 0, 45, 1]  # a full prompt, nothing, a chunk after a cached prefix, a single token
    cache, tables, context = build(fmt, block_size, head_dim, 2, lens, seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 2 * group, head_dim, generator=torch.Generator().manual_seed(seed))
    for starts in (None, starts_for(context, seed)):
        out = paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=starts, backend="cpu")
        ref = reference.paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=starts)
        assert rel_err(out, ref) < TOL


def test_prefill_of_one_token_each_equals_decode():
    cache, tables, context = build(INT8, 16, 64, 2, [33, 80, 17], seed=21)
    q = torch.randn(3, 8, 64)
    cu = torch.arange(4, dtype=torch.int32)
    prefill = paged_prefill_attention(cache, 1, q, cu, tables, context, backend="cpu")
    decode = paged_decode_attention(cache, 1, q, tables, context, backend="cpu", precision="exact")
    assert torch.allclose(prefill, decode, rtol=1e-6, atol=1e-7)
    # Under the default precision a prefill of one token each stays exact, a decode rounds its rows to int16.
    assert torch.equal(prefill, paged_prefill_attention(cache, 1, q, cu, tables, context, precision="int16"))


def test_prefill_window_start_past_a_query_gives_zeros():
    cache, tables, context = build(F16, 8, 64, 1, [20], seed=22)
    q = torch.randn(20, 2, 64)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    starts = torch.tensor([12], dtype=torch.int32)
    out = paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=starts, backend="cpu")
    ref = reference.paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=starts)
    assert not out[:12].any()  # queries before the window start see no key at all
    assert rel_err(out, ref) < TOL


# -- dispatcher and validation -----------------------------------------------------------------------------
def test_dispatcher_picks_cpu_for_cpu_tensors_and_reference_on_request():
    cache, tables, context = build(INT8, 16, 64, 2, [50, 9], seed=31)
    q = torch.randn(2, 4, 64)
    auto = paged_decode_attention(cache, 1, q, tables, context)
    assert torch.equal(auto, paged_decode_attention(cache, 1, q, tables, context, backend="cpu"))
    ref = paged_decode_attention(cache, 1, kernel_query(cache, q, tables, context), tables, context,
                                 backend="reference")
    assert ref.dtype == torch.float32 and torch.allclose(auto, ref, rtol=1e-5, atol=1e-6)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    qp = torch.randn(5, 4, 64)
    auto = paged_prefill_attention(cache, 1, qp, cu, tables, context)
    ref = paged_prefill_attention(cache, 1, qp, cu, tables, context, backend="reference")
    assert torch.allclose(auto, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(KvCacheError):
        paged_decode_attention(cache, 1, q, tables, context, backend="cuda")


def test_q_dtypes_and_index_dtypes_are_accepted():
    cache, tables, context = build(F16, 16, 64, 2, [50, 9], seed=32)
    q = torch.randn(2, 4, 64)
    ref = reference.paged_decode_attention(cache, 1, q.bfloat16().float(), tables, context)
    out = paged_decode_attention(cache, 1, q.bfloat16(), tables.long(), context.long(), backend="cpu")
    assert rel_err(out, ref) < TOL


def test_attention_argument_errors():
    cache, tables, context = build(INT8, 16, 64, 2, [50, 9], seed=33)
    q = torch.randn(2, 4, 64)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    bad_decode = [
        (LayerOutOfRange, dict(layer=2)),
        (ShapeMismatch, dict(q=torch.randn(2, 3, 64))),  # 3 q heads over 2 kv heads
        (ShapeMismatch, dict(q=torch.randn(2, 4, 32))),
        (ShapeMismatch, dict(q=torch.randn(3, 4, 64))),  # batch differs from the tables
        (ShapeMismatch, dict(tables=tables.float())),
        (ShapeMismatch, dict(context=context[:1])),
        (PositionOutOfRange, dict(tables=tables + cache.num_blocks)),
        (PositionOutOfRange, dict(context=context + 1000)),
        (PositionOutOfRange, dict(starts=torch.tensor([-1, 0], dtype=torch.int32))),
    ]
    for err, change in bad_decode:
        args = dict(layer=1, q=q, tables=tables, context=context, starts=None) | change
        with pytest.raises(err):
            paged_decode_attention(
                cache, args["layer"], args["q"], args["tables"], args["context"], kv_starts=args["starts"]
            )
    for bad_cu in (torch.tensor([0, 1, 3]), torch.tensor([1, 1, 2]), torch.tensor([0, 2, 1]), torch.tensor([0, 2])):
        with pytest.raises(ShapeMismatch):
            paged_prefill_attention(cache, 1, q, bad_cu.int(), tables, context)
    with pytest.raises(ShapeMismatch):  # 10 queries for a 9-token sequence
        paged_prefill_attention(cache, 1, torch.randn(12, 4, 64), torch.tensor([0, 2, 12]).int(), tables, context)
    out = paged_prefill_attention(cache, 1, q, cu, tables, context)
    assert out.shape == q.shape


def test_empty_batch():
    cache, tables, context = build(INT8, 16, 64, 2, [5], seed=34)
    out = paged_decode_attention(cache, 1, torch.randn(0, 4, 64), tables[:0], context[:0], backend="cpu")
    assert out.shape == (0, 4, 64)


def test_all_finite_is_numpys_isfinite_on_ragged_rows_with_nan_inf_and_huge_values():
    """`cpu.all_finite`, the CPU query check of ops.check_query: the same answer as numpy's isfinite(...).all() on
    fresh random float32 rows of ragged sizes and magnitudes up to float32's largest, with a NaN, a +/-inf or
    neither at a random place (no fastmath: a compiled pass allowed to assume finite values would say True)."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    seen = set()
    for _ in range(2000):
        n = int(rng.integers(1, 700))
        a = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-45, 38)
        kind = int(rng.integers(0, 4))
        if kind:
            a[int(rng.integers(0, n))] = (np.nan, np.inf, -np.inf)[kind - 1]
        rows = a.reshape(1, 1, n)
        assert cpu.all_finite(rows) == bool(np.isfinite(rows).all())
        seen.add(bool(np.isfinite(rows).all()))
    assert seen == {True, False}
    assert cpu.all_finite(np.full((1, 9, 64), np.finfo(np.float32).max, np.float32))


def test_a_pools_numpy_views_are_kept_while_it_lives_and_dropped_with_it():
    """The kernels' numpy views of a pool's layers are built once per (pool, layer) and kept by the pool's
    identity; a pool that is gone takes its entry with it, so neither its tensors stay alive nor a later pool
    that reuses its id reads them."""
    import gc

    cache, tables, context = build(INT8, 16, 64, 2, [90], seed=31)
    pool = cache.pool
    first = cpu._layer_arrays(pool, 1)
    assert cpu._layer_arrays(pool, 1) is first and first[0].base is not None
    assert np.shares_memory(first[0], pool.layer_parts(1)[0][0].numpy())
    key = id(pool)
    assert key in cpu._VIEWS
    del cache, pool, first
    gc.collect()
    assert key not in cpu._VIEWS
