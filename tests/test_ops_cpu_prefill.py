"""Long prefill chunks (the tiled torch path of ops/cpu.py) against the float64 reference.

Batches mix chunks above and below `cpu.FLASH_MIN_QUERIES`, so one call runs both the torch path and the numba
kernel and their rows must land in the right places. The work threshold (`FLASH_MIN_PAIRS`) is lifted so that
small, fast cases take the torch path; `test_default_threshold_picks_the_path` checks the real one. The pools
are poisoned (NaN) outside the written rows, as in test_ops_cpu.py: reading a slot past a context, a padding
block or a masked position fails loudly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_ops_cpu import FORMATS, INT8, TOL, build, one_torch_thread, rel_err  # noqa: F401

from int8kv.ops import cpu, paged_prefill_attention, reference

LONG = cpu.FLASH_MIN_QUERIES


@pytest.fixture(autouse=True)
def any_work_is_long(monkeypatch, request):
    if request.node.originalname != "test_default_threshold_picks_the_path":
        monkeypatch.setattr(cpu, "FLASH_MIN_PAIRS", 0)


def run_case(fmt, block_size, head_dim, group, lens, q_lens, seed, starts=None, num_kv_heads=2):
    cache, tables, context = build(fmt, block_size, head_dim, num_kv_heads, lens, seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed))
    kv_starts = None if starts is None else torch.tensor(starts, dtype=torch.int32)
    out = paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=kv_starts, backend="cpu")
    ref = reference.paged_prefill_attention(cache, 1, q, cu, tables, context, kv_starts=kv_starts)
    assert rel_err(out, ref) < TOL
    return out, cu


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_reference(fmt, block_size, head_dim, group):
    seed = block_size * 1000 + head_dim * 10 + group
    # A whole prompt, a long chunk after a cached prefix, short chunks and nothing: both paths in one call.
    lens = [LONG + 13, 3 * LONG + 5, 40, 9, 2 * LONG]
    q_lens = [LONG + 13, 2 * LONG + 1, 7, 0, LONG - 1]
    rng = np.random.default_rng(seed)
    for starts in (None, [int(rng.integers(0, n // 2 + 1)) for n in lens]):
        run_case(fmt, block_size, head_dim, group, lens, q_lens, seed, starts)


@pytest.mark.parametrize("fmt", FORMATS)
def test_contexts_longer_than_a_key_tile(fmt, monkeypatch):
    """Several key tiles per query block, tiles ending mid-block, and several query blocks per sequence."""
    monkeypatch.setattr(cpu, "FLASH_KEY_TILE", 100)  # not a multiple of any block size
    monkeypatch.setattr(cpu, "FLASH_QUERY_ROWS", 96)
    lens = [450, 333]
    q_lens = [200, 333]
    run_case(fmt, 16, 64, 4, lens, q_lens, seed=5)
    run_case(fmt, 8, 128, 1, lens, q_lens, seed=6, starts=[117, 250])


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_tiles_on_a_long_prompt(fmt):
    run_case(fmt, 16, 64, 3, [cpu.FLASH_KEY_TILE * 2 + 77], [cpu.FLASH_KEY_TILE + 40], seed=8, num_kv_heads=3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_window_start_past_some_queries_gives_zeros(fmt):
    lens, q_lens, starts = [3 * LONG, 2 * LONG], [2 * LONG, 2 * LONG], [2 * LONG + 5, 2 * LONG]
    out, cu = run_case(fmt, 16, 64, 2, lens, q_lens, seed=9, starts=starts)
    assert not out[: LONG + 5].any() and out[LONG + 5 : int(cu[1])].abs().sum(dim=(1, 2)).all()
    assert not out[int(cu[1]) :].any()  # the whole second sequence lies before its window


def test_default_threshold_picks_the_path(monkeypatch):
    """Long chunks with enough work take the torch path, the rest the numba kernel (a spy: both paths agree
    with the reference, so only this tells them apart)."""
    calls = []
    real = cpu._flash_sequence
    monkeypatch.setattr(cpu, "_flash_sequence", lambda q, *a: calls.append(q.shape[1]) or real(q, *a))
    enough = -(-cpu.FLASH_MIN_PAIRS // LONG) + LONG  # keys for LONG queries to reach the work threshold
    lens = [enough, enough, 2 * LONG, 40]
    q_lens = [LONG, LONG - 1, 2 * LONG, 40]  # long with work, too few queries, too little work, short
    run_case(INT8, 16, 64, 1, lens, q_lens, seed=10)
    assert calls == [LONG]
