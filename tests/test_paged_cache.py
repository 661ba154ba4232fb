"""PagedKvCache: layout, sizing, copy-on-write of real data (the write path is tested in test_write.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from int8kv.cache.paged import PagedKvCache, tokens_per_format
from int8kv.errors import (
    KvPoolExhausted,
    ShapeMismatch,
)
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
FORMATS = [INT8, F16]


# -- layout and sizing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_matches_design(fmt):
    c = PagedKvCache(5, 8, 3, 2, 16, fmt)
    assert len(c.k_codes) == len(c.v_codes) == len(c.k_scales) == 3
    for layer in range(3):
        assert c.k_codes[layer].shape == (5, 8, 2, 16) and c.k_codes[layer].dtype == fmt.spec.part("codes").dtype
        if fmt.is_quantized:
            assert c.k_scales[layer].shape == (5, 8, 2) and c.k_scales[layer].dtype == torch.float32
        else:
            assert c.k_scales[layer] is None and c.v_scales[layer] is None
    assert c.memory_bytes() == 5 * 8 * fmt.bytes_per_token(3, 2, 16)


def test_sizing_helpers():
    per_block = 16 * INT8.bytes_per_token(4, 8, 128)
    assert PagedKvCache.blocks_for_memory(10 * per_block + 5, 16, 4, 8, 128, INT8) == 10
    assert PagedKvCache.tokens_for_memory(10 * per_block + 5, 4, 8, 128, INT8, block_size=16) == 160
    budget = 1 << 30
    caps = tokens_per_format(budget, 32, 8, 128)
    assert set(caps) == set(KvStorageFormat)
    # INT8 rows are 128 + 4 bytes against 256 for F16: nearly twice the tokens.
    assert caps[INT8] / caps[F16] == pytest.approx(256 / 132, rel=0.01)
    q4w = KvStorageFormat.INT4_SINK_WINDOW_V1  # one sequence's stored form, F16 sinks and window included
    assert caps[q4w] == q4w.spec.tokens_for_memory(budget, 32, 8, 128) and 3.3 < caps[q4w] / caps[F16] < 3.8
    c = PagedKvCache.for_memory(budget // 64, 16, 2, 2, 64, F16)
    assert c.memory_bytes() <= budget // 64 < c.memory_bytes() + PagedKvCache.bytes_per_block(16, 2, 2, 64, F16)


def test_constructor_rejects_bad_shapes():
    with pytest.raises(ShapeMismatch):
        PagedKvCache(0, 16, 1, 1, 8)
    with pytest.raises(ValueError):
        PagedKvCache(4, 16, 1, 1, 8, "nope")


def test_batch_tensors_are_padded_int32():
    c = PagedKvCache(16, 4, 1, 1, 8)
    c.add_sequence("a", 9)
    c.add_sequence("b", 2)
    tables, lens = c.batch_tensors(["a", "b"])
    assert tables.dtype == lens.dtype == torch.int32
    assert tables.shape == (2, 3) and lens.tolist() == [9, 2]
    assert tables[0].tolist() == c.block_table("a") and tables[1].tolist() == c.block_table("b") + [0, 0]


def test_add_sequence_exhaustion_is_typed():
    c = PagedKvCache(2, 4, 1, 1, 8)
    with pytest.raises(KvPoolExhausted):
        c.add_sequence(0, 9)
    assert c.num_free_blocks == 2


# -- copy-on-write with real data ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_fork_copies_codes_and_scales_of_every_layer(fmt):
    gen = torch.Generator().manual_seed(3)
    c = PagedKvCache(8, 4, 3, 2, 8, fmt)
    slots = c.add_sequence("p", 6)
    for layer in range(3):
        append_paged_kv(c, layer, torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), slots)
    parent_rows = [c.read_rows(layer, c.slots("p")) for layer in range(3)]
    c.fork("p", "c")
    new_slot = c.grow("c", 1)
    assert c.block_table("c")[0] == c.block_table("p")[0]  # the full block is still shared
    assert c.block_table("c")[1] != c.block_table("p")[1]  # the partial one was copied
    for layer in range(3):
        # The child sees the parent's 6 rows in its own copy, for every layer, codes and scales alike.
        k, v = c.read_rows(layer, c.slots("c", 0, 6))
        assert torch.equal(k, parent_rows[layer][0]) and torch.equal(v, parent_rows[layer][1])
        append_paged_kv(c, layer, torch.full((1, 2, 8), 5.0), torch.full((1, 2, 8), -5.0), new_slot)
        k, v = c.read_rows(layer, c.slots("p"))
        assert torch.equal(k, parent_rows[layer][0]) and torch.equal(v, parent_rows[layer][1])


class CacheContentsMachine(RuleBasedStateMachine):
    """Every sequence reads back exactly the rows written to it, whatever add/grow/fork/free came before."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.c = PagedKvCache(10, 4, 2, 1, 4, F16)
        self.shadow: dict[int, list[float]] = {}  # per sequence: the value written at each position
        self.next_id = 0
        self.counter = 0.0

    def _write(self, sid: int, start: int, slots: torch.Tensor) -> None:
        n = len(slots)
        values = [self.counter + i for i in range(n)]  # small integers: exact in float16
        self.counter += n
        rows = torch.tensor(values).reshape(n, 1, 1).expand(n, 1, 4)
        for layer in range(2):
            append_paged_kv(self.c, layer, rows + layer, -rows, slots)
        self.shadow[sid][start:] = values

    @rule(target=seqs, n=st.integers(0, 9))
    def add(self, n):
        self.next_id += 1
        sid = self.next_id
        try:
            slots = self.c.add_sequence(sid, n)
        except KvPoolExhausted:
            return sid
        self.shadow[sid] = []
        self._write(sid, 0, slots)
        return sid

    @rule(sid=seqs, n=st.integers(1, 6))
    def grow(self, sid, n):
        if sid not in self.shadow:
            return
        start = self.c.context_len(sid)
        try:
            slots = self.c.grow(sid, n)
        except KvPoolExhausted:
            return
        self._write(sid, start, slots)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        self.next_id += 1
        if parent in self.shadow:
            self.c.fork(parent, self.next_id)
            self.shadow[self.next_id] = list(self.shadow[parent])
        return self.next_id

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.shadow:
            self.c.free(sid)
            del self.shadow[sid]

    @invariant()
    def contents_match(self):
        for sid, values in self.shadow.items():
            want = torch.tensor(values).reshape(-1, 1, 1).expand(-1, 1, 4)
            for layer in range(2):
                k, v = self.c.read_rows(layer, self.c.slots(sid))
                assert torch.equal(k, want + layer) and torch.equal(v, -want)

    def teardown(self):
        for sid in list(self.shadow):
            self.c.free(sid)
        assert self.c.num_free_blocks == self.c.num_blocks


