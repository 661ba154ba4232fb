"""vLLM-style paged KV cache: a pool of fixed-size blocks shared by many sequences.

``PagedKvCache`` is two parts: a :class:`~int8kv.cache.pool.KvPool` (:attr:`pool`) owns the tensors and their
layout (docs/design.md), a :class:`~int8kv.cache.allocator.BlockAllocator` (:attr:`allocator`) owns block tables,
context lengths and refcounts (it holds no tensor). The cache turns allocator decisions into pool operations
(copy-on-write copies a block) and sequence ids into slots and block tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import PositionOutOfRange, ShapeMismatch, UnsupportedFormat
from ..formats import KvStorageFormat
from .allocator import BlockAllocator, SeqId
from .pool import KvPool, Rows
from .state import GroupedKvState, KvLayout, KvState, state_sections

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1


class PagedKvCache:
    """Block pool for every layer plus the allocator that hands the blocks to sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = INT8,
        device: torch.device | str = "cpu",
        windows: Sequence[int | None] = (None,),
    ) -> None:
        if min(num_blocks, block_size, num_layers, num_kv_heads, head_dim) <= 0:
            raise ShapeMismatch(
                "num_blocks, block_size, num_layers, num_kv_heads and head_dim must all be > 0, got "
                f"{num_blocks}, {block_size}, {num_layers}, {num_kv_heads}, {head_dim}"
            )
        if KvStorageFormat(format).is_stateful:
            raise UnsupportedFormat(f"PagedKvCache holds rows by slot, not the {KvStorageFormat(format).value} format: "
                                    "build it through PagedKvCache.with_groups (cache/paged_q4w.py)")
        self.pool = KvPool(KvLayout(num_layers, num_kv_heads, head_dim, KvStorageFormat(format)), num_blocks,
                           block_size, device)  # fmt: skip
        self.pools: tuple[KvPool, ...] = (self.pool,)
        # One block table per entry (a table group of `num_layers` layers; None: full attention, else a window).
        self.allocator = BlockAllocator(num_blocks, block_size, windows)
        self.windows, self.num_tables = self.allocator.windows, self.allocator.num_groups
        self._table_layers = (num_layers,) * self.num_tables  # layers each table's group writes (set_table_layers)
        p = self.pool
        self.layout: KvLayout = p.layout
        self.format, self.device = p.format, p.device
        self.num_blocks, self.block_size = p.num_blocks, p.block_size
        self.num_layers, self.num_kv_heads, self.head_dim = p.layout.dims
        # The pool's per-layer views, exposed as before for kernels, tests and readers of the layout.
        self.k_codes, self.v_codes, self.k_scales, self.v_scales = p.k_codes, p.v_codes, p.k_scales, p.v_scales

    @classmethod
    def with_groups(
        cls, num_blocks: int, block_size: int, layouts: Sequence[KvLayout], device: torch.device | str = "cpu",
        windows: Sequence[int | None] = (None,), table_layers: Sequence[int] | None = None, *,
        window_pages: int | None = None, sink_slots: int | None = None,
    ) -> PagedKvCache:
        """One pool per layout (a group of layers sharing a K/V shape; one format), every pool indexed by the same
        block ids of one allocator (with one block table per entry of `windows`). One layout is the plain cache.
        A stateful format's cache (int8kv.cache.paged_q4w.Int4SinkWindowCache, which also takes the pool's
        ``window_pages`` and ``sink_slots``) for layouts of that format."""
        first = layouts[0] if isinstance(layouts, (tuple, list)) and layouts else None
        if not isinstance(first, KvLayout) or any(
            not isinstance(la, KvLayout) or la.format != first.format for la in layouts
        ):
            raise ShapeMismatch(f"layouts must be a non-empty list of KvLayouts of one format, got {layouts!r}")
        if first.format.is_stateful:
            from .paged_q4w import Int4SinkWindowCache

            return Int4SinkWindowCache.for_layouts(num_blocks, block_size, layouts, device, windows, table_layers,
                                                   window_pages=window_pages, sink_slots=sink_slots)  # fmt: skip
        cache = cls(num_blocks, block_size, *first.dims, first.format, device, windows)
        cache.pools = (cache.pool, *(KvPool(la, num_blocks, block_size, cache.device) for la in layouts[1:]))
        if table_layers is not None:
            cache.set_table_layers(table_layers)
        return cache

    def set_table_layers(self, table_layers: Sequence[int]) -> None:
        """How many of the pool's layers each block table's group really holds (the last table group of a span
        is padded: its block's remaining layers are never written). Exported states, block values and prefix
        keys hold only these layers (`state_layouts`)."""
        counts = tuple(table_layers)
        if len(self.pools) > 1 or len(counts) != self.num_tables or any(
            isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= self.num_layers for n in counts
        ):
            raise ShapeMismatch(
                f"table_layers must give each of the {self.num_tables} block tables of one pool a count in "
                f"[1, {self.num_layers}], got {table_layers!r}"
            )
        self._table_layers = counts

    @property
    def layouts(self) -> tuple[KvLayout, ...]:
        """Each pool's layout (one per group of layers with the same K/V shape)."""
        return tuple(p.layout for p in self.pools)

    def _sections(self) -> tuple[tuple[KvPool, int, KvLayout], ...]:
        """What an exported state holds, section by section: (pool, block table, layout of the section's layers,
        the pool's first ones). One per pool on one table; one per table of the one pool with several."""
        if self.num_tables == 1:
            return tuple((p, 0, p.layout) for p in self.pools)
        la = self.pool.layout
        return tuple((self.pool, t, KvLayout(n, la.num_kv_heads, la.head_dim, la.format))
                     for t, n in enumerate(self._table_layers))  # fmt: skip

    @property
    def state_layouts(self) -> tuple[KvLayout, ...]:
        """The layouts of an exported state's sections (a KvState for one, a GroupedKvState for several), which
        block values and prefix keys describe: the pools' layouts on one block table; with several tables, each
        table group's written layers."""
        return tuple(la for _, _, la in self._sections())

    def __repr__(self) -> str:
        return (
            f"PagedKvCache(num_blocks={self.num_blocks}, block_size={self.block_size}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, format={self.format}, "
            f"device={self.device}, free_blocks={self.num_free_blocks})"
        )

    # -- sizing (KvLayout answers; these keep the loose-argument form) -------------------------------------
    @staticmethod
    def bytes_per_block(
        block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, format: KvStorageFormat
    ) -> int:
        """Bytes one block takes across all layers, K and V, codes and scales."""
        return KvLayout(num_layers, num_kv_heads, head_dim, format).bytes_per_block(block_size)

    @staticmethod
    def blocks_for_memory(
        memory_bytes: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = INT8,
    ) -> int:
        """How many blocks of this shape fit in `memory_bytes` (the `num_blocks` to construct with)."""
        return KvLayout(num_layers, num_kv_heads, head_dim, format).blocks_for_memory(int(memory_bytes), block_size)

    @staticmethod
    def tokens_for_memory(
        memory_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = INT8,
        block_size: int = 16,
    ) -> int:
        """Token capacity of a pool sized for `memory_bytes` (whole blocks only)."""
        return KvLayout(num_layers, num_kv_heads, head_dim, format).tokens_for_memory(int(memory_bytes), block_size)

    @classmethod
    def for_memory(
        cls,
        memory_bytes: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = INT8,
        device: torch.device | str = "cpu",
    ) -> PagedKvCache:
        num_blocks = cls.blocks_for_memory(memory_bytes, block_size, num_layers, num_kv_heads, head_dim, format)
        return cls(num_blocks, block_size, num_layers, num_kv_heads, head_dim, format, device)

    def memory_bytes(self) -> int:
        """Bytes held by the pools (allocated up front, whatever the occupancy)."""
        return sum(p.memory_bytes() for p in self.pools)

    # -- sequences ----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def add_sequence(self, seq_id: SeqId, num_tokens: int = 0) -> torch.Tensor:
        """Register a sequence with room for `num_tokens`; returns their slots (int64)."""
        self.allocator.add_sequence(seq_id, num_tokens)
        return self.slots(seq_id, 0, num_tokens)

    def add_sequence_with_prefix(
        self, seq_id: SeqId, num_tokens: int, block_keys: Sequence[bytes]
    ) -> tuple[int, torch.Tensor]:
        """Register a sequence reusing the registered blocks of its key chain (BlockAllocator.add_sequence);
        returns the hit in tokens and the int64 slots of the positions left to compute, ``[hit, num_tokens)``."""
        hit = self.allocator.add_sequence(seq_id, num_tokens, block_keys)
        return hit, self.slots(seq_id, hit, num_tokens)

    def register_blocks(self, seq_id: SeqId, block_keys: Sequence[bytes]) -> int:
        """Key the sequence's first ``len(block_keys)`` blocks, full and written, for reuse; returns how many
        got a key now (BlockAllocator.register_blocks)."""
        return self.allocator.register_blocks(seq_id, block_keys)

    def grow(self, seq_id: SeqId, num_tokens: int) -> torch.Tensor:
        """Reserve `num_tokens` more positions (copying a shared partial block first); returns their slots."""
        start = self.allocator.context_len(seq_id)
        for src, dst in self.allocator.grow(seq_id, num_tokens):
            for pool in self.pools:
                pool.copy_block(src, dst)
        return self.slots(seq_id, start, start + num_tokens)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self.allocator.fork(parent, child)

    def free(self, seq_id: SeqId) -> None:
        self.allocator.free(seq_id)

    def release_before(self, seq_id: SeqId, position: int) -> int:
        """Give back the sequence's blocks holding only positions < `position` (outside a sliding window that
        starts there) in every table; BlockAllocator.release_before. Returns how many blocks went back to the
        pool."""
        return self.allocator.release_before(seq_id, position)

    def release_outside_windows(self, seq_id: SeqId, position: int) -> int:
        """Give back the blocks of each sliding table that the query at `position` and later ones never read
        (BlockAllocator.release_outside_windows); returns how many went back to the pool."""
        return self.allocator.release_outside_windows(seq_id, position)

    def block_table(self, seq_id: SeqId, group: int = 0) -> list[int]:
        return self.allocator.block_table(seq_id, group)

    def table_rows(self, seq_id: SeqId, start: int, end: int) -> torch.Tensor:
        """Entries ``[start, end)`` of the sequence's block table as int32 on the cache's device: ``[end - start]``
        with one table, ``[num_tables, end - start]`` with several."""
        rows = [self.allocator.block_table(seq_id, g)[start:end] for g in range(self.num_tables)]
        t = torch.tensor(rows, dtype=torch.int32).reshape(self.num_tables, end - start)
        return (t[0] if self.num_tables == 1 else t).to(self.device)

    def context_len(self, seq_id: SeqId) -> int:
        return self.allocator.context_len(seq_id)

    def slots(self, seq_id: SeqId, start: int = 0, end: int | None = None) -> torch.Tensor:
        """int64 slots of positions ``[start, end)``: ``[n]`` with one block table, ``[num_tables, n]`` (each
        table's slots, for its group's layers) with several."""
        stop = self.context_len(seq_id) if end is None else end
        self.allocator.check_positions(seq_id, start, stop)  # stored, and not released in any table
        # Vectorised: a long prompt has thousands of slots, too many for a Python loop per step.
        pos = torch.arange(start, stop)
        blocks = torch.tensor([self.allocator.block_table(seq_id, g) for g in range(self.num_tables)],
                              dtype=torch.int64).reshape(self.num_tables, -1)  # fmt: skip
        bs = self.block_size
        out = blocks[:, pos // bs] * bs + pos % bs
        return (out[0] if self.num_tables == 1 else out).to(self.device)

    def batch_tensors(self, seq_ids: Sequence[SeqId], min_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded `block_tables [batch, max_blocks]` (``[num_tables, batch, max_blocks]`` with several tables) and
        `context_lens [batch]`, int32, on the cache's device."""
        tables = [[self.allocator.block_table(s, g) for s in seq_ids] for g in range(self.num_tables)]
        width = max([min_blocks, 1, *(len(t) for t in tables[0])])
        padded = [[t + [0] * (width - len(t)) for t in group] for group in tables]
        lens = [self.allocator.context_len(s) for s in seq_ids]
        block_tables = torch.tensor(padded, dtype=torch.int32, device=self.device).reshape(
            self.num_tables, len(seq_ids), width
        )
        block_tables = block_tables[0] if self.num_tables == 1 else block_tables
        return block_tables, torch.tensor(lens, dtype=torch.int32, device=self.device)

    # -- state (see cache/state.py) ---------------------------------------------------
    def export_state(self, seq_id: SeqId, start: int = 0, end: int | None = None) -> KvState | GroupedKvState:
        """The stored tokens ``[start, end)`` of one sequence (all by default), in position order: a batch-1
        :class:`KvState`, or with several pools a :class:`GroupedKvState` of one section per pool (in pool order;
        no model layer map: the cache knows its pools, not the model's layer numbers)."""
        # Gathering by slot follows the block table, so the state holds the rows in position order whatever
        # blocks (shared, copied-on-write, scattered) the sequence occupies.
        slots = self.slots(seq_id, start, end)
        sections = []
        for pool, table, layout in self._sections():
            at = slots if self.num_tables == 1 else slots[table]
            rows = [pool.export_rows(layer, at) for layer in range(layout.num_layers)]
            batch_of_one = [tuple(tuple(t.unsqueeze(0) for t in side) for side in r) for r in rows]
            sections.append(KvState.from_layers(layout, batch_of_one))
        return sections[0] if len(sections) == 1 else GroupedKvState.of(sections)

    def import_state(self, seq_id: SeqId, state: KvState | GroupedKvState) -> torch.Tensor:
        """Create sequence ``seq_id`` holding a batch-1 ``state`` (a GroupedKvState of the cache's layouts when it
        has several pools); returns its slots. Atomic: on any error (layout, existing id, too few free blocks)
        nothing is allocated or written."""
        moved = self._state_rows(state)
        slots = self.add_sequence(seq_id, state.length)  # raises before allocating if it cannot
        try:
            self._write_state_rows(slots, moved)
        except BaseException:
            self.free(seq_id)  # the rows written so far sit in blocks that go back to the pool
            raise
        return slots

    def write_state(self, seq_id: SeqId, start: int, state: KvState | GroupedKvState) -> torch.Tensor:
        """Write a batch-1 ``state`` at positions ``[start, start + state.length)`` of a sequence, which must
        already hold them (e.g. blocks reserved by `add_sequence_with_prefix` for a prefix loaded from a block
        store); returns their slots. Checks layouts, batch and range before writing anything."""
        moved = self._state_rows(state)
        slots = self.slots(seq_id, start, start + state.length)
        self._write_state_rows(slots, moved)
        return slots

    def _state_rows(self, state: KvState | GroupedKvState) -> list[list[tuple[Rows, Rows]]]:
        """For each pool, the state's per-layer (k_parts, v_parts) of its section, batch row 0, on this device."""
        sections = state_sections(state, self.state_layouts, "a paged sequence")
        return [
            [
                tuple(tuple(t[0].to(self.device) for t in side) for side in section.layer(layer))  # type: ignore[misc]
                for layer in range(section.layout.num_layers)
            ]
            for section in sections
        ]

    def _write_state_rows(self, slots: torch.Tensor, moved: list[list[tuple[Rows, Rows]]]) -> None:
        for (pool, table, _), layers in zip(self._sections(), moved, strict=True):
            at = slots if self.num_tables == 1 else slots[table]
            for layer, (k, v) in enumerate(layers):
                pool.write_rows(layer, at, k, v)

    # -- rows -------------------------------------------------------------------------------------------
    def check_layer(self, layer: int) -> int:
        return self.pool.check_layer(layer)

    def write_rows(self, layer: int, slots: torch.Tensor, k: Rows, v: Rows) -> None:
        """Store already-encoded rows (one tensor per part of the format) at int64 `slots`; no validation
        (see ops.append_paged_kv)."""
        self.pool.write_rows(layer, slots, k, v)

    def read_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded float32 K and V `[len(slots), num_kv_heads, head_dim]` (for tests and references)."""
        self.check_layer(layer)
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise ShapeMismatch("slots must be a 1-d integer tensor")
        s = slots.to(device=self.device, dtype=torch.int64)
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.pool.num_slots):
            raise PositionOutOfRange(f"slots must lie in [0, {self.pool.num_slots})")
        return self.pool.read_rows(layer, s)


def tokens_per_format(
    memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16
) -> dict[KvStorageFormat, int]:
    """Token capacity of a `memory_bytes` pool for every storage format (to compare before choosing)."""
    layout = KvLayout(num_layers, num_kv_heads, head_dim)
    return {fmt: layout.with_format(fmt).tokens_for_memory(int(memory_bytes), block_size) for fmt in KvStorageFormat}
