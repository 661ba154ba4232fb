"""AttentionPlan (int8kv.ops.plan): checked once per step, frozen, reused by every layer and every backend."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import int8kv.ops.plan as plan_mod
from int8kv.cache.paged import PagedKvCache
from int8kv.errors import KvCacheError, NonFiniteError, PositionOutOfRange, ShapeMismatch, UnknownBackend
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, attention, paged_decode_attention, paged_prefill_attention, plan_attention
from int8kv.ops import cpu as cpu_backend

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
BIG = 2**32 + 1  # wraps to 1 when cast to int32


def filled_cache(lens=(9, 20), layers=2, seed=0) -> tuple[PagedKvCache, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    c = PagedKvCache(16, 4, layers, 2, 8, INT8)
    for i, n in enumerate(lens):
        slots = c.add_sequence(i, n)
        for layer in range(layers):
            append_paged_kv(c, layer, torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen), slots)
    tables, context = c.batch_tensors(list(range(len(lens))))
    return c, tables, context


def counting_validations(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = plan_mod.validate_values

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_mod, "validate_values", counted)
    return calls


# -- int64 values are checked before any cast ------------------------------------------------------------
def test_int64_entries_beyond_int32_are_refused_not_wrapped():
    c, tables, context = filled_cache()
    q = torch.randn(2, 4, 8)
    with pytest.raises(PositionOutOfRange):
        plan_attention(c.pool, torch.tensor([[0, BIG], [1, 2]]), context.long())
    with pytest.raises(PositionOutOfRange):
        plan_attention(c.pool, tables.long(), torch.tensor([9, BIG]))
    with pytest.raises(PositionOutOfRange):
        plan_attention(c.pool, tables, context, kv_starts=torch.tensor([0, BIG]))
    with pytest.raises(PositionOutOfRange):
        paged_decode_attention(c, 0, q, tables.long() + torch.tensor([[0], [2**32]]), context)
    with pytest.raises(KvCacheError):
        paged_prefill_attention(c, 0, q, torch.tensor([0, 1, BIG + 1]), tables, context)
    with pytest.raises(PositionOutOfRange):
        plan_attention(c.pool, tables, context, slots=torch.tensor([3, BIG]))


def test_plan_is_frozen_and_int32():
    c, tables, context = filled_cache()
    plan = plan_attention(c.pool, tables.long(), context.long(), kv_starts=torch.tensor([0, 3]))
    assert plan.block_tables.dtype == plan.context_lens.dtype == plan.kv_starts.dtype == torch.int32
    assert plan.is_decode and plan.max_query_len == 1 and plan.cu_seqlens_q.tolist() == [0, 1, 2]
    assert plan.softmax_scale == pytest.approx(8**-0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.softmax_scale = 1.0


def test_unvalidated_plan_skips_the_checks(monkeypatch):
    c, tables, context = filled_cache()
    calls = counting_validations(monkeypatch)
    plan = plan_attention(c.pool, tables, context, validate=False)
    assert calls == [] and plan.is_decode
    with pytest.raises(ShapeMismatch):  # prefill launch grids need the longest query run: it must be given
        plan_attention(c.pool, tables, context, cu_seqlens_q=torch.tensor([0, 1, 3]), validate=False)
    plan = plan_attention(
        c.pool, tables, context, cu_seqlens_q=torch.tensor([0, 1, 3]), num_queries=3, max_query_len=2,
        validate=False,
    )
    q = torch.randn(3, 4, 8)
    want = paged_prefill_attention(c, 1, q, torch.tensor([0, 1, 3]), tables, context)
    assert torch.equal(attention(c, 1, q, plan), want)


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except KvCacheError as e:
        return type(e), str(e)


def test_host_statistics_decide_exactly_like_the_device_ones():
    """validate_values computes its statistics with numpy on CPU tensors and with torch ops (one host read)
    elsewhere: on the same metadata, valid or not (ragged batches, int32 and int64, values out of range, beyond
    int32, repeated slots, queries past their keys, empty tensors), both return the same or raise the same."""
    pool = PagedKvCache(16, 4, 1, 2, 8, INT8).pool
    gen = torch.Generator().manual_seed(7)
    seen: set = set()

    def ints(shape, lo, hi, dtype):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)

    for trial in range(400):
        batch = int(torch.randint(0, 5, (), generator=gen))
        width = int(torch.randint(1, 5, (), generator=gen))
        dtype = (torch.int32, torch.int64)[trial % 2]
        bad = trial % 3 == 0  # a third of the trials stretch the ranges past the pool's
        tables = ints((batch, width), -1 if bad else 0, 18 if bad else 16, dtype)
        lens = ints((batch,), -1 if bad else 0, width * 4 + (3 if bad else 1), dtype)
        starts = None if trial % 4 else ints((batch,), 0, 3, dtype)
        cu = n_q = None
        if trial % 5:
            counts = ints((batch,), -1 if bad else 0, 4, torch.int64)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(dtype)
            n_q = int(cu[-1]) if batch else 0
        tokens = batch if cu is None else max(n_q, 0)
        slots = None if trial % 7 == 3 else ints((tokens,), -1 if bad else 0, 70 if bad else 64, torch.int64)
        if slots is not None and tokens > 1 and trial % 6 == 0:
            slots[-1] = slots[0]  # a repeat
        positions = None if trial % 8 == 5 else ints((tokens,), -1 if bad else 0, 40, torch.int64)
        if trial % 11 == 0 and batch and dtype == torch.int64:
            lens[0] = BIG  # beyond int32: refused, not wrapped
        args = (pool, tables, lens, starts, cu, n_q, slots, positions, 32)
        host = _outcome(plan_mod.validate_values, *args, host=True)
        device = _outcome(plan_mod.validate_values, *args, host=False)
        assert host == device, (trial, args[1:])
        seen.add(host[0] if isinstance(host[0], type) else "valid")
    assert seen == {"valid", PositionOutOfRange, ShapeMismatch}  # every kind of outcome was met


# -- one behaviour on every backend ----------------------------------------------------------------------
BACKENDS = ["reference", "cpu", "triton"]


def _skip_without_triton(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")


def test_finite_query_whose_sum_overflows_is_accepted():
    """The CPU check first sums q (fast): huge finite values (their float32 sum would overflow) are accepted,
    a single NaN or inf among them is still refused."""
    from int8kv.ops import check_query

    c, tables, context = filled_cache()
    plan = plan_attention(c.pool, tables, context)
    q = torch.full((2, 4, 8), 3e38)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        assert torch.equal(check_query(c.pool, q, plan), q)
    for bad in (float("nan"), float("inf"), float("-inf")):
        q_bad = q.clone()
        q_bad[0, 1, 2] = bad
        with pytest.raises(NonFiniteError):
            check_query(c.pool, q_bad, plan)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_query_or_scale_is_refused_on_every_backend(backend):
    _skip_without_triton(backend)
    c, tables, context = filled_cache()
    q = torch.randn(2, 4, 8)
    for bad in (float("nan"), float("inf")):
        q_bad = q.clone()
        q_bad[1, 2, 3] = bad
        with pytest.raises(NonFiniteError):
            paged_decode_attention(c, 0, q_bad, tables, context, backend=backend)
        with pytest.raises(NonFiniteError):
            paged_prefill_attention(c, 0, q_bad, torch.tensor([0, 1, 2]), tables, context, backend=backend)
    with pytest.raises(NonFiniteError):
        paged_decode_attention(c, 0, q, tables, context, softmax_scale=float("nan"), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_plan_serves_every_layer_like_single_calls(backend):
    _skip_without_triton(backend)
    c, tables, context = filled_cache(lens=(9, 20, 1), layers=3, seed=5)
    cu = torch.tensor([0, 3, 7, 8])
    q = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(6))
    plan = plan_attention(c.pool, tables, context, cu_seqlens_q=cu, num_queries=8)
    for layer in range(3):
        planned = attention(c, layer, q, plan, backend=backend)
        single = paged_prefill_attention(c, layer, q, cu, tables, context, backend=backend)
        torch.testing.assert_close(planned, single, rtol=0, atol=0)


def test_triton_backend_on_a_cpu_cache_is_a_typed_error(monkeypatch):
    c, tables, context = filled_cache()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnknownBackend):
        paged_decode_attention(c, 0, torch.randn(2, 4, 8), tables, context, backend="triton")


def test_cpu_work_items_are_built_once_per_plan(monkeypatch):
    c, tables, context = filled_cache(layers=2)
    built = []
    real = cpu_backend._work

    def counted(plan, pool, num_q_heads, threads, variant):
        built.append(None if variant is None else variant.window)
        return real(plan, pool, num_q_heads, threads, variant)

    monkeypatch.setattr(cpu_backend, "_work", counted)
    plan = plan_attention(c.pool, tables, context)
    for layer in (0, 1, 0, 1):
        attention(c, layer, torch.randn(2, 4, 8), plan, backend="cpu")
    assert built == [None]
    # Sliding and full layers in one step (Gemma 3): once per window; sinks alone change no key range
    for layer in (0, 1, 0, 1):
        attention(c, layer, torch.randn(2, 4, 8), plan, backend="cpu", window=3, sinks=torch.zeros(4))
        attention(c, layer, torch.randn(2, 4, 8), plan, backend="cpu", sinks=torch.ones(4))
    assert built == [None, 3]


# -- once per step, whatever the number of layers ---------------------------------------------------------
def _tiny_llama(num_layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(num_layers)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("num_layers", [2, 6])
@pytest.mark.parametrize("path", ["fused", "transformers"])
def test_engine_step_validates_once_whatever_the_layers(num_layers, path, monkeypatch):
    pytest.importorskip("transformers")
    from int8kv.engine.hf_model import TransformersModel
    from int8kv.engine.model import Batch, DecoderModel

    model = (DecoderModel if path == "fused" else TransformersModel)(_tiny_llama(num_layers))
    cache = model.make_cache(16, 4, INT8)
    calls = counting_validations(monkeypatch)
    prompts = [5, 3]
    slots = [cache.add_sequence(i, n) for i, n in enumerate(prompts)]
    tables, lens = cache.batch_tensors([0, 1])
    ids = torch.randint(0, 64, (sum(prompts),), generator=torch.Generator().manual_seed(2))
    prefill = Batch(ids, torch.cat([torch.arange(n) for n in prompts]), torch.cat(slots),
                    torch.tensor([0, 5, 8], dtype=torch.int32), tables, lens, is_decode=False)
    logits = model.forward(cache, prefill)
    assert logits.shape == (2, 64) and len(calls) == 1
    slots = [cache.grow(i, 1) for i in range(2)]
    tables, lens = cache.batch_tensors([0, 1])
    decode = Batch(torch.tensor([7, 9]), torch.tensor([5, 3]), torch.cat(slots),
                   torch.tensor([0, 1, 2], dtype=torch.int32), tables, lens, is_decode=True)
    model.forward(cache, decode)
    assert len(calls) == 2  # one validation per step, for 2 layers as for 6


@pytest.mark.parametrize("num_layers", [2, 6])
def test_transformers_forward_validates_once_whatever_the_layers(num_layers, monkeypatch):
    pytest.importorskip("transformers")
    from int8kv.hf import Int8KvCache

    model = _tiny_llama(num_layers)
    cache = Int8KvCache(model.config)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding: the plan carries kv_starts and the packed queries
    calls = counting_validations(monkeypatch)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        assert len(calls) == 1
        nxt = out.logits[:, -1:].argmax(-1)
        model(nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), cache=cache,
              use_cache=True)
    assert len(calls) == 2
    assert cache.attention_calls == 2 * num_layers
