"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step gets a token budget. Running sequences go first, in arrival order (a decode needs one token,
an unfinished prefill continues in chunks); waiting ones join while budget, sequence slots and blocks
last. When the pool cannot hold a running sequence's next tokens, the most recently admitted one is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
A sequence leaves by `finish` (complete) or `fail` (an error isolated to it); both free its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..cache.paged import PagedKvCache
from ..errors import InvalidEngineConfig, KvPoolExhausted
from .sequence import Sequence, Status, positive_int


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_cached on
    # One generated token fed back (not a prompt token, not a recomputation after preemption); fixed when
    # scheduled, since the sequence's state moves on during the step.
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_decode = self.num_tokens == 1 and self.seq.is_decoding


class Scheduler:
    def __init__(self, cache: PagedKvCache, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_seqs = positive_int(max_num_seqs, "max_num_seqs", InvalidEngineConfig)
        self.max_num_batched_tokens = positive_int(
            max_num_batched_tokens, "max_num_batched_tokens", InvalidEngineConfig
        )
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

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Queue requests, all or none: each is checked (`check_fits`, once) before any is queued."""
        seqs = list(seqs)
        for seq in seqs:
            self.check_fits(seq)
        self.waiting.extend(seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        batch: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncached, budget)
            if not self._reserve(seq, n):
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

    def in_decode_phase(self, batch: list[Scheduled]) -> bool:
        """True when this step decodes every unfinished request: nothing waits, nothing prefills, and each
        running sequence feeds back its one generated token. Steps that pass this are the ones whose rate is
        "tokens generated per second while all the batch's sequences decode" (EngineStats.decode_tokens_per_s).
        """
        return (
            bool(batch) and not self.waiting and len(batch) == len(self.running)
            and all(item.is_decode for item in batch)
        )

    def _reserve(self, seq: Sequence, n: int) -> bool:
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
        seq.num_table_blocks = 0  # its blocks went back to the pool; the runner's copy is stale
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def advance(self, item: Scheduled) -> bool:
        """The step computed `item`'s tokens; True when the sequence is now fully cached (a token is due)."""
        item.seq.num_cached += item.num_tokens
        return item.seq.num_uncached == 0

    def finish(self, seq: Sequence) -> None:
        self._remove(seq)
        seq.status = Status.FINISHED

    def fail(self, seq: Sequence, error: BaseException | str) -> None:
        """Take `seq` out wherever it is (running or waiting), free its blocks and record why."""
        self._remove(seq)
        seq.status = Status.FAILED
        seq.finish_reason = "error"
        seq.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def _remove(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.cache.allocator:
            self.cache.free(seq.seq_id)
        seq.slots = None
        seq.num_table_blocks = 0
