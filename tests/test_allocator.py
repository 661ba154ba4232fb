"""Block allocator: bookkeeping, fork / copy-on-write, atomic failures, and no leaks under any op sequence."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from int8kv.cache.allocator import BlockAllocator
from int8kv.errors import KvCacheError, KvPoolExhausted, ShapeMismatch, UnknownSequence


def snapshot(a: BlockAllocator) -> tuple:
    return (list(a._free), list(a._refcounts), {k: (list(s.blocks), s.length) for k, s in a._seqs.items()})


def test_add_grow_free_bookkeeping():
    a = BlockAllocator(num_blocks=8, block_size=4)
    a.add_sequence("x", 5)
    assert a.context_len("x") == 5 and len(a.block_table("x")) == 2
    assert a.num_free_blocks == 6
    assert a.grow("x", 3) == []  # fills the partial block: no new block
    assert a.num_free_blocks == 6 and a.context_len("x") == 8
    a.grow("x", 1)
    assert len(a.block_table("x")) == 3 and a.num_free_blocks == 5
    table = a.block_table("x")
    assert a.slots("x", 0, 9) == [table[p // 4] * 4 + p % 4 for p in range(9)]
    a.free("x")
    assert a.num_free_blocks == 8 and len(a) == 0


def test_empty_sequence_and_zero_growth():
    a = BlockAllocator(4, 16)
    a.add_sequence(0)
    assert a.block_table(0) == [] and a.context_len(0) == 0
    assert a.grow(0, 0) == [] and a.num_free_blocks == 4
    a.grow(0, 1)
    assert a.num_free_blocks == 3


def test_errors_are_typed():
    a = BlockAllocator(4, 4)
    a.add_sequence(1)
    with pytest.raises(KvCacheError):
        a.add_sequence(1)
    for call in (lambda: a.grow(2, 1), lambda: a.free(2), lambda: a.fork(2, 3), lambda: a.block_table(2)):
        with pytest.raises(UnknownSequence):
            call()
    with pytest.raises(KvCacheError):
        a.fork(1, 1)
    with pytest.raises(ShapeMismatch):
        a.grow(1, -1)
    with pytest.raises(ShapeMismatch):
        BlockAllocator(0, 4)


def test_exhaustion_changes_nothing():
    a = BlockAllocator(4, 4)
    a.add_sequence("a", 10)  # 3 blocks
    before = snapshot(a)
    with pytest.raises(KvPoolExhausted):
        a.add_sequence("b", 8)
    with pytest.raises(KvPoolExhausted):
        a.grow("a", 7)  # needs 2 more blocks, 1 free
    assert snapshot(a) == before
    assert not a.can_grow("a", 7) and a.can_grow("a", 6)


def test_fork_shares_then_copies_partial_block_on_first_write():
    a = BlockAllocator(8, 4)
    a.add_sequence("p", 6)  # one full block, one partial
    full, partial = a.block_table("p")
    a.fork("p", "c")
    assert a.block_table("c") == [full, partial]
    assert a.refcount(full) == 2 and a.refcount(partial) == 2
    assert a.blocks_needed("c", 1) == 1  # the copy
    copies = a.grow("c", 1)
    assert len(copies) == 1 and copies[0][0] == partial
    new = copies[0][1]
    assert a.block_table("c") == [full, new] and a.block_table("p") == [full, partial]
    assert a.refcount(partial) == 1 and a.refcount(new) == 1 and a.refcount(full) == 2
    # The parent is now the only owner of its partial block: it writes in place, no copy.
    assert a.grow("p", 1) == []
    a.free("p")
    a.free("c")
    assert a.num_free_blocks == 8


def test_fork_at_block_boundary_needs_no_copy():
    a = BlockAllocator(8, 4)
    a.add_sequence("p", 8)
    a.fork("p", "c")
    assert a.grow("c", 3) == []  # new tokens go to a fresh block
    assert a.block_table("c")[:2] == a.block_table("p")


def test_copy_on_write_exhaustion_changes_nothing():
    a = BlockAllocator(2, 4)
    a.add_sequence("p", 5)
    a.fork("p", "c")
    before = snapshot(a)
    with pytest.raises(KvPoolExhausted):
        a.grow("c", 1)  # the copy needs a block and none is free
    assert snapshot(a) == before


class AllocatorMachine(RuleBasedStateMachine):
    """Random add / grow / fork / free: refcounts always match the tables, nothing leaks, failures are atomic."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(num_blocks=12, block_size=4)
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(target=seqs, n=st.integers(0, 20))
    def add(self, n):
        sid = self._new_id()
        before = snapshot(self.a)
        try:
            self.a.add_sequence(sid, n)
        except KvPoolExhausted:
            assert snapshot(self.a) == before
            return sid  # not registered: later rules on it must raise UnknownSequence
        assert self.a.context_len(sid) == n
        return sid

    @rule(sid=seqs, n=st.integers(0, 9))
    def grow(self, sid, n):
        if sid not in self.a:
            with pytest.raises(UnknownSequence):
                self.a.grow(sid, n)
            return
        before = snapshot(self.a)
        need = self.a.blocks_needed(sid, n)
        length = self.a.context_len(sid)
        try:
            copies = self.a.grow(sid, n)
        except KvPoolExhausted:
            assert need > len(before[0])
            assert snapshot(self.a) == before
            return
        assert self.a.num_free_blocks == len(before[0]) - need
        assert self.a.context_len(sid) == length + n
        for src, dst in copies:  # the copied block was shared; the writer now owns a private one
            assert self.a.refcount(dst) == 1 and self.a.refcount(src) >= 1

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        child = self._new_id()
        if parent not in self.a:
            with pytest.raises(UnknownSequence):
                self.a.fork(parent, child)
            return child
        free = self.a.num_free_blocks
        self.a.fork(parent, child)
        assert self.a.num_free_blocks == free  # forking never allocates
        assert self.a.block_table(child) == self.a.block_table(parent)
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.a:
            self.a.free(sid)

    @invariant()
    def refcounts_match_tables(self):
        counts = [0] * self.a.num_blocks
        for sid in self.a.sequences():
            table = self.a.block_table(sid)
            assert len(table) == self.a.blocks_for_tokens(self.a.context_len(sid))
            for block in table:
                counts[block] += 1
        assert counts == [self.a.refcount(b) for b in range(self.a.num_blocks)]
        free = set(self.a._free)
        assert len(free) == self.a.num_free_blocks  # no block listed twice
        assert free == {b for b, c in enumerate(counts) if c == 0}  # free exactly when unreferenced

    def teardown(self):
        for sid in self.a.sequences():
            self.a.free(sid)
        assert self.a.num_free_blocks == self.a.num_blocks
        assert all(self.a.refcount(b) == 0 for b in range(self.a.num_blocks))


TestAllocatorMachine = AllocatorMachine.TestCase
