"""``Int8KvCache`` and ``Int8KvLayer``: transformers' Cache/layer pair over INT8 (or F16) codes.

Storage: each layer is a one-layer :class:`~int8kv.cache.pool.KvPool` in the layout of docs/design.md in
which block ``b`` is batch row ``b`` and the block size is the allocated capacity (grown by reallocation in
chunks). The kernels therefore see ``block_tables = arange(batch)[:, None]`` and ``context_lens = held``
for every row; left padding becomes ``kv_starts`` (see :mod:`int8kv.hf.attention`).

A layer holds no reference to its cache (transformers' own split): what belongs to one forward (the plans
built from the attention masks, the layers written so far for a rollback) lives in the cache's
:class:`~int8kv.hf.attention.Book`, which every layer of the cache shares.

Sliding-window and chunked layers keep only what a future query can still see: a layer of window ``W`` (or
chunk ``W``: its queries see no key at or before ``seq_len - W`` either) drops the rows
before ``seq_len - W + 1`` once at least ``slack`` of them have piled up (between forwards, so a failed step
can still be rolled back), and tracks the dropped prefix as :attr:`Int8KvLayer.offset`; the masks
transformers builds start at that offset (:meth:`Int8KvLayer.get_mask_sizes`). Positions in the storage are
all shifted by the same offset, so windows (relative) and left padding (``kv_starts`` read from the mask)
stay right; so do chunks, counted from ``kv_starts``: on a chunked layer the mask's first visible key is the
current chunk's start, at a whole number of chunks from the true origin.

Hybrid models keep their other layers as transformers keeps them: linear-attention, Mamba and conv layers are
transformers' own layer classes, "hybrid" layers (a state and full K/V) an :class:`Int8KvHybridLayer`.

The 4-bit format ``int4_kchan64_vtok_asym_sink4_win64_v1`` (:data:`~int8kv.formats.INT4_SINK_WINDOW_V1`, by
name or object) stores each full-attention layer in an :class:`~int8kv.cache.pool_q4w.Int4SinkWindowPool`
instead: pages of 64 positions, ``P`` per batch row (row ``b`` owns block ids ``[b * P, (b + 1) * P)``, so the
kernels see ``block_tables [batch, P]``), written by step through the forward's write plan (one per forward,
kept in the :class:`~int8kv.hf.attention.Book`) and sealed into 4-bit codes as 64 positions follow them. A
left-padded row stores its padding as the INT8 path does (masked by ``kv_starts``), so its sinks are padding
positions: a padded row's first real tokens are not held in F16. Growth copies the pool into a larger one
(:meth:`~int8kv.cache.pool_q4w.Int4SinkWindowPool.remapped`); ``crop`` cuts back while the F16 rows the new
length reads are still held (refused by name, UnsupportedFormat, once those pages were sealed and their rows
given back). ``export_state`` gives every row's stored form as a :class:`~int8kv.cache.state_q4w.Q4WState`
(``save_kv`` writes it) and ``import_state`` builds each layer's pool from one, so that a restored cache continues
exactly as the exported one. A sliding-window or chunked layer of this format keeps every page, as a full one
does: its stored form is the whole sequence's, the kernels apply the window or chunk (the attention's
``window`` / ``chunk``), so its memory grows with the sequence, not bounded by the window. Refused by name:
hybrid layers (a state beside K/V).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionLayer,
)

from ..cache.pool import KvPool
from ..cache.pool_q4w import Int4SinkWindowPool
from ..cache.state import GroupedKvState, KvLayout, KvState, as_format, group_layers
from ..cache.state_q4w import Q4WState
from ..cpu_budget import limit_torch
from ..errors import PositionOutOfRange, ShapeMismatch, UnsupportedAttention, UnsupportedFormat
from ..formats import INT4_SINK_WINDOW_V1, KvFormat, KvStorageFormat
from ..ops import plan_attention, resolve_backend, write
from ..quant4w import Q4WRows
from .attention import ATTN_IMPLEMENTATION, Book, make_handle
from .attention import attach as attach_config
from .layers import LayerSpec, layer_specs

__all__ = ["Int8KvCache", "Int8KvHybridLayer", "Int8KvLayer"]

_FULL = LayerSpec("full_attention", "full")

_DEFAULT_CHUNK = 256
_PAGE = INT4_SINK_WINDOW_V1.page


def resolve_format(value: KvStorageFormat | KvFormat | str) -> KvStorageFormat | KvFormat:
    """The drop-in's storage format from a :class:`KvStorageFormat`, a format object or a name / dtype alias:
    the 4-bit format (:data:`INT4_SINK_WINDOW_V1`) matched by its name (``.value`` or ``.name``), so an enum
    member of that name and the object both select it; any other one through :func:`as_format`."""
    fmt = as_format(value.name if isinstance(value, KvFormat) else value)  # names and dtype aliases
    return INT4_SINK_WINDOW_V1 if fmt.value == INT4_SINK_WINDOW_V1.name else fmt


def is_4bit(fmt: Any) -> bool:
    """Whether ``fmt`` (resolved by :func:`resolve_format`) is the 4-bit sink-and-window format."""
    return fmt is INT4_SINK_WINDOW_V1


@functools.lru_cache(maxsize=64)
def _tables(batch: int, pages: int, device: torch.device) -> torch.Tensor:
    """int32 ``[batch, pages]``: row ``b`` holds block ids ``[b * pages, (b + 1) * pages)``."""
    return torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages).to(device)


@functools.lru_cache(maxsize=256)
def _slots(batch: int, capacity: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """int64 slots ``[batch * n]`` of positions ``[start, start + n)`` of every row (row ``b`` = block ``b``):
    the same for every layer of a step, so built once (a decode step of 30 layers asks 30 times)."""
    rows = torch.arange(batch, dtype=torch.int64)[:, None] * capacity
    return (rows + torch.arange(start, start + n, dtype=torch.int64)[None, :]).reshape(-1).to(device)


class Int8KvLayer(CacheLayerMixin):
    """One decoder layer's K/V, stored as codes (+ scales) in a one-layer pool (:attr:`pool`).

    ``pool.layer_parts(0)`` are K's and V's parts of the format, ``[batch, capacity, num_kv_heads, *part.shape]``
    (V1: int8 codes ``[.., head_dim]`` and float32 scales ``[..]``; F16: float16 codes).
    ``keys``/``values`` stay None: there is no float copy to expose (see :meth:`dequantize`).
    """

    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        format: KvStorageFormat | str = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        chunk_size: int = _DEFAULT_CHUNK,
        max_cache_len: int | None = None,
        backend: str | None = None,
        *,
        spec: LayerSpec = _FULL,
        layer_idx: int = 0,
        book: Book | None = None,
    ) -> None:
        CacheLayerMixin.__init__(self)
        if chunk_size <= 0:
            raise ShapeMismatch(f"chunk_size must be > 0, got {chunk_size}")
        if max_cache_len is not None and max_cache_len <= 0:
            raise ShapeMismatch(f"max_cache_len must be > 0 (or None), got {max_cache_len}")
        self.format = resolve_format(format)
        self.chunk_size = int(chunk_size)
        self.max_cache_len = max_cache_len
        self.backend = backend
        self.seq_len = 0  # positions written (transformers' cumulative length)
        self.offset = 0  # positions dropped from the front (sliding window): row i holds position offset + i
        self.read_to = 0  # seq_len when the int8kv attention last read this layer
        self.attention_calls = 0  # int8kv kernel launches on this layer (counted by int8kv.hf.attention)
        self.pool: KvPool | Int4SinkWindowPool | None = None
        self.pages = 0  # 4-bit format: pages of 64 positions per batch row (row b owns [b * pages, (b + 1) * pages))
        self._handles: tuple | None = None  # (what they describe, K handle, V handle): see update()
        self.spec = spec
        self.layer_idx = layer_idx
        self.book = book if book is not None else Book()
        # The span a future query looks back over, or None: what bounds the storage. A chunked layer's query
        # sees at most the chunk's earlier keys, all later than seq_len - chunk: the bound of a window of the
        # chunk's size (transformers keeps a chunked layer as a sliding one of that size too). The chunk origin
        # needs nothing stored: the mask's first visible key, a chunk start, is the kernels' kv_start.
        self.window = spec.window if spec.window is not None else spec.chunk
        self.is_sliding = spec.kind in ("sliding", "chunked")  # transformers sizes their masks on sliding layers
        # Rows dropped at once: a window's 1/16 (~6 % over the window at most; measured bound in test_hf), so a
        # decode step moves W / slack ~ 16 rows on average instead of W.
        self.slack = max(16, self.window // 16) if self.window else 0
        self.paged = is_4bit(self.format)
        # The 4-bit format's stored form is that of the whole sequence (quant4w.encode_sequence): a sliding or
        # chunked layer keeps every page, as a full one does, and the kernels apply its window or chunk (trim()
        # drops nothing from it). Layers with a state beside their K/V stay refused.
        if self.paged and (spec.kind not in ("full", "sliding", "chunked") or spec.state):
            raise UnsupportedFormat(
                f"the {self.format.name} format is implemented for full-attention, sliding-window and chunked "
                f"layers only, not for a {spec.layer_type!r} layer "
                f"({spec.kind}{', with a state' if spec.state else ''})"
            )

    def __repr__(self) -> str:
        kind = "" if self.spec.kind == "full" else f", {self.spec.kind} {self.spec.window or self.spec.chunk}"
        if self.pool is None:
            return f"Int8KvLayer(format={self.format}{kind}, empty)"
        p = self.pool
        return (
            f"Int8KvLayer(format={self.format.value}{kind}, batch={self.batch_size}, seq_len={self.seq_len}, "
            f"offset={self.offset}, capacity={self.capacity}, num_kv_heads={p.num_kv_heads}, head_dim={p.head_dim})"
        )

    @property
    def held(self) -> int:
        """Positions stored (``seq_len - offset``)."""
        return self.seq_len - self.offset

    def read_complete(self) -> bool:
        """Whether the int8kv attention has read everything written (the forward's not-read check)."""
        return self.read_to == self.seq_len

    def mark_read(self) -> None:
        self.read_to = self.seq_len
        self.attention_calls += 1

    @property
    def batch_size(self) -> int:
        if self.pool is None:
            return 0
        return self.pool.num_blocks // self.pages if self.paged else self.pool.num_blocks

    @property
    def capacity(self) -> int:
        """Positions each batch row has room for."""
        if self.pool is None:
            return 0
        return self.pages * _PAGE if self.paged else self.pool.block_size

    def block_tables(self) -> torch.Tensor | None:
        """4-bit format: int32 ``[batch, pages]``, row ``b`` = block ids ``[b * pages, (b + 1) * pages)``; None for a
        one-block-per-row pool (the attention's ``arange(batch)[:, None]``)."""
        if not self.paged or self.pool is None:
            return None
        return _tables(self.batch_size, self.pages, self.pool.device)

    # -- allocation ------------------------------------------------------------------------------------
    def _round_up(self, n: int) -> int:
        return -(-n // self.chunk_size) * self.chunk_size

    def capacity_for(self, needed: int) -> int:
        """Rows allocated when ``needed`` rows do not fit: ``needed`` plus headroom of ``max(chunk_size,
        needed // 8)``, rounded up to whole chunks. A prefill therefore leaves room for at least ``chunk_size``
        decode steps (an exact fit made the first decode step after a 512-token prefill reallocate all 30
        layers of SmolLM2-135M: 0.35 s of the 2.45 s its first 20 decode steps took, cProfile at load ~4),
        and a long generation reallocates every ~1/9 of its length: each reallocation copies the rows held, at
        most 9 times the rows appended since the previous one, so appending stays amortised O(1) per row. The
        headroom is allocated, not stored: :meth:`memory_bytes` counts the rows held, :meth:`allocated_bytes`
        the capacity."""
        return self._round_up(needed + max(self.chunk_size, needed // 8))

    def _first_capacity(self, needed: int) -> int:
        # A known final length is reserved exactly (a longer write grows past it by the rule above).
        if self.max_cache_len is not None and needed <= self.max_cache_len:
            return self.max_cache_len
        return self.capacity_for(needed)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() == 4 and value_states.dim() == 4 and key_states.shape[:3] == value_states.shape[:3]:
            if key_states.shape[3] != value_states.shape[3]:
                raise UnsupportedAttention(
                    f"the int8kv layout does not implement values of another head_dim than the keys' (keys "
                    f"{key_states.shape[3]}, values {value_states.shape[3]})"
                )
        if key_states.dim() != 4 or tuple(key_states.shape) != tuple(value_states.shape):
            raise ShapeMismatch(
                f"keys and values must both be [batch, kv_heads, tokens, head_dim], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        batch, heads, _, dim = (int(d) for d in key_states.shape)
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.seq_len = self.offset = self.read_to = 0
        # Sized for this first write (the prefill) and the steps after it, so update() does not reallocate.
        n = int(key_states.shape[2])
        self.pool = self._new_pool(batch, heads, dim, self._first_capacity(n), self.device, tokens=n)
        self.is_initialized = True

    def _new_pool(
        self, batch: int, heads: int, dim: int, capacity: int, device: torch.device | str, tokens: int = 1
    ) -> KvPool | Int4SinkWindowPool:
        if self.paged:  # window pages for a step of `tokens` (the first one); more are added when a step needs them
            self.pages = -(-capacity // _PAGE)
            return Int4SinkWindowPool(1, heads, dim, batch * self.pages, self.windows_for(batch, tokens), batch, device)
        return KvPool(KvLayout(1, heads, dim, self.format), batch, capacity, device)

    @staticmethod
    def windows_for(batch: int, tokens: int) -> int:
        """4-bit format: window pages a step of ``tokens`` positions per row needs at most (``ceil(tokens / 64)
        + 2`` per row: cache.pool_q4w)."""
        return batch * (-(-tokens // _PAGE) + 2)

    def _reserve_4bit(self, needed: int, tokens: int) -> None:
        """Room for ``needed`` positions per row and window pages for a step of ``tokens``: a copy of the pool
        into a larger one (row b's pages first in its new range) when either falls short."""
        p = self.pool
        pages = self.pages if needed <= self.capacity else -(-self.capacity_for(needed) // _PAGE)
        windows = self.windows_for(self.batch_size, tokens)
        if pages == self.pages and windows <= p.window_pages:
            return
        batch, old = self.batch_size, self.pages
        sources = [b * old + t if t < old else -1 for b in range(batch) for t in range(pages)]
        self.pool = p.remapped(sources, window_pages=max(windows, p.window_pages))
        self.pages = pages

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` stored rows (the stored ones are kept; the old storage survives a failure)."""
        p = self.pool
        if p is None:
            raise ShapeMismatch("the layer holds no storage yet")
        if self.paged:
            self._reserve_4bit(needed, 1)
            return
        if needed <= p.block_size:
            return
        self.pool = p.resized(self.capacity_for(needed), self.held)

    def trim(self) -> int:
        """Sliding window: drop the stored rows no future query can see (positions before
        ``seq_len - window + 1``) once ``slack`` of them have piled up, into storage sized to what remains plus
        room for ``slack`` more; returns the rows dropped. Called between forwards, never inside one. A layer of the
        4-bit format drops nothing: it keeps every page (its stored form is the whole sequence's)."""
        if self.window is None or self.pool is None or self.paged:
            return 0
        drop = self.seq_len - self.window + 1 - self.offset
        if drop < self.slack:
            return 0
        keep = self.held - drop
        self.pool = self.pool.resized(self._round_up(keep + self.slack), keep, start=drop)
        self.offset += drop
        return drop


    def storage_from(self, k: tuple[torch.Tensor, ...], v: tuple[torch.Tensor, ...], head_dim: int) -> KvPool:
        """A pool holding K's and V's parts ``[batch, length, heads, *part.shape]`` with room to grow, on the
        tensors' device; the layer is unchanged until :meth:`adopt`."""
        if self.paged:
            raise UnsupportedFormat(f"importing a state into the {self.format.name} format is not implemented")
        batch, n, heads = (int(d) for d in k[0].shape[:3])
        pool = self._new_pool(batch, heads, head_dim, self._first_capacity(n), k[0].device)
        for dst, src in zip((*pool.layer_parts(0)[0], *pool.layer_parts(0)[1]), (*k, *v), strict=True):
            dst[:, :n] = src
        return pool

    def stored_forms(self) -> list[Q4WRows]:
        """4-bit format: each batch row's stored form of the positions held (``pool.export_sequence``)."""
        if not self.paged or self.pool is None:
            raise ShapeMismatch("stored forms are the 4-bit format's, of a layer that holds rows")
        return [self.pool.export_sequence(t, self.held)[0] for t in self.block_tables().tolist()]

    def storage_from_forms(self, forms: list[Q4WRows], device: torch.device | str) -> Int4SinkWindowPool:
        """4-bit format: a pool holding each batch row's stored form ``forms[b]`` (one length ``n``, checked by
        the caller's Q4WState) with room to grow, on ``device``; the layer is unchanged until :meth:`adopt`."""
        n, batch = len(forms[0]), len(forms)
        pages = -(-self._first_capacity(max(n, 1)) // _PAGE)
        heads, dim = forms[0].k_window.shape[1:]  # [r, H, d], r = 0 included
        pool = Int4SinkWindowPool(1, int(heads), int(dim), batch * pages, self.windows_for(batch, 1), batch, device)
        for b, rows in enumerate(forms):  # a row between steps holds at most 2 window pages: windows_for's 3 suffice
            pool.import_sequence(range(b * pages, (b + 1) * pages), [rows])
        return pool

    def adopt(self, pool: KvPool | Int4SinkWindowPool, length: int) -> None:
        """Take ``pool`` (from :meth:`storage_from` / :meth:`storage_from_forms`) holding ``length`` positions as
        this layer's storage."""
        if self.paged:
            self.pages = pool.num_blocks // pool.sink_slots  # storage_from_forms: one sink slot per batch row
        self.pool = pool
        self.device = pool.device
        if not self.is_initialized:
            self.dtype = torch.float32
        self.seq_len = self.read_to = length
        self.offset = 0
        self.is_initialized = True

    # -- writing ---------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[batch, kv_heads, tokens, head_dim]`` keys and values after the stored ones, through the write
        path (checks, one encode for K and V); returns tagged empty handles for the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p = self.pool
        assert p is not None
        expected = (self.batch_size, p.num_kv_heads, p.head_dim)
        for name, t in (("keys", key_states), ("values", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShapeMismatch(
                    f"{name} must be [{expected[0]}, {expected[1]}, tokens, {expected[2]}] for this cache, got {got}"
                )
        n = int(key_states.shape[2])
        if value_states.shape[2] != n:
            raise ShapeMismatch(f"keys hold {n} tokens but values {value_states.shape[2]}")
        row = self.held
        if self.paged:
            self._reserve_4bit(row + n, n)
        else:
            self.reserve(row + n)  # returns at once while the rows fit
        p = self.pool
        # [batch, heads, n, dim] -> rows [batch * n, heads, dim] in slot order (row b's block, rows row..). One
        # position (decode) is already in that order: one reshape instead of transpose + reshape.
        if n == 1:
            k = key_states.reshape(-1, p.num_kv_heads, p.head_dim)
            v = value_states.reshape(-1, p.num_kv_heads, p.head_dim)
        else:
            k = key_states.transpose(1, 2).reshape(-1, p.num_kv_heads, p.head_dim)
            v = value_states.transpose(1, 2).reshape(-1, p.num_kv_heads, p.head_dim)
        if self.paged:
            # By step, with the forward's write plan: rows [row, row + n) of every batch row (padding included).
            # Raises (NonFiniteError, shape) before the pool changes: the layer stays as it was.
            write.append_paged_kv(p, 0, k, v, plan=self._write_plan(n), backend=resolve_backend(p, self.backend))
        else:
            slots = _slots(p.num_blocks, p.block_size, row, n, p.device)
            # Raises (NonFiniteError, device, shape) before anything is stored: the layer stays as it was.
            if n != 1 or not self._store_direct(k, v, slots):
                write.append_rows(p, 0, k, v, slots, backend=resolve_backend(p, self.backend))
        self.seq_len += n
        # Empty handles only the int8kv attention may read (any other operation raises AttentionBypassed): they
        # hold nothing but shape, dtype, device and this layer, so one pair serves every step of that kind
        # (two new tensor subclasses per layer and step were a large part of a small model's decode layer).
        kind = (expected, key_states.dtype, value_states.dtype, key_states.device)
        handles = self._handles
        if handles is None or handles[0] != kind:
            handles = self._handles = (kind, make_handle(key_states, self), make_handle(value_states, self))
        return handles[1], handles[2]

    def _store_direct(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
        """Store a decode step's rows ``k, v [batch, heads, head_dim]`` (contiguous) at ``slots`` straight through
        the format's compiled store (``write.store_compiled``, which refuses rows not finite in float16, storing
        nothing: NonFiniteError), skipping the checks this layer already made. False, with nothing stored, where
        that does not apply (the triton backend, non-contiguous rows, and what ``write.store_compiled`` declines):
        the general path then takes the rows.

        The general path (write.append_rows: its checks, the backend, the pool, the format and the codec's own
        checks, each a Python call) costs about twice this one per layer in a small model's decode
        (docs/archive/benchmarks-2026.md, "The decode write through compiled calls")."""
        if self.backend == "triton" or not (k.is_contiguous() and v.is_contiguous()):
            return False
        return write.store_compiled(self.pool, 0, k, v, slots)

    def _write_plan(self, n: int) -> Any:
        """The plan of a step appending ``n`` positions to every row: one per forward and shape, shared by the
        layers (kept in the forward in progress when there is one)."""
        batch, held, device = self.batch_size, self.held, self.pool.device
        key = ("4-bit write", batch, n, held, self.pages, device)
        fw = self.book.forward
        plan = fw.plans.get(key) if fw is not None else None
        if plan is None:
            plan = plan_attention(
                self.pool, _tables(batch, self.pages, device),
                torch.full((batch,), held + n, dtype=torch.int32, device=device),
                cu_seqlens_q=torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device=device),
            )  # fmt: skip
            if fw is not None:
                fw.plans[key] = plan
        return plan

    # -- reading ---------------------------------------------------------------------------------------
    def stored(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Views of the stored positions: K's and V's parts ``[batch, held, heads, *part.shape]``."""
        if self.pool is None:
            raise PositionOutOfRange("the layer holds no tokens yet")
        if self.paged:
            raise UnsupportedFormat(f"reading the {self.format.name} pool's rows as parts is not implemented")
        n = self.held
        k, v = self.pool.layer_parts(0)
        return tuple(t[:, :n] for t in k), tuple(t[:, :n] for t in v)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``[batch, kv_heads, held, head_dim]`` copies of the stored K and V (positions from
        :attr:`offset`), for inspection and tests only."""
        k, v = (self.format.spec.decode(side) for side in self.stored())
        return k.transpose(1, 2), v.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held + query_length, self.offset

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return self.window if self.window is not None else -1

    # -- editing ---------------------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not self.offset <= n <= self.seq_len:
            raise PositionOutOfRange(
                f"cannot truncate to {n!r}: positions [{self.offset}, {self.seq_len}) are stored"
                + (" (the window dropped the ones before)" if self.offset else "")
            )
        if self.paged and n < self.seq_len:
            # Refused (UnsupportedFormat, nothing changed) once the F16 rows length n reads were given back.
            tables = self.block_tables().tolist()
            self.pool.truncate(tables, n)
        self.seq_len = n
        self.read_to = min(self.read_to, n)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-k)`` drops the last ``k`` tokens (transformers 5 semantics, ``crop(0)`` is a no-op);
        ``crop(n)`` with ``n > 0`` keeps the first ``n`` (the 4.x ``max_length`` form; no-op if ``n >= seq_len``)."""
        if tokens_to_remove > 0:
            self.truncate(min(tokens_to_remove, self.seq_len))
        elif tokens_to_remove < 0:
            if -tokens_to_remove > self.seq_len:
                raise PositionOutOfRange(f"cannot remove {-tokens_to_remove} tokens: only {self.seq_len} stored")
            self.truncate(self.seq_len + tokens_to_remove)

    def reset(self) -> None:
        # Storage is kept for reuse; only the lengths go back to zero (the 4-bit pool's pages given back).
        if self.paged and self.pool is not None:
            self.pool.truncate(self.block_tables().tolist(), 0)
        self.seq_len = self.offset = self.read_to = 0

    def _select_rows(self, index: torch.Tensor) -> None:
        p = self.pool
        if p is None:
            return
        index = index.to(device=p.device, dtype=torch.long)
        batch = self.batch_size
        if index.dim() != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch)):
            raise ShapeMismatch(f"batch indices must be a 1-D tensor in [0, {batch}), got {index.tolist()}")
        if self.paged:
            if not index.numel():
                raise ShapeMismatch("batch indices must select at least one row")
            # Copies of row r's pages (its window pages and sink slot too): a row picked twice gives two rows.
            rows = index.cpu()[:, None] * self.pages + torch.arange(self.pages)[None, :]
            self.pool = p.remapped(rows.reshape(-1).tolist())
            return
        # Copies: a row picked twice (beam search) gives two independent rows.
        self.pool = p.select_blocks(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.dtype == torch.bool:
            indices = torch.nonzero(indices).flatten()
        self._select_rows(indices)

    def offload(self) -> None:  # transformers' offloading moves .keys/.values, which this layer does not have
        raise UnsupportedAttention("Int8KvCache does not support offloading")

    prefetch = offload

    # -- accounting ------------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of the stored tokens (every batch row, padding included), codes and scales, K and V."""
        p = self.pool
        if p is None:
            return 0
        if self.paged:  # the stored form: sealed pages, the sinks and the window in F16
            return self.batch_size * p.num_kv_heads * self.format.stored_bytes(self.held, p.head_dim)
        return p.num_blocks * self.held * p.layout.bytes_per_token

    def allocated_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.memory_bytes()


class Int8KvHybridLayer(LinearAttentionLayer, Int8KvLayer):
    """transformers' "hybrid" / "hybrid_sliding" layer: a linear-attention state (transformers' own code) and
    the layer's K/V in int8kv."""

    def __init__(self, *args: Any, number_of_states: int = 1, **kwargs: Any) -> None:
        Int8KvLayer.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        # transformers' convention: K/V with two positional args, the states with keyword args only.
        if args:
            Int8KvLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        Int8KvLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        Int8KvLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        Int8KvLayer.crop(self, tokens_to_remove)

    offload = Int8KvLayer.offload
    prefetch = Int8KvLayer.offload
    get_max_length = Int8KvLayer.get_max_length
    is_compileable = False


class Int8KvCache(Cache):
    """A ``transformers.Cache`` holding K/V as INT8 codes + float32 scales per (token, KV head) (format V1),
    or as float16 (``format=KvStorageFormat.F16``), read directly by the ``"int8kv"`` attention function.

    Args:
        config: the model's config. It sizes the cache (one layer per decoder layer) and, unless
            ``attach=False``, switches ``config._attn_implementation`` to ``"int8kv"`` (see int8kv.hf).
            Without a config, layers are created on first use and attention must be enabled by hand.
        format: a :class:`KvStorageFormat` or its name / a dtype alias (``"int8"``, ``"f16"``).
        chunk_size: allocation granularity in tokens.
        max_cache_len: tokens to reserve up front (avoids reallocation when the final length is known).
        backend: forwarded to the :mod:`int8kv.ops` dispatcher (None: chosen from the device).
        attach: whether to switch the config's attention implementation.

    Layers follow the config (:func:`int8kv.hf.layers.layer_specs`): full, sliding-window (storage bounded by
    the window, except in the 4-bit format, which keeps every page) and chunked attention layers in int8kv;
    linear-attention, Mamba and conv layers as transformers' own layer classes. A config whose attention int8kv
    does not implement (MLA, ALiBi, sparse attention, ...) is refused here, by name, before anything changes; a
    refusal at the first forward (the model's attention turns out to be something the kernels cannot serve) puts
    the config back as it was.

    ``crop(-k)`` drops the last ``k`` tokens and ``crop(n > 0)`` keeps the first ``n``. Beam search works
    through ``reorder_cache``. If encoding a step raises (``NonFiniteError`` on NaN/inf), or the attention
    rejects the step, every layer is rolled back to where the step began before the error propagates.
    Works with autograd on: keys and values are detached on the way in (a KV cache stores values, not graphs).
    """

    def __init__(
        self,
        config: PreTrainedConfig | None = None,
        format: KvStorageFormat | str = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        *,
        chunk_size: int = _DEFAULT_CHUNK,
        max_cache_len: int | None = None,
        backend: str | None = None,
        attach: bool = True,
    ) -> None:
        if isinstance(config, PreTrainedModel):  # Int8KvCache(model) as well as Int8KvCache(model.config)
            config = config.config
        if config is not None and not isinstance(config, PreTrainedConfig):
            raise TypeError(f"Int8KvCache takes a transformers config or model, got {type(config).__name__}")
        self.format = resolve_format(format)
        self.backend = backend
        limit_torch()  # torch's threads within the CPUs the process may use (a cgroup quota it does not see)
        self.book = Book(strict=config is not None)
        make_layer = functools.partial(
            Int8KvLayer, self.format, chunk_size=chunk_size, max_cache_len=max_cache_len, backend=backend,
            book=self.book,
        )  # fmt: skip
        self._make_layer = make_layer
        self._text_config: PreTrainedConfig | None = None
        self.specs: list[LayerSpec] | None = None
        if config is None:
            super().__init__(layer_class_to_replicate=self._next_layer)
            return
        text_config = config.get_text_config(decoder=True)
        if getattr(text_config, "is_encoder_decoder", False) or getattr(text_config, "is_causal", True) is False:
            raise UnsupportedAttention("Int8KvCache serves causal decoders only")
        specs = layer_specs(text_config)  # refuses unsupported attention by name, before anything changes
        self.specs = specs
        self._text_config = text_config
        super().__init__(layers=[self._layer_for(i, spec) for i, spec in enumerate(specs)])
        if attach:
            self.book.attached = attach_config(config)

    def _next_layer(self, offset: int = 0) -> Int8KvLayer:
        """A full-attention layer for caches built without a config (created as transformers asks for them)."""
        return self._make_layer(layer_idx=len(self.layers) + offset)

    def _layer_for(self, idx: int, spec: LayerSpec) -> Any:
        kwargs = dict(spec.layer_kwargs)
        if spec.kind == "shared":
            return DummyLayer()
        if spec.kind == "state":
            return DYNAMIC_LAYER_TYPE_MAPPING[spec.layer_type](**kwargs)  # transformers' own state layer
        if spec.state:
            return Int8KvHybridLayer(
                self.format, **self._make_layer.keywords, spec=spec, layer_idx=idx,
                number_of_states=kwargs.get("number_of_states", 1),
            )  # fmt: skip
        return self._make_layer(spec=spec, layer_idx=idx)

    def __repr__(self) -> str:
        return (
            f"Int8KvCache(format={self.format}, layers={len(self.layers)}, seq_len={self.get_seq_length()}, "
            f"memory_bytes={self.memory_bytes()})"
        )

    @property
    def attention_calls(self) -> int:
        """int8kv kernel launches over all layers, for checking the kernels really serve the model."""
        return sum(layer.attention_calls for layer in self.kv_layers())

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.book.broken:
            raise UnsupportedAttention(self.book.broken)
        config = self._text_config
        # Asked when a forward begins (no forward in progress, or this layer already written in it): reading
        # `_attn_implementation` goes through transformers' config __getattribute__, slow per layer. A switch
        # in the middle of a forward is still caught: the next layer's attention is then another function, which
        # reads the handles of this cache and raises AttentionBypassed.
        fw = self.book.forward
        if (
            config is not None
            and (fw is None or layer_idx in fw.starts)
            and config._attn_implementation != ATTN_IMPLEMENTATION
        ):
            # Any other attention function would read the empty handles update() returns as zero keys.
            raise UnsupportedAttention(
                f"the model attends with {config._attn_implementation!r}; Int8KvCache needs the int8kv attention: "
                "call int8kv.hf.enable_int8kv_attention(model) (or construct the cache with attach=True)"
            )
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self._next_layer())
        layer = self.layers[layer_idx]
        if not isinstance(layer, Int8KvLayer):
            raise UnsupportedAttention(
                f"the model writes K/V to layer {layer_idx}, which its config declares as "
                f"{self.specs[layer_idx].layer_type if self.specs is not None else 'no attention layer'}"
            )
        start = layer.get_seq_length()
        self.book.written(layer, start)  # refuses if an earlier layer of this forward was not read
        try:
            # A KV cache stores values, not graphs: with autograd on, the keys carry a grad_fn.
            if key_states.requires_grad or value_states.requires_grad:
                key_states, value_states = key_states.detach(), value_states.detach()
            return layer.update(key_states, value_states, *args, **kwargs)
        except Exception as e:
            self.book.abort(e)
            raise

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        # Masks are built at the start of a forward: the previous one is over, so its layers must all have been
        # read and the sliding layers can drop what no query will see again (before the masks are sized on them).
        self.finish_forward()
        return super().get_mask_sizes(query_length, layer_idx)

    def finish_forward(self) -> None:
        """End the forward in progress: refuse it if a layer it wrote was not read (AttentionBypassed), then let
        the sliding-window layers drop the rows no future query can see. transformers calls this through
        :meth:`get_mask_sizes` before each forward; call it yourself to trim after the last one."""
        self.book.finish()
        for layer in self.layers:
            if isinstance(layer, Int8KvLayer):
                layer.trim()

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._state_written()
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        self._state_written()
        return super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)

    def _state_written(self) -> None:
        if self.book.broken:
            raise UnsupportedAttention(self.book.broken)
        if self.book.forward is not None:
            self.book.forward.state_written = True

    def reset(self) -> None:
        self.book.forward = None
        self.book.broken = None
        super().reset()

    def truncate(self, n: int) -> None:
        for layer in self.kv_layers():
            layer.truncate(n)

    def kv_layers(self) -> list[Int8KvLayer]:
        """The layers holding K/V in int8kv (the others: transformers' state layers, shared layers)."""
        return [la for la in self.layers if isinstance(la, Int8KvLayer)]

    # -- state (see int8kv/cache/state.py) ----------------------------------------------------------------
    def export_state(self) -> KvState | GroupedKvState | Q4WState:
        """Every layer's stored tokens (all batch rows) as a :class:`KvState` (CPU copies); for a model whose layers
        hold K/V of several shapes (Gemma 4) a :class:`GroupedKvState`, one section per shape in order of first
        use, with each section's model layers. The 4-bit format: every row's stored form as a :class:`Q4WState`
        (one K/V shape only; several refused by name)."""
        layers = list(self.layers)
        if not layers or not all(isinstance(la, Int8KvLayer) and la.is_initialized for la in layers):
            raise ShapeMismatch(
                "the Int8KvCache holds nothing yet (run the prompt through the model first), or holds layers that "
                "are not int8kv K/V (a hybrid model's states cannot be exported)"
            )
        if any(la.offset or type(la) is not Int8KvLayer for la in layers):
            raise ShapeMismatch("a sliding-window layer has dropped its oldest tokens: the state is not exportable")
        lengths = {la.seq_len for la in layers}
        batches = {la.batch_size for la in layers}
        if len(lengths) != 1 or len(batches) != 1:
            raise ShapeMismatch(f"the layers disagree (lengths {sorted(lengths)}, batch sizes {sorted(batches)})")
        shapes = [(la.pool.num_kv_heads, la.pool.head_dim) for la in layers]
        if is_4bit(self.format):
            if len(set(shapes)) != 1:
                raise UnsupportedFormat(f"a state of several K/V shapes {sorted(set(shapes))} in the "
                                        f"{self.format.name} format is not implemented")
            layout = KvLayout(len(layers), *shapes[0], KvStorageFormat.INT4_SINK_WINDOW_V1)
            return Q4WState.of(layout, [la.stored_forms() for la in layers])
        groups = group_layers(shapes)
        sections = [
            KvState.from_layers(KvLayout(len(g), *shapes[g[0]], self.format), [layers[i].stored() for i in g])
            for g in groups
        ]
        return sections[0] if len(sections) == 1 else GroupedKvState.of(sections, groups)

    def import_state(self, state: KvState | GroupedKvState | Q4WState, device: torch.device | str | None = None
                     ) -> None:
        """Replace every layer's contents with ``state`` (creating the layers if the cache has none yet); a
        GroupedKvState must record each section's model layers (:meth:`export_state` does; a paged cache's does
        not); the 4-bit format takes a :class:`Q4WState` (each layer's pool built from its stored forms). Atomic:
        every new storage is allocated and filled before the first layer changes, so an error (a bad state, or
        running out of memory part-way) leaves every layer as it was."""
        if is_4bit(self.format) or isinstance(state, Q4WState):
            self._import_forms(state, device)
            return
        if isinstance(state, GroupedKvState):
            if state.layers is None:
                raise ShapeMismatch(
                    "the state of several K/V shapes does not record which model layers each group holds (a paged "
                    "cache's export); an Int8KvCache places layers by model layer"
                )
            pairs = zip(state.sections, state.layers, strict=True)
            where = {i: (section, j) for section, group in pairs for j, i in enumerate(group)}
        elif isinstance(state, KvState):
            where = {i: (state, i) for i in range(state.layout.num_layers)}
        else:
            raise ShapeMismatch(f"expected a KvState, got {type(state).__name__}")
        num_layers = len(where)
        if state.format != self.format:
            raise ShapeMismatch(f"the state stores {state.format.value} but the cache holds {self.format.value}")
        layers, created = self._import_layers(num_layers, lambda la: la.format == state.format,
                                              lambda i: where[i][0].layout)
        pools = []
        for i, la in enumerate(layers):
            dev = torch.device(device) if device is not None else (la.device if la.is_initialized else "cpu")
            section, j = where[i]
            k, v = (tuple(t.to(dev) for t in side) for side in section.layer(j))
            pools.append(la.storage_from(k, v, section.layout.head_dim))
        # Every pool exists: adopting them allocates nothing and cannot fail part-way.
        for la, pool in zip(layers, pools, strict=True):
            la.adopt(pool, state.length)
        if created:
            self.layers.extend(layers)

    def _import_layers(self, num_layers: int, holds_format, layout_of) -> tuple[list, bool]:
        """The layers an import fills (new ones when the cache has none yet) and whether they were created, each
        checked, nothing changed: an Int8KvLayer of the state's format (``holds_format(layer)``) whose rows, if it
        holds any, have the shape of ``layout_of(i)`` (a KvLayout)."""
        created = not self.layers
        if created and getattr(self, "layer_class_to_replicate", None) is None:
            raise ShapeMismatch("the Int8KvCache has no layers and cannot create any")
        layers = [self._next_layer(i) for i in range(num_layers)] if created else list(self.layers)
        if len(layers) != num_layers:
            raise ShapeMismatch(f"the state holds {num_layers} layers but the cache has {len(layers)}")
        for i, la in enumerate(layers):
            if not isinstance(la, Int8KvLayer) or not holds_format(la):
                raise ShapeMismatch(f"layer {i} is not an Int8KvLayer of format {self.format.value}")
            held = layout_of(i)
            if la.is_initialized and (la.pool.num_kv_heads, la.pool.head_dim) != (held.num_kv_heads, held.head_dim):
                raise ShapeMismatch(
                    f"the state holds {held.num_kv_heads} kv heads of {held.head_dim} for layer {i}, which holds "
                    f"{la.pool.num_kv_heads} of {la.pool.head_dim}"
                )
        return layers, created

    def _import_forms(self, state: Q4WState, device: torch.device | str | None) -> None:
        """:meth:`import_state` of the 4-bit format: each layer's new pool built from the state's stored forms
        before the first layer changes."""
        if not is_4bit(self.format) or not isinstance(state, Q4WState):
            got = state.format.value if isinstance(state, (KvState, GroupedKvState, Q4WState)) else type(state).__name__
            raise ShapeMismatch(f"the state stores {got} but the cache holds {self.format.value}")
        layers, created = self._import_layers(state.layout.num_layers, lambda la: la.paged, lambda i: state.layout)
        pools = []
        for i, la in enumerate(layers):
            dev = torch.device(device) if device is not None else (la.device if la.is_initialized else "cpu")
            pools.append(la.storage_from_forms([state.rows(i, b) for b in range(state.batch)], dev))
        for la, pool in zip(layers, pools, strict=True):  # every pool exists: nothing below can fail part-way
            la.adopt(pool, state.length)
        if created:
            self.layers.extend(layers)

    def memory_bytes(self) -> int:
        """Bytes of the stored tokens across the int8kv layers (codes + scales, K and V, padding rows included;
        transformers' own state layers are not counted)."""
        return sum(layer.memory_bytes() for layer in self.kv_layers())

    def allocated_bytes(self) -> int:
        """Bytes actually allocated (capacity is grown in chunks, so this is >= memory_bytes())."""
        return sum(layer.allocated_bytes() for layer in self.kv_layers())
