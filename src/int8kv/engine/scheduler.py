"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step gets a token budget. Running sequences go first, in arrival order (a decode needs one token,
an unfinished prefill continues in chunks); waiting ones join while budget, sequence slots and blocks
last. When the pool cannot hold a running sequence's next tokens, the most recently admitted one is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
A sequence leaves by `finish` (complete), `fail` (an error isolated to it) or `abort`; all free its blocks.

Forked groups (n choices of one prompt): the first choice's sequence carries the others in `forks` and is
admitted with seats for all; when its prefill ends, `fork` shares its blocks with each of them (copy-on-write
of the partial last block on first write, in `_grow`) and they run on as ordinary sequences.

Prefix caching (with a `PrefixHasher`): a waiting sequence is admitted with the longest run of its full
blocks already registered in the pool, then (with a `StoreTier`) the next run found in the block store,
loaded into newly reserved blocks; only the rest is computed and counts against the token budget. Blocks are
registered (and pushed to the store) in `advance`, as soon as a step has filled them, before the sequence
can finish or be preempted, so a preempted sequence hits its own blocks when it comes back. With the tier of the
4-bit format's pages (`_admit_pages`), a run loaded from the store replaces a shorter pool hit, and `advance` and
`finish` push the pages sealed by a step and the F16 rows of the pages a later hit can end on.

