"""vLLM-style paged KV cache: a pool of fixed-size blocks shared by many sequences.

Layout (docs/design.md, shared by every backend), per layer ``l``:
  k_codes[l], v_codes[l]    [num_blocks, block_size, num_kv_heads, head_dim]  int8 (INT8) | float16 (F16)
  k_scales[l], v_scales[l]  [num_blocks, block_size, num_kv_heads]            float32 (INT8) | None (F16)
All layers live in one tensor per kind so a copy-on-write moves a block of every layer in one indexing op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..codec import decode
from ..errors import LayerOutOfRange, PositionOutOfRange, ShapeMismatch
from ..formats import KvStorageFormat
from .allocator import BlockAllocator, SeqId
from .state import KvLayout, KvState

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class AttentionBatch:
    """Validated kernel arguments: q float32 contiguous, index tensors int32 contiguous."""

    q: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    kv_starts: torch.Tensor | None
    softmax_scale: float
    cu_seqlens_q: torch.Tensor | None = None


class PagedKvCache:
    """Block pool for every layer plus the allocator that hands the blocks to sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_blocks, block_size, num_layers, num_kv_heads, head_dim) <= 0:
            raise ShapeMismatch(
                "num_blocks, block_size, num_layers, num_kv_heads and head_dim must all be > 0, got "
                f"{num_blocks}, {block_size}, {num_layers}, {num_kv_heads}, {head_dim}"
            )
        self.format = KvStorageFormat(format)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.allocator = BlockAllocator(num_blocks, block_size)
        code_shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self._k = torch.zeros(code_shape, dtype=self.format.code_dtype, device=device)
        self._v = torch.zeros(code_shape, dtype=self.format.code_dtype, device=device)
        # Taken from a tensor so "cuda" becomes "cuda:0" and device comparisons with inputs hold.
        self.device = self._k.device
        self.k_codes: list[torch.Tensor] = list(self._k.unbind(0))
        self.v_codes: list[torch.Tensor] = list(self._v.unbind(0))
        self._ks: torch.Tensor | None = None
        self._vs: torch.Tensor | None = None
        self.k_scales: list[torch.Tensor | None] = [None] * num_layers
        self.v_scales: list[torch.Tensor | None] = [None] * num_layers
        if self.format.is_quantized:
            self._ks = torch.ones(code_shape[:-1], dtype=torch.float32, device=self.device)
            self._vs = torch.ones(code_shape[:-1], dtype=torch.float32, device=self.device)
            self.k_scales = list(self._ks.unbind(0))
            self.v_scales = list(self._vs.unbind(0))

    def __repr__(self) -> str:
        return (
            f"PagedKvCache(num_blocks={self.num_blocks}, block_size={self.block_size}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, format={self.format}, "
            f"device={self.device}, free_blocks={self.num_free_blocks})"
        )

    # -- sizing -------------------------------------------------------------------
    @staticmethod
    def bytes_per_block(
        block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, format: KvStorageFormat
    ) -> int:
        """Bytes one block takes across all layers, K and V, codes and scales."""
        return block_size * KvStorageFormat(format).bytes_per_token(num_layers, num_kv_heads, head_dim)

    @staticmethod
    def blocks_for_memory(
        memory_bytes: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
    ) -> int:
        """How many blocks of this shape fit in `memory_bytes` (the `num_blocks` to construct with)."""
        per_block = PagedKvCache.bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, format)
        return max(0, int(memory_bytes) // per_block)

    @staticmethod
    def tokens_for_memory(
        memory_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        block_size: int = 16,
    ) -> int:
        """Token capacity of a pool sized for `memory_bytes` (whole blocks only)."""
        blocks = PagedKvCache.blocks_for_memory(memory_bytes, block_size, num_layers, num_kv_heads, head_dim, format)
        return blocks * block_size

    @classmethod
    def for_memory(
        cls,
        memory_bytes: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        format: KvStorageFormat = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        device: torch.device | str = "cpu",
    ) -> PagedKvCache:
        num_blocks = cls.blocks_for_memory(memory_bytes, block_size, num_layers, num_kv_heads, head_dim, format)
        return cls(num_blocks, block_size, num_layers, num_kv_heads, head_dim, format, device)

    def memory_bytes(self) -> int:
        """Bytes held by the pool (allocated up front, whatever the occupancy)."""
        per_block = self.bytes_per_block(
            self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.format
        )
        return per_block * self.num_blocks

    # -- sequences ----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def add_sequence(self, seq_id: SeqId, num_tokens: int = 0) -> torch.Tensor:
        """Register a sequence with room for `num_tokens`; returns their slots (int64)."""
        self.allocator.add_sequence(seq_id, num_tokens)
        return self.slots(seq_id, 0, num_tokens)

    def grow(self, seq_id: SeqId, num_tokens: int) -> torch.Tensor:
        """Reserve `num_tokens` more positions (copying a shared partial block first); returns their slots."""
        start = self.allocator.context_len(seq_id)
        for src, dst in self.allocator.grow(seq_id, num_tokens):
            self._copy_block(src, dst)
        return self.slots(seq_id, start, start + num_tokens)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self.allocator.fork(parent, child)

    def free(self, seq_id: SeqId) -> None:
        self.allocator.free(seq_id)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return self.allocator.block_table(seq_id)

    def context_len(self, seq_id: SeqId) -> int:
        return self.allocator.context_len(seq_id)

    def slots(self, seq_id: SeqId, start: int = 0, end: int | None = None) -> torch.Tensor:
        length = self.context_len(seq_id)
        stop = length if end is None else end
        if not 0 <= start <= stop <= length:
            raise PositionOutOfRange(f"positions [{start}, {stop}) outside stored [0, {length})")
        # Vectorised: a long prompt has thousands of slots, too many for a Python loop per step.
        pos = torch.arange(start, stop)
        blocks = torch.tensor(self.allocator.block_table(seq_id), dtype=torch.int64)
        bs = self.block_size
        return (blocks[pos // bs] * bs + pos % bs).to(self.device)

    def batch_tensors(self, seq_ids: Sequence[SeqId], min_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded `block_tables [batch, max_blocks]` and `context_lens [batch]`, int32, on the cache's device."""
        tables = [self.allocator.block_table(s) for s in seq_ids]
        width = max([min_blocks, 1, *(len(t) for t in tables)])
        padded = [t + [0] * (width - len(t)) for t in tables]
        lens = [self.allocator.context_len(s) for s in seq_ids]
        block_tables = torch.tensor(padded, dtype=torch.int32, device=self.device).reshape(len(tables), width)
        return block_tables, torch.tensor(lens, dtype=torch.int32, device=self.device)

    def _copy_block(self, src: int, dst: int) -> None:
        self._k[:, dst] = self._k[:, src]
        self._v[:, dst] = self._v[:, src]
        if self._ks is not None and self._vs is not None:
            self._ks[:, dst] = self._ks[:, src]
            self._vs[:, dst] = self._vs[:, src]

    # -- state (see cache/state.py) ---------------------------------------------------
    @property
    def layout(self) -> KvLayout:
        return KvLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.format)

    def export_state(self, seq_id: SeqId) -> KvState:
        """The stored tokens of one sequence, in position order, as a batch-1 :class:`KvState`."""
        # Gathering by slot follows the block table, so the state holds the rows in position order whatever
        # blocks (shared, copied-on-write, scattered) the sequence occupies.
        slots = self.slots(seq_id, 0, self.context_len(seq_id))
        rows = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)

        def gather(tensors: list, shape: tuple[int, ...]) -> list[torch.Tensor] | None:
            if tensors[0] is None:
                return None
            return [t.view(shape).index_select(0, slots).unsqueeze(0) for t in tensors]

        return KvState.build(
            self.layout,
            gather(self.k_codes, rows),
            gather(self.v_codes, rows),
            gather(self.k_scales, rows[:2]),
            gather(self.v_scales, rows[:2]),
        )

    def import_state(self, seq_id: SeqId, state: KvState) -> torch.Tensor:
        """Create sequence ``seq_id`` holding a batch-1 ``state``; returns its slots. Atomic: on any error
        (layout, existing id, too few free blocks) nothing is allocated or written."""
        if not isinstance(state, KvState):
            raise ShapeMismatch(f"expected a KvState, got {type(state).__name__}")
        if state.layout != self.layout:
            raise ShapeMismatch(f"the state's layout {state.layout} differs from the cache's {self.layout}")
        if state.batch != 1:
            raise ShapeMismatch(f"a paged sequence holds one sequence; the state holds {state.batch}")
        moved = [
            None if g is None else [t[0].to(self.device) for t in g]
            for g in (state.k_codes, state.v_codes, state.k_scales, state.v_scales)
        ]
        slots = self.add_sequence(seq_id, state.length)  # raises before allocating if it cannot
        try:
            for layer in range(self.num_layers):
                k, v, ks, vs = (None if g is None else g[layer] for g in moved)
                self.write_rows(layer, slots, (k, ks), (v, vs))
        except BaseException:
            self.free(seq_id)  # the rows written so far sit in blocks that go back to the pool
            raise
        return slots

    # -- rows ---------------------------------------------------------------------
    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise LayerOutOfRange(f"layer {layer} outside [0, {self.num_layers})")

    def check_slots(self, slots: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Slots as an int64 tensor on the cache's device; values are range-checked when on the CPU."""
        s = slots if isinstance(slots, torch.Tensor) else torch.as_tensor(slots)
        if s.dim() != 1 or s.shape[0] != num_tokens or s.dtype not in INDEX_DTYPES:
            raise ShapeMismatch(f"slots must be int32/int64 of shape [{num_tokens}], got {s.dtype} {tuple(s.shape)}")
        s = s.to(device=self.device, dtype=torch.int64)
        limit = self.num_blocks * self.block_size
        # A range check reads the values: free on the CPU, a device sync on an accelerator, so only done here.
        if s.device.type == "cpu" and s.numel() and (int(s.min()) < 0 or int(s.max()) >= limit):
            raise PositionOutOfRange(f"slots must lie in [0, {limit}), got [{int(s.min())}, {int(s.max())}]")
        return s

    def check_rows(self, x: torch.Tensor, what: str) -> torch.Tensor:
        shape = (self.num_kv_heads, self.head_dim)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ShapeMismatch(f"{what} must be [tokens, {shape[0]}, {shape[1]}], got {got}")
        if x.dtype not in FLOAT_DTYPES:
            raise ShapeMismatch(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")
        return x

    def write_rows(
        self,
        layer: int,
        slots: torch.Tensor,
        k: tuple[torch.Tensor, torch.Tensor | None],
        v: tuple[torch.Tensor, torch.Tensor | None],
    ) -> None:
        """Store already-encoded rows (codes, scales) at int64 `slots`; no validation (see ops.append_paged_kv)."""
        n = self.num_blocks * self.block_size
        rows = (n, self.num_kv_heads, self.head_dim)
        self.k_codes[layer].view(rows).index_copy_(0, slots, k[0])
        self.v_codes[layer].view(rows).index_copy_(0, slots, v[0])
        ks, vs = self.k_scales[layer], self.v_scales[layer]
        if ks is not None and vs is not None:
            ks.view(rows[:2]).index_copy_(0, slots, k[1])
            vs.view(rows[:2]).index_copy_(0, slots, v[1])

    def read_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded float32 K and V `[len(slots), num_kv_heads, head_dim]` (for tests and references)."""
        self.check_layer(layer)
        s = self.check_slots(slots, len(slots))
        rows = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        ks, vs = self.k_scales[layer], self.v_scales[layer]
        k = decode(self.format, self.k_codes[layer].view(rows)[s], None if ks is None else ks.view(rows[:2])[s])
        v = decode(self.format, self.v_codes[layer].view(rows)[s], None if vs is None else vs.view(rows[:2])[s])
        return k, v

    # -- attention arguments --------------------------------------------------------
    def attention_batch(
        self,
        layer: int,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        softmax_scale: float | None = None,
        kv_starts: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
    ) -> AttentionBatch:
        """Validate decode (`cu_seqlens_q` None) or prefill arguments and normalise their dtypes."""
        self.check_layer(layer)
        q = self._check_q(q)
        batch = self._batch_size(q, cu_seqlens_q)
        tables = _index_tensor(block_tables, "block_tables", 2, self.device)
        if tables.shape[0] != batch or tables.shape[1] == 0:
            raise ShapeMismatch(f"block_tables must be [{batch}, max_blocks >= 1], got {tuple(tables.shape)}")
        lens = _index_tensor(context_lens, "context_lens", 1, self.device, batch)
        starts = None if kv_starts is None else _index_tensor(kv_starts, "kv_starts", 1, self.device, batch)
        cu = None if cu_seqlens_q is None else _index_tensor(cu_seqlens_q, "cu_seqlens_q", 1, self.device, batch + 1)
        if self.device.type == "cpu":
            self._check_values(tables, lens, starts, cu, q.shape[0])
        scale = float(softmax_scale) if softmax_scale is not None else self.head_dim**-0.5
        return AttentionBatch(q, tables, lens, starts, scale, cu)

    def _check_q(self, q: torch.Tensor) -> torch.Tensor:
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != self.head_dim:
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ShapeMismatch(f"q must be [n, num_q_heads, {self.head_dim}], got {got}")
        if q.shape[1] == 0 or q.shape[1] % self.num_kv_heads != 0:
            raise ShapeMismatch(f"num_q_heads ({q.shape[1]}) must be a positive multiple of {self.num_kv_heads}")
        if q.dtype not in FLOAT_DTYPES:
            raise ShapeMismatch(f"q must be float32, float16 or bfloat16, got {q.dtype}")
        if q.device != self.device:
            raise ShapeMismatch(f"q is on {q.device} but the cache is on {self.device}")
        return q.to(torch.float32).contiguous()

    @staticmethod
    def _batch_size(q: torch.Tensor, cu_seqlens_q: torch.Tensor | None) -> int:
        if cu_seqlens_q is None:
            return q.shape[0]
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
            raise ShapeMismatch("cu_seqlens_q must be a 1-d tensor [batch + 1]")
        return cu_seqlens_q.shape[0] - 1

    def _check_values(
        self,
        tables: torch.Tensor,
        lens: torch.Tensor,
        starts: torch.Tensor | None,
        cu: torch.Tensor | None,
        num_q: int,
    ) -> None:
        """Value checks that keep the CPU kernels in bounds (they do no bounds checking themselves)."""
        if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= self.num_blocks):
            raise PositionOutOfRange(f"block_tables entries must lie in [0, {self.num_blocks})")
        capacity = tables.shape[1] * self.block_size
        if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > capacity):
            raise PositionOutOfRange(f"context_lens must lie in [0, {capacity}] (block_tables width x block_size)")
        if starts is not None and starts.numel() and int(starts.min()) < 0:
            raise PositionOutOfRange("kv_starts must be >= 0")
        if cu is not None:
            counts = cu[1:] - cu[:-1]
            if int(cu[0]) != 0 or int(cu[-1]) != num_q or (counts.numel() and int(counts.min()) < 0):
                raise ShapeMismatch(f"cu_seqlens_q must rise from 0 to the number of queries ({num_q})")
            if bool((counts > lens).any()):
                raise ShapeMismatch("a sequence has more queries than stored tokens (write K/V before attending)")


def _index_tensor(
    x: torch.Tensor, what: str, dim: int, device: torch.device, length: int | None = None
) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != dim or x.dtype not in INDEX_DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ShapeMismatch(f"{what} must be a {dim}-d int32/int64 tensor, got {got}")
    if length is not None and x.shape[0] != length:
        raise ShapeMismatch(f"{what} must have {length} entries, got {x.shape[0]}")
    if x.device != device:
        raise ShapeMismatch(f"{what} is on {x.device} but the cache is on {device}")
    return x.to(torch.int32).contiguous()


def tokens_per_format(
    memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16
) -> dict[KvStorageFormat, int]:
    """Token capacity of a `memory_bytes` pool for every storage format (to compare before choosing)."""
    return {
        fmt: PagedKvCache.tokens_for_memory(memory_bytes, num_layers, num_kv_heads, head_dim, fmt, block_size)
        for fmt in KvStorageFormat
    }
