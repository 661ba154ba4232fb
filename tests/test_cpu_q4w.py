"""The CPU backend's kernel over int4_kchan64_vtok_asym_sink4_win64_v1 (int8kv.ops.cpu_q4w) against the float64
reference over the same pool (int8kv.ops.reference_q4w), step by step on fresh random ragged batches: decode rows
and prefill chunks, lengths below the sinks, mid-page, below 64 + 64 and on seal boundaries, GQA, head_dim 64,
80 and 128, windows, chunks, softcap, sinks, kv_starts; and its refusals.

Two kernel specialisations, 5-6 s of CPU each when cold (float32 q, the pool's dtypes, one numba thread: the
serial call only; a parallel one runs the same `_run_items` through ops.calls.fan_out): the codes read in
place, and unpacked first for head_dim 80)."""

from __future__ import annotations

import numba
import pytest
import torch
from q4w_helpers import PoolBatch, rel_err, seeded

from int8kv import ops
from int8kv.cache.pool_q4w import Int4SinkWindowPool
from int8kv.errors import UnsupportedFormat
from int8kv.ops.plan import plan_attention

TOL = 1e-5  # the INT8 kernel's (tests/test_ops_cpu.py): max |error| / max |reference|
LAYERS = 2


@pytest.fixture(autouse=True)
def one_thread():
    """One numba thread (the serial kernel: one specialisation compiled) and one torch thread (the reference's
    many small ops); both restored after."""
    threads, torch_threads = numba.get_num_threads(), torch.get_num_threads()
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    yield
    numba.set_num_threads(threads)
    torch.set_num_threads(torch_threads)


class Batch(PoolBatch):
    """Sequences written step by step into a pool, each step attended by the cpu and reference backends on every
    layer."""

    def __init__(self, heads, group, dim, capacity, gen, starts=None, **variant):
        super().__init__(heads, group, dim, capacity, gen, LAYERS, starts, **variant)

    def step(self, new, tol=TOL):
        plan = self.plan(new)
        for layer in range(LAYERS):
            self.write(plan, layer)
        for layer in range(LAYERS):
            q = self.query(plan)
            got = ops.attention(self.pool, layer, q, plan, backend="cpu", **self.variant)
            want = ops.attention(self.pool, layer, q, plan, backend="reference", **self.variant)
            assert rel_err(got, want) < tol, (new, self.lens, layer)
            if self.starts is not None or "window" in self.variant or "chunk" in self.variant:
                assert torch.equal(got == 0, want == 0)  # rows that see no key: zeros in both
        return plan


# Lengths after each step: 3 70 127 200 (a prefill of each), 4 71 128 201 (decode: the third seals page 0),
# 5 128 192 256 (a chunk sealing pages its first queries still read in F16), 6 129 193 257 (decode), then
# 70 129 193 321 (a chunk across a page boundary next to decode rows).
STEPS = [(3, 70, 127, 200), (1, 1, 1, 1), (1, 57, 64, 55), (1, 1, 1, 1), (64, 0, 0, 64)]


@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 4, 128), (1, 2, 80)], ids=str)
def test_steps_match_the_float64_reference(shape):
    heads, group, dim = shape
    batch = Batch(heads, group, dim, [70, 130, 200, 330], seeded("steps", shape))
    for new in STEPS:
        if 0 in new:  # a sequence with no query this step stays out of the batch's rows, not out of the plan
            new = tuple(max(m, 1) for m in new)
        batch.step(list(new))


def test_a_long_decode_row_split_into_key_ranges():
    batch = Batch(3, 3, 64, [1200, 40], seeded("long"))
    batch.step([1130, 40])
    for _ in range(3):  # 1,131-1,133 keys: two ranges merged (one thread: two items per sequence)
        batch.step([1, 1])


@pytest.mark.parametrize("variant", [{"window": 50}, {"window": 200}, {"chunk": 70}, {"softcap": 2.0},
                                     {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])}, {"starts": [3, 90]},
                                     {"window": 80, "softcap": 5.0, "sinks": torch.full((6,), 1.0)}], ids=str)
def test_variants_and_kv_starts(variant):
    variant = dict(variant)
    starts = variant.pop("starts", None)
    batch = Batch(2, 3, 64, [260, 200], seeded("variant", str(variant), starts), starts=starts, **variant)
    for new in [(100, 140), (40, 1), (1, 1), (1, 60)]:
        batch.step(list(new))


def test_refusals():
    pool = Int4SinkWindowPool(1, 2, 8, 4, 4, 1)  # head_dim 8: not one the vector kernels take
    plan = plan_attention(pool, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32))
    with pytest.raises(UnsupportedFormat, match="multiple of 16"):
        ops.attention(pool, 0, torch.zeros(1, 2, 8), plan, backend="cpu")
    batch = Batch(2, 2, 16, [200], seeded("refuse"))
    plan = batch.plan([130])
    batch.write(plan, 0)
    q = torch.zeros(130, 4, 16)
    ops.attention(batch.pool, 0, q, plan, backend="cpu")  # layer 0 is written and sealed
    with pytest.raises(UnsupportedFormat, match="layer 1 has not sealed"):  # layer 1 is not written yet
        ops.attention(batch.pool, 1, q, plan, backend="cpu")
    ops.attention(batch.pool, 0, q, plan, backend="cpu")  # checked once per pool generation, then trusted
    batch.pool.release(batch.tables[0])  # the sequence ends: its window pages and sink slot go back
    with pytest.raises(UnsupportedFormat, match="given back"):  # the same plan's reads are checked again
        ops.attention(batch.pool, 0, q, plan, backend="cpu")


def test_a_non_finite_query_is_refused_and_the_pool_is_unharmed():
    """The CPU backend checks q's values itself (`cpu.CHECKS_QUERY`), and for this pool, whose kernel has an item
    loop of its own, before it calls it: NaN, +inf or -inf in a decode or prefill query raises NonFiniteError, on
    `ops.attention` and a prepared call alike, and the next call with the finite q returns what it did before."""
    from int8kv.errors import NonFiniteError

    batch = Batch(3, 3, 64, [70, 130], seeded("non-finite", 1))
    for new in ([40, 90], [1, 1]):
        plan = batch.plan(new)
        for layer in range(LAYERS):
            batch.write(plan, layer)
        q = batch.query(plan)
        prepared = ops.PreparedAttention(batch.pool, plan, q.shape[1], backend="cpu")
        good = ops.attention(batch.pool, 1, q, plan, backend="cpu")
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = q.clone()
            broken[q.shape[0] - 1, 2, 5] = bad
            with pytest.raises(NonFiniteError):
                ops.attention(batch.pool, 1, broken, plan, backend="cpu")
            with pytest.raises(NonFiniteError):
                prepared.run(batch.pool, 1, broken)
        assert torch.equal(ops.attention(batch.pool, 1, q, plan, backend="cpu"), good)
        assert torch.equal(prepared.run(batch.pool, 1, q), good)
