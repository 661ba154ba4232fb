"""KV storage: the tensors of a paged cache and the operations on their layout, no bookkeeping.

A :class:`KvPool` owns, for every layer ``l`` of its :class:`~int8kv.cache.state.KvLayout`,
  k_codes[l], v_codes[l]    [num_blocks, block_size, num_kv_heads, head_dim]  int8 (INT8) | float16 (F16)
  k_scales[l], v_scales[l]  [num_blocks, block_size, num_kv_heads]            float32 (INT8) | None (F16)
(docs/design.md, "Paged cache layout"). A slot is ``block_id * block_size + offset``. All layers live in one
tensor per kind so copying a block moves it in every layer with one indexing op.

The pool knows nothing of sequences: which blocks belong to whom is the allocator's business
(:class:`~int8kv.cache.allocator.BlockAllocator`), and :class:`~int8kv.cache.paged.PagedKvCache` is the two
together. The transformers layer (:mod:`int8kv.hf`) uses a one-layer pool directly, with block ``b`` = batch
row ``b`` and ``block_size`` = its capacity. Rows arrive here already checked and encoded
(:mod:`int8kv.ops.write`); the pool stores what it is given.
"""

from __future__ import annotations

import torch

from ..codec import decode
from ..errors import LayerOutOfRange, ShapeMismatch
from ..formats import KvStorageFormat
from .state import KvLayout

#: Encoded rows: codes ``[n, num_kv_heads, head_dim]`` and float32 scales ``[n, num_kv_heads]`` (None for F16).
Rows = tuple[torch.Tensor, torch.Tensor | None]


