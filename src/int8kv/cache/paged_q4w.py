"""The engine's paged cache in ``int4_kchan64_vtok_asym_sink4_win64_v1``: a :class:`PagedKvCache` whose pool is an
:class:`~int8kv.cache.pool_q4w.Int4SinkWindowPool` (one layout, one block table, blocks of 64 positions).

Block ids are the allocator's as for every paged cache: block ``b`` is sealed page ``b`` (pool tensors
``[num_layers, num_blocks, 64, H, d / 2]`` codes and the scales of cache/pool_q4w.py); the F16 rows of a page not
yet sealed sit in one of ``window_pages`` window pages, a sequence's positions 0-3 in one of ``sink_slots`` sink
slots, both taken by the pool's writes and given back by :meth:`free` (``pool.release`` of the blocks the
allocator freed) and :meth:`release_outside_windows` (``pool.settle``: the scheduler calls it after each step,
so a sequence holds at most its last two pages' F16 rows between steps).

Sizing (:func:`plan_sizes`): a step that writes ``m`` positions of a sequence holds at most ``ceil(m / 64) + 2``
window pages for it, a running sequence between its steps at most 2, so ``ceil(max_num_batched_tokens / 64) +
3 * seats`` window pages and ``seats`` sink slots (``seats``: ``max_num_seqs`` plus one for ``LLM.score``'s
sequence) mean an admitted request never meets KvPoolExhausted mid-step: admission and preemption count blocks
only, as for the other formats.

States: :meth:`export_state` gives a sequence's stored form as a :class:`~int8kv.cache.state_q4w.Q4WState`
(``save_kv(path, cache, seq_id=)`` writes it as a KV file) and :meth:`import_state` creates a sequence holding
one (``load_kv(path, cache, seq_id=)``); the sequence then continues exactly as the exported one would have.

Prefix caching (the allocator's keys and hits, as for every paged cache) with three books of the pool's
(cache/pool_q4w.py, "Sharing"):

- pins: a sequence pins the pages whose F16 rows its next queries read, from page ``(context - 64) // 64`` on
  (the pages :meth:`release_outside_windows` does not settle yet), so a page shared by a hit is given back only
  once every sharer has passed it; the pin moves on with each step and is dropped by :meth:`free`.
- usable hits: a hit of ``k`` pages (the new sequence computes from position ``64 k``: the allocator always
  leaves a token) needs the sink slot of page 0, the F16 rows of page ``k - 1`` (its first query reads positions
  ``64 (k - 1)`` on in F16) and pages ``0 .. k - 2`` sealed in every layer; recomputing page ``k - 1`` would not
  do (its queries read the F16 rows before it), so the allocator's ``hit_limit`` cuts a hit to the longest
  usable run (``pool.usable_prefix``), possibly 0, and only that much is counted as hit.
- kept rows: a registered page no sequence holds any more keeps its window page and sink slot (``pool.keep``),
  so that the next turn of a chat (the previous prompt, its answer and a new message) hits up to the end of the
  previous turn: a sequence ending at ``n`` positions still holds the F16 rows of page ``n // 64 - 1``. A step
  short of window pages or sink slots takes kept ones back, least recently kept first (the page stays cached,
  no longer usable as a hit's end), so sizing counts them as free; a page the allocator hands out afresh drops
  what it kept (``pool.release``), a page taken by a hit is claimed (``pool.claim``).

Sealing a shared page happens once per layer, from the F16 rows every sharer reads: no sharer writes it
differently (a registered page is full, never written again). :meth:`free` gives back the window pages of the
pages it unpinned that other sequences still hold, once no pin holds them and every layer sealed them
(``pool.give_back_sealed``: their holders have all passed them), as those holders' next settle would.

The block store (engine/store_tier.py PageStoreTier, blockstore/codec_q4w.py): :meth:`sealed_page` and
:meth:`page_rows` give a page's sealed value and end value (its F16 rows); :meth:`write_state` writes a run of
``j`` whole pages loaded from the store (the stored form of ``64 j`` positions) into a sequence registered without
a hit, through ``pool.import_sequence``, after which it pins its pages as after a hit of ``j`` pages.

Forks (the engine's ``n > 1``, :meth:`fork`): the child shares every page of the parent (the allocator's
refcounts, nothing allocated) and pins what the parent pins, so the shared pages are the sharing above: each
keeps its F16 rows until every sharer has passed it and is sealed once per layer. The shared partial last page
is copied when one of them first writes into it (:meth:`grow`, the allocator's copy-on-write and
``pool.copy_block``): a block, a window page holding the page's F16 rows and, for page 0 (a fork at fewer than 64
positions), a sink slot holding the sinks; the copy is pinned in place of the original. A fork at a multiple of
64 positions copies nothing (each sequence starts its own page), one at fewer than 64 shares no full page. The
sizing above is unchanged: the copy is the window page of the sequence's own last page, which its step counts
anyway (``ceil(m / 64) + 2`` per sequence, a shared page counted in each sharer), a running sequence still holds
at most 2 window pages between its steps (the pages it pins) and one sink slot (its page 0's), and admission
counts the copy's block (``blocks_needed``, as for every format).

Refused by name (UnsupportedFormat): slices of a state and writes of one other than a run of whole pages from
position 0 into a fresh sequence, releasing blocks before a position (sliding tables: page 0 holds the sinks every
query reads), several K/V shapes or block tables. A model with sliding-window or chunked layers gets this cache with
every layer on the one full table (engine/hf_model.py ``TransformersModel.full_layouts``), the window or chunk
applied by the attention: its sliding layers keep every page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import KvPoolExhausted, ShapeMismatch, UnsupportedFormat
from ..formats import INT4_SINK_WINDOW_V1, KvStorageFormat
from .allocator import BlockAllocator, SeqId
from .paged import PagedKvCache
from .pool_q4w import PAGE, SINKS, WINDOW, Int4SinkWindowPool
from .state import KvLayout
from .state_q4w import Q4WState

Q4W = KvStorageFormat.INT4_SINK_WINDOW_V1
NAME = INT4_SINK_WINDOW_V1.name


def window_page_bytes(layout: KvLayout) -> int:
    """Bytes of one window page over every layer: 64 F16 rows of K and of V per KV head."""
    return layout.num_layers * 2 * PAGE * layout.num_kv_heads * layout.head_dim * 2


def sink_slot_bytes(layout: KvLayout) -> int:
    """Bytes of one sink slot over every layer: 4 F16 rows of K and of V per KV head."""
    return layout.num_layers * 2 * SINKS * layout.num_kv_heads * layout.head_dim * 2


def sealed_page_bytes(layout: KvLayout) -> int:
    """Bytes of one sealed page (a block) over every layer: ``H (68 d + 256)`` per layer."""
    return layout.num_layers * layout.num_kv_heads * INT4_SINK_WINDOW_V1.bytes_per_page(layout.head_dim)


def plan_sizes(budget: int, layout: KvLayout, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int, int]:
    """``(num_blocks, window_pages, sink_slots)`` of an engine cache within ``budget`` bytes (module docs): the
    window pages and sink slots its worst step needs first, the rest in sealed pages (``num_blocks`` may be 0 or
    less: the budget holds no block)."""
    seats = max_num_seqs + 1
    windows = math.ceil(max_num_batched_tokens / PAGE) + 3 * seats
    fixed = windows * window_page_bytes(layout) + seats * sink_slot_bytes(layout)
    return (budget - fixed) // sealed_page_bytes(layout), windows, seats


def refuse(what: str) -> UnsupportedFormat:
    return UnsupportedFormat(f"{what} is not implemented for the {NAME} format in the engine's paged cache")


class Int4SinkWindowCache(PagedKvCache):
    """``num_blocks`` pages of 64 positions for ``num_layers`` layers of ``num_kv_heads`` x ``head_dim``, with
    ``window_pages`` window pages and ``sink_slots`` sink slots (module docs), and the allocator of their block
    ids."""

    def __init__(
        self, num_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int, window_pages: int, sink_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        # The base's __init__ builds a KvPool, which refuses this format: the same attributes, over this pool.
        self.layout = KvLayout(num_layers, num_kv_heads, head_dim, Q4W)
        self.pool = Int4SinkWindowPool(num_layers, num_kv_heads, head_dim, num_blocks, window_pages, sink_slots,
                                       device)  # fmt: skip
        self.pools = (self.pool,)
        self.allocator = BlockAllocator(num_blocks, PAGE)
        self.allocator.hit_limit = self.pool.usable_prefix
        self._pinned_from: dict[SeqId, int] = {}  # per sequence: the first table index it pins (module docs)
        self.windows, self.num_tables = self.allocator.windows, self.allocator.num_groups
        self.format, self.device = self.layout.format, self.pool.device
        self.num_blocks, self.block_size = num_blocks, PAGE
        self.num_layers, self.num_kv_heads, self.head_dim = self.layout.dims

    @classmethod
    def for_layouts(
        cls, num_blocks: int, block_size: int, layouts: Sequence[KvLayout], device: torch.device | str = "cpu",
        windows: Sequence[int | None] = (None,), table_layers: Sequence[int] | None = None, *,
        window_pages: int | None = None, sink_slots: int | None = None,
    ) -> Int4SinkWindowCache:
        """``PagedKvCache.with_groups``' arguments for this format: one layout, one block table of full attention,
        ``block_size`` 64, and the pool's ``window_pages`` and ``sink_slots``; anything else refused by name."""
        if block_size != PAGE:
            raise refuse(f"a block size of {block_size!r} (its pages are {PAGE} positions)")
        if len(layouts) != 1:
            raise refuse(f"{len(layouts)} K/V shapes (one pool per shape)")
        if tuple(windows) != (None,):
            raise refuse(f"block tables {tuple(windows)!r} (sliding layers give page 0, the sinks', back)")
        if table_layers is not None and tuple(table_layers) != (layouts[0].num_layers,):
            raise refuse(f"table groups of {tuple(table_layers)!r} layers")
        if window_pages is None or sink_slots is None:
            raise ShapeMismatch(f"a {NAME} cache needs window_pages and sink_slots (cache/paged_q4w.plan_sizes)")
        return cls(num_blocks, *layouts[0].dims, window_pages, sink_slots, device)

    def __repr__(self) -> str:
        return (f"Int4SinkWindowCache(num_blocks={self.num_blocks}, num_layers={self.num_layers}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, window_pages={self.pool.window_pages}, "
                f"sink_slots={self.pool.sink_slots}, device={self.device}, free_blocks={self.num_free_blocks})")

    @property
    def layouts(self) -> tuple[KvLayout, ...]:
        return (self.layout,)

    @property
    def state_layouts(self) -> tuple[KvLayout, ...]:
        raise refuse("per-row states (prefix keys, block values)")

    def set_table_layers(self, table_layers: Sequence[int]) -> None:
        if tuple(table_layers) != (self.num_layers,):
            raise refuse(f"table groups of {tuple(table_layers)!r} layers")

    # -- sequences ------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, num_tokens: int = 0) -> torch.Tensor:
        slots = super().add_sequence(seq_id, num_tokens)
        self._took(seq_id, 0, 0)
        return slots

    def add_sequence_with_prefix(self, seq_id: SeqId, num_tokens: int, block_keys: Sequence[bytes]):
        """Register a sequence reusing the usable run of registered pages of its key chain (module docs);
        returns the hit in tokens and the int64 slots of the positions left to compute."""
        hit, slots = super().add_sequence_with_prefix(seq_id, num_tokens, block_keys)
        self._took(seq_id, hit // PAGE, max(0, hit // PAGE - 1))
        return hit, slots

    def _took(self, seq_id: SeqId, hits: int, pin_from: int) -> None:
        """A sequence was registered with ``hits`` hit pages: they are claimed, its other pages start afresh
        (whatever an evicted page kept is given back), and it pins its pages from ``pin_from`` on."""
        table = self.allocator.block_table(seq_id)
        self.pool.claim(table[:hits])
        self.pool.release(table[hits:])
        self.pool.pin(table[pin_from:])
        self._pinned_from[seq_id] = pin_from

    def grow(self, seq_id: SeqId, num_tokens: int) -> torch.Tensor:
        """Reserve ``num_tokens`` more positions; the new pages start afresh and are pinned. A shared partial last
        page (after :meth:`fork`) is copied first (``pool.copy_block``: its F16 rows, and its sink slot for page 0)
        and the copy pinned in its place; KvPoolExhausted, nothing changed, when the blocks, or the window page or
        sink slot of the copy, are short (the engine's sizing leaves room for the copy: module docs)."""
        before = self.allocator.block_table(seq_id)
        if self.allocator.copies_on_grow(seq_id, num_tokens) and not self.pool.can_copy(before[-1]):
            raise KvPoolExhausted(f"copying the shared partial page of sequence {seq_id!r} needs a window page or "
                                  "a sink slot; none is free (kept ones included)")
        slots = super().grow(seq_id, num_tokens)
        table = self.allocator.block_table(seq_id)
        last = len(before) - 1
        if before and table[last] != before[-1] and last >= self._pinned_from[seq_id]:  # copied on write
            self.pool.unpin([before[-1]])
            self.pool.pin([table[last]])
        new = table[len(before) :]
        self.pool.release(new)
        self.pool.pin(new)
        return slots

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """``child`` starts as ``parent``: it shares every page (refcounts only, nothing allocated or copied) and
        pins what ``parent`` pins, so a shared page keeps its F16 rows until both have passed it. The shared
        partial last page is copied when one of them first writes into it (:meth:`grow`)."""
        self.allocator.fork(parent, child)
        start = self._pinned_from[parent]
        self.pool.pin(self.allocator.block_table(child)[start:])
        self._pinned_from[child] = start

    def free(self, seq_id: SeqId) -> None:
        """Drop a sequence and its pins; of the blocks that went back to the pool with it, the registered ones
        (cached) keep their window pages and sink slot (``pool.keep``), the others give them back
        (``pool.release``). A page other sequences still hold gives back its window page once no pin holds it
        and every layer sealed it (``pool.give_back_sealed``: they all read it sealed), as their next
        :meth:`release_outside_windows` would."""
        table = self.allocator.block_table(seq_id)
        self.allocator.free(seq_id)
        start = self._pinned_from.pop(seq_id)
        self.pool.unpin(table[start:])
        self.pool.give_back_sealed([b for b in table[start:] if self.allocator.refcount(b) > 0])
        gone = [b for b in table if self.allocator.refcount(b) == 0]
        self.pool.keep([b for b in gone if self.allocator.block_key(b) is not None])
        self.pool.release([b for b in gone if self.allocator.block_key(b) is None])

    def clear_prefix_cache(self) -> int:
        """Forget every cached page (``BlockAllocator.clear_cached``) and give back what they kept; returns how
        many pages were forgotten."""
        blocks = self.allocator.clear_cached()
        self.pool.release(blocks)
        return len(blocks)

    def release_outside_windows(self, seq_id: SeqId, position: int) -> int:
        """After a step (the scheduler's ``advance``): the window pages of the pages every query from
        ``position`` (the sequence's context) on reads sealed go back to the pool (``pool.settle``). One block
        table of full attention: no block is released; returns 0."""
        if position < self.allocator.context_len(seq_id):
            raise ShapeMismatch(f"position {position} is before the sequence's context "
                                f"({self.allocator.context_len(seq_id)}): its queries still read those rows")
        table = self.allocator.block_table(seq_id)
        start = self._pinned_from[seq_id]
        upto = min(len(table), max(start, (position - WINDOW) // PAGE))  # pages settle may give back
        self.pool.unpin(table[start:upto])
        self._pinned_from[seq_id] = upto
        self.pool.settle(table, position)
        return 0

    def release_before(self, seq_id: SeqId, position: int) -> int:
        raise refuse("releasing blocks before a position (page 0 holds the sinks every query reads)")

    # -- states and rows ------------------------------------------------------------------------------------
    def export_state(self, seq_id: SeqId, start: int = 0, end: int | None = None) -> Q4WState:
        """A sequence's stored form (every layer) as a batch-1 :class:`~int8kv.cache.state_q4w.Q4WState` (numpy
        copies). Only the whole sequence: a slice ``[start, end)`` other than ``[0, context)`` is no stored form
        of this format (refused by name, UnsupportedFormat)."""
        n = self.allocator.context_len(seq_id)
        if start != 0 or (end is not None and end != n):
            raise refuse(f"exporting positions [{start!r}, {end!r}) of a {n}-position sequence (a state is the "
                         "stored form of a whole sequence: [0, context))")
        rows = self.pool.export_sequence(self.allocator.block_table(seq_id), n)
        return Q4WState.of(self.layout, [[r] for r in rows])

    def import_state(self, seq_id: SeqId, state: Q4WState) -> torch.Tensor:
        """Create sequence ``seq_id`` holding a batch-1 ``state`` of this cache's layout (its sealed pages, window
        pages and sink slot written by ``pool.import_sequence``); returns its slots. Atomic: on any error (the
        state, an existing id, too few free blocks, window pages or sink slots) nothing is allocated or written."""
        if not isinstance(state, Q4WState):
            raise ShapeMismatch(f"a {NAME} cache imports a Q4WState, got {type(state).__name__}")
        if state.layout != self.layout:
            raise ShapeMismatch(f"the state's layout {state.layout} differs from the cache's {self.layout}")
        if state.batch != 1:
            raise ShapeMismatch(f"a paged sequence holds one sequence; the state holds {state.batch}")
        rows = state.sequence(0)
        slots = self.add_sequence(seq_id, state.length)  # raises before allocating if it cannot
        try:
            self.pool.import_sequence(self.allocator.block_table(seq_id), rows)
        except BaseException:
            self.free(seq_id)  # import_sequence took nothing: the blocks go back as they came
            raise
        return slots

    def write_state(self, seq_id: SeqId, start: int, state) -> None:
        """Write a run of whole pages loaded from the block store into a sequence just registered without a hit
        (``add_sequence_with_prefix`` found none, nothing written since): ``state`` a batch-1
        :class:`~int8kv.cache.state_q4w.Q4WState` of ``64 j`` positions (``j >= 1``) written at ``start`` 0, as
        ``pool.import_sequence`` writes a state, after which the sequence pins its pages from ``j - 1`` on as
        after a hit of ``j`` pages. Anything else is refused by name (UnsupportedFormat: the stored form of a
        range is not a range of a longer one's) or ShapeMismatch; nothing is written then."""
        if start != 0 or not isinstance(state, Q4WState) or not state.length or state.length % PAGE:
            got = f"{state.length} positions" if isinstance(state, Q4WState) else type(state).__name__
            raise refuse(f"writing {got} at position {start!r} into a sequence (only a run of whole pages from 0)")
        if state.layout != self.layout or state.batch != 1:
            raise ShapeMismatch(f"a batch-1 state of {self.layout} is needed, got {state.batch} of {state.layout}")
        j = state.length // PAGE
        table = self.allocator.block_table(seq_id)
        if self.allocator.context_len(seq_id) < state.length or self._pinned_from[seq_id] != 0 or (
                self.pool.holds_rows(table[:j])):
            raise refuse("writing a state into a sequence that holds a prefix hit or written rows")
        self.pool.import_sequence(table, state.sequence(0))  # nothing taken or written on error
        self.pool.unpin(table[: j - 1])
        self._pinned_from[seq_id] = j - 1

    def sealed_page(self, seq_id: SeqId, index: int) -> dict:
        """Page ``index`` of a sequence as its block-store sealed value's arrays (``pool.sealed_page``; page 0
        with its sink rows)."""
        table = self.allocator.block_table(seq_id)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(table):
            raise ShapeMismatch(f"page index {index!r} outside the sequence's {len(table)} pages")
        return self.pool.sealed_page(table[index], index == 0)

    def page_rows(self, seq_id: SeqId, index: int) -> dict:
        """Page ``index`` of a sequence as its block-store end value's arrays (``pool.page_rows``: its F16 rows)."""
        table = self.allocator.block_table(seq_id)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(table):
            raise ShapeMismatch(f"page index {index!r} outside the sequence's {len(table)} pages")
        return self.pool.page_rows(table[index])

    def write_rows(self, layer: int, slots: torch.Tensor, k, v) -> None:
        raise refuse("writing rows by slot (the pool is written by step, with the plan)")

    def read_rows(self, layer: int, slots: torch.Tensor):
        raise refuse("reading rows by slot (pool.stored_form reads a sequence's stored form)")
