"""Block allocator for the paged cache: reference-counted blocks, sequences as block lists, fork and copy-on-write.

The allocator only does bookkeeping; it never touches tensors. When a write would land in a block that another
sequence still shares, `grow` hands back the (source, destination) block pairs the cache must copy first.
Every mutating call checks that it can succeed before changing anything, so a `KvPoolExhausted` leaves the
allocator exactly as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from ..errors import KvCacheError, KvPoolExhausted, PositionOutOfRange, ShapeMismatch, UnknownSequence

SeqId = Hashable
BlockCopy = tuple[int, int]  # (source block, destination block)


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class BlockAllocator:
    """Hands out fixed-size blocks of token slots to sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ShapeMismatch(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        # Popped from the end, so low block ids are handed out first (easier to read in debug dumps).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[SeqId, _Sequence] = {}

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, sequences={len(self._seqs)})"
        )

    # -- queries ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

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

    def block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).blocks)

    def context_len(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).length

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: SeqId, num_tokens: int) -> int:
        """Free blocks `grow(seq_id, num_tokens)` would consume (new blocks plus a copy-on-write copy)."""
        seq = self._seq(seq_id)
        return self._new_blocks(seq, num_tokens) + int(self._needs_cow(seq, num_tokens))

    def can_grow(self, seq_id: SeqId, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    def slots(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Slot ids of positions [start, end) of a sequence."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.length:
            raise PositionOutOfRange(f"positions [{start}, {end}) outside stored [0, {seq.length})")
        bs = self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    # -- mutations ----------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, num_tokens: int = 0) -> None:
        if seq_id in self._seqs:
            raise KvCacheError(f"sequence {seq_id!r} is already registered")
        if num_tokens < 0:
            raise ShapeMismatch(f"num_tokens must be >= 0, got {num_tokens}")
        blocks = self._take(self.blocks_for_tokens(num_tokens))
        self._seqs[seq_id] = _Sequence(blocks, num_tokens)

    def grow(self, seq_id: SeqId, num_tokens: int) -> list[BlockCopy]:
        """Reserve `num_tokens` more positions; returns the block copies to do before writing into them."""
        if num_tokens < 0:
            raise ShapeMismatch(f"num_tokens must be >= 0, got {num_tokens}")
        seq = self._seq(seq_id)
        cow = self._needs_cow(seq, num_tokens)
        fresh = self._take(self._new_blocks(seq, num_tokens) + int(cow))
        copies: list[BlockCopy] = []
        if cow:
            # The shared partial last block: this sequence gets a private copy, the others keep the original.
            src, dst = seq.blocks[-1], fresh.pop()
            self._refcounts[src] -= 1
            seq.blocks[-1] = dst
            copies.append((src, dst))
        seq.blocks.extend(fresh)
        seq.length += num_tokens
        return copies

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """`child` starts as `parent`: it shares every block, so forking never allocates."""
        if child in self._seqs:
            raise KvCacheError(f"sequence {child!r} is already registered")
        src = self._seq(parent)
        for block in src.blocks:
            self._refcounts[block] += 1
        self._seqs[child] = _Sequence(list(src.blocks), src.length)

    def free(self, seq_id: SeqId) -> None:
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for block in reversed(seq.blocks):
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.append(block)

    # -- internals ----------------------------------------------------------------
    def _new_blocks(self, seq: _Sequence, num_tokens: int) -> int:
        return self.blocks_for_tokens(seq.length + num_tokens) - len(seq.blocks)

    def _needs_cow(self, seq: _Sequence, num_tokens: int) -> bool:
        partial = seq.length % self.block_size != 0
        return num_tokens > 0 and partial and self._refcounts[seq.blocks[-1]] > 1

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KvPoolExhausted(f"need {n} free block(s), only {len(self._free)} of {self.num_blocks} free")
        taken = [self._free.pop() for _ in range(n)]
        for block in taken:
            self._refcounts[block] = 1
        return taken
