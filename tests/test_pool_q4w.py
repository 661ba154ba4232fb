"""int4_kchan64_vtok_asym_sink4_win64_v1 in a paged pool: the format object, the pool's stored form after steps of
any chunking (bit for bit the codec's), the reference backend over it against float64 per query on ragged
batches, and the refusals (typed, nothing changed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_ops_reference_q4 import dense

from int8kv import ops, quant4w
from int8kv.cache.pool_q4w import Int4SinkWindowPool
from int8kv.errors import KvPoolExhausted, NonFiniteError, ShapeMismatch, UnsupportedFormat
from int8kv.formats import INT4_SINK_WINDOW_V1 as FMT
from int8kv.formats import format_names, get_format
from int8kv.ops.plan import plan_attention
from int8kv.ops.reference_q4w import query_runs

FIELDS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "k_sink", "v_sink", "k_window", "v_window")
LAYERS, HEADS, GROUP, DIM = 2, 2, 2, 16


def test_format_object():
    assert FMT.name == quant4w.NAME and FMT.version == 1 and (FMT.page, FMT.sinks, FMT.window) == (64, 4, 64)
    assert FMT.name in format_names() and get_format(FMT.name) is FMT and FMT.stateful
    for d in (64, 128):
        assert FMT.bytes_per_page(d) == 68 * d + 256 == 64 * quant4w.sealed_bytes_per_position(d)
        assert FMT.bytes_per_token(30, 3, d) == 30 * 3 * quant4w.sealed_bytes_per_position(d)
        assert FMT.bytes_per_token(1, 1, d) / (4 * d) == pytest.approx({64: 0.28125, 128: 0.2734375}[d])
        assert FMT.stored_bytes(4096, d) == quant4w.stored_bytes(4096, d)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(64, 3, 8, generator=gen) * 5, torch.randn(64, 3, 8, generator=gen)
    (k16,), (v16,) = FMT.encode(k), FMT.encode(v)
    assert k16.dtype == torch.float16 and torch.equal(FMT.decode((k16,)), k.half().float())
    for first in (False, True):
        k_parts, v_parts = FMT.seal(k16, v16, first)
        want = quant4w.seal_block(k.half().float().numpy(), v.half().float().numpy(), first)
        for got, ref, part in zip((*k_parts, *v_parts), want, (*FMT.k_page_parts, *FMT.v_page_parts), strict=True):
            assert got.dtype == part.dtype and got.numpy().tobytes() == ref.tobytes()
            lead = (3,) if part.per_block else (64, 3)
            assert tuple(got.shape) == (*lead, *part.shape(8))
    assert FMT.value_problem("k_scale", np.array([0.0, 2.0], np.float16)) is None
    assert "scale" in FMT.value_problem("v_scale", np.array([-1.0], np.float16))
    assert "minimum" in FMT.value_problem("k_min", np.array([np.nan], np.float16))
    assert "NaN or inf" in FMT.value_problem("k_rows", np.array([np.inf], np.float16))
    assert FMT.value_problem("v_codes", np.array([255], np.uint8)) is None
    assert "stores no tensor" in FMT.value_problem("k_scales", np.zeros(1, np.float16))


def _pool(num_blocks=16, window_pages=12, sink_slots=4) -> Int4SinkWindowPool:
    return Int4SinkWindowPool(LAYERS, HEADS, DIM, num_blocks, window_pages, sink_slots)


def _plan(pool, tables, lens, new, starts=None):
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32)
    kv_starts = None if starts is None else torch.tensor(starts, dtype=torch.int32)
    return plan_attention(pool, bt, torch.tensor(lens, dtype=torch.int32), cu_seqlens_q=cu, kv_starts=kv_starts)


class Sequences:
    """Sequences written step by step into a pool, with their inputs kept to check what the pool stores."""

    def __init__(self, pool, tables, seed, starts=None, **variant):
        self.pool, self.tables, self.starts, self.variant = pool, tables, starts, variant
        self.gen = torch.Generator().manual_seed(seed)
        self.k = [[torch.zeros(0, HEADS, DIM) for _ in tables] for _ in range(LAYERS)]
        self.v = [[torch.zeros(0, HEADS, DIM) for _ in tables] for _ in range(LAYERS)]
        self.offsets = torch.randn(HEADS, DIM, generator=self.gen) * 4  # per-channel key offsets

    def lengths(self):
        return [len(x) for x in self.k[0]]

    def step(self, new, check_reads=True):
        lens = [n + m for n, m in zip(self.lengths(), new, strict=True)]
        plan = _plan(self.pool, self.tables, lens, new, self.starts)
        for layer in range(LAYERS):
            k = torch.randn(sum(new), HEADS, DIM, generator=self.gen) + self.offsets
            v = torch.randn(sum(new), HEADS, DIM, generator=self.gen)
            ops.append_paged_kv(self.pool, layer, k, v, plan=plan)
            cu = plan.cu_seqlens_q.tolist()
            for b, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
                self.k[layer][b] = torch.cat([self.k[layer][b], k[lo:hi]])
                self.v[layer][b] = torch.cat([self.v[layer][b], v[lo:hi]])
            q = torch.randn(sum(new), HEADS * GROUP, DIM, generator=self.gen)
            if check_reads:
                got = ops.attention(self.pool, layer, q, plan, backend="reference", **self.variant)
                self.check_attention(layer, q, got, plan)
        return plan

    def encoded(self, layer, b, n):
        return quant4w.encode_sequence(self.k[layer][b][:n].numpy(), self.v[layer][b][:n].numpy())

    def check_stored(self):
        for layer in range(LAYERS):
            for b, n in enumerate(self.lengths()):
                got, want = self.pool.stored_form(layer, self.tables[b], n), self.encoded(layer, b, n)
                for f in FIELDS:
                    assert getattr(got, f).tobytes() == getattr(want, f).tobytes(), (layer, b, n, f)

    def check_attention(self, layer, q, got, plan):
        cu, lens = plan.cu_seqlens_q.tolist(), plan.context_lens.tolist()
        for b, n in enumerate(lens):
            m = cu[b + 1] - cu[b]
            # Query i reads the stored form of its own prefix, as its decode step would; queries that read the
            # same sealed pages are checked together over the form of the longest prefix among them (the
            # causal mask cuts each one's).
            runs = query_runs(n, m)
            assert [i for lo, hi in runs for i in range(lo, hi)] == list(range(m))
            for lo, hi in runs:
                pos = range(n - m + lo, n - m + hi)
                assert len({quant4w.sealed_blocks(p + 1) for p in pos}) == 1
                dk, dv = quant4w.decode_sequence(self.encoded(layer, b, pos.stop))
                for p in (pos.start, pos.stop - 1):  # the run's rows are each query's decode rows
                    ek, ev = quant4w.decode_sequence(self.encoded(layer, b, p + 1))
                    assert np.array_equal(dk[: p + 1], ek) and np.array_equal(dv[: p + 1], ev)
                opts = {k: v.double().numpy() if k == "sinks" else v for k, v in self.variant.items()}
                start = 0 if self.starts is None else self.starts[b]
                want = dense(q[cu[b] + lo : cu[b] + hi].double().numpy(), dk, dv, start, DIM**-0.5, **opts)
                np.testing.assert_allclose(got[cu[b] + lo : cu[b] + hi].numpy(), want, rtol=2e-6, atol=2e-6)


def test_steps_of_any_chunking_store_the_codecs_form_and_attend_as_decode_would():
    pool = _pool()
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1)).tolist()
    seqs = Sequences(pool, [perm[0:4], perm[4:8], perm[8:12]], seed=2)
    # Lengths after each step: A 70 130 131 132 194 195, B 3 128 129 130 194 195, C 130 131 132 133 193 194:
    # a chunk that seals a page its first queries still read in F16 (A's second, B's second), seals by decode
    # steps, and chunks ending on and across page boundaries.
    for new in [(70, 3, 130), (60, 125, 1), (1, 1, 1), (1, 1, 1), (62, 64, 60), (1, 1, 1)]:
        seqs.step(list(new))
        seqs.check_stored()
        # A step of m positions of a sequence holds at most ceil(m / 64) + 2 window pages for it.
        assert pool.windows_held() <= sum(-(-m // 64) + 2 for m in new)
    assert pool.windows_held() == 6  # after decode steps: each sequence's last two pages
    assert pool.memory_bytes() == 16 * LAYERS * HEADS * FMT.bytes_per_page(DIM) + (12 + 4 * 4 / 64) * (
        LAYERS * 64 * HEADS * DIM * 2 * 2)


@pytest.mark.parametrize("variant", [{"window": 50}, {"chunk": 70}, {"softcap": 2.0},
                                     {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}], ids=str)
def test_variants_and_kv_starts_through_the_pool(variant):
    pool = _pool(num_blocks=8, window_pages=7, sink_slots=2)
    seqs = Sequences(pool, [[5, 2, 7, 0], [1, 3, 4, 6]], seed=8, starts=[3, 0], **variant)
    for new in [(100, 140), (40, 1), (1, 60)]:
        seqs.step(list(new))


def test_a_block_reused_from_offset_zero_starts_afresh():
    pool = _pool(num_blocks=6, window_pages=4, sink_slots=1)
    first = Sequences(pool, [[3, 1, 4]], seed=5)
    first.step([150], check_reads=False)  # page 3 sealed (its F16 rows still held), 1 and 4 open; 3 holds the sink
    assert pool.windows_held() == 3
    pool.release([4])  # the owner gives back one block; the others are left as a finished sequence leaves them
    assert pool.windows_held() == 2
    # The same block ids in another order, written from position 0: 1 is now the first page (the only sink slot
    # moves to it from 3), 3 starts afresh with the window page it held.
    again = Sequences(pool, [[1, 3, 0]], seed=6)
    for new in ([100], [40], [1]):
        again.step(new)
        again.check_stored()
    assert pool.windows_held() == 2  # pages 3 and 0; page 1's F16 rows went back with the decode step


def _snapshot(pool):
    return [t.clone() for t in pool.storage()], pool.windows_held()


def _same(pool, snap):
    tensors, held = snap
    return held == pool.windows_held() and all(torch.equal(a, b) for a, b in zip(tensors, pool.storage(), strict=True))


def test_refusals_change_nothing():
    pool = _pool(num_blocks=8, window_pages=3, sink_slots=2)
    seqs = Sequences(pool, [[0, 1, 2], [3, 4, 5]], seed=7)
    seqs.step([100, 10], check_reads=False)  # 2 + 1 window pages held: none left
    snap = _snapshot(pool)
    plan = _plan(pool, seqs.tables, [101, 70], [1, 60])  # the second sequence needs a new window page
    with pytest.raises(KvPoolExhausted, match="window pages"):
        ops.append_paged_kv(pool, 0, torch.zeros(61, HEADS, DIM), torch.zeros(61, HEADS, DIM), plan=plan)
    assert _same(pool, snap)
    plan = _plan(pool, seqs.tables, [101, 11], [1, 1])
    bad = torch.zeros(2, HEADS, DIM)
    bad[1, 0, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        ops.append_paged_kv(pool, 0, bad, torch.zeros(2, HEADS, DIM), plan=plan)
    with pytest.raises(ShapeMismatch, match="written by step"):
        ops.append_paged_kv(pool, 0, torch.zeros(2, HEADS, DIM), torch.zeros(2, HEADS, DIM),
                            torch.tensor([5, 6]), plan=plan)
    with pytest.raises(ShapeMismatch, match="written by step"):
        ops.append_paged_kv(pool, 0, torch.zeros(2, HEADS, DIM), torch.zeros(2, HEADS, DIM), torch.tensor([5, 6]))
    assert _same(pool, snap)
    for call in (lambda: pool.export_rows(0, torch.tensor([0])), lambda: pool.write_rows(0, torch.tensor([0]), (), ())):
        with pytest.raises(UnsupportedFormat, match=FMT.name):
            call()
    assert _same(pool, snap)
    with pytest.raises(ShapeMismatch, match="even head_dim"):
        Int4SinkWindowPool(1, 1, 7, 4, 2, 1)


def test_a_cuda_device_is_refused_by_name_until_the_kernel_is_verified_there(monkeypatch):
    # Its Triton kernel faulted on the first GPU run: a CUDA pool is refused before anything is allocated
    # (torch.device("cuda") is only a name here; no GPU is needed to be refused), the CPU is served as ever, and
    # INT8KV_UNVERIFIED_GPU_KERNELS=1 (what bench/gpu_check.py sets) lets the check through.
    from int8kv.cache import pool_q4w

    monkeypatch.delenv(pool_q4w.UNVERIFIED_GPU_ENV, raising=False)
    for device in ("cuda", torch.device("cuda:0")):
        with pytest.raises(UnsupportedFormat, match=r"not served on a GPU yet.*INT8KV_UNVERIFIED_GPU_KERNELS=1"):
            Int4SinkWindowPool(1, 2, 32, 4, 4, 1, device)
    assert Int4SinkWindowPool(1, 2, 32, 4, 4, 1, "cpu").device.type == "cpu"
    monkeypatch.setenv(pool_q4w.UNVERIFIED_GPU_ENV, "1")
    pool_q4w.check_gpu("cuda")  # no refusal: the allocation would come next
    monkeypatch.setenv(pool_q4w.UNVERIFIED_GPU_ENV, "yes")  # only "1" opts in
    with pytest.raises(UnsupportedFormat):
        pool_q4w.check_gpu("cuda")