Sliding windows (the cache's block tables of sliding layers, `PagedKvCache.windows`): after the blocks are
registered and pushed, `advance` gives back each sliding table's blocks wholly before the window of the
sequence's next query (position num_cached sees keys > num_cached - window), so a sequence holds about
window / block_size + 1 blocks per sliding table however long it runs; tables of full attention keep every
block. A released keyed block stays cached for prefix hits while it is not evicted (the hit rule still needs
the whole chain from the first block, in every table). Capacity (`check_fits`, admission, `_reserve`) counts
every table's blocks.

Per-sequence state (`states`, for a model with recurrent / conv layers: engine/hf_model.py `SequenceStates`):
whatever frees a sequence's blocks frees its state, whatever forks its blocks copies its state. Such a model
runs without a prefix cache (a hit would skip tokens its state layers never saw).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..cache.paged import PagedKvCache
from ..cache.prefix import PrefixHasher
from ..errors import InvalidEngineConfig, InvalidRequest, KvPoolExhausted
from .sequence import Sequence, Status, positive_int
from .store_tier import StoreTier


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_cached on
    # One generated token fed back (not a prompt token, not a recomputation after preemption); fixed when
    # scheduled, since the sequence's state moves on during the step.
    is_decode: bool = field(init=False)
    # Admission only: prefix tokens offered as keys, found in the pool, loaded from the store, and store faults.
    queried_tokens: int = 0
    hit_tokens: int = 0
    store_tokens: int = 0
    store_faults: int = 0

    def __post_init__(self) -> None:
        self.is_decode = self.num_tokens == 1 and self.seq.is_decoding


class Scheduler:
    def __init__(
        self,
        cache: PagedKvCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        hasher: PrefixHasher | None = None,
        tier: StoreTier | None = None,
        states=None,
    ) -> None:
        self.cache = cache
        self.states = states  # per-sequence model state: fork(src, dst) and free(seq_id) (None: the model has none)
        self.hasher = hasher  # None: no prefix caching
        self.tier = tier  # None: no block store (needs a hasher)
        self.max_num_seqs = positive_int(max_num_seqs, "max_num_seqs", InvalidEngineConfig)
        self.max_num_batched_tokens = positive_int(
            max_num_batched_tokens, "max_num_batched_tokens", InvalidEngineConfig
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Requests queued since the scheduler was last idle: "the batch" whose decode phase is measured.
        self.batch_size = 0

    def check_fits(self, seq: Sequence) -> None:
        """A request that could not fit even in an empty pool would wait forever: refuse it up front.

        A forked group (`seq.forks`, LLM.add_forked_request) runs all its choices at once, so it must fit whole:
        at most `max_num_seqs` choices (InvalidRequest), and the prompt's full blocks once plus, per choice, its
        private blocks (the copy of the shared partial last block and its growth to prompt + max_tokens) within
        the pool (KvPoolExhausted); a sliding table counts at most its window and a chunk per choice."""
        group = [seq, *seq.forks]
        if len(group) > self.max_num_seqs:
            raise InvalidRequest(f"n={len(group)} choices of one prompt run together; this engine runs at most "
                                 f"max_num_seqs={self.max_num_seqs} sequences")
        alloc = self.cache.allocator
        # Full prompt blocks are held once by the whole group.
        need = alloc.peak_blocks([len(s.prompt) + s.params.max_tokens for s in group], len(seq.prompt),
                                 self.max_num_batched_tokens)  # fmt: skip
        if need > self.cache.num_blocks:
            what = f"{len(group)} choices of " if len(group) > 1 else ""
            raise KvPoolExhausted(
                f"a request of {what}{len(seq.prompt)} prompt + {seq.params.max_tokens} new tokens needs {need} "
                f"blocks; the whole pool has {self.cache.num_blocks}"
            )

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Queue requests, all or none: each is checked (`check_fits`, once) before any is queued. A sequence
        with `forks` brings its whole forked group (the forks stay on it until its prefill ends)."""
        seqs = list(seqs)
        for seq in seqs:
            self.check_fits(seq)
        if not self.has_work():
            self.batch_size = 0
        self.batch_size += self.num_choices(seqs)
        self.waiting.extend(seqs)

    @staticmethod
    def num_choices(seqs: Iterable[Sequence]) -> int:
        """Requests these sequences stand for: each one, plus the forks still waiting on it."""
        return sum(seq.group_size for seq in seqs)

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
        # A forked group's seats are taken when its first sequence is admitted: its forks join right after
        # its prefill (check_fits keeps every group within max_num_seqs, so the queue cannot stall on one).
        seats = self.num_choices(self.running)
        while self.waiting and budget > 0 and seats + self.waiting[0].group_size <= self.max_num_seqs:
            seq = self.waiting[0]
            item = self._admit(seq, budget) if self.hasher is not None else self._admit_plain(seq, budget)
            if item is None:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.admitted_at is None:
                seq.admitted_at = time.perf_counter()
            self.running.append(seq)
            batch.append(item)
            budget -= item.num_tokens
            seats += seq.group_size
        return batch

    def _admit_plain(self, seq: Sequence, budget: int) -> Scheduled | None:
        n = min(seq.num_uncached, budget)
        if not self.cache.allocator.can_add(n):
            return None
        self.cache.add_sequence(seq.seq_id, 0)
        self._grow(seq, n)
        return Scheduled(seq, n)

    def _admit(self, seq: Sequence, budget: int) -> Scheduled | None:
        """Register `seq` with its prefix hit (pool, then store) and the slots of its first chunk; None (and
        nothing changed) when the pool cannot hold it now."""
        alloc, bs, length = self.cache.allocator, self.cache.block_size, len(seq)
        keys = self.keys(seq, length // bs)
        hit = alloc.match_prefix(keys, length)
        if not alloc.can_add(hit + min(length - hit, budget), keys):
            return None
        stored, state, faults = 0, None, 0
        if self.tier is not None and self.tier.pages:
            return self._admit_pages(seq, budget, keys, hit)
        if self.tier is not None and hit // bs < (length - 1) // bs:
            before = self.tier.faults
            state = self.tier.fetch(keys[hit // bs : (length - 1) // bs])  # never all: a token is left to compute
            faults = self.tier.faults - before
            stored = 0 if state is None else state.length
            # Keep only what fits next to the first chunk (the check above guarantees that zero blocks fit).
            while stored and not alloc.can_add(hit + stored + min(length - hit - stored, budget), keys):
                stored -= bs
        n = min(length - hit - stored, budget)
        got, slots = self.cache.add_sequence_with_prefix(seq.seq_id, hit + stored + n, keys)
        assert got == hit, "the allocator changed between match_prefix and add_sequence"
        if stored:
            try:
                self.cache.write_state(seq.seq_id, hit, state if stored == state.length else state.slice(0, stored))
                self._register(seq, keys[: (hit + stored) // bs])
            except BaseException:
                self.cache.free(seq.seq_id)  # not admitted: no block stays reserved
                raise
        seq.num_cached = hit + stored
        seq.num_registered = seq.num_cached // bs
        seq.slots = slots[..., stored:]
        return Scheduled(seq, n, queried_tokens=len(keys) * bs, hit_tokens=hit, store_tokens=stored,
                         store_faults=faults)  # fmt: skip

    def _admit_pages(self, seq: Sequence, budget: int, keys: list[bytes], hit: int) -> Scheduled | None:
        """`_admit` with a tier of pages (the 4-bit format: engine/store_tier.py PageStoreTier): a run from the
        store longer than the pool's usable hit replaces it (it is the stored form from position 0: sealed pages,
        sinks and the F16 rows of its last page), written into fresh pages; all or nothing, since a shorter run
        would need the F16 rows of another page. The caller checked that the hit and the first chunk fit."""
        alloc, bs, length = self.cache.allocator, self.cache.block_size, len(seq)
        before = self.tier.faults
        state = self.tier.fetch(keys[: (length - 1) // bs], hit // bs)  # never all: a token is left to compute
        faults = self.tier.faults - before
        if state is not None and alloc.can_add(state.length + min(length - state.length, budget)):
            stored = state.length
            n = min(length - stored, budget)
            _, slots = self.cache.add_sequence_with_prefix(seq.seq_id, stored + n, [])
            try:
                self.cache.write_state(seq.seq_id, 0, state)
                self._register(seq, keys[: stored // bs])
            except KvPoolExhausted:  # every window page or sink slot is held now: compute the run instead
                self.cache.free(seq.seq_id)
                faults += 1
            except BaseException:
                self.cache.free(seq.seq_id)  # not admitted: no block, window page or sink slot stays taken
                raise
            else:
                seq.num_cached = stored
                seq.num_registered = stored // bs
                seq.slots = slots[..., stored:]
                return Scheduled(seq, n, queried_tokens=len(keys) * bs, store_tokens=stored, store_faults=faults)
            hit = alloc.match_prefix(keys, length)  # the reservation may have evicted cached pages
            if not alloc.can_add(hit + min(length - hit, budget), keys):
                return None
        n = min(length - hit, budget)
        got, slots = self.cache.add_sequence_with_prefix(seq.seq_id, hit + n, keys)
        assert got == hit, "the allocator changed between match_prefix and add_sequence"
        seq.num_cached = hit
        seq.num_registered = hit // bs
        seq.slots = slots
        return Scheduled(seq, n, queried_tokens=len(keys) * bs, hit_tokens=hit, store_faults=faults)

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix keys of `seq`'s first `num_blocks` full blocks, hashing only those not known yet."""
        if len(seq.block_keys) < num_blocks:
            bs = self.cache.block_size
            seq.block_keys = self.hasher.block_keys(seq.token_slice(0, num_blocks * bs), seq.block_keys)
        return seq.block_keys

    def in_decode_phase(self, batch: list[Scheduled]) -> bool:
        """True when this step decodes the whole batch: every request queued since the scheduler was last idle
        is running (none waits, none has finished or failed) and feeds back its one generated token. These
        steps give "tokens generated per second while all the batch's sequences decode"
        (EngineStats.decode_tokens_per_s): with chunked prefill the first-prefilled sequences decode alongside
        later prefills (not counted: the step also prefills) and finish early (then not all of the batch decodes).
        """
        return (
            len(batch) == len(self.running) == self.batch_size and not self.waiting
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
        length = self.cache.context_len(seq.seq_id)
        if self.cache.allocator.copies_on_grow(seq.seq_id, n):
            # Copy-on-write will replace the shared partial last block: the runner re-reads that entry.
            seq.num_table_blocks = min(seq.num_table_blocks, length // self.cache.block_size)
        seq.slots = self.cache.grow(seq.seq_id, n)

    def _free(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        if self.states is not None:
            self.states.free(seq.seq_id)

    def _fork(self, src: Sequence, dst: Sequence) -> None:
        self.cache.fork(src.seq_id, dst.seq_id)
        if self.states is not None:
            self.states.fork(src.seq_id, dst.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_cached = 0
        seq.num_table_blocks = 0  # its blocks went back to the pool; the runner's copy is stale
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _register(self, seq: Sequence, keys: list[bytes]) -> None:
        """Key `seq`'s first blocks for prefix caching; with KV events on, the blocks newly keyed are logged with
        their tokens (engine/kv_events.py)."""
        self.cache.register_blocks(seq.seq_id, keys)
        events = self.cache.allocator.events
        if events is not None:
            events.complete(keys, seq.token_slice)

    def advance(self, item: Scheduled) -> bool:
        """The step computed `item`'s tokens; True when the sequence is now fully cached (a token is due)."""
        seq = item.seq
        before = seq.num_cached
        seq.num_cached += item.num_tokens
        full = seq.num_cached // self.cache.block_size
        if self.hasher is not None and full > seq.num_registered:
            keys = self.keys(seq, full)
            self._register(seq, keys[:full])
            if self.tier is not None:
                self.tier.push(seq.seq_id, keys, seq.num_registered, full)
            seq.num_registered = full
        if self.tier is not None and self.tier.pages:  # before settle gives back the F16 rows it reads
            self.tier.push_step(seq.seq_id, self.keys(seq, full), before, seq.num_cached, len(seq.prompt))
        self.cache.release_outside_windows(seq.seq_id, seq.num_cached)
        return seq.num_uncached == 0

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start the forks waiting on `parent`, whose prompt is now cached (its first token is due): each
        shares all of `parent`'s blocks (`PagedKvCache.fork`, refcounts only, nothing allocated) and runs from
        here, right after `parent`, as an ordinary sequence. The shared partial last block is copied when a
        sequence first writes into it (`_grow`: `blocks_needed` counts the copy, `_reserve` preempts for it);
        a fork preempted later recomputes its prompt + its own tokens like any preempted sequence."""
        forks, parent.forks = parent.forks, []
        for seq in forks:
            self._fork(parent, seq)
            self._inherit(seq, parent)
        at = self.running.index(parent) + 1
        self.running[at:at] = forks
        return forks

    def _inherit(self, seq: Sequence, parent: Sequence) -> None:
        """`seq` (a fork of `parent`) takes over parent's cache state; its runner table is read afresh."""
        seq.fork_of = None
        seq.status = parent.status
        seq.admitted_at = parent.admitted_at
        seq.num_cached = parent.num_cached
        seq.num_registered = parent.num_registered
        seq.block_keys = list(parent.block_keys)  # keys of the shared prompt blocks; it extends its own copy
        seq.block_table, seq.num_table_blocks = None, 0

    def finish(self, seq: Sequence) -> None:
        if self.tier is not None and self.tier.pages:  # the last full page's F16 rows, which the pool keeps
            full = seq.num_cached // self.cache.block_size
            self.tier.push_end(seq.seq_id, self.keys(seq, full), seq.num_cached, len(seq.prompt))
        self._remove(seq)
        seq.status = Status.FINISHED

    def fail(self, seq: Sequence, error: BaseException | str) -> None:
        """Take `seq` out wherever it is (running or waiting), free its blocks and record why. Forks still
        waiting on it fail with it: they share the prompt whose prefill failed."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        forks, seq.forks = seq.forks, []
        for s in [seq, *forks]:
            if s is not seq:
                s.fork_of = None
            self._remove(s)
            s.status = Status.FAILED
            s.finish_reason = "error"
            s.error = message

    def abort(self, seq: Sequence) -> None:
        """Take one request out (finish_reason "abort"), freeing only its own block references. A fork still
        waiting for its group's prefill just leaves the group; the sequence prefilling for a group hands its
        place, its blocks so far and the other forks to the next fork, so the group's other choices go on."""
        if seq.forks:
            self._hand_over(seq)
        self._remove(seq)
        seq.status = Status.FAILED
        seq.finish_reason = "abort"
        seq.error = "aborted"

    def _hand_over(self, seq: Sequence) -> None:
        heir, *rest = seq.forks
        seq.forks = []
        heir.forks = rest
        for s in rest:
            s.fork_of = heir
        if seq.seq_id in self.cache.allocator:
            self._fork(seq, heir)  # the prefill done so far stays (seq's references go next)
        self._inherit(heir, seq)
        heir.slots = None
        queue = self.running if seq.status is Status.RUNNING else self.waiting
        queue.insert(queue.index(seq), heir)

    def _remove(self, seq: Sequence) -> None:
        if seq.fork_of is not None:  # a fork not started yet: it holds no block and no place in a queue
            seq.fork_of.forks.remove(seq)
            seq.fork_of = None
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.cache.allocator:
            self._free(seq)
        seq.slots = None
        seq.num_table_blocks = 0
