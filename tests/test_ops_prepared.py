"""`ops.PreparedAttention`: one plan's attention resolved once and run per layer gives each layer exactly what
`ops.attention` gives it (every format, decode and prefill, every variant, the cpu and reference backends), and
refuses what `ops.attention` refuses, by type, before anything runs.

The float64 oracle is the reference backend, on fresh random inputs with ragged lengths.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_decode_path import HKV, HQ, tiny_model
from test_ops_cpu import FORMATS, TOL, kernel_query, rel_err
from test_ops_windows import VARIANTS, ragged_step, variant_args

from int8kv.errors import LayerOutOfRange, NonFiniteError, ShapeMismatch
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache
from int8kv.ops import PreparedAttention, append_paged_kv, attention, plan_attention


def _two_layers(fmt, decode: bool, seed: int):
    """A ragged step (`test_ops_windows.ragged_step`: layer 1 filled) with layer 0 filled too, other rows."""
    cache, q, tables, context, starts, cu = ragged_step(fmt, 16, 64, 2, decode, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    for seq in range(len(context)):
        n = int(context[seq])
        if n:
            k, v = (torch.randn(n, 2, 64, generator=gen) for _ in range(2))
            append_paged_kv(cache, 0, k, v, cache.slots(seq))
    plan = plan_attention(cache.pool, tables, context, kv_starts=starts, cu_seqlens_q=cu, num_queries=q.shape[0])
    return cache, q, plan, tables, context


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("name", ["plain", "window", "softcap", "sinks", "all"])
def test_each_layer_gets_what_attention_gives_it(fmt, decode, name):
    seed = 11 + len(name) + 3 * decode
    cache, q, plan, tables, context = _two_layers(fmt, decode, seed)
    args = {} if name == "plain" else variant_args(VARIANTS[name], q.shape[1], seed)
    for backend in ("cpu", "reference"):
        call = PreparedAttention(cache, plan, q.shape[1], backend=backend, **args)
        # Layers in both orders and twice each: a prepared call keeps nothing of one layer for the next.
        for layer in (1, 0, 1, 0):
            got = call.run(cache, layer, q)
            assert got.dtype == torch.float32 and got.shape == q.shape
            assert torch.equal(got, attention(cache, layer, q, plan, backend=backend, **args)), (backend, layer)
    # The two layers hold different rows, so their outputs differ; the cpu backend's are the float64 oracle's
    # within TOL, for the query as its decode path rounds it (int16 codes; test_ops_windows checks that bound).
    cpu = PreparedAttention(cache, plan, q.shape[1], backend="cpu", **args)
    exact = q if not decode else kernel_query(cache, q, tables, context, None)
    oracle = PreparedAttention(cache, plan, q.shape[1], backend="reference", **args)
    out = [cpu.run(cache, layer, q) for layer in (0, 1)]
    assert not torch.equal(out[0], out[1])
    for layer in (0, 1):
        assert rel_err(out[layer], oracle.run(cache, layer, exact)) < TOL, layer


def test_a_query_checked_by_the_caller_is_taken_as_is():
    cache, q, plan, *_ = _two_layers(FORMATS[0], True, 5)
    call = PreparedAttention(cache, plan, q.shape[1])
    assert torch.equal(call.run(cache, 1, q, check_q=False), call.run(cache, 1, q))


def test_what_attention_refuses_a_prepared_call_refuses():
    fmt = FORMATS[1]
    cache, q, plan, *_ = _two_layers(fmt, True, 3)
    heads = q.shape[1]
    for bad in (3, 0, -2, True, 4.0):  # not a positive int multiple of the 2 KV heads
        with pytest.raises(ShapeMismatch):
            PreparedAttention(cache, plan, bad)
    for args in ({"window": 0}, {"softcap": -1.0}, {"sinks": torch.zeros(heads + 1)}):
        with pytest.raises(type(_refusal(cache, q, plan, args))):
            PreparedAttention(cache, plan, heads, **args)
    call = PreparedAttention(cache, plan, heads)
    other, *_ = ragged_step(fmt, 16, 64, 2, True, 4, lens=(1, 37))  # another geometry: fewer blocks
    with pytest.raises(ShapeMismatch, match="prepared for another pool"):
        call.run(other, 1, q)
    with pytest.raises(LayerOutOfRange):
        call.run(cache, 2, q)
    with pytest.raises(ShapeMismatch):
        call.run(cache, 1, q[:, : heads // 2])  # other query heads
    with pytest.raises(ShapeMismatch):
        call.run(cache, 1, q[1:])  # other number of queries than the plan's
    nan = q.clone()
    nan[1, 0, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        call.run(cache, 1, nan)
    assert torch.equal(call.run(cache, 1, q), attention(cache, 1, q, plan))  # still serves after the refusals


def _refusal(cache, q, plan, args) -> Exception:
    try:
        attention(cache, 1, q, plan, **args)
    except Exception as e:  # the error attention raises for these arguments
        return e
    raise AssertionError(f"attention took {args}")


def test_the_drop_in_prepares_once_per_forward_for_every_layer(monkeypatch):
    """A decode step of a 2-layer model builds one prepared call, which both layers run; the logits are the
    float32 model's within F16 storage's rounding."""
    built = []
    original = PreparedAttention.__init__

    def counting(self, *args, **kwargs):
        built.append(args[2])
        original(self, *args, **kwargs)

    monkeypatch.setattr(PreparedAttention, "__init__", counting)
    torch.manual_seed(2)
    model = tiny_model()
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = Int8KvCache(model.config, format=KvStorageFormat.F16)
    with torch.inference_mode():
        model(input_ids=ids[:, :19], cache=cache, use_cache=True)
        built.clear()
        step = model(input_ids=ids[:, 19:], cache=cache, use_cache=True).logits
        model.set_attn_implementation("sdpa")
        full = model(input_ids=ids).logits[:, -1:]
    assert built == [HQ] and HQ % HKV == 0
    assert rel_err(step, full) < 2e-3


def test_attention_with_one_plan_follows_numbas_thread_count():
    # `attention` keeps what it resolved for a plan (the CPU's work items and their split of the keys over
    # threads) per numba thread count: after `numba.set_num_threads` it runs the split of the new count, as a call
    # prepared under that count does. One long sequence: two threads split its keys (then merge), one does not, so
    # the two counts' outputs differ in their last bits and a call that kept the other count's split is seen.
    import numba

    threads = numba.get_num_threads()
    if threads < 2:
        pytest.skip("numba runs one thread here")
    fmt = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
    cache, q, plan = _one_long_sequence(fmt, 2_000, seed=31)
    outs = {}
    try:
        for n in (threads, 1, threads):
            numba.set_num_threads(n)
            prepared = PreparedAttention(cache, plan, q.shape[1]).run(cache, 0, q)
            for _ in range(3):
                assert torch.equal(attention(cache, 0, q, plan), prepared), n
            outs.setdefault(n, prepared)
            assert torch.equal(outs[n], prepared)
    finally:
        numba.set_num_threads(threads)
    assert not torch.equal(outs[1], outs[threads])  # the check above could tell the two splits apart


def _one_long_sequence(fmt, n: int, seed: int):
    from int8kv.cache.paged import PagedKvCache

    gen = torch.Generator().manual_seed(seed)
    cache = PagedKvCache(-(-n // 16), 16, 1, 2, 64, fmt)
    cache.add_sequence(0, n)
    k, v = (torch.randn(n, 2, 64, generator=gen) for _ in range(2))
    append_paged_kv(cache, 0, k, v, cache.slots(0))
    tables, context = cache.batch_tensors([0], min_blocks=1)
    q = torch.randn(1, 6, 64, generator=gen)
    return cache, q, plan_attention(cache.pool, tables, context)
