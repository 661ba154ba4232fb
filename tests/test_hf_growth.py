"""Int8KvLayer's storage growth: headroom after a prefill, amortised growth during decode, what memory_bytes
counts. Layers are driven directly (no model) on small random K/V, through the V1 codec's one CPU kernel that
tests/test_hf.py compiles as well (no new numba specialisation)."""

from __future__ import annotations

import math

import pytest
import torch

import int8kv.codec
from int8kv.formats import KvStorageFormat
from int8kv.hf import Int8KvCache

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1


def expected_capacity(needed: int, chunk: int) -> int:
    """The documented rule: needed + max(chunk, needed // 8), rounded up to whole chunks."""
    return math.ceil((needed + max(chunk, needed // 8)) / chunk) * chunk


@pytest.mark.parametrize(("prefill", "chunk"), [(1, 16), (100, 16), (512, 256), (2000, 64)])
def test_prefill_leaves_headroom_and_decode_grows_amortised(prefill, chunk):
    torch.manual_seed(prefill)
    batch, heads, dim = 2, 3, 8
    cache = Int8KvCache(format=INT8, chunk_size=chunk)
    keys = [torch.randn(batch, heads, prefill, dim)]
    values = [torch.randn(batch, heads, prefill, dim)]
    cache.update(keys[0], values[0], 0)
    layer = cache.layers[0]
    assert layer.capacity == expected_capacity(prefill, chunk)
    assert layer.capacity - prefill >= chunk  # room for at least one chunk of decode steps
    pool, reallocations, copied = layer.pool, 0, 0
    steps = 3 * prefill + 2 * chunk
    for step in range(steps):
        k, v = torch.randn(batch, heads, 1, dim) * (step % 5 + 1), torch.randn(batch, heads, 1, dim)
        keys.append(k)
        values.append(v)
        held = layer.held
        cache.update(k, v, 0)
        if layer.pool is not pool:
            # Grown only when the rows did not fit, to the rule's size for the rows needed then.
            assert held + 1 > pool.block_size
            assert layer.capacity == expected_capacity(held + 1, chunk)
            reallocations += 1
            copied += held
            pool = layer.pool
        elif step < expected_capacity(prefill, chunk) - prefill:
            assert reallocations == 0
    total = prefill + steps
    assert layer.held == total
    # Amortised O(1): every reallocation copies at most 9 rows per row appended since the previous one.
    assert copied <= 9 * steps
    assert reallocations <= math.ceil(math.log(total / prefill, 9 / 8)) + 1
    # memory_bytes counts the rows held; allocated_bytes the capacity, at most 1/8 + a chunk more.
    per_row = batch * layer.pool.layout.bytes_per_token
    assert cache.memory_bytes() == total * per_row
    assert cache.allocated_bytes() == layer.capacity * per_row
    assert total * per_row <= cache.allocated_bytes() <= (total + total // 8 + 2 * chunk) * per_row
    # Every row survived the reallocations: exactly the codec's encoding of what was written.
    stored_k, stored_v = layer.dequantize()
    for stored, written in ((stored_k, keys), (stored_v, values)):
        codes, scales = int8kv.codec.quantize_int8(torch.cat(written, dim=2))
        torch.testing.assert_close(stored, int8kv.codec.dequantize_int8(codes, scales), atol=0, rtol=0)


def test_imported_state_and_reserved_length_keep_the_rule():
    torch.manual_seed(7)
    source = Int8KvCache(format=INT8, chunk_size=16)
    source.update(torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), 0)
    state = source.export_state()
    imported = Int8KvCache(format=INT8, chunk_size=16)
    imported.import_state(state)
    assert imported.layers[0].capacity == expected_capacity(40, 16)
    torch.testing.assert_close(imported.layers[0].dequantize(), source.layers[0].dequantize(), atol=0, rtol=0)
    # A known final length is reserved exactly, for a prefill and for an import, and grown past by the rule.
    reserved = Int8KvCache(format=INT8, chunk_size=16, max_cache_len=50)
    reserved.update(torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), 0)
    assert reserved.layers[0].capacity == 50
    again = Int8KvCache(format=INT8, chunk_size=16, max_cache_len=50)
    again.import_state(state)
    assert again.layers[0].capacity == 50
    reserved.update(torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8), 0)
    assert reserved.layers[0].capacity == expected_capacity(51, 16)
