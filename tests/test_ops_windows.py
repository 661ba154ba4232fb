"""Sliding windows, chunked attention, logit softcapping and attention sinks, in every backend.

The float64 reference is first checked against transformers' own code (its mask functions and the eager
attention of Gemma 2 and gpt-oss) on a dense batch, then every backend against the reference on ragged paged
batches. Every key a step may not see is poisoned (NaN) before the backends run, and block-table entries of
blocks wholly outside the window point at a NaN block: a kernel that reads one returns NaN and fails loudly.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from test_ops_cpu import F16, FORMATS, INT8, TOL, build, kernel_query, one_torch_thread, rel_err  # noqa: F401

from int8kv.errors import KvCacheError, NonFiniteError, ShapeMismatch
from int8kv.ops import AttentionVariant, attention, paged_decode_attention, plan_attention, reference

VARIANTS = {
    "window": {"window": 37},
    "chunk": {"chunk": 24},
    "softcap": {"softcap": 3.0},
    "sinks": {"sinks": "random"},
    "window+softcap+sinks": {"window": 50, "softcap": 5.0, "sinks": "random"},
    "chunk+window": {"chunk": 64, "window": 20},
    "all": {"window": 45, "chunk": 32, "softcap": 4.0, "sinks": "random"},
}


def variant_args(spec: dict, num_q_heads: int, seed: int) -> dict:
    """The keyword arguments of `spec`, with fresh random sinks (some far above the scores, some below)."""
    args = dict(spec)
    if args.get("sinks") == "random":
        gen = torch.Generator().manual_seed(seed)
        args["sinks"] = torch.randn(num_q_heads, generator=gen) * 3
    return args


def positions(context: torch.Tensor, cu: torch.Tensor | None) -> list[torch.Tensor]:
    """The query positions of each sequence (decode: its last one)."""
    lens = context.tolist()
    counts = [1] * len(lens) if cu is None else (cu[1:] - cu[:-1]).tolist()
    return [torch.arange(n - c, n) for n, c in zip(lens, counts, strict=True)]


def poison_outside(cache, layer, tables, context, starts, cu, args) -> torch.Tensor:
    """NaN every stored key of each sequence that none of its queries of this step may see, and point the table
    entries of blocks holding no visible key at block 0 (all NaN: it belongs to no sequence). Returns the tables."""
    variant = AttentionVariant(args.get("window"), args.get("chunk"))
    k, v = cache.pool.layer_parts(layer)
    poisoned = (k[-1], v[-1])  # V1's scales, F16's codes
    bs = cache.block_size
    tables = tables.clone()
    start_list = [0] * len(context) if starts is None else starts.tolist()
    for b, pos in enumerate(positions(context, cu)):
        if pos.numel() == 0:
            continue
        visible = reference.visible_keys(pos, torch.arange(int(context[b])), start_list[b], variant)
        seen = visible.any(dim=0).nonzero()
        first = int(seen[0]) if seen.numel() else int(context[b])
        for p in range(first):
            for t in poisoned:
                t[tables[b, p // bs], p % bs] = float("nan")
        tables[b, : first // bs] = 0
    return tables


def dense_transformers(q, k, v, visible, scale, softcap=None, sinks=None):
    """Attention as transformers computes it in eager mode, in float64: q [n, Hq, D], k/v [t, Hkv, D]."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    module.training = False
    mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))[None, None]
    args = (q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None])
    if sinks is not None:
        assert softcap is None
        module.sinks = sinks.double()
        out, _ = gpt_oss_eager(module, *args, mask, scale)
    else:
        out, _ = gemma2_eager(module, *args, mask, scaling=scale, softcap=softcap)
    return out[0]


@pytest.mark.parametrize("case", ["window", "chunk", "chunk-padded", "softcap", "sinks"])
def test_reference_matches_transformers(case):
    """The oracle against transformers' own mask functions and eager attention, on one dense sequence."""
    from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

    n, hq, hkv, d, first = 70, 4, 2, 16, 50  # queries at positions 50..69 of 70 stored
    cache, tables, context = build(F16, 16, d, hkv, [n], seed=3)
    q = torch.randn(n - first, hq, d, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, n - first], dtype=torch.int32)
    start = 7 if case == "chunk-padded" else 0
    qi, ki = torch.arange(first, n)[:, None], torch.arange(n)[None, :]
    args: dict = {}
    if case == "window":
        args = {"window": 13}
        visible = sliding_window_causal_mask_function(13)(0, 0, qi, ki)
    elif case.startswith("chunk"):
        args = {"chunk": 16}
        visible = chunked_causal_mask_function(16, torch.tensor([start]))(0, 0, qi, ki)
    else:
        visible = ki <= qi
        args = {"softcap": 2.5} if case == "softcap" else {"sinks": torch.randn(hq) * 2}
    visible = visible & (ki >= start)  # the left padding itself is masked by the padding mask
    starts = torch.tensor([start], dtype=torch.int32)
    got = reference.paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=starts, **args)
    k, v = reference.gather_kv(cache.pool, 1, tables[0], n)
    want = dense_transformers(q, k, v, visible, d**-0.5, args.get("softcap"), args.get("sinks"))
    # Gemma 2's eager softmax runs in float32 whatever the input (dtype=torch.float32); gpt-oss's in float64 here
    assert (got - want).abs().max() < (1e-12 if case == "sinks" else 1e-6)
    # ...and the variant changes the answer: a test that would pass on plain causal attention proves nothing
    plain = reference.paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=starts)
    assert (plain - got).abs().max() > 1e-3


