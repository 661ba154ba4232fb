"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step gets a token budget. Running sequences go first, in arrival order (a decode needs one token,
an unfinished prefill continues in chunks); waiting ones join while budget, sequence slots and blocks
last. When the pool cannot hold a running sequence's next tokens, the most recently admitted one is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..cache.paged import PagedKvCache
from ..errors import KvPoolExhausted
from .sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_cached on


class Scheduler:
    def __init__(self, cache: PagedKvCache, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def check_fits(self, seq: Sequence) -> None:
        """A request that could not fit even in an empty pool would wait forever: refuse it up front."""
        need = self.cache.allocator.blocks_for_tokens(len(seq.prompt) + seq.params.max_tokens)
        if need > self.cache.num_blocks:
            raise KvPoolExhausted(
                f"a request of {len(seq.prompt)} prompt + {seq.params.max_tokens} new tokens needs {need} blocks; "
                f"the whole pool has {self.cache.num_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        batch: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncached, budget)
            if not self._reserve(seq, n, batch):
                continue  # seq itself was preempted; running[i] is now the next one
            batch.append(Scheduled(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncached, budget)
            if self.cache.allocator.blocks_for_tokens(n) > self.cache.num_free_blocks:
                break
            self.waiting.popleft()
            self.cache.add_sequence(seq.seq_id, 0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._grow(seq, n)
            batch.append(Scheduled(seq, n))
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: list[Scheduled]) -> bool:
        """Make room for n more tokens of a running seq, preempting younger ones; False if seq was preempted."""
        while not self.cache.allocator.can_grow(seq.seq_id, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self._grow(seq, n)
        return True

    def _grow(self, seq: Sequence, n: int) -> None:
        seq.slots = self.cache.grow(seq.seq_id, n)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.status = Status.WAITING
        seq.num_cached = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.status = Status.FINISHED
