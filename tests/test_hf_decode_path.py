"""The drop-in's per-layer decode path: the query and K/V layouts it takes without copies, what it remembers
across calls (the backend of a pool, a pool's numpy views, the attention implementation checked once per
forward) and that refusals still come before anything changes.

References are float64, from the stored (dequantized) K/V, on fresh random inputs.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from int8kv import formats, ops
from int8kv.cache.pool import KvPool
from int8kv.cache.state import KvLayout
from int8kv.errors import AttentionBypassed, NonFiniteError, UnknownBackend, UnsupportedFormat
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache, int8kv_attention_forward

F16 = KvStorageFormat.F16
INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
HQ, HKV, D = 4, 2, 16


def tiny_model() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HQ,
        num_key_value_heads=HKV, head_dim=D, max_position_embeddings=128, initializer_range=0.2,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """float64 attention of the last ``n`` positions ``q [b, hq, n, d]`` over ``k, v [b, hkv, L, d]``, causal,
    row ``i`` seeing keys from ``starts[i]``: ``[b, n, hq, d]``."""
    b, hq, n, d = q.shape
    length = k.shape[2]
    g = hq // k.shape[1]
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(2, 3) / math.sqrt(d)
    key_pos = torch.arange(length)[None, None, None, :]
    query_pos = torch.arange(length - n, length)[None, None, :, None]
    first = torch.tensor(starts)[:, None, None, None]
    scores = scores.masked_fill((key_pos > query_pos) | (key_pos < first), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _filled_layer(fmt, batch: int, length: int):
    cache = Int8KvCache(tiny_model().config, fmt)
    k, v = torch.randn(batch, HKV, length, D), torch.randn(batch, HKV, length, D)
    cache.get_mask_sizes(length, 0)
    hk, hv = cache.update(k, v, 0)
    return cache, hk, hv


@pytest.mark.parametrize("fmt", [INT8, F16])
def test_decode_queries_of_every_layout_and_dtype_match_the_reference(fmt):
    """One decode position through the attention function: a contiguous query, a transposed view (the layout of
    `q_proj(x).view(b, 1, hq, d).transpose(1, 2)`), float16 / bfloat16 and one with autograd on, ragged left
    padding by mask, all equal to the float64 reference over the stored K/V, returned in the query's dtype."""
    batch, length = 3, 21
    module = tiny_model().model.layers[0].self_attn
    for dtype, layout, padded in [
        (torch.float32, "contiguous", False), (torch.float32, "transposed", True), (torch.float16, "contiguous", True),
        (torch.bfloat16, "transposed", False), (torch.float32, "grad", False),
    ]:  # fmt: skip
        cache, hk, hv = _filled_layer(fmt, batch, length - 1)
        int8kv_attention_forward(module, torch.randn(batch, HQ, length - 1, D), hk, hv, None, scaling=D**-0.5)
        cache.get_mask_sizes(1, 0)
        hk, hv = cache.update(torch.randn(batch, HKV, 1, D), torch.randn(batch, HKV, 1, D), 0)
        if layout == "transposed":
            q = torch.randn(batch, 1, HQ, D).transpose(1, 2)
        else:
            q = torch.randn(batch, HQ, 1, D, requires_grad=layout == "grad")
        q = q.to(dtype) if layout != "grad" else q
        starts = [0, 5, 2] if padded else [0] * batch
        mask = None
        if padded:
            mask = torch.arange(length)[None, None, None, :] >= torch.tensor(starts)[:, None, None, None]
        out, _ = int8kv_attention_forward(module, q, hk, hv, mask, scaling=D**-0.5)
        assert out.dtype == dtype and out.shape == (batch, 1, HQ, D)
        keys, values = cache.layers[0].dequantize()
        expected = _reference(q.detach().float(), keys, values, starts)
        tol = 2e-2 if dtype != torch.float32 else 1e-5
        assert torch.allclose(out.double(), expected, atol=tol, rtol=tol), (dtype, layout, padded)