def test_reference_no_visible_key_is_zero_with_a_sink():
    cache, tables, context = build(INT8, 8, 16, 1, [30, 12], seed=5)
    q = torch.randn(2, 2, 16)
    starts = torch.tensor([30, 0], dtype=torch.int32)  # sequence 0: nothing visible
    out = reference.paged_decode_attention(cache, 1, q, tables, context, kv_starts=starts, sinks=torch.ones(2))
    assert not out[0].any() and out[1].abs().min() > 0


def test_variant_key_lows_match_the_reference_mask():
    """`AttentionVariant.key_lows`, which the CPU backend plans its key ranges with, against the mask."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        window = int(rng.integers(1, 40)) if rng.random() < 0.7 else None
        chunk = int(rng.integers(1, 40)) if rng.random() < 0.7 else None
        variant = AttentionVariant(window, chunk)
        start = int(rng.integers(0, 20))
        pos = np.arange(100)
        lows = variant.key_lows(pos, np.full(100, start))
        visible = reference.visible_keys(torch.from_numpy(pos), torch.arange(100), start, variant)
        for p in range(100):
            keys = visible[p].nonzero().squeeze(1)
            if keys.numel():  # visible keys form one run [low, p]
                assert int(keys[0]) == lows[p] and int(keys[-1]) == p and keys.numel() == p - lows[p] + 1
            else:
                assert p < start


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"window": 0}, ShapeMismatch),
        ({"window": -3}, ShapeMismatch),
        ({"window": 2.5}, ShapeMismatch),
        ({"window": True}, ShapeMismatch),
        ({"chunk": 0}, ShapeMismatch),
        ({"chunk": "8"}, ShapeMismatch),
        ({"softcap": 0.0}, ShapeMismatch),
        ({"softcap": -1.0}, ShapeMismatch),
        ({"softcap": float("inf")}, NonFiniteError),
        ({"softcap": float("nan")}, NonFiniteError),
        ({"softcap": "5"}, ShapeMismatch),
        ({"sinks": torch.zeros(3)}, ShapeMismatch),
        ({"sinks": torch.zeros(4, 1)}, ShapeMismatch),
        ({"sinks": torch.zeros(4, dtype=torch.int32)}, ShapeMismatch),
        ({"sinks": [0.0] * 4}, ShapeMismatch),
        ({"sinks": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, NonFiniteError),
        ({"sinks": torch.tensor([0.0, float("inf"), 0.0, 0.0])}, NonFiniteError),
    ],
)
def test_bad_variant_arguments_are_refused(backend, args, error):
    cache, tables, context = build(INT8, 8, 16, 2, [20, 9], seed=6)
    before = [t.clone().flatten().view(torch.uint8) for t in cache.pool.storage() if t is not None]
    plan = plan_attention(cache.pool, tables, context)
    q = torch.randn(2, 4, 16)
    with pytest.raises(error) as info:
        attention(cache, 1, q, plan, backend=backend, **args)
    assert isinstance(info.value, KvCacheError)
    after = [t.flatten().view(torch.uint8) for t in cache.pool.storage() if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # bit for bit, NaN poison included
    # the same plan still serves a good call
    out = attention(cache, 1, q, plan, backend=backend, window=5)
    # the query the kernel multiplies: int16 codes where this CPU's integer kernel takes head_dim 16 (AVX2, whose
    # vectors hold 16 of them; the 512-bit one needs multiples of 32 and runs exact)
    kq = kernel_query(cache, q, tables, context) if backend == "cpu" else q
    ref = reference.paged_decode_attention(cache, 1, kq, tables, context, window=5)
    assert rel_err(out, ref) < TOL


def test_huge_window_is_full_attention():
    cache, tables, context = build(F16, 16, 16, 2, [40, 3], seed=8)
    q = torch.randn(2, 2, 16)
    full = paged_decode_attention(cache, 1, q, tables, context, backend="reference")
    wide = paged_decode_attention(cache, 1, q, tables, context, backend="reference", window=2**40, chunk=2**40)
    assert torch.equal(full, wide)


# -- every backend against the reference ---------------------------------------------------------------------
def run_backend(backend, cache, q, tables, context, starts, cu, args, precision=None):
    """`backend` and the reference over the same step, out-of-window keys poisoned; returns (out, ref).
    ``precision``: the plan's (None: the default)."""
    tables = poison_outside(cache, 1, tables, context, starts, cu, args)
    plan = plan_attention(cache.pool, tables, context, kv_starts=starts, cu_seqlens_q=cu, num_queries=q.shape[0],
                          precision=precision)
    out = attention(cache, 1, q, plan, backend=backend, **args)
    if backend == "cpu" and cu is None:  # a decode step: the query as its precision rounds it
        q = kernel_query(cache, q, tables, context, precision)
    ref = reference.attend(cache.pool, 1, q, plan, check_variant_of(cache, q, args))
    return out, ref