class KvPool:
    """``num_blocks`` blocks of ``block_size`` token rows for every layer of ``layout``, on one device."""

    def __init__(
        self, layout: KvLayout, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
    ) -> None:
        if not isinstance(layout, KvLayout):
            raise ShapeMismatch(f"layout must be a KvLayout, got {type(layout).__name__}")
        for name, n in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ShapeMismatch(f"{name} must be a positive int, got {n!r}")
        shape = (layout.num_layers, num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        # Zero codes and unit scales, never garbage: a kernel multiplying a masked lane by 0 must not meet NaN.
        k = torch.zeros(shape, dtype=layout.format.code_dtype, device=device)
        ks = vs = None
        if layout.format.is_quantized:
            ks = torch.ones(shape[:-1], dtype=torch.float32, device=device)
            vs = torch.ones_like(ks)
        self._init(layout, k, torch.zeros_like(k), ks, vs)

    @classmethod
    def from_tensors(
        cls,
        layout: KvLayout,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scales: torch.Tensor | None,
        v_scales: torch.Tensor | None,
    ) -> KvPool:
        """A pool over existing ``[num_layers, num_blocks, block_size, heads, dim]`` codes (and
        ``[num_layers, num_blocks, block_size, heads]`` scales), without copying them."""
        shape = tuple(k.shape)
        if len(shape) != 5 or shape[0] != layout.num_layers or shape[3:] != (layout.num_kv_heads, layout.head_dim):
            raise ShapeMismatch(f"codes {shape} do not fit {layout}")
        for name, t, want, dtype in (
            ("v", v, shape, layout.format.code_dtype),
            ("k", k, shape, layout.format.code_dtype),
            ("k_scales", k_scales, shape[:4], torch.float32),
            ("v_scales", v_scales, shape[:4], torch.float32),
        ):
            if t is None and not layout.format.is_quantized and "scales" in name:
                continue
            if t is None or tuple(t.shape) != want or t.dtype != dtype or t.device != k.device:
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
                raise ShapeMismatch(f"{name} must be {dtype} {want} on {k.device}, got {got}")
        pool = cls.__new__(cls)
        pool._init(layout, k, v, k_scales if layout.format.is_quantized else None,
                   v_scales if layout.format.is_quantized else None)  # fmt: skip
        return pool

    def _init(self, layout: KvLayout, k, v, ks, vs) -> None:
        self.layout = layout
        self.format: KvStorageFormat = layout.format
        self.num_layers, self.num_kv_heads, self.head_dim = layout.dims
        self.num_blocks, self.block_size = int(k.shape[1]), int(k.shape[2])
        self._k, self._v, self._ks, self._vs = k, v, ks, vs
        # Taken from a tensor so "cuda" becomes "cuda:0" and device comparisons with inputs hold.
        self.device = k.device
        self.k_codes: list[torch.Tensor] = list(k.unbind(0))
        self.v_codes: list[torch.Tensor] = list(v.unbind(0))
        self.k_scales: list[torch.Tensor | None] = list(ks.unbind(0)) if ks is not None else [None] * self.num_layers
        self.v_scales: list[torch.Tensor | None] = list(vs.unbind(0)) if vs is not None else [None] * self.num_layers

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

    def storage(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The whole pool: codes ``[num_layers, num_blocks, block_size, heads, dim]`` and scales without ``dim``."""
        return self._k, self._v, self._ks, self._vs

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(k_codes, v_codes, k_scales, v_scales)`` of one layer in the block layout above (views)."""
        return self.k_codes[layer], self.v_codes[layer], self.k_scales[layer], self.v_scales[layer]

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The same tensors viewed by slot: codes ``[num_slots, heads, dim]``, scales ``[num_slots, heads]``."""
        rows = (self.num_slots, self.num_kv_heads, self.head_dim)
        kc, vc, ks, vs = self.layer_tensors(layer)
        return (
            kc.view(rows), vc.view(rows),
            None if ks is None else ks.view(rows[:2]), None if vs is None else vs.view(rows[:2]),
        )  # fmt: skip

    # -- rows ---------------------------------------------------------------------------------------------
    def write_rows(self, layer: int, slots: torch.Tensor, k: Rows, v: Rows) -> None:
        """Store encoded rows at int64 ``slots [n]`` (distinct, in range, on this device: the write path checks)."""
        kc, vc, ks, vs = self.layer_rows(layer)
        kc.index_copy_(0, slots, k[0])
        vc.index_copy_(0, slots, v[0])
        if ks is not None and vs is not None:
            ks.index_copy_(0, slots, k[1])
            vs.index_copy_(0, slots, v[1])

    def export_rows(self, layer: int, slots: torch.Tensor) -> tuple[Rows, Rows]:
        """Encoded K and V rows of int64 ``slots`` (copies), the inverse of :meth:`write_rows`."""
        kc, vc, ks, vs = self.layer_rows(layer)
        return (
            (kc.index_select(0, slots), None if ks is None else ks.index_select(0, slots)),
            (vc.index_select(0, slots), None if vs is None else vs.index_select(0, slots)),
        )

    def read_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded float32 K and V ``[len(slots), num_kv_heads, head_dim]`` (for tests and references)."""
        (kc, ks), (vc, vs) = self.export_rows(layer, slots)
        return decode(self.format, kc, ks), decode(self.format, vc, vs)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` onto ``dst`` in every layer (copy-on-write of a shared block)."""
        for t in (self._k, self._v, self._ks, self._vs):
            if t is not None:
                t[:, dst] = t[:, src]

    # -- whole-pool reshaping (the transformers layer: block = batch row, block_size = capacity) -----------
    def resized(self, block_size: int, keep: int, start: int = 0) -> KvPool:
        """A new pool with ``block_size`` rows per block holding rows ``[start, start + keep)`` of every block
        as its first ``keep`` rows (``start > 0``: a sliding-window layer dropping the rows no query can see)."""
        out = KvPool(self.layout, self.num_blocks, block_size, self.device)
        for dst, src in ((out._k, self._k), (out._v, self._v), (out._ks, self._ks), (out._vs, self._vs)):
            if dst is not None and src is not None and keep:
                dst[:, :, :keep] = src[:, :, start : start + keep]
        return out

    def select_blocks(self, index: torch.Tensor) -> KvPool:
        """A new pool whose block ``i`` is a copy of block ``index[i]`` (a block picked twice is copied twice)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(1, index)

        return KvPool.from_tensors(self.layout, pick(self._k), pick(self._v), pick(self._ks), pick(self._vs))