TestCacheContentsMachine = CacheContentsMachine.TestCase


def test_sizes_scale_with_block_count():
    assert math.isclose(
        PagedKvCache(10, 16, 2, 4, 64).memory_bytes() / PagedKvCache(5, 16, 2, 4, 64).memory_bytes(), 2.0
    )


# -- several block tables (table groups of layers with one attention span each) -------------------------------
def test_tables_give_per_table_slots_and_copy_written_rows_on_write():
    c = PagedKvCache(10, 4, 1, 2, 16, F16, windows=(None, 8))
    assert c.num_tables == 2 and c.windows == (None, 8) and c.memory_bytes() == 10 * 4 * F16.bytes_per_token(1, 2, 16)
    slots = c.add_sequence("p", 6)
    full, sliding = c.block_table("p", 0), c.block_table("p", 1)
    want = [[t[p // 4] * 4 + p % 4 for p in range(6)] for t in (full, sliding)]
    assert slots.shape == (2, 6) and slots.tolist() == want
    # Each table's rows at its own slots: a layer of table 1 never lands in table 0's blocks.
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(6, 2, 16, generator=gen) for _ in range(4)]
    append_paged_kv(c, 0, rows[0], rows[1], slots[0])
    append_paged_kv(c, 0, rows[2], rows[3], slots[1])
    c.fork("p", "c")
    grown = c.grow("c", 1)  # copy-on-write of the shared partial block in both tables
    assert grown.shape == (2, 1) and c.block_table("c", 0)[1] != full[1] and c.block_table("c", 1)[1] != sliding[1]
    for t, (k, v) in enumerate((rows[:2], rows[2:])):
        got_k, got_v = c.read_rows(0, c.slots("c", 0, 6)[t])
        torch.testing.assert_close(got_k, k.half().float())
        torch.testing.assert_close(got_v, v.half().float())
    tables, lens = c.batch_tensors(["p", "c"])
    assert tables.shape == (2, 2, 2) and tables[1, 1].tolist() == c.block_table("c", 1) and lens.tolist() == [6, 7]
    assert c.table_rows("c", 0, 2).tolist() == [c.block_table("c", 0), c.block_table("c", 1)]
    # The next query at position 9 sees 2..9: nothing to give back yet; at 13 (sees 6..13) block 0 of table 1.
    c.grow("c", 6)
    assert c.release_outside_windows("c", 9) == 0 and c.release_outside_windows("c", 13) == 1
    assert c.allocator.num_released("c", 0) == 0 and c.allocator.num_released("c", 1) == 1
    # A state holds one section per table, each gathered at that table's slots; it imports into another cache
    # with the same tables bit for bit, and a one-section state is refused before anything is allocated.
    state = c.export_state("p")
    assert c.state_layouts == (c.layout, c.layout) and state.layouts == c.state_layouts
    for t, (k, v) in enumerate((rows[:2], rows[2:])):
        got_k, got_v = (c.format.spec.decode(side)[0] for side in state.sections[t].layer(0))
        torch.testing.assert_close(got_k, k.half().float())
        torch.testing.assert_close(got_v, v.half().float())
    other = PagedKvCache(10, 4, 1, 2, 16, F16, windows=(None, 8))
    other.import_state("q", state)
    assert other.export_state("q").equal(state)
    one = PagedKvCache(4, 4, 1, 2, 16, F16)
    assert one.add_sequence("x", 3).shape == (3,) and one.batch_tensors(["x"])[0].shape == (1, 1)
    free = c.num_free_blocks
    for call in (lambda: c.import_state("n", one.export_state("x")), lambda: c.write_state("p", 0, state.sections[0])):
        with pytest.raises(ShapeMismatch):
            call()
    assert "n" not in c.allocator and c.num_free_blocks == free
