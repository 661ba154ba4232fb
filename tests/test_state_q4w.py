"""Q4WState and the 4-bit pool's export_sequence / import_sequence (no model): for ragged lengths around the
sinks, a page and each seal, the stored form of fresh random inputs (quant4w.encode_sequence) imported into a
pool is exported back bit for bit, and writing on from it (steps through the write path) stores exactly
encode_sequence of all the inputs, as a pool that never stopped; the constructors' and the pool's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from int8kv import quant4w
from int8kv.cache.pool_q4w import Int4SinkWindowPool
from int8kv.cache.state import KvLayout
from int8kv.cache.state_q4w import Q4W, TENSOR_NAMES, Q4WState, row_shapes
from int8kv.errors import InvalidKvState, KvPoolExhausted, ShapeMismatch
from int8kv.ops import write
from int8kv.ops.plan import plan_attention

LAYERS, HEADS, DIM = 2, 3, 6  # a ragged head count and head_dim


def inputs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    k = gen.standard_normal((LAYERS, n, HEADS, DIM)) * gen.choice([0.01, 1, 40], (1, n, 1, 1)) + gen.normal(0, 3, DIM)
    return k.astype(np.float32), gen.standard_normal((LAYERS, n, HEADS, DIM)).astype(np.float32)


def same(a: quant4w.Q4WRows, b: quant4w.Q4WRows) -> bool:
    return all(getattr(a, f).shape == getattr(b, f).shape and getattr(a, f).tobytes() == getattr(b, f).tobytes()
               for f in TENSOR_NAMES)


def step(pool, table, start, k, v):
    """Write positions ``[start, start + len(k[0]))`` of one sequence through the write path (one step)."""
    m = k.shape[1]
    plan = plan_attention(pool, torch.tensor([table], dtype=torch.int32), torch.tensor([start + m], dtype=torch.int32),
                          cu_seqlens_q=torch.tensor([0, m], dtype=torch.int32))  # fmt: skip
    for layer in range(LAYERS):
        write.append_paged_kv(pool, layer, torch.from_numpy(k[layer]), torch.from_numpy(v[layer]), plan=plan)
    pool.settle(table, start + m)


@pytest.mark.parametrize("n", [0, 3, 5, 64, 127, 128, 130, 192])
def test_import_then_continue_is_the_codecs_stored_form(n):
    k, v = inputs(n + 70, n)
    rows = [[quant4w.encode_sequence(k[layer, :n], v[layer, :n])] for layer in range(LAYERS)]
    state = Q4WState.of(KvLayout(LAYERS, HEADS, DIM, Q4W), rows)
    assert (state.batch, state.length) == (1, n)
    pool = Int4SinkWindowPool(LAYERS, HEADS, DIM, 8, 4, 2)
    table = [5, 2, 7, 0, 3]  # scattered block ids: 320 positions
    pool.import_sequence(table, state.sequence(0))
    pages = -(-n // 64)
    assert pool.windows_held() == pages - quant4w.sealed_blocks(n) and pool.sinks_held() == (1 if n else 0)
    assert all(same(a, r[0]) for a, r in zip(pool.export_sequence(table, n), rows, strict=True))
    step(pool, table, n, k[:, n : n + 1], v[:, n : n + 1])  # a decode step, then a chunk
    step(pool, table, n + 1, k[:, n + 1 :], v[:, n + 1 :])
    for layer in range(LAYERS):
        want = quant4w.encode_sequence(k[layer], v[layer])
        assert same(pool.stored_form(layer, table, n + 70), want)
    pool.release(table)
    assert pool.windows_held() == 0 and pool.sinks_held() == 0


def test_refusals_change_nothing():
    n = 140
    k, v = inputs(n, 1)
    layout = KvLayout(LAYERS, HEADS, DIM, Q4W)
    rows = [[quant4w.encode_sequence(k[layer], v[layer])] for layer in range(LAYERS)]
    state = Q4WState.of(layout, rows)
    arrays = dict(state.arrays)
    assert {n: (a.dtype, a.shape[2:]) for n, a in arrays.items()} == row_shapes(n, HEADS, DIM)
    with pytest.raises(ValueError, match="read-only"):
        arrays["k_codes"][0, 0, 0, 0, 0, 0] = 1
    for bad, error, match in (
        (lambda: Q4WState.of(KvLayout(LAYERS, HEADS, DIM), rows), ShapeMismatch, "layout"),
        (lambda: Q4WState.of(layout, rows[:1]), ShapeMismatch, "layers"),
        (lambda: Q4WState.of(layout, [rows[0], [quant4w.encode_sequence(k[1, :139], v[1, :139])]]), ShapeMismatch,
         "one length"),
        (lambda: Q4WState.from_arrays(layout, 1, n, dict(arrays, v_min=arrays["v_min"].astype(np.float32))),
         ShapeMismatch, "v_min"),
        (lambda: Q4WState.from_arrays(layout, 1, n, dict(arrays, k_scale=-arrays["k_scale"])), InvalidKvState,
         "negative"),
        (lambda: Q4WState.from_arrays(layout, 1, n, dict(arrays, v_sink=arrays["v_sink"] * np.float16(np.inf))),
         InvalidKvState, "v_sink"),
        (lambda: Q4WState.from_arrays(layout, 0, n, arrays), ShapeMismatch, "batch"),
    ):
        with pytest.raises(error, match=match):
            bad()
    pool = Int4SinkWindowPool(LAYERS, HEADS, DIM, 4, 2, 1)
    pool.import_sequence([0, 1, 2], state.sequence(0))  # 2 window pages, 1 sink slot: all of them
    books = (pool.windows_held(), pool.sinks_held(), pool.generation)
    for table, error in (([3], ShapeMismatch), ([3, 3, 3], ShapeMismatch), ([3, 4, 5], ShapeMismatch)):
        with pytest.raises(error):
            pool.import_sequence(table, state.sequence(0))
    with pytest.raises(ShapeMismatch, match="one Q4WRows per layer"):
        pool.import_sequence([3], state.sequence(0)[:1])
    other = Int4SinkWindowPool(LAYERS, HEADS, DIM, 8, 2, 1)
    other.import_sequence([0, 1, 2], state.sequence(0))
    with pytest.raises(KvPoolExhausted, match="window pages"):
        other.import_sequence([3, 4, 5], state.sequence(0))
    assert (pool.windows_held(), pool.sinks_held(), pool.generation) == books
    assert other.windows_held() == 2 and other.sinks_held() == 1
    assert same(other.export_sequence([0, 1, 2], n)[1], rows[1][0])


def test_an_import_takes_back_what_cached_pages_keep():
    n = 140  # page 0 sealed, pages 1 and 2 in window pages, a sink slot
    k, v = inputs(n, 2)
    rows = [[quant4w.encode_sequence(k[layer], v[layer])] for layer in range(LAYERS)]
    state = Q4WState.of(KvLayout(LAYERS, HEADS, DIM, Q4W), rows)
    pool = Int4SinkWindowPool(LAYERS, HEADS, DIM, 8, 2, 1)
    pool.import_sequence([0, 1, 2], state.sequence(0))
    pool.keep([0, 1, 2])  # its sequence ended, its pages stay cached for prefix hits with their rows
    assert pool.kept() == (2, 1) and pool.usable_prefix([0, 1, 2]) == 2  # page 1: F16 rows, page 0 sealed
    pool.import_sequence([3, 4, 5], state.sequence(0))  # every window page and the sink slot were kept: taken back
    assert pool.kept() == (0, 0) and (pool.windows_held(), pool.sinks_held()) == (2, 1)
    assert all(same(a, r[0]) for a, r in zip(pool.export_sequence([3, 4, 5], n), rows, strict=True))
    assert pool.usable_prefix([0, 1, 2]) == 0  # the cached pages no longer hold their sink slot