def check_variant_of(cache, q, args):
    from int8kv.ops import check_variant

    return check_variant(cache.pool, q.shape[1], **args)


def ragged_step(fmt, block_size, head_dim, group, decode, seed, lens=(1, 37, 150, 0, 90, 300)):
    """A ragged batch (an empty sequence, one shorter than any window, long ones), kv_starts on some, and for
    prefill chunks of 1..40 queries (the last positions of each sequence)."""
    cache, tables, context = build(fmt, block_size, head_dim, 2, list(lens), seed)
    rng = np.random.default_rng(seed)
    starts = torch.tensor([int(rng.integers(0, n // 3 + 1)) for n in lens], dtype=torch.int32)
    if decode:
        cu = None
        n_q = len(lens)
    else:
        counts = [min(n, int(rng.integers(1, 41))) for n in lens]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
        n_q = int(cu[-1])
    q = torch.randn(n_q, 2 * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return cache, q, tables, context, starts, cu


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cpu_matches_reference(fmt, decode, name):
    for block_size, head_dim, group in ((8, 64, 1), (16, 40, 3), (32, 128, 4), (16, 64, 2)):
        for padded in (False, True):  # a fresh cache each: the poison depends on the kv_starts
            seed = block_size * 100 + head_dim + group + len(name) + padded
            cache, q, tables, context, starts, cu = ragged_step(fmt, block_size, head_dim, group, decode, seed)
            args = variant_args(VARIANTS[name], q.shape[1], seed)
            out, ref = run_backend("cpu", cache, q, tables, context, starts if padded else None, cu, args)
            assert rel_err(out, ref) < TOL, (block_size, head_dim, group, padded)


@pytest.mark.parametrize("name", ["softcap", "all"])
def test_cpu_exact_decode_matches_reference(name):
    """The float32 query path on an INT8 cache (the default where no integer kernel fits), every variant's
    branch: softcap alone, and window + chunk + softcap + sinks."""
    for block_size, head_dim, group in ((16, 64, 2), (32, 128, 4)):
        seed = block_size + head_dim + len(name)
        cache, q, tables, context, starts, _ = ragged_step(INT8, block_size, head_dim, group, True, seed)
        args = variant_args(VARIANTS[name], q.shape[1], seed)
        out, ref = run_backend("cpu", cache, q, tables, context, starts, None, args, precision="exact")
        assert rel_err(out, ref) < TOL, (block_size, head_dim)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["window", "chunk", "sinks", "all", "chunk+window", "window+softcap+sinks"])
def test_cpu_long_prefill_chunks_match_reference(fmt, name, monkeypatch):
    """Long chunks take the torch flash path (thresholds lifted, small tiles: several key tiles and query blocks,
    masked tiles below the block's common window where some rows see nothing); with a softcap they must not."""
    from int8kv.ops import cpu

    monkeypatch.setattr(cpu, "FLASH_MIN_PAIRS", 0)
    monkeypatch.setattr(cpu, "FLASH_KEY_TILE", 24)  # not a multiple of any block size
    monkeypatch.setattr(cpu, "FLASH_QUERY_ROWS", 96)
    calls = []
    real = cpu._flash_sequence
    monkeypatch.setattr(cpu, "_flash_sequence", lambda q, *a: calls.append(q.shape[1]) or real(q, *a))
    lens, counts = (300, 180, 40, 9), (200, 150, 7, 0)
    for padded in (False, True):
        seed = 40 + padded + len(name)
        cache, tables, context = build(fmt, 16, 64, 2, list(lens), seed)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
        q = torch.randn(int(cu[-1]), 6, 64, generator=torch.Generator().manual_seed(seed))
        starts = torch.tensor([17, 150, 3, 0], dtype=torch.int32) if padded else None
        args = variant_args(VARIANTS[name], 6, seed)
        out, ref = run_backend("cpu", cache, q, tables, context, starts, cu, args)
        assert rel_err(out, ref) < TOL, padded
    assert bool(calls) == ("softcap" not in args)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [None, 700])
def test_cpu_split_decode_counts_each_sink_once(fmt, window):
    """Few sequences, long contexts: keys split across work items (flash-decoding), merged with the sink once."""
    from int8kv.ops import cpu

    cache, tables, context = build(fmt, 32, 64, 1, [3000, 1200], seed=12)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(13))
    sinks = torch.tensor([-2.0, 0.5, 3.0, 40.0])  # the last far above every score: the output almost vanishes
    args = {"sinks": sinks} if window is None else {"sinks": sinks, "window": window}
    lows = AttentionVariant(window).key_lows(context.numpy().astype(np.int64) - 1, np.zeros(2, np.int64))
    _, splits = cpu._decode_items(context.numpy().astype(np.int64), lows, numba.get_num_threads())
    if numba.get_num_threads() > 1:
        assert splits > 1
    out, ref = run_backend("cpu", cache, q, tables, context, None, None, args)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_keys_outside_the_window_are_never_read(backend, decode):
    """The guarantee that lets the engine free blocks wholly outside every window: with those blocks' table
    entries pointed at a NaN block and every older key NaN, the output is bit for bit what it was."""
    cache, tables, context = build(INT8, 16, 64, 2, [2000, 700], seed=21)
    cu = None if decode else torch.tensor([0, 5, 9], dtype=torch.int32)
    q = torch.randn(2 if decode else 9, 4, 64, generator=torch.Generator().manual_seed(22))
    args = {"window": 64, "sinks": torch.zeros(4)}
    plan = plan_attention(cache.pool, tables, context, cu_seqlens_q=cu, num_queries=q.shape[0])
    clean = attention(cache, 1, q, plan, backend=backend, **args)
    poisoned = poison_outside(cache, 1, tables, context, None, cu, args)
    assert (poisoned[0] == 0).sum() > 100  # most of the long sequence's blocks now point at garbage
    plan = plan_attention(cache.pool, poisoned, context, cu_seqlens_q=cu, num_queries=q.shape[0])
    assert torch.equal(attention(cache, 1, q, plan, backend=backend, **args), clean)


# -- triton (the interpreter on a machine without a GPU: kept small, it is slow) -----------------------------
triton_backend = pytest.importorskip("int8kv.ops.triton", reason="triton is not installed")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_triton_matches_reference(fmt, decode, name):
    block_size, head_dim, group = {True: (8, 64, 3), False: (16, 40, 2)}[decode]
    seed = 300 + len(name) + decode
    lens = (1, 37, 130, 0, 70)
    cache, q, tables, context, starts, cu = ragged_step(fmt, block_size, head_dim, group, decode, seed, lens)
    args = variant_args(VARIANTS[name], q.shape[1], seed)
    out, ref = run_backend("triton", cache, q, tables, context, starts if name != "softcap" else None, cu, args)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_split_keys_count_each_sink_once(fmt):
    """Keys split across programs (flash-decoding) and merged by the merge kernel, which adds each sink once."""
    cache, tables, context = build(fmt, 16, 32, 1, [700, 300], seed=31)
    q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(32))
    for args in ({"sinks": torch.tensor([1.5, 30.0])}, {"sinks": torch.tensor([-1.0, 2.0]), "window": 400}):
        tables_p = poison_outside(cache, 1, tables, context, None, None, args)
        plan = plan_attention(cache.pool, tables_p, context)
        variant = check_variant_of(cache, q, args)
        launch = triton_backend.launch_plan(
            q.device, batch=2, num_kv_heads=1, group=2, max_q=1, kv_bound=700, is_int8=fmt.is_quantized, num_splits=3
        )
        assert launch.num_splits == 3
        out = triton_backend.attention(cache, 1, q, plan, num_splits=3, variant=variant)
        assert rel_err(out, reference.attend(cache.pool, 1, q, plan, variant)) < TOL


def test_triton_keys_outside_the_window_are_never_read():
    cache, tables, context = build(F16, 16, 32, 1, [900, 200], seed=41)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    q = torch.randn(9, 2, 32, generator=torch.Generator().manual_seed(42))
    args = {"window": 40, "chunk": 100}
    plan = plan_attention(cache.pool, tables, context, cu_seqlens_q=cu, num_queries=9)
    clean = attention(cache, 1, q, plan, backend="triton", **args)
    poisoned = poison_outside(cache, 1, tables, context, None, cu, args)
    assert (poisoned[0] == 0).sum() > 40
    plan = plan_attention(cache.pool, poisoned, context, cu_seqlens_q=cu, num_queries=9)
    assert torch.equal(attention(cache, 1, q, plan, backend="triton", **args), clean)
