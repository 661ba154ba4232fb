"""Block allocator: bookkeeping, fork / copy-on-write, prefix caching (hits, LRU eviction), atomic failures,
and no leaks under any op sequence."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from int8kv.cache.allocator import BlockAllocator
from int8kv.cache.prefix import PrefixHasher
from int8kv.cache.state import KvLayout
from int8kv.errors import (
    KvCacheError,
    KvPoolExhausted,
    PositionOutOfRange,
    PrefixKeyError,
    ShapeMismatch,
    UnknownSequence,
)


def snapshot(a: BlockAllocator) -> tuple:
    """Everything the allocator knows, through its public queries (every table group's tables)."""
    blocks = range(a.num_blocks)
    groups = range(a.num_groups)
    return (
        a.free_blocks(),
        a.cached_blocks(),
        [a.refcount(b) for b in blocks],
        [a.block_key(b) for b in blocks],
        {s: ([a.block_table(s, g) for g in groups], a.context_len(s), [a.num_released(s, g) for g in groups])
         for s in a.sequences()},  # fmt: skip
        (a.queried_tokens, a.hit_tokens, a.evictions),
        [a.block_group(b) for b in blocks],
    )


def hasher(block_size: int) -> PrefixHasher:
    return PrefixHasher(KvLayout(2, 2, 8), "test-model", block_size)


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


def test_freed_keyed_blocks_stay_cached_and_are_reused():
    a, h = BlockAllocator(8, 4), hasher(4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    keys = h.block_keys(prompt)
    assert a.add_sequence("a", len(prompt), keys) == 0  # empty cache: a miss
    table = a.block_table("a")
    assert a.register_blocks("a", keys) == 2
    assert [a.block_key(b) for b in table] == [*keys, None] and a.lookup(keys[1]) == table[1]
    a.free("a")
    # The two keyed blocks are cached (and still allocatable); the partial one is plain free.
    assert a.num_free_blocks == 8 and a.num_cached_blocks == 2
    assert set(a.cached_blocks()) == set(table[:2]) and table[2] in a.free_blocks()
    # A new request with the same first 9 tokens reuses both blocks and computes only the rest.
    other = prompt[:9] + [7, 7, 7]
    okeys = h.block_keys(other)
    assert a.match_prefix(okeys, len(other)) == 8
    assert a.add_sequence("b", len(other), okeys) == 8
    assert a.block_table("b")[:2] == table[:2] and a.num_cached_blocks == 0
    assert a.refcount(table[0]) == 1 and a.num_free_blocks == 5
    # Queried: the full blocks offered, 2 of "a" and 3 of "b".
    assert (a.queried_tokens, a.hit_tokens, a.evictions) == (20, 8, 0) and a.hit_rate == 8 / 20


def test_a_full_hit_leaves_at_least_one_token_to_compute():
    a, h = BlockAllocator(8, 4), hasher(4)
    prompt = list(range(12))  # exactly 3 blocks
    keys = h.block_keys(prompt)
    a.add_sequence("a", 12, keys)
    a.register_blocks("a", keys)
    a.free("a")
    # All three blocks are cached, but reusing all of them would leave nothing to compute the logits from.
    assert a.match_prefix(keys, 12) == 8
    assert a.add_sequence("b", 12, keys) == 8
    assert len(a.block_table("b")) == 3 and a.block_table("b")[2] not in [a.lookup(k) for k in keys[:2]]
    # The cap follows num_tokens: a sequence that holds one more token may reuse all three.
    assert a.match_prefix(keys, 13) == 12
    for n in (0, 1, 4):
        assert a.match_prefix(keys, n) == 0
    assert a.match_prefix(keys, 5) == 4


def test_hit_on_a_running_sequence_shares_its_blocks_for_free():
    a, h = BlockAllocator(6, 4), hasher(4)
    keys = h.block_keys(list(range(8)) + [1])
    a.add_sequence("a", 9, keys)
    a.register_blocks("a", keys)
    assert a.blocks_needed_to_add(9, keys) == 1  # two shared blocks cost nothing, the third is new
    a.free("a")
    assert a.blocks_needed_to_add(9, keys) == 3  # now the two are cached: taking them uses allocatable ones
    a.add_sequence("a", 9, keys)
    assert a.add_sequence("b", 9, keys) == 8
    shared = a.block_table("a")[:2]
    assert a.block_table("b")[:2] == shared and [a.refcount(b) for b in shared] == [2, 2]
    assert a.num_free_blocks == 6 - 4
    a.free("a")
    assert a.num_cached_blocks == 0  # b still references them
    a.free("b")
    assert a.num_cached_blocks == 2 and a.num_free_blocks == 6


def test_eviction_takes_free_blocks_first_then_least_recently_freed():
    a, h = BlockAllocator(6, 2), hasher(2)
    seqs = {name: h.block_keys([i, i, i, i]) for i, name in enumerate("xyz")}
    for name, keys in seqs.items():
        a.add_sequence(name, 4, keys)
        a.register_blocks(name, keys)
    for name in "yxz":
        a.free(name)
    # LRU order: y's blocks (tail first), then x's, then z's.
    order = [a.lookup(k) for name in "yxz" for k in reversed(seqs[name])]
    assert a.cached_blocks() == order and a.free_blocks() == []
    a.add_sequence("n", 5)  # 3 blocks: evicts y's two and x's tail
    assert a.evictions == 3 and sorted(a.block_table("n")) == sorted(order[:3])
    assert a.lookup(seqs["y"][0]) is None and a.lookup(seqs["x"][1]) is None
    assert all(a.block_key(b) is None for b in a.block_table("n"))
    # x's head block survives, but its successor is gone: reuse stops at the gap.
    assert a.match_prefix(seqs["x"], 5) == 2 and a.match_prefix(seqs["z"], 5) == 4
    a.free("n")  # unkeyed blocks go back to the free list and are handed out before any cached one
    a.add_sequence("m", 6)
    assert a.evictions == 3 and a.num_cached_blocks == 3
    # A hit moves a block out of the LRU; freeing it again makes it the most recent.
    a.free("m")
    a.add_sequence("x2", 3, seqs["x"])
    a.free("x2")
    assert a.cached_blocks()[-1] == a.lookup(seqs["x"][0])


def test_middle_block_evicted_stops_reuse_and_recompute_registers_again():
    a, h = BlockAllocator(4, 2), hasher(2)
    tokens = [5, 6, 7, 8, 9, 10]
    keys = h.block_keys(tokens)
    a.add_sequence("a", 6, keys)
    a.register_blocks("a", keys)
    a.free("a")
    lru = a.cached_blocks()  # tail first: the third block, then the second, then the first
    a.add_sequence("t", 2)  # takes the free block, no eviction
    a.add_sequence("u", 2)  # evicts the least recent: the third block
    assert a.evictions == 1 and a.lookup(keys[2]) is None and a.block_table("u") == [lru[0]]
    a.free("t")
    a.free("u")
    assert a.match_prefix(keys, 7) == 4
    assert a.add_sequence("b", 7, keys) == 4
    assert a.register_blocks("b", keys) == 1  # only the recomputed third block is new
    assert a.lookup(keys[2]) == a.block_table("b")[2]


def test_preempted_sequence_hits_its_own_blocks_when_it_returns():
    a, h = BlockAllocator(10, 4), hasher(4)
    tokens = list(range(30, 43))  # 13 tokens: prompt and generated so far
    keys = h.block_keys(tokens)
    a.add_sequence(1, 13)
    a.register_blocks(1, keys)
    table = a.block_table(1)
    a.free(1)  # preempted
    assert a.add_sequence(1, 13, keys) == 12
    assert a.block_table(1)[:3] == table[:3]


def test_chunked_prefill_registers_blocks_as_they_fill():
    a, h = BlockAllocator(12, 4), hasher(4)
    prompt = list(range(20))
    keys = h.block_keys(prompt)
    assert a.add_sequence("a", 6, keys) == 0  # first chunk of 6 tokens
    assert a.register_blocks("a", keys[:1]) == 1
    with pytest.raises(PrefixKeyError):
        a.register_blocks("a", keys[:2])  # the second block is not full yet
    a.grow("a", 6)
    assert a.register_blocks("a", keys[:3]) == 2
    assert a.register_blocks("a", keys[:3]) == 0  # registering again is a no-op
    # A second request with the same prompt, while the first is still prefilling, reuses what is done.
    assert a.add_sequence("b", 13, keys) == 12
    assert a.block_table("b")[:3] == a.block_table("a")[:3]


def test_fork_and_copy_on_write_keep_keyed_blocks_intact():
    a, h = BlockAllocator(8, 4), hasher(4)
    tokens = list(range(6))  # one full block, one partial
    keys = h.block_keys(tokens)
    a.add_sequence("p", 6, keys)
    a.register_blocks("p", keys)
    full, partial = a.block_table("p")
    a.fork("p", "c")
    copies = a.grow("c", 1)  # copy-on-write of the partial block only, as without prefix caching
    assert len(copies) == 1 and copies[0][0] == partial and a.block_key(copies[0][1]) is None
    assert a.block_table("c")[0] == full and a.refcount(full) == 2 and a.block_key(full) == keys[0]
    a.grow("c", 1)  # the child's private block is full now; registering it follows its own tokens
    ckeys = h.block_keys(tokens + [9, 9])
    assert a.register_blocks("c", ckeys) == 1
    a.free("p")
    a.free("c")
    assert a.num_cached_blocks == 2 and a.num_free_blocks == 8
    assert a.match_prefix(ckeys, 9) == 8 and a.match_prefix(keys + [h.root], 9) == 4


def test_duplicate_prefix_first_registration_wins():
    a, h = BlockAllocator(8, 4), hasher(4)
    keys = h.block_keys(list(range(9)))
    a.add_sequence("a", 9, keys)  # both admitted before either registered: computed twice
    a.add_sequence("b", 9, keys)
    assert a.register_blocks("a", keys) == 2
    assert a.register_blocks("b", keys) == 0
    assert [a.lookup(k) for k in keys] == a.block_table("a")[:2]
    assert all(a.block_key(b) is None for b in a.block_table("b"))
    a.free("b")
    assert a.num_cached_blocks == 0  # b's copies carry no key: plain free blocks


def test_prefix_errors_change_nothing():
    a, h = BlockAllocator(4, 4), hasher(4)
    keys = h.block_keys(list(range(12)))
    a.add_sequence("a", 12, keys)
    a.register_blocks("a", keys[:2])
    other = h.block_keys([0] * 12)
    before = snapshot(a)
    for call in (
        lambda: a.register_blocks("a", [keys[0], other[1]]),  # block 1 is registered under keys[1]
        lambda: a.register_blocks("a", keys + [keys[0]]),  # more keys than full blocks
        lambda: a.register_blocks("a", [keys[0], "x"]),
        lambda: a.register_blocks("a", keys[0]),  # one key, not a list of keys
        lambda: a.add_sequence("b", 4, ["abc"]),
        lambda: a.match_prefix([1, 2], 8),
    ):
        with pytest.raises(PrefixKeyError):
            call()
        assert snapshot(a) == before
    with pytest.raises(UnknownSequence):
        a.register_blocks("zz", keys)
    with pytest.raises(ShapeMismatch):
        a.match_prefix(keys, -1)
    with pytest.raises(ShapeMismatch):
        a.add_sequence("b", -1, keys)
    with pytest.raises(KvPoolExhausted):
        a.add_sequence("b", 12, other)  # 3 blocks needed, 1 free
    assert snapshot(a) == before
    # A hit makes the same request fit: two of its three blocks are shared with "a".
    assert not a.can_add(12, other) and a.can_add(12, keys)
    assert a.add_sequence("b", 12, keys) == 8 and a.num_free_blocks == 0
    # A repeated key (bad input) is never matched twice: no block appears twice in a table.
    a.free("b")
    assert a.match_prefix([keys[0], keys[0], keys[1]], 13) == 4



# Several block tables per sequence (table groups: a full one and a sliding one of window 6), one free list.
def test_every_table_gets_its_own_blocks_from_one_free_list():
    a = BlockAllocator(12, 4, windows=(None, 6))
    a.add_sequence("x", 5)
    full, sliding = a.block_table("x", 0), a.block_table("x", 1)
    assert len(full) == len(sliding) == 2 and not set(full) & set(sliding) and a.num_free_blocks == 8
    assert [a.block_group(b) for b in full + sliding] == [0, 0, 1, 1] and a.block_group(a.free_blocks()[0]) is None
    assert a.blocks_needed("x", 4) == 2 and a.grow("x", 4) == []  # a new block in each table
    assert a.slots("x", 0, 9, 1) == [a.block_table("x", 1)[p // 4] * 4 + p % 4 for p in range(9)]
    assert (a.blocks_in_use(0), a.blocks_in_use(1), a.blocks_in_use()) == (3, 3, 6)
    # The next query sits at position 9: it sees 4..9, so the sliding table's first block goes back; the full one
    # keeps all three.
    assert a.release_outside_windows("x", 9) == 1
    assert (a.num_released("x", 0), a.num_released("x", 1)) == (0, 1) and a.blocks_in_use(1) == 2
    with pytest.raises(PositionOutOfRange):
        a.slots("x", 0, 9, 1)
    assert len(a.slots("x", 0, 9, 0)) == 9
    with pytest.raises(PositionOutOfRange):
        a.check_positions("x", 0, 9)  # no group given: every table must still hold the positions
    a.fork("x", "y")
    assert [a.refcount(b) for b in a.block_table("x", 0)] == [2, 2, 2]
    assert [a.refcount(b) for b in a.block_table("x", 1)] == [0, 2, 2]  # the released head is not shared
    assert a.blocks_needed("y", 1) == 2 and a.copies_on_grow("y", 1)  # the partial last block of both tables
    copies = a.grow("y", 1)
    assert sorted(src for src, _ in copies) == sorted([a.block_table("x", 0)[2], a.block_table("x", 1)[2]])
    a.free("x")
    a.free("y")
    assert a.num_free_blocks == 12 and a.blocks_in_use() == 0
    for bad in ((), [0], [None, -1], "ab", [True]):
        with pytest.raises(ShapeMismatch):
            BlockAllocator(4, 4, windows=bad)
    a.add_sequence("z", 1)
    for group in (2, -1, True):
        with pytest.raises(ShapeMismatch):
            a.block_table("z", group)


def test_tables_fail_atomically():
    a = BlockAllocator(5, 4, windows=(None, 6))
    a.add_sequence("a", 5)  # two blocks per table: 4 of 5
    a.fork("a", "b")
    before = snapshot(a)
    for call in (lambda: a.add_sequence("c", 1), lambda: a.grow("a", 4), lambda: a.grow("b", 1)):
        with pytest.raises(KvPoolExhausted):
            call()  # 2 blocks needed (one per table, or two copies), 1 free
        assert snapshot(a) == before
    assert a.can_add(0) and not a.can_add(1) and not a.can_grow("b", 1) and a.can_grow("b", 0)


def test_a_hit_needs_every_table_and_a_sliding_table_holds_only_its_window():
    a, h = BlockAllocator(16, 4, windows=(None, 6)), hasher(4)
    prompt = list(range(17))  # 4 full blocks + 1 token
    keys = h.block_keys(prompt)
    a.add_sequence("a", 17, keys)
    assert a.register_blocks("a", keys) == 8  # each key in both tables' namespaces
    assert a.lookup(keys[0], 0) != a.lookup(keys[0], 1) and a.block_key(a.lookup(keys[0], 1)) == keys[0]
    full, sliding = a.block_table("a", 0), a.block_table("a", 1)
    a.free("a")
    # All 8 keyed blocks are cached. Position 16 (the first to compute) sees 11..16: the sliding table holds its
    # hit blocks 2 and 3 only, blocks 0 and 1 enter its table released, never held.
    assert a.match_prefix(keys, 17) == 16
    assert a.blocks_needed_to_add(17, keys) == (4 + 1) + (2 + 1)
    assert a.add_sequence("b", 17, keys) == 16
    assert a.block_table("b", 0)[:4] == full[:4] and a.block_table("b", 1)[:4] == sliding[:4]
    assert (a.num_released("b", 0), a.num_released("b", 1)) == (0, 2)
    assert [a.refcount(b) for b in sliding[:4]] == [0, 0, 1, 1] and a.cached_blocks() == sliding[:2][::-1]
    a.free("b")
    assert a.cached_blocks()[:2] == sliding[:2][::-1] and a.num_free_blocks - a.num_cached_blocks == 8
    # 5 blocks per table: the 8 free ones and the two least recently freed, the sliding table's first two. The full
    # table still holds the whole chain, but a hit needs it in every table: none.
    a.add_sequence("c", 20)
    assert a.evictions == 2 and a.lookup(keys[0], 1) is None and a.lookup(keys[0], 0) == full[0]
    assert a.match_prefix(keys, 17) == 0 and a.blocks_needed_to_add(17, keys) == 10


def test_peak_blocks_counts_a_sliding_table_up_to_its_window_and_chunk():
    a = BlockAllocator(64, 4, windows=(None, 6))
    # One sequence of 40 tokens: the full table 10 blocks; the sliding one at most 6 - 1 + 8 positions of a chunk
    # of 8 (4 blocks) plus a block for the alignment.
    assert a.peak_blocks([40], 0, 8) == 10 + 5
    assert a.peak_blocks([40]) == 20  # without a chunk bound, every block of both tables
    assert a.peak_blocks([8], 0, 8) == 2 + 2  # short: all its blocks
    # Three choices of a 9-token prompt: the full table holds the two full prompt blocks once.
    assert a.peak_blocks([20, 20, 20], 9, 8) == 2 + 3 * 3 + 3 * 5
    assert BlockAllocator(64, 4).peak_blocks([20, 20, 20], 9, 8) == 2 + 3 * 3

BS = 4  # the machine's block size
# Prompts: random, or the start of one of two shared prompts plus a random tail, so that prefixes repeat.
SHARED = ([0, 1, 2, 0, 1, 2, 2, 1, 0, 0, 2, 1, 1, 1, 0, 2], [2, 2, 0, 1, 0, 0, 1, 2, 2, 0, 1, 1])
TAIL = st.lists(st.integers(0, 2), max_size=8)
TOKENS = st.one_of(
    st.lists(st.integers(0, 2), max_size=20),
    st.builds(lambda p, n, tail: p[:n] + tail, st.sampled_from(SHARED), st.integers(0, 16), TAIL),
)


class AllocatorMachine(RuleBasedStateMachine):
    """Random add (plain or with a prefix hit) / grow / register / fork / free / preempt-and-return / release
    (a sliding window's head, explicitly or by the table groups' windows) over a pool that remembers the token
    written at each slot; `WINDOWS` gives the table groups (one block table each per sequence).

    Invariants: refcounts match the tables; every block is exactly one of referenced, cached (keyed) or free,
    so nothing leaks; a shared block sits at the same position of the same group in every table that holds it;
    every position of every sequence reads back, in every group, the token it was written with (so no write ever
    reached another sequence's block or another group's); a keyed block holds the tokens its key was computed
    from. Per rule: failures are atomic; writes go only to private unkeyed blocks; allocation never hands out a
    referenced block, and evicts (drops the key of) exactly the cached blocks it hands out; a hit returns the
    blocks registered under its keys in every group, is the longest run and leaves a token to compute; a preempted
    sequence that returns hits its own blocks. A released head is no longer held (its stale table entries are
    never counted or read); its keyed blocks stay hits.
    """

    WINDOWS: tuple[int | None, ...] = (None,)
    NUM_BLOCKS = 12
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(num_blocks=self.NUM_BLOCKS, block_size=BS, windows=self.WINDOWS)
        self.groups = range(len(self.WINDOWS))
        self.h = hasher(BS)
        self.next_id = 0
        self.pool: list[int | None] = [None] * (self.NUM_BLOCKS * BS)  # the token last written at each slot
        self.tokens: dict[int, list[int]] = {}  # written tokens of each live sequence: its positions [0, len)
        self.pending: dict[int, list[int]] = {}  # prompt tokens not reserved yet (chunked prefill)
        self.key_tokens: dict[bytes, tuple[int, ...]] = {}  # the block tokens behind every key computed

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _keys(self, tokens: list[int]) -> list[bytes]:
        keys = self.h.block_keys(tokens)
        for i, key in enumerate(keys):
            self.key_tokens[key] = tuple(tokens[i * BS : (i + 1) * BS])
        return keys

    def _tables(self, sid: int) -> list[int]:
        """Every block of every table of `sid`, group after group."""
        return [b for g in self.groups for b in self.a.block_table(sid, g)]

    def _write(self, sid: int, toks: list[int]) -> None:
        """The forward pass: write `toks` after the sequence's written tokens in every group, only into blocks it
        owns alone."""
        start = len(self.tokens[sid])
        for g in self.groups:
            for slot, t in zip(self.a.slots(sid, start, start + len(toks), g), toks, strict=True):
                assert self.a.refcount(slot // BS) == 1 and self.a.block_key(slot // BS) is None
                assert self.a.block_group(slot // BS) == g
                self.pool[slot] = t
        self.tokens[sid] += toks

    def _check_fresh(self, fresh: list[int], refs_before: list[int], keys_before: list, evictions: int) -> None:
        """Blocks just handed out were unreferenced; the keyed ones among them were evicted and lost their key."""
        assert all(refs_before[b] == 0 and self.a.refcount(b) == 1 for b in fresh)
        evicted = [b for b in fresh if keys_before[b] is not None]
        assert self.a.evictions - evictions == len(evicted)
        assert all(self.a.block_key(b) is None for b in evicted)
        assert all(self.a.lookup(keys_before[b], g) != b for b in evicted for g in self.groups)

    def _add_with_keys(self, sid: int, toks: list[int], num: int) -> int | None:
        """add_sequence(sid, num, keys of toks) with every check; the hit, or None if the pool was exhausted."""
        a = self.a
        keys = self._keys(toks)
        hit = a.match_prefix(keys, len(toks))
        hb, cap = hit // BS, max(0, (len(toks) - 1) // BS)
        # Capped, and the longest run every group holds.
        assert hb <= cap and (hb in (cap, len(keys)) or any(a.lookup(keys[hb], g) is None for g in self.groups))
        registered = [[a.lookup(k, g) for k in keys[:hb]] for g in self.groups]
        before = snapshot(a)
        refs, held = before[2], before[3]
        need = a.blocks_needed_to_add(num, keys)
        counters = (a.queried_tokens, a.hit_tokens, a.evictions)
        try:
            got = a.add_sequence(sid, num, keys)
        except KvPoolExhausted:
            assert need > a.num_free_blocks
            assert snapshot(a) == before
            return None
        assert got == hit and a.context_len(sid) == num
        fresh = []
        for g in self.groups:
            table = a.block_table(sid, g)
            assert table[:hb] == registered[g]  # a hit returns the blocks registered under those keys
            fresh += table[hb:]
            # A sliding group holds no hit block wholly before the window of position `hit`.
            window = self.WINDOWS[g]
            skip = 0 if window is None else max(0, hit - window + 1) // BS
            assert a.num_released(sid, g) == skip
        self._check_fresh(fresh, refs, held, counters[2])
        assert len(before[0]) + len(before[1]) - a.num_free_blocks == need
        assert (a.queried_tokens - counters[0], a.hit_tokens - counters[1]) == (len(keys) * BS, hit)
        # The hit positions already hold this prompt's tokens: nothing to compute there.
        for g in self.groups:
            start = a.num_released(sid, g) * BS
            assert [self.pool[s] for s in a.slots(sid, start, hit, g)] == toks[start:hit]
        self.tokens[sid] = list(toks[:hit])
        self._write(sid, toks[hit:num])
        return hit

    @rule(target=seqs, toks=TOKENS)
    def add(self, toks):
        sid = self._new_id()
        n = len(toks)
        before = snapshot(self.a)
        try:
            self.a.add_sequence(sid, n)
        except KvPoolExhausted:
            assert snapshot(self.a) == before
            return sid  # not registered: later rules on it must raise UnknownSequence
        assert self.a.context_len(sid) == n
        assert all(len(self.a.block_table(sid, g)) == self.a.blocks_for_tokens(n) for g in self.groups)
        self._check_fresh(self._tables(sid), before[2], before[3], before[5][2])
        self.tokens[sid], self.pending[sid] = [], []
        self._write(sid, toks)
        return sid

    @rule(target=seqs, toks=TOKENS, chunk=st.integers(1, 20))
    def add_with_prefix(self, toks, chunk):
        """Admission as the scheduler does it: match, then hold the hit plus the first chunk of the rest."""
        sid = self._new_id()
        hit = self.a.match_prefix(self._keys(toks), len(toks))
        num = min(len(toks), hit + chunk)
        if self._add_with_keys(sid, toks, num) is not None:
            self.pending[sid] = list(toks[num:])
        return sid

    @rule(sid=seqs, extra=st.lists(st.integers(0, 2), max_size=9))
    def grow(self, sid, extra):
        n = len(extra)
        if sid not in self.a:
            with pytest.raises(UnknownSequence):
                self.a.grow(sid, n)
            return
        before = snapshot(self.a)
        need = self.a.blocks_needed(sid, n)
        cow = self.a.copies_on_grow(sid, n)
        length = self.a.context_len(sid)
        try:
            copies = self.a.grow(sid, n)
        except KvPoolExhausted:
            assert need > self.a.num_free_blocks
            assert snapshot(self.a) == before
            return
        assert self.a.num_free_blocks == len(before[0]) + len(before[1]) - need
        assert self.a.context_len(sid) == length + n and cow == bool(copies)
        # New tail blocks, and the private copy of a shared partial block (an id may be one this sequence released).
        tails = [b for g in self.groups for b in self.a.block_table(sid, g)[len(before[4][sid][0][g]) :]]
        self._check_fresh(tails + [dst for _, dst in copies], before[2], before[3], before[5][2])
        for src, dst in copies:  # the copied block was shared; the writer now owns a private one
            assert self.a.refcount(dst) == 1 and self.a.refcount(src) >= 1
            assert self.a.block_group(dst) == self.a.block_group(src)
            self.pool[dst * BS : (dst + 1) * BS] = self.pool[src * BS : (src + 1) * BS]
        new = (self.pending[sid] + extra)[:n]  # the rest of the prompt first, then generated tokens
        self.pending[sid] = self.pending[sid][n:]
        self._write(sid, new)

    @rule(sid=seqs)
    def register(self, sid):
        if sid not in self.a:
            with pytest.raises(UnknownSequence):
                self.a.register_blocks(sid, [])
            return
        keys = self._keys(self.tokens[sid])
        tables = [self.a.block_table(sid, g) for g in self.groups]
        held = [[self.a.block_key(b) for b in table] for table in tables]
        added = self.a.register_blocks(sid, keys)
        expected = 0
        for g, table in enumerate(tables):
            gone = self.a.num_released(sid, g)  # released blocks may belong to other sequences (and keys) now
            for i, key in list(enumerate(keys))[gone:]:
                now = self.a.block_key(table[i])
                # Registered under its key, or left without one because another block already holds that key.
                assert now == key or (now is None and self.a.lookup(key, g) not in (None, table[i]))
                expected += held[g][i] is None and now is not None
        assert added == expected
        assert self.a.register_blocks(sid, keys) == 0

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
        assert all(self.a.block_table(child, g) == self.a.block_table(parent, g) for g in self.groups)
        self.tokens[child], self.pending[child] = list(self.tokens[parent]), list(self.pending[parent])
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid not in self.a:
            return
        tables = [self.a.block_table(sid, g)[self.a.num_released(sid, g) :] for g in self.groups]
        cached = self.a.cached_blocks()
        self.a.free(sid)
        released = [b for table in tables for b in reversed(table) if self.a.refcount(b) == 0]
        keyed = [b for b in released if self.a.block_key(b) is not None]
        assert self.a.cached_blocks() == cached + keyed  # most recently freed last, the tail before the head
        assert set(released) - set(keyed) <= set(self.a.free_blocks())
        del self.tokens[sid], self.pending[sid]

    @rule(sid=seqs)
    def preempt_and_return(self, sid):
        """Preemption frees a sequence; when it is admitted again it hits whatever is still registered."""
        if sid not in self.a:
            return
        toks = self.tokens[sid]
        keys = self._keys(toks)
        expected = self.a.match_prefix(keys, len(toks))
        own = len(keys)
        for g in self.groups:
            table, run = self.a.block_table(sid, g), 0
            while run < len(keys) and self.a.lookup(keys[run], g) == table[run]:
                run += 1
            own = min(own, run)
        assert expected >= min(own, max(0, (len(toks) - 1) // BS)) * BS
        pending = self.pending[sid]
        self.a.free(sid)
        assert self.a.match_prefix(keys, len(toks)) == expected  # freeing evicts nothing
        hit = self._add_with_keys(sid, toks, len(toks))
        if hit is None:  # a block it shared unkeyed (a fork's partial block) has no room now: it waits
            del self.tokens[sid], self.pending[sid]
            return
        assert hit == expected
        self.pending[sid] = pending

    def _check_release(self, sid: int, call, upto: list[int]) -> None:
        """`call()` releases, in group g, the blocks before ``upto[g]`` (in blocks) and nothing else."""
        length = self.a.context_len(sid)
        gone = [self.a.num_released(sid, g) for g in self.groups]
        tables = [self.a.block_table(sid, g) for g in self.groups]
        cached = self.a.cached_blocks()
        released = call()
        now = [self.a.num_released(sid, g) for g in self.groups]
        assert now == [max(g0, min(u, length // BS)) for g0, u in zip(gone, upto, strict=True)]
        assert released == sum(n - g0 for n, g0 in zip(now, gone, strict=True))
        assert [self.a.block_table(sid, g) for g in self.groups] == tables and self.a.context_len(sid) == length
        dropped = [b for g in self.groups for b in tables[g][gone[g] : now[g]] if self.a.refcount(b) == 0]
        assert self.a.cached_blocks() == cached + [b for b in dropped if self.a.block_key(b) is not None]
        if any(now):
            with pytest.raises(PositionOutOfRange):
                self.a.slots(sid, 0, length, now.index(max(now)))

    @rule(sid=seqs, keep=st.integers(0, 9))
    def release(self, sid, keep):
        """A sliding window over the last `keep` positions, in every group: the blocks wholly before it go back."""
        if sid not in self.a:
            with pytest.raises(UnknownSequence):
                self.a.release_before(sid, 0)
            return
        length = self.a.context_len(sid)
        upto = [max(0, length - keep) // BS] * len(self.groups)
        self._check_release(sid, lambda: self.a.release_before(sid, length - keep), upto)

    @rule(sid=seqs)
    def release_windows(self, sid):
        """The groups' own windows, for the next query (at the sequence's length): full groups keep every block."""
        if sid not in self.a:
            with pytest.raises(UnknownSequence):
                self.a.release_outside_windows(sid, 0)
            return
        length = self.a.context_len(sid)
        upto = [0 if w is None else max(0, length - w + 1) // BS for w in self.WINDOWS]
        self._check_release(sid, lambda: self.a.release_outside_windows(sid, length), upto)

    @invariant()
    def refcounts_match_tables(self):
        counts = [0] * self.a.num_blocks
        for sid in self.a.sequences():
            for g in self.groups:
                table = self.a.block_table(sid, g)
                assert len(table) == self.a.blocks_for_tokens(self.a.context_len(sid))
                for block in table[self.a.num_released(sid, g) :]:
                    counts[block] += 1
                    assert self.a.block_group(block) == g
        assert counts == [self.a.refcount(b) for b in range(self.a.num_blocks)]
        assert self.a.blocks_in_use() == sum(1 for c in counts if c)
        assert sum(self.a.blocks_in_use(g) for g in self.groups) == self.a.blocks_in_use()
        free, cached = self.a.free_blocks(), self.a.cached_blocks()
        assert len(set(free)) == len(free) and len(set(cached)) == len(cached)  # no block listed twice
        assert len(free) + len(cached) == self.a.num_free_blocks
        assert not set(free) & set(cached)
        # No leak: free + cached + referenced == all blocks, and the unreferenced ones are exactly free or cached.
        assert set(free) | set(cached) == {b for b, c in enumerate(counts) if c == 0}
        assert all(self.a.block_key(b) is None for b in free) and all(self.a.block_key(b) for b in cached)

    @invariant()
    def shared_blocks_hold_the_same_positions(self):
        where: dict[int, set[tuple[int, int]]] = {}
        for sid in self.a.sequences():
            for g in self.groups:
                gone = self.a.num_released(sid, g)
                for i, block in list(enumerate(self.a.block_table(sid, g)))[gone:]:
                    where.setdefault(block, set()).add((g, i))
        assert all(len(positions) == 1 for positions in where.values())

    @invariant()
    def every_position_reads_back_its_token(self):
        for sid in self.a.sequences():
            n = self.a.context_len(sid)
            assert len(self.tokens[sid]) == n
            for g in self.groups:
                start = self.a.num_released(sid, g) * BS
                assert [self.pool[s] for s in self.a.slots(sid, start, n, g)] == self.tokens[sid][start:]

    @invariant()
    def keyed_blocks_hold_their_tokens(self):
        for b in range(self.a.num_blocks):
            key = self.a.block_key(b)
            if key is not None:
                assert self.a.lookup(key, self.a.block_group(b)) == b
                assert tuple(self.pool[b * BS : (b + 1) * BS]) == self.key_tokens[key]

    def teardown(self):
        for sid in self.a.sequences():
            self.a.free(sid)
        assert self.a.num_free_blocks == self.a.num_blocks
        assert all(self.a.refcount(b) == 0 for b in range(self.a.num_blocks))


TestAllocatorMachine = AllocatorMachine.TestCase


class TablesMachine(AllocatorMachine):
    """The same rules over three block tables per sequence (full, a sliding window of 6, full) sharing one pool."""

    WINDOWS = (None, 6, None)
    NUM_BLOCKS = 30


TestTablesMachine = TablesMachine.TestCase
TestTablesMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
