"""Block allocator for the paged cache: reference-counted blocks, sequences as block lists, fork and copy-on-write,
and automatic prefix caching.

The allocator only does bookkeeping; it never touches tensors. When a write would land in a block that another
sequence still shares, `grow` hands back the (source, destination) block pairs the cache must copy first.
Every mutating call checks that it can succeed before changing anything, so a `KvPoolExhausted` (or any other
error) leaves the allocator exactly as it was.

Prefix caching (keys: cache/prefix.py). Every block is in exactly one of three states:
  referenced  refcount > 0, in one or more block tables;
  cached      refcount 0 but registered under a key: its K/V is kept for reuse, in LRU order;
  free        refcount 0, no key.
A full, computed block is registered with `register_blocks`. When its last sequence frees it, it becomes
cached instead of free. `add_sequence(..., block_keys=...)` shares the longest run of registered blocks
(cached or still referenced) from the start of the key chain instead of allocating them. Allocation takes
free blocks first and then evicts cached ones, least recently freed first; so cached blocks count as
allocatable in `num_free_blocks`, and a block is never evicted while referenced. A registered block is full
and a sequence only writes at positions >= its length, so a block with a key is never written again;
copy-on-write only ever concerns a partial last block, which has no key.

Sliding windows (`release_before`): a sequence whose model attends only to its last `window` positions drops
its references to the blocks wholly before the window, oldest first; they become cached (keyed) or free like
freed blocks, while the sequence keeps their (stale) ids in its table, which attention never reads again.
`free`, `fork` and `register_blocks` skip the released head; `slots` refuses positions in it.

A cache whose blocks are usable as a hit's end only while it still holds more than the blocks' K/V (the 4-bit
format's F16 rows, cache/paged_q4w.py) sets `hit_limit`: every hit (`match_prefix`, `blocks_needed_to_add`,
`add_sequence`) is cut to the blocks of the run it says are usable, and counted so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    KvCacheError,
    KvPoolExhausted,
    PositionOutOfRange,
    PrefixKeyError,
    ShapeMismatch,
    UnknownSequence,
)

SeqId = Hashable
BlockCopy = tuple[int, int]  # (source block, destination block)


@dataclass
class _Sequence:
    # Per table group: the block table, and how many of its leading blocks are no longer referenced (outside
    # that group's sliding window). Every group covers the same positions [0, length).
    tables: list[list[int]]
    length: int = 0
    released: list[int] = field(default_factory=list)


class BlockAllocator:
    """Hands out fixed-size blocks of token slots to sequences; keeps freed blocks with a key for reuse.

    ``windows``: one entry per *table group* (a group of layers whose K/V one block of the pool holds): None for
    layers that attend to every earlier position, the window W for sliding layers. Each sequence has one block
    table per group, all over the same positions, all drawing blocks from one free list; a block belongs to one
    group at a time. Capacity questions (`blocks_needed`, `blocks_needed_to_add`, `can_grow`, `can_add`) count
    every group, and every mutation acts on every group or on none. One group, ``(None,)``, is the plain cache.
    Per-group queries take ``group`` (default 0).

    Counters for the engine's stats (monotonic): ``queried_tokens`` (tokens of the block keys offered to
    `add_sequence`), ``hit_tokens`` (of those, tokens served from registered blocks) and ``evictions``
    (cached blocks handed out again, their K/V lost).
    """

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None] = (None,)) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ShapeMismatch(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        windows = tuple(windows) if isinstance(windows, (tuple, list)) else ()
        if not windows or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0)
                              for w in windows):  # fmt: skip
            raise ShapeMismatch(f"windows must be a non-empty list of positive ints or None, got {windows!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows: tuple[int | None, ...] = windows
        self.num_groups = len(windows)
        self._refcounts = [0] * num_blocks
        self._group_of = [0] * num_blocks  # the table group of a referenced or cached block
        # Popped from the end, so low block ids are handed out first (easier to read in debug dumps).
        self._free = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks that carry a key, least recently freed first (the next to be evicted).
        self._cached: OrderedDict[int, None] = OrderedDict()
        # Keys live in each table group's namespace: the same chain key names one block per group.
        self._key_of: dict[int, tuple[int, bytes]] = {}  # every registered block, referenced or cached
        self._block_of: dict[tuple[int, bytes], int] = {}  # the inverse: one block per (group, key)
        self._seqs: dict[SeqId, _Sequence] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        #: None, or how many blocks of a hit's run (first table group's blocks, from the first) a new sequence can
        #: take and compute on from: the hit is cut to that many (module docs).
        self.hit_limit: Callable[[list[int]], int] | None = None
        #: None, or where the prefix cache's changes go (engine/kv_events.py EventLog: stored, removed, cleared).
        self.events: Any = None

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, windows={self.windows}, "
            f"free={self.num_free_blocks}, cached={self.num_cached_blocks}, sequences={len(self._seqs)})"
        )

    # -- queries ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: the free ones plus the cached (unreferenced, keyed) ones, which are
        evicted on demand."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for their key (a part of `num_free_blocks`)."""
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        """hit_tokens / queried_tokens (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def free_blocks(self) -> list[int]:
        """Unreferenced blocks without a key, the next one handed out first."""
        return self._free[::-1]

    def cached_blocks(self) -> list[int]:
        """Unreferenced blocks with a key, the next one evicted first (least recently freed)."""
        return list(self._cached)

    def block_key(self, block: int) -> bytes | None:
        """The key `block` is registered under (in its group's namespace, `block_group`), or None."""
        held = self._key_of.get(block)
        return None if held is None else held[1]

    def block_group(self, block: int) -> int | None:
        """The table group whose K/V a referenced or cached block holds; None for a free block."""
        return None if self._refcounts[block] == 0 and block not in self._cached else self._group_of[block]

    def lookup(self, key: bytes, group: int = 0) -> int | None:
        """The block registered under `key` in table group `group` (referenced or cached), or None."""
        return self._block_of.get((group, key))

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def blocks_in_use(self, group: int | None = None) -> int:
        """Referenced blocks (held by a sequence) of table group `group` (None: of every group)."""
        return sum(1 for b, c in enumerate(self._refcounts) if c and (group is None or self._group_of[b] == group))

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequences(self) -> Iterator[SeqId]:
        return iter(list(self._seqs))

    def _seq(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} is not registered") from None

    def _group(self, group: int) -> int:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise ShapeMismatch(f"group must be an int in [0, {self.num_groups}), got {group!r}")
        return group

    def block_table(self, seq_id: SeqId, group: int = 0) -> list[int]:
        return list(self._seq(seq_id).tables[self._group(group)])

    def context_len(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).length

    def num_released(self, seq_id: SeqId, group: int = 0) -> int:
        """Leading blocks of the sequence's table it no longer holds (`release_before`): their ids are stale."""
        return self._seq(seq_id).released[self._group(group)]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks one table of `num_tokens` positions spans (per table group)."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: SeqId, num_tokens: int) -> int:
        """Free blocks `grow(seq_id, num_tokens)` would consume over every group (new blocks plus copy-on-write
        copies)."""
        seq = self._seq(seq_id)
        return self.num_groups * self._new_blocks(seq, num_tokens) + len(self._cow_groups(seq, num_tokens))

    def copies_on_grow(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Whether `grow(seq_id, num_tokens)` replaces the shared partial last block of a table (copy-on-write)."""
        return bool(self._cow_groups(self._seq(seq_id), num_tokens))

    def can_grow(self, seq_id: SeqId, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    def peak_blocks(self, lengths: Sequence[int], shared_tokens: int = 0, chunk: int | None = None) -> int:
        """The most blocks a group of sequences (each growing to `lengths[i]` tokens, sharing their first
        `shared_tokens` positions' full blocks: a forked prompt) holds at once, over every table group. A sliding
        group holds at most the blocks its window and a chunk of `chunk` new tokens span
        (`blocks_for_tokens(window - 1 + chunk) + 1` per sequence); with `chunk` None every block is counted."""
        shared = shared_tokens // self.block_size
        need = 0
        for window in self.windows:
            per = [self.blocks_for_tokens(n) for n in lengths]
            if window is None or chunk is None:
                need += shared + sum(b - shared for b in per) if per else 0
            else:
                cap = self.blocks_for_tokens(window - 1 + chunk) + 1
                need += sum(min(b, cap) for b in per)
        return need

    def slots(self, seq_id: SeqId, start: int, end: int, group: int = 0) -> list[int]:
        """Slot ids of positions [start, end) of a sequence in table group `group`."""
        seq = self._seq(seq_id)
        self.check_positions(seq_id, start, end, group)
        bs, table = self.block_size, seq.tables[group]
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def check_positions(self, seq_id: SeqId, start: int, end: int, group: int | None = None) -> None:
        """PositionOutOfRange unless ``[start, end)`` lies in the stored positions still held (not released) in
        table group `group` (None: in every group)."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.length:
            raise PositionOutOfRange(f"positions [{start}, {end}) outside stored [0, {seq.length})")
        groups = range(self.num_groups) if group is None else (self._group(group),)
        gone = max(seq.released[g] for g in groups) * self.block_size
        if start < end and start < gone:
            raise PositionOutOfRange(
                f"positions [{start}, {gone}) of sequence {seq_id!r} were released "
                "(outside its sliding window): their blocks may hold other tokens now"
            )

    def match_prefix(self, block_keys: Sequence[bytes], num_tokens: int) -> int:
        """Tokens of a sequence of `num_tokens` tokens, with full-block keys `block_keys`, that the pool already
        holds: the longest run of registered blocks from the first key, in whole blocks, in every table group (the
        shortest group's run), and never all of `num_tokens` (at most ``(num_tokens - 1) // block_size`` blocks), so
        at least one token is left to compute the next logits from. A query: nothing changes. `add_sequence` with
        the same arguments hits as many tokens while no allocation or free happens in between."""
        if num_tokens < 0:
            raise ShapeMismatch(f"num_tokens must be >= 0, got {num_tokens}")
        return len(self._match(block_keys, num_tokens)[0]) * self.block_size

    def blocks_needed_to_add(self, num_tokens: int, block_keys: Sequence[bytes] | None = None) -> int:
        """Blocks `add_sequence(_, num_tokens, block_keys)` would take out of `num_free_blocks`, over every group:
        the new ones, plus the hit blocks that are cached now and will be held (a hit on a referenced block costs
        nothing, and a sliding group does not hold the hit blocks wholly before the window of the first position to
        compute)."""
        if num_tokens < 0:
            raise ShapeMismatch(f"num_tokens must be >= 0, got {num_tokens}")
        hits = self._match(block_keys, num_tokens) if block_keys is not None else [[]] * self.num_groups
        need = 0
        for g, run in enumerate(hits):
            held = run[self._skipped(g, len(run)) :]
            need += self.blocks_for_tokens(num_tokens) - len(run) + sum(1 for b in held if self._refcounts[b] == 0)
        return need

    def can_add(self, num_tokens: int, block_keys: Sequence[bytes] | None = None) -> bool:
        return self.blocks_needed_to_add(num_tokens, block_keys) <= self.num_free_blocks

    # -- mutations ----------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, num_tokens: int = 0, block_keys: Sequence[bytes] | None = None) -> int:
        """Register a sequence holding `num_tokens` positions; returns how many of them hit the prefix cache.

        Without `block_keys` every block is new and the result is 0. With them (the keys of the full blocks of
        the sequence's tokens, see `PrefixHasher.block_keys`; more keys than `num_tokens` covers are fine), the
        first `match_prefix(block_keys, num_tokens)` tokens share the registered blocks of every group: positions
        ``[0, hit)`` already hold valid K/V and the caller computes ``[hit, num_tokens)``, which is never
        empty when `num_tokens` > 0. In a sliding group the hit blocks wholly before the window of position `hit`
        enter the table released (never read, not held). Counts `queried_tokens` (``len(block_keys) *
        block_size``) and `hit_tokens`.
        """
        if seq_id in self._seqs:
            raise KvCacheError(f"sequence {seq_id!r} is already registered")
        need = self.blocks_needed_to_add(num_tokens, block_keys)  # validates num_tokens and the keys
        if need > self.num_free_blocks:
            raise KvPoolExhausted(f"need {need} free block(s), only {self.num_free_blocks} of {self.num_blocks} free")
        hits = self._match(block_keys, num_tokens) if block_keys is not None else [[]] * self.num_groups
        skipped = [self._skipped(g, len(run)) for g, run in enumerate(hits)]
        for g, run in enumerate(hits):
            for block in run[skipped[g] :]:
                # Claimed before `_take` runs, so the eviction it may do cannot pick a block this sequence reuses.
                self._cached.pop(block, None)
                self._refcounts[block] += 1
        fresh = self._take(self.num_groups * self.blocks_for_tokens(num_tokens) - sum(len(r) for r in hits))
        tables = []
        for g, run in enumerate(hits):
            n = self.blocks_for_tokens(num_tokens) - len(run)
            tables.append(run + self._assign(fresh[:n], g))
            fresh = fresh[n:]
        self._seqs[seq_id] = _Sequence(tables, num_tokens, skipped)
        hit = len(hits[0]) * self.block_size
        if block_keys is not None:
            self.queried_tokens += len(block_keys) * self.block_size
            self.hit_tokens += hit
        return hit

    def register_blocks(self, seq_id: SeqId, block_keys: Sequence[bytes]) -> int:
        """Register block ``i`` of a sequence under ``block_keys[i]`` in every table group, so later sequences can
        reuse it; returns how many blocks got a key now (over every group).

        Call it once those blocks are full *and written* (after the forward pass that computed them): the
        caller vouches for their content. Keys may be passed again as a sequence grows (already registered
        blocks are skipped). A key already held by another block (the same prefix computed twice at once)
        leaves this block without a key: the first registration wins. Raises `PrefixKeyError`, changing
        nothing, for more keys than full blocks or a block already registered under a different key.
        """
        seq = self._seq(seq_id)
        self._check_keys(block_keys)
        full = seq.length // self.block_size
        if len(block_keys) > full:
            raise PrefixKeyError(f"{len(block_keys)} keys but sequence {seq_id!r} has {full} full block(s)")
        for g, table in enumerate(seq.tables):
            for block, key in zip(table[seq.released[g] :], block_keys[seq.released[g] :], strict=False):
                held = self._key_of.get(block)
                if held is not None and held != (g, key):
                    raise PrefixKeyError(f"block {block} of sequence {seq_id!r} is registered under another key")
        added = 0
        # Released blocks were registered (or not) while held; another sequence may own them now.
        for g, table in enumerate(seq.tables):
            for block, key in zip(table[seq.released[g] :], block_keys[seq.released[g] :], strict=False):
                if block not in self._key_of and (g, key) not in self._block_of:
                    self._key_of[block] = (g, key)
                    self._block_of[(g, key)] = block
                    added += 1
                    if self.events is not None:
                        self.events.stored(g, key)
        return added

    def grow(self, seq_id: SeqId, num_tokens: int) -> list[BlockCopy]:
        """Reserve `num_tokens` more positions in every group; returns the block copies to do before writing into
        them."""
        if num_tokens < 0:
            raise ShapeMismatch(f"num_tokens must be >= 0, got {num_tokens}")
        seq = self._seq(seq_id)
        cow = self._cow_groups(seq, num_tokens)
        new = self._new_blocks(seq, num_tokens)
        fresh = self._take(self.num_groups * new + len(cow))
        copies: list[BlockCopy] = []
        for g, table in enumerate(seq.tables):
            if g in cow:
                # The shared partial last block: this sequence gets a private copy, the others keep the original.
                src, dst = table[-1], self._assign([fresh.pop()], g)[0]
                self._refcounts[src] -= 1
                table[-1] = dst
                copies.append((src, dst))
            table.extend(self._assign(fresh[:new], g))
            fresh = fresh[new:]
        seq.length += num_tokens
        return copies

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """`child` starts as `parent`: it shares every block of every group, so forking never allocates."""
        if child in self._seqs:
            raise KvCacheError(f"sequence {child!r} is already registered")
        src = self._seq(parent)
        for g, table in enumerate(src.tables):
            for block in table[src.released[g] :]:
                self._refcounts[block] += 1
        self._seqs[child] = _Sequence([list(t) for t in src.tables], src.length, list(src.released))

    def free(self, seq_id: SeqId) -> None:
        """Drop a sequence. Its unshared blocks become cached (those with a key) or free."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        # Last block first: a sequence's tail is the least likely part to be shared, so it is evicted first.
        for g, table in enumerate(seq.tables):
            for block in reversed(table[seq.released[g] :]):
                self._unref(block)

    def release_before(self, seq_id: SeqId, position: int, group: int | None = None) -> int:
        """Drop the sequence's references to its blocks holding only positions < `position` (a sliding window's
        first visible key) in table group `group` (None: every group), oldest first; returns how many were released
        now. They become cached (keyed) or free as on `free`; the sequence keeps their stale ids in its table
        (never read again) and its length."""
        seq = self._seq(seq_id)
        groups = range(self.num_groups) if group is None else (self._group(group),)
        upto = min(max(0, position) // self.block_size, seq.length // self.block_size)
        released = 0
        for g in groups:
            for block in seq.tables[g][seq.released[g] : upto]:
                self._unref(block)
            released += max(0, upto - seq.released[g])
            seq.released[g] = max(seq.released[g], upto)
        return released

    def release_outside_windows(self, seq_id: SeqId, position: int) -> int:
        """In every sliding group (window W), release the blocks the query at `position` and later ones never read
        (positions < position - W + 1); returns how many were released now. Full groups keep every block."""
        self._seq(seq_id)
        return sum(self.release_before(seq_id, position - w + 1, g) for g, w in enumerate(self.windows)
                   if w is not None)  # fmt: skip

    def clear_cached(self) -> list[int]:
        """Drop every cached block's key (they become free, their K/V forgotten); returns those blocks. Referenced
        blocks keep theirs."""
        blocks = list(self._cached)
        for block in blocks:
            del self._block_of[self._key_of.pop(block)]
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        self._free.extend(reversed(blocks))
        return blocks

    def _unref(self, block: int) -> None:
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            if block in self._key_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    # -- internals ----------------------------------------------------------------
    def _new_blocks(self, seq: _Sequence, num_tokens: int) -> int:
        """New blocks per table (every table spans the same positions)."""
        return self.blocks_for_tokens(seq.length + num_tokens) - len(seq.tables[0])

    def _cow_groups(self, seq: _Sequence, num_tokens: int) -> list[int]:
        """The groups whose partial last block is shared and would be written by growing `num_tokens`."""
        if num_tokens <= 0 or seq.length % self.block_size == 0:
            return []
        return [g for g, table in enumerate(seq.tables) if self._refcounts[table[-1]] > 1]

    def _skipped(self, group: int, hit_blocks: int) -> int:
        """Hit blocks a sliding group leaves released at admission: those wholly before the window of the first
        position computed (the hit's end)."""
        window = self.windows[group]
        if window is None:
            return 0
        return min(hit_blocks, max(0, hit_blocks * self.block_size - window + 1) // self.block_size)

    def _check_keys(self, block_keys: Sequence[bytes]) -> None:
        if isinstance(block_keys, (bytes, str)) or not all(isinstance(k, bytes) for k in block_keys):
            raise PrefixKeyError("block_keys must be a sequence of bytes keys (see PrefixHasher.block_keys)")

    def _match(self, block_keys: Sequence[bytes] | None, num_tokens: int) -> list[list[int]]:
        """Per group, the registered blocks of the longest run of `block_keys` from the start that every group
        holds, capped to leave a token."""
        if block_keys is None:
            return [[] for _ in range(self.num_groups)]
        self._check_keys(block_keys)
        cap = max(0, (num_tokens - 1) // self.block_size)
        runs: list[list[int]] = []
        seen: set[int] = set()
        for g in range(self.num_groups):
            run: list[int] = []
            for key in block_keys[:cap]:
                block = self._block_of.get((g, key))
                if block is None or block in seen:  # a repeated key (bad input) would alias two positions
                    break
                run.append(block)
                seen.add(block)
            runs.append(run)
            cap = len(run)
        shortest = min(len(r) for r in runs)
        if self.hit_limit is not None and shortest:
            shortest = max(0, min(shortest, self.hit_limit(runs[0][:shortest])))
        return [r[:shortest] for r in runs]

    def _assign(self, blocks: list[int], group: int) -> list[int]:
        for block in blocks:
            self._group_of[block] = group
        return blocks

    def _take(self, n: int) -> list[int]:
        """`n` blocks with refcount 1: free ones first, then cached ones evicted in LRU order."""
        if n > self.num_free_blocks:
            raise KvPoolExhausted(f"need {n} free block(s), only {self.num_free_blocks} of {self.num_blocks} free")
        taken = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(taken) < n:
            block, _ = self._cached.popitem(last=False)
            group_key = self._key_of.pop(block)
            del self._block_of[group_key]
            self.evictions += 1
            if self.events is not None:
                self.events.removed(*group_key)
            taken.append(block)
        for block in taken:
            self._refcounts[block] = 1
        return taken
