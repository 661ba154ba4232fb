"""KV storage: the tensors of a paged cache and the operations on their layout, no bookkeeping.

A :class:`KvPool` owns, for every part of its format (int8kv.formats: V1 has codes and scales, F16 codes only)
and for K and for V, one tensor holding every layer ``l``:
  k[part][l], v[part][l]   [num_blocks, block_size, num_kv_heads, *part.shape(head_dim)]
e.g. V1's codes ``[.., head_dim]`` int8 and scales ``[..]`` float32 (docs/design.md, "Paged cache layout"). A
slot is ``block_id * block_size + offset``. All layers live in one tensor per part so copying a block moves it
in every layer with one indexing op.

The pool knows nothing of sequences: which blocks belong to whom is the allocator's business
(:class:`~int8kv.cache.allocator.BlockAllocator`), and :class:`~int8kv.cache.paged.PagedKvCache` is the two
together. The transformers layer (:mod:`int8kv.hf`) uses a one-layer pool directly, with block ``b`` = batch
row ``b`` and ``block_size`` = its capacity. Rows arrive here already checked and encoded
(:mod:`int8kv.ops.write`); the pool stores what it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import LayerOutOfRange, ShapeMismatch
from ..formats import KvStorageFormat
from .state import KvLayout

#: Encoded rows: one tensor per part of the format, ``[n, num_kv_heads, *part.shape(head_dim)]`` (V1: codes
#: ``[n, heads, dim]`` int8 and scales ``[n, heads]`` float32; F16: float16 codes only).
Rows = tuple[torch.Tensor, ...]


class KvPool:
    """``num_blocks`` blocks of ``block_size`` token rows for every layer of ``layout``, on one device."""

    def __init__(
        self, layout: KvLayout, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
    ) -> None:
        if not isinstance(layout, KvLayout):
            raise ShapeMismatch(f"layout must be a KvLayout, got {type(layout).__name__}")
        layout.format.spec.refuse_stateful("KvPool")  # its own pool: cache/pool_q4w.py
        for name, n in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ShapeMismatch(f"{name} must be a positive int, got {n!r}")
        lead = (layout.num_layers, num_blocks, block_size, layout.num_kv_heads)

        def side() -> tuple[torch.Tensor, ...]:
            # Each part's fill (zero codes, unit scales), never garbage: a kernel multiplying a masked lane by 0
            # must not meet NaN.
            return tuple(
                torch.full((*lead, *p.shape(layout.head_dim)), p.fill, dtype=p.dtype, device=device)
                for p in layout.format.spec.parts
            )

        self._init(layout, side(), side())

    @classmethod
    def from_tensors(cls, layout: KvLayout, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> KvPool:
        """A pool over existing K and V parts (one tensor per part of the format,
        ``[num_layers, num_blocks, block_size, heads, *part.shape(dim)]``, one device), without copying them."""
        spec = layout.format.spec
        spec.refuse_stateful("KvPool")
        first = k[0] if isinstance(k, (tuple, list)) and k and isinstance(k[0], torch.Tensor) else None
        if first is None or first.dim() < 4 or (first.shape[0], first.shape[3]) != layout.dims[:2]:
            raise ShapeMismatch(f"K parts do not fit {layout}")
        lead = tuple(first.shape[:4])
        k = spec.check_parts(k, lead, layout.head_dim, "k")
        v = spec.check_parts(v, lead, layout.head_dim, "v")
        if v[0].device != k[0].device:
            raise ShapeMismatch(f"K is on {k[0].device} but V on {v[0].device}")
        pool = cls.__new__(cls)
        pool._init(layout, k, v)
        return pool

    def _init(self, layout: KvLayout, k: tuple[torch.Tensor, ...], v: tuple[torch.Tensor, ...]) -> None:
        self.layout = layout
        self.format: KvStorageFormat = layout.format
        self.num_layers, self.num_kv_heads, self.head_dim = layout.dims
        self.num_blocks, self.block_size = int(k[0].shape[1]), int(k[0].shape[2])
        self._k, self._v = tuple(k), tuple(v)
        # Taken from a tensor so "cuda" becomes "cuda:0" and device comparisons with inputs hold.
        self.device = k[0].device
        self._layers = [(tuple(t[i] for t in self._k), tuple(t[i] for t in self._v)) for i in range(self.num_layers)]
        # The same views by slot, built once: a decode step writes every layer, and flattening its four parts
        # per write was a sizeable part of a transformers-layer append.
        self._rows = [tuple(tuple(t.flatten(0, 1) for t in side) for side in pair) for pair in self._layers]
        self._row_arrays: list[tuple | None] = [None] * self.num_layers  # row_arrays(), built on first use
        self._compiled: list[tuple | None] = [None] * self.num_layers  # compiled_store(), found on first use

    def __repr__(self) -> str:
        return (
            f"KvPool({self.layout}, num_blocks={self.num_blocks}, block_size={self.block_size}, device={self.device})"
        )

    # -- sizes --------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def memory_bytes(self) -> int:
        """Bytes held (allocated up front, whatever the occupancy)."""
        return self.layout.bytes_per_block(self.block_size) * self.num_blocks

    def check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise LayerOutOfRange(f"layer {layer!r} outside [0, {self.num_layers})")
        return layer

    # -- the tensors --------------------------------------------------------------------------------------
    def storage(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the pool, all layers: K then V of each part in part order (V1: k codes, v codes,
        k scales, v scales)."""
        return tuple(t for pair in zip(self._k, self._v, strict=True) for t in pair)

    def layer_parts(self, layer: int) -> tuple[Rows, Rows]:
        """``(k_parts, v_parts)`` of one layer in the block layout above (views), in the format's part order."""
        return self._layers[layer]

    def layer_rows(self, layer: int) -> tuple[Rows, Rows]:
        """The same tensors viewed by slot: ``[num_slots, heads, *part.shape(dim)]``."""
        return self._rows[layer]  # type: ignore[return-value]

    def row_arrays(self, layer: int) -> tuple | None:
        """:meth:`layer_rows` as numpy views, K's parts then V's (zero-copy, kept for the pool's life), or None
        for a pool not on the CPU. Taking the four views per write was a measurable part of a decode step's layer."""
        arrays = self._row_arrays[layer]
        if arrays is None and self.device.type == "cpu":
            k, v = self._rows[layer]
            arrays = self._row_arrays[layer] = tuple(t.numpy() for t in (*k, *v))
        return arrays

    def compiled_store(self, layer: int) -> tuple[Callable, tuple] | None:
        """``(store, arrays)``: the format's compiled store (:meth:`~int8kv.formats.KvFormat.compiled_store`)
        and this layer's :meth:`row_arrays` as it takes them (``compiled_views``), its destinations; None for a
        pool not on the CPU or a format without one."""
        found = self._compiled[layer]
        if found is None:
            spec = self.format.spec
            store = spec.compiled_store() if self.device.type == "cpu" else None
            arrays = None if store is None else spec.compiled_views(self.row_arrays(layer))
            found = self._compiled[layer] = (None,) if store is None else (store, arrays)
        return None if found[0] is None else found  # type: ignore[return-value]

    def part(self, side: str, name: str) -> list[torch.Tensor | None]:
        """One part of K (``side="k"``) or V, per layer: ``pool.part("k", "codes")[l]``; None per layer when the
        format stores no part of that name (F16's scales)."""
        index = self.format.spec.part_names.index(name) if name in self.format.spec.part_names else None
        which = 0 if side == "k" else 1
        return [None if index is None else layer[which][index] for layer in self._layers]

    # The V1-era per-layer views (tests, benchmarks): the codes and scales parts.
    @property
    def k_codes(self) -> list[torch.Tensor]:
        return self.part("k", "codes")  # type: ignore[return-value]

    @property
    def v_codes(self) -> list[torch.Tensor]:
        return self.part("v", "codes")  # type: ignore[return-value]

    @property
    def k_scales(self) -> list[torch.Tensor | None]:
        return self.part("k", "scales")

    @property
    def v_scales(self) -> list[torch.Tensor | None]:
        return self.part("v", "scales")

    # -- rows ---------------------------------------------------------------------------------------------
    def write_rows(self, layer: int, slots: torch.Tensor, k: Rows, v: Rows) -> None:
        """Store encoded rows at int64 ``slots [n]`` (distinct, in range, on this device: the write path checks)."""
        for dst, src in zip(self.layer_rows(layer), (k, v), strict=True):
            for t, rows in zip(dst, src, strict=True):
                t.index_copy_(0, slots, rows)

    def encode_rows(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode checked rows ``k, v [n, heads, head_dim]`` and store them at int64 ``slots [n]`` (the format's
        :meth:`~int8kv.formats.KvFormat.store`): nothing is stored if encoding fails."""
        self.format.spec.store(k, v, slots, *self.layer_rows(layer), arrays=self.row_arrays(layer))

    def export_rows(self, layer: int, slots: torch.Tensor) -> tuple[Rows, Rows]:
        """Encoded K and V rows of int64 ``slots`` (copies), the inverse of :meth:`write_rows`."""
        k, v = self.layer_rows(layer)
        return tuple(t.index_select(0, slots) for t in k), tuple(t.index_select(0, slots) for t in v)

    def read_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded float32 K and V ``[len(slots), num_kv_heads, head_dim]`` (for tests and references)."""
        k, v = self.export_rows(layer, slots)
        return self.format.spec.decode(k), self.format.spec.decode(v)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` onto ``dst`` in every layer (copy-on-write of a shared block)."""
        for t in self.storage():
            t[:, dst] = t[:, src]

    # -- whole-pool reshaping (the transformers layer: block = batch row, block_size = capacity) -----------
    def resized(self, block_size: int, keep: int, start: int = 0) -> KvPool:
        """A new pool with ``block_size`` rows per block holding rows ``[start, start + keep)`` of every block
        as its first ``keep`` rows (``start > 0``: a sliding-window layer dropping the rows no query can see)."""
        out = KvPool(self.layout, self.num_blocks, block_size, self.device)
        if keep:
            for dst, src in zip(out.storage(), self.storage(), strict=True):
                dst[:, :, :keep] = src[:, :, start : start + keep]
        return out

    def select_blocks(self, index: torch.Tensor) -> KvPool:
        """A new pool whose block ``i`` is a copy of block ``index[i]`` (a block picked twice is copied twice)."""
        return KvPool.from_tensors(
            self.layout, [t.index_select(1, index) for t in self._k], [t.index_select(1, index) for t in self._v]
        )
