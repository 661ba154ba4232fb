"""The CPU backend's work items (`cpu._decode_items`, `cpu._assign_items`, compiled): what a decode step's items
cover and how they are dealt to the workers, on fresh random lengths, against a plain-Python statement of the
rules (every key exactly once in whole 16-key runs; greedy longest-first to the least loaded worker)."""

from __future__ import annotations

import numpy as np
import pytest

from int8kv.ops import cpu


def _reference_assignment(items: np.ndarray, limits: np.ndarray, workers: int):
    """Longest item first, each to the worker with the least load so far (the first such on a tie), an item's
    load its (row, key) pairs + 1; then the items by worker, longest first within each (ties in item order)."""
    cost = []
    for it in items.tolist():
        last = min(it[1] + max(it[2], 1) - 1, len(limits) - 1)
        cost.append(max(min(int(limits[last]), it[4]) - it[3], 0) * it[2])
    order = sorted(range(len(items)), key=lambda i: -cost[i])  # sorted() is stable
    load, owner = [0] * workers, {}
    for i in order:
        w = load.index(min(load))
        owner[i] = w
        load[w] += cost[i] + 1
    grouped = [items[i] for w in range(workers) for i in order if owner[i] == w]
    lists = np.cumsum([0] + [sum(1 for i in order if owner[i] == w) for w in range(workers)])
    return np.array(grouped).reshape(-1, 6), lists, sum(cost)


@pytest.mark.parametrize("seed", range(6))
def test_decode_items_cover_every_key_once_in_whole_runs(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        batch, threads = int(rng.integers(1, 12)), int(rng.integers(1, 9))
        lens = rng.integers(0, 9000, batch).astype(np.int64)
        starts = (rng.random(batch) * lens * rng.integers(0, 2)).astype(np.int64)
        items, splits = cpu._decode_items(lens, starts, threads)
        assert splits >= 1 and items.shape == (batch * splits, 6)
        want = threads if batch == 1 else -(-2 * threads // batch)  # one range per thread for a single sequence
        assert max(1, min(want, int((lens - starts).max()) // cpu.MIN_SPLIT_KEYS)) == splits
        for b in range(batch):
            mine = items[items[:, 0] == b]
            assert (mine[:, 1] == b).all() and (mine[:, 2] == 1).all()
            assert list(mine[:, 5]) == list(range(splits))
            covered = [k for lo, hi in mine[:, 3:5] for k in range(lo, hi)]
            assert covered == list(range(starts[b], lens[b]))  # every key once, in order
            assert ((mine[:, 3] - starts[b]) % cpu.cpu_simd.LANES == 0).all()  # ranges start on 16-key runs


@pytest.mark.parametrize("seed", range(6))
def test_assign_items_is_the_greedy_rule(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(200):
        if rng.random() < 0.5:  # a decode step's items
            batch = int(rng.integers(1, 12))
            lens = rng.integers(0, 9000, batch).astype(np.int64)
            items, _ = cpu._decode_items(lens, np.zeros(batch, np.int64), int(rng.integers(1, 9)))
            limits = lens
        else:  # prefill items: several rows, keys up to each row's limit
            n = int(rng.integers(1, 20))
            items = np.stack([rng.integers(0, 3, n), rng.integers(0, 30, n), rng.integers(1, 8, n),
                              rng.integers(0, 100, n), rng.integers(0, 400, n), np.zeros(n, np.int64)],
                             axis=1).astype(np.int64)  # fmt: skip
            limits = rng.integers(0, 500, 40).astype(np.int64)
        workers = int(rng.integers(1, 6))
        grouped, lists, pairs = cpu._assign_items(items, limits, workers)
        want_grouped, want_lists, want_pairs = _reference_assignment(items, limits, workers)
        assert np.array_equal(grouped, want_grouped)
        assert np.array_equal(lists, want_lists) and pairs == want_pairs
        assert sorted(map(tuple, grouped.tolist())) == sorted(map(tuple, items.tolist()))  # a permutation