def test_a_non_finite_query_is_refused_before_the_layer_changes():
    """NaN, +inf or -inf anywhere in a decode query: NonFiniteError, and the step's write is rolled back."""
    module = tiny_model().model.layers[0].self_attn
    for bad in (float("nan"), float("inf"), float("-inf")):
        cache, hk, hv = _filled_layer(INT8, 2, 9)
        int8kv_attention_forward(module, torch.randn(2, HQ, 9, D), hk, hv, None, scaling=D**-0.5)
        before = cache.layers[0].dequantize()
        cache.get_mask_sizes(1, 0)
        hk, hv = cache.update(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D), 0)
        q = torch.randn(2, HQ, 1, D)
        q[1, 3, 0, 7] = bad
        with pytest.raises(NonFiniteError):
            int8kv_attention_forward(module, q, hk, hv, None, scaling=D**-0.5)
        assert cache.layers[0].get_seq_length() == 9
        after = cache.layers[0].dequantize()
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_query_check_takes_huge_finite_values_silently():
    """The finiteness test is a sum of squares: values whose squares overflow float32 are still finite,
    accepted without a warning, and every non-finite value is caught wherever it is."""
    pool = KvPool(KvLayout(1, HKV, D, INT8), 2, 8)
    tables, lens = torch.arange(2, dtype=torch.int32)[:, None], torch.tensor([4, 4], dtype=torch.int32)
    plan = ops.plan_attention(pool, tables, lens)
    q = torch.randn(2, HQ, D)
    q[0, 1, 3] = 3e38
    q[1, 0, 0] = -1e30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(ops.check_query(pool, q, plan), q)
    for i in torch.randint(0, q.numel(), (8,)).tolist():
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = torch.randn(2, HQ, D)
            x.view(-1)[i] = bad
            with pytest.raises(NonFiniteError):
                ops.check_query(pool, x, plan)


def test_backend_modules_are_remembered_per_format_and_refusals_never():
    """backend_module serves each format its backend (the kernels of that format, compared with the float64
    reference); a backend that cannot serve the pool is refused every time it is asked."""
    tables = torch.arange(2, dtype=torch.int32)[:, None]
    lens = torch.tensor([7, 3], dtype=torch.int32)
    for fmt in (INT8, F16, INT8):
        pool = KvPool(KvLayout(1, HKV, D, fmt), 2, 8)
        ops.append_paged_kv(pool, 0, torch.randn(16, HKV, D), torch.randn(16, HKV, D), torch.arange(16))
        assert ops.backend_module(pool) is ops.backend_module(pool, "cpu")
        plan = ops.plan_attention(pool, tables, lens)
        q = torch.randn(2, HQ, D)
        got = ops.attention(pool, 0, q, plan)
        want = ops.attention(pool, 0, q, plan, backend="reference")
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        for _ in range(2):
            with pytest.raises(UnknownBackend):
                ops.attention(pool, 0, q, plan, backend="numpy")
            with pytest.raises(UnknownBackend):
                ops.backend_module(pool, "gpu")


def test_a_remembered_backend_is_checked_again_when_the_format_object_changes(monkeypatch):
    """The memo is keyed by the format's object, the thing check_kernels reads: F16's member answering with an
    object of another kernel after the cpu backend served it is refused by name, not handed the f16 kernels."""
    pool = KvPool(KvLayout(1, HKV, D, F16), 2, 8)
    assert ops.backend_module(pool, "cpu").__name__ == "int8kv.ops.cpu"

    class OtherKernel(formats.F16Format):
        kernel = "no-such-kernel"

    other, spec = OtherKernel(), KvStorageFormat.spec
    monkeypatch.setattr(KvStorageFormat, "spec", property(lambda f: other if f.value == "f16" else spec.fget(f)))
    with pytest.raises(UnsupportedFormat, match="cpu backend has no kernels for the f16 format"):
        ops.backend_module(pool, "cpu")
    monkeypatch.undo()
    assert ops.backend_module(pool, "cpu").__name__ == "int8kv.ops.cpu"


@pytest.mark.parametrize("fmt", [INT8, F16])
def test_row_arrays_are_the_pool_rows(fmt):
    """KvPool.row_arrays: zero-copy numpy views of layer_rows (K's parts, then V's), so a write through the pool
    is what they show, and the same objects on every call."""
    pool = KvPool(KvLayout(2, HKV, D, fmt), 3, 4)
    arrays = pool.row_arrays(1)
    assert arrays is pool.row_arrays(1) and arrays is not pool.row_arrays(0)
    k, v = pool.layer_rows(1)
    assert len(arrays) == len(k) + len(v)
    slots = torch.tensor([5, 0, 11])
    ops.append_paged_kv(pool, 1, torch.randn(3, HKV, D), torch.randn(3, HKV, D), slots)
    for a, t in zip(arrays, (*k, *v), strict=True):
        assert np.shares_memory(a, t.numpy()) and np.array_equal(a, t.numpy())


def _decode_steps(rows: list[tuple[torch.Tensor, torch.Tensor]], monkeypatch, fmt=INT8) -> tuple[Int8KvCache, int]:
    """A cache of ``fmt`` (plain storage: no config) given a 6-position prefill, then ``rows`` as decode steps;
    returns it and how many of the steps went through the general write path (write.append_rows)."""
    from int8kv.hf import cache as hf_cache

    general = []
    append_rows = hf_cache.write.append_rows
    monkeypatch.setattr(hf_cache.write, "append_rows", lambda *a, **k: general.append(1) or append_rows(*a, **k))
    cache = Int8KvCache(format=fmt)
    torch.manual_seed(7)
    cache.update(torch.randn(rows[0][0].shape[0], HKV, 6, D), torch.randn(rows[0][0].shape[0], HKV, 6, D), 0)
    general.clear()
    for k, v in rows:
        cache.update(k, v, 0)
    return cache, len(general)


@pytest.mark.parametrize("fmt", [INT8, F16])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_rows_through_the_compiled_store_are_the_general_paths_bits(batch, fmt, monkeypatch):
    """Decode rows that are float32 and contiguous go to the format's compiled store (not write.append_rows);
    the same values as non-contiguous views or as float16 take the general path, and every stored part is the
    same, equal to the format's encoder's of those rows."""
    steps = []
    for _ in range(5):
        k, v = torch.randn(batch, HKV, 1, D) * 3, torch.randn(batch, HKV, 1, D)
        k[0, 0, 0, 1] = 0.0  # a zero, and a row of float16 subnormals
        v[-1, -1, 0] = torch.randn(D) * 1e-6
        steps.append((k.half().float(), v.half().float()))  # values float16 holds: the float16 inputs are the same
    direct, general_calls = _decode_steps(steps, monkeypatch, fmt)
    assert general_calls == 0
    strided = [tuple(torch.stack((x, x), dim=-1)[..., 0] for x in kv) for kv in steps]
    assert not strided[0][0].is_contiguous()
    for rows in (strided, [(k.half(), v.half()) for k, v in steps]):
        other, general_calls = _decode_steps(rows, monkeypatch, fmt)
        assert general_calls == len(steps)
        for a, b in zip(direct.layers[0].stored(), other.layers[0].stored(), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    stored = [torch.stack([t[:, 6 + i] for i in range(len(steps))], dim=1) for t in direct.layers[0].stored()[0]]
    expected = fmt.spec.encode(torch.stack([k[:, :, 0] for k, _ in steps], dim=1))
    assert len(stored) == len(expected) and all(torch.equal(a, b) for a, b in zip(stored, expected, strict=True))


@pytest.mark.parametrize("fmt", [INT8, F16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -70000.0, 65520.0])
def test_a_decode_row_the_compiled_store_refuses_changes_nothing(bad, fmt, monkeypatch):
    """NaN, inf or a value beyond float16 in one decode row: NonFiniteError from the compiled store, nothing of
    the step stored (neither K nor V, no batch row), the length unchanged; the next good step is stored."""
    good = (torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
    cache, _ = _decode_steps([good], monkeypatch, fmt)
    layer = cache.layers[0]
    before = [tuple(t.clone() for t in side) for side in layer.pool.layer_parts(0)]
    k, v = torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D)
    v[1, 0, 0, 5] = bad
    with pytest.raises(NonFiniteError):
        cache.update(k, v, 0)
    assert layer.get_seq_length() == 7
    for a, b in zip(before, layer.pool.layer_parts(0), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    v[1, 0, 0, 5] = 1.0
    cache.update(k, v, 0)
    assert layer.get_seq_length() == 8
    stored_k, stored_v = layer.dequantize()
    assert torch.allclose(stored_v[:, :, 7], v[:, :, 0], rtol=0, atol=2e-2)
    assert torch.allclose(stored_k[:, :, 7], k[:, :, 0], rtol=0, atol=4e-2)


def test_an_implementation_switched_inside_a_forward_is_refused_and_rolled_back():
    """The cache checks the model's attention implementation when a forward begins; one switched to SDPA in
    the middle of a forward sends a later layer's handles to SDPA, which refuses them (AttentionBypassed), and
    every layer goes back to its length before that forward. Switched back, the next step serves as before."""
    model = tiny_model()
    ids = torch.randint(1, 64, (2, 6))
    cache = Int8KvCache(model.config)
    second = model.model.layers[1].self_attn

    def switch(module, args, kwargs):
        model.config._attn_implementation_internal = "sdpa"

    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
        nxt = torch.randint(1, 64, (2, 1))
        hook = second.register_forward_pre_hook(switch, with_kwargs=True)
        with pytest.raises(AttentionBypassed):
            model(nxt, cache=cache, use_cache=True)
        hook.remove()
        assert [la.get_seq_length() for la in cache.layers] == [6, 6]
        model.config._attn_implementation_internal = "int8kv"
        out = model(nxt, cache=cache, use_cache=True).logits
        assert [la.get_seq_length() for la in cache.layers] == [7, 7]
    reference = Int8KvCache(model.config)
    with torch.inference_mode():
        model(ids, cache=reference, use_cache=True)
        assert torch.equal(model(nxt, cache=reference, use_cache=True).logits, out)
