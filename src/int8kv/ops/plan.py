"""Plan once, run per layer: the per-step metadata every attention backend reads, validated once.

What attention needs to know about a step (which blocks each sequence owns, how many tokens it has stored,
where its window starts, how its queries are packed, where the new tokens go) is the same for every layer.
:func:`plan_attention` checks it once and freezes it in an :class:`AttentionPlan`; the backends
(``reference``, ``cpu``, ``triton``) take ``(pool, layer, q, plan)`` and check nothing. A 30-layer model
therefore validates a step once, not 30 times (tests/test_plan.py counts it).

Tensors of a plan (all on the pool's device, contiguous):
  block_tables  [batch, max_blocks] int32   padding entries are 0 and never read
  context_lens  [batch] int32               tokens stored per sequence, this step's included
  kv_starts     [batch] int32 | None        positions < kv_starts[b] are masked out (left padding)
  cu_seqlens_q  [batch + 1] int32           the queries of sequence b are rows cu[b]:cu[b+1] of q
                                            (decode: 0, 1, ..., batch); they are its last n_b positions
  slots         [num_queries] int64 | None  where this step's K/V rows go (distinct, in the pool)
  positions     [num_queries] int64 | None  RoPE positions of this step's tokens

Every range check runs on the caller's int32/int64 values *before* anything is cast to int32, so an int64
entry beyond int32 is refused rather than wrapped (``block_tables=[[0, 2**32 + 1]]`` would read block 1).
All the bounds are gathered into one tensor and read back in one host transfer: free on the CPU, one device
sync per step on a GPU. A caller that built its metadata itself and wants no sync passes ``validate=False``
(then ``max_query_len`` must be given for prefill, as the launch grid needs it).
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import NonFiniteError, PositionOutOfRange, ShapeMismatch, UnknownBackend

INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
# How the CPU backend multiplies an INT8 cache: "exact" (float32 query and arithmetic, checked against the
# float64 reference) or "int16" (each decode row's (token, head) rounded to int16 inside the kernel, q . k in
# int32 on the int8 key codes; prefill runs exact); docs/design.md gives the error bound. Default: int16, or the
# INT8KV_ATTENTION_PRECISION environment variable. int16 is the default because its change is inside the noise
# of the quality metric itself: on the 2,048-token decode run (docs/results/eval_decode_noise.json) moving each
# decode query by one float32 ulp moved the exact path's perplexity over 13.064-13.101 (fp32 13.067) and its KL
# from fp32 over 1.72-1.82e-3, and int16 gave 13.068-13.090 and 1.68-1.82e-3; and it is faster than exact per
# decode call (docs/performance.md, "Decode attention kernel"). F16 and 4-bit caches, CPUs without an integer dot
# variant and head_dims its kernel does not take run exact whatever the precision. An int8 query (for
# `vpdpbusd`) is not offered: it moved the 2,048-token perplexity by +0.24 percentage points against exact, beyond
# the 0.02 budget (docs/archive/benchmarks-2026.md, "The default query precision"), so a name outside PRECISIONS
# is refused, never mapped.
PRECISIONS = ("exact", "int16")
DEFAULT_PRECISION = "int16"
PRECISION_ENV = "INT8KV_ATTENTION_PRECISION"


@dataclass(frozen=True, eq=False)
class HostIndex:
    """int64 numpy copies of the plan's lengths (CPU pools only): the CPU backend plans its work items on them."""

    context_lens: np.ndarray  # [batch]
    kv_starts: np.ndarray  # [batch], zeros without kv_starts
    cu_seqlens_q: np.ndarray  # [batch + 1]


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """Frozen per-step attention metadata (module docs). Build it with :func:`plan_attention`."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    kv_starts: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    num_queries: int
    max_query_len: int
    softmax_scale: float
    is_decode: bool
    slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    host: HostIndex | None = None
    precision: str = DEFAULT_PRECISION
    # Backend-derived data that depends only on the plan (the CPU backend's sorted work items), computed by
    # the first layer and reused by the others. Not part of the plan's identity.
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        require_unit_stride(
            block_tables=self.block_tables, context_lens=self.context_lens, kv_starts=self.kv_starts,
            cu_seqlens_q=self.cu_seqlens_q, slots=self.slots, positions=self.positions,
        )  # fmt: skip

    @property
    def batch(self) -> int:
        return int(self.block_tables.shape[0])

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per plan under ``key``; later layers get the stored result."""
        memo = self._memo
        if key not in memo:
            memo[key] = build()
        return memo[key]


@dataclass(frozen=True, eq=False)
class AttentionVariant:
    """What one attention call changes in the causal softmax, per call (per layer: one plan serves a model whose
    layers mix sliding and full attention). Built and checked by :func:`check_variant`; None fields are unused.

    With ``s`` the position of a stored key and ``p`` a query's position (both the kernels' stored positions,
    0..context_len-1, left padding included) and ``start`` the sequence's kv_start (0 without kv_starts),
    key ``s`` is visible to ``p`` iff ``start <= s <= p`` and
      window   ``p - window < s``                                   (transformers' ``sliding_window``)
      chunk    ``(s - start) // chunk == (p - start) // chunk``     (Llama 4 ``attention_chunk_size``; chunks
                                                                     count from the first unpadded position)
    so both only raise the lowest visible key of each query: ``low(p) = max(start, p - window + 1,
    start + (p - start) // chunk * chunk)``. Keys below ``low`` of a step's first query are never read.
      softcap  a score ``x = softmax_scale * q.k`` becomes ``softcap * tanh(x / softcap)``     (Gemma 2)
      sinks    ``[num_q_heads]`` float32 logits, one per query head, that join the softmax denominator only:
               ``out = sum_s e^x_s v_s / (sum_s e^x_s + e^sink)`` (gpt-oss ``s_aux``; not scaled, not capped).
    A query with no visible key yields zeros, sink or not."""

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def bounds_keys(self) -> bool:
        """Whether a query may see fewer keys than the causal range [start, p]."""
        return self.window is not None or self.chunk is not None

    def key_lows(self, positions: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """``low(p)`` (the class docs) of int64 query ``positions`` whose sequences start at ``starts``."""
        low = starts.copy()
        if self.window is not None:
            low = np.maximum(low, positions - self.window + 1)
        if self.chunk is not None:
            low = np.maximum(low, starts + (positions - starts) // self.chunk * self.chunk)
        return low


def _positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, bool) or n < 1:
        raise ShapeMismatch(f"{name} must be a positive int or None, got {value!r}")
    # Contexts stay below 2**31, so a longer window or chunk sees the same keys; clamped, it fits int32 kernels.
    return min(n, INT32_MAX)


def check_variant(
    pool: Any,
    num_q_heads: int,
    *,
    window: Any = None,
    chunk: Any = None,
    softcap: Any = None,
    sinks: Any = None,
) -> AttentionVariant | None:
    """The checked :class:`AttentionVariant` of one call, or None when every argument is None (plain causal).

    ``window``, ``chunk``: positive ints; ``softcap``: a finite positive number; ``sinks``: a floating tensor
    ``[num_q_heads]`` on the pool's device, finite (copied to float32, detached). Anything else is refused
    (ShapeMismatch, NonFiniteError for NaN/inf); the check reads ``sinks`` back once (a device sync on a GPU)."""
    if window is None and chunk is None and softcap is None and sinks is None:
        return None
    window = _positive_int(window, "window")
    chunk = _positive_int(chunk, "chunk")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
            raise ShapeMismatch(f"softcap must be a positive number or None, got {softcap!r}")
        softcap = float(softcap)
        if not math.isfinite(softcap):
            raise NonFiniteError(f"softcap must be finite, got {softcap}")
        if softcap <= 0:
            raise ShapeMismatch(f"softcap must be positive, got {softcap}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != num_q_heads:
            got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ShapeMismatch(f"sinks must be a [{num_q_heads}] tensor (one logit per query head), got {got}")
        if not sinks.dtype.is_floating_point:
            raise ShapeMismatch(f"sinks must be a floating tensor, got {sinks.dtype}")
        if sinks.device != pool.device:
            raise ShapeMismatch(f"sinks is on {sinks.device} but the cache is on {pool.device}")
        sinks = sinks.detach().to(torch.float32).contiguous()
        if not bool(torch.isfinite(sinks).all()):
            raise NonFiniteError("sinks hold NaN or inf")
    return AttentionVariant(window, chunk, softcap, sinks)


def require_unit_stride(**tensors: torch.Tensor | None) -> None:
    """Refuse (ShapeMismatch) a tensor whose last dimension is strided: the kernels read metadata row ``i`` at
    ``ptr + i`` (a block table's rows at ``ptr + b * stride(0) + i``), so ``ctx[::2]`` would be read wrongly.

    :func:`plan_attention` copies strided metadata to contiguous tensors; this guards plans built by hand and
    the write path's caller-vouched slots. Host-side strides only: no device read."""
    for name, t in tensors.items():
        if t is not None and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ShapeMismatch(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")


_DECODE_CU: dict[torch.device, list[torch.Tensor]] = {}


def decode_cu_seqlens(batch: int, device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., batch]`` int32 on ``device`` without a launch per step: a slice of a kept ``arange``.

    Every ``arange`` ever handed out stays referenced, so a captured CUDA graph never reads freed memory."""
    kept = _DECODE_CU.setdefault(device, [])
    if not kept or kept[-1].numel() < batch + 1:
        size = max(batch + 1, 2 * kept[-1].numel() if kept else 1024)
        kept.append(torch.arange(size, dtype=torch.int32, device=device))
    return kept[-1][: batch + 1]


def _index(x: Any, what: str, dim: int, device: torch.device, length: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != dim or x.dtype not in INDEX_DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ShapeMismatch(f"{what} must be a {dim}-d int32/int64 tensor, got {got}")
    if length is not None and x.shape[0] != length:
        raise ShapeMismatch(f"{what} must have {length} entries, got {x.shape[0]}")
    if x.device != device:
        raise ShapeMismatch(f"{what} is on {x.device} but the cache is on {device}")
    return x


def _int32(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.int32).contiguous()


def plan_attention(
    pool: Any,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    num_queries: int | None = None,
    max_query_len: int | None = None,
    softmax_scale: float | None = None,
    slots: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    max_position: int | None = None,
    validate: bool = True,
    precision: str | None = None,
) -> AttentionPlan:
    """Check a step's metadata against ``pool`` (a :class:`~int8kv.cache.pool.KvPool` or anything with its
    ``num_blocks``, ``block_size``, ``head_dim`` and ``device``) and freeze it.

    Decode when ``cu_seqlens_q`` is None (one query per sequence). ``num_queries`` (the rows of q) defaults to
    ``cu_seqlens_q[-1]``; ``max_position`` bounds ``positions`` (the rows of the RoPE tables). With
    ``validate=False`` only dtypes are normalised: the caller vouches for shapes and values. ``precision``: one
    of :data:`PRECISIONS` (None: the environment's ``INT8KV_ATTENTION_PRECISION``, else :data:`DEFAULT_PRECISION`).
    """
    precision = resolve_precision(precision)
    device = pool.device
    scale = pool.head_dim**-0.5 if softmax_scale is None else softmax_scale
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise ShapeMismatch(f"softmax_scale must be a number, got {softmax_scale!r}") from None
    if not math.isfinite(scale):
        raise NonFiniteError(f"softmax_scale must be finite, got {scale}")
    is_decode = cu_seqlens_q is None
    if validate:
        tables = _index(block_tables, "block_tables", 2, device)
        batch = tables.shape[0]
        if tables.shape[1] == 0 and batch:
            raise ShapeMismatch(f"block_tables must be [{batch}, max_blocks >= 1], got {tuple(tables.shape)}")
        lens = _index(context_lens, "context_lens", 1, device, batch)
        starts = None if kv_starts is None else _index(kv_starts, "kv_starts", 1, device, batch)
        cu = None if is_decode else _index(cu_seqlens_q, "cu_seqlens_q", 1, device, batch + 1)
        n_q = batch if is_decode else num_queries
        if n_q is not None and (isinstance(n_q, bool) or not isinstance(n_q, int) or n_q < 0):
            raise ShapeMismatch(f"num_queries must be an int >= 0, got {n_q!r}")
        if slots is not None:
            slots = _index(slots, "slots", 1, device)
        if positions is not None:
            positions = _index(positions, "positions", 1, device)
        n_q, max_q = validate_values(pool, tables, lens, starts, cu, n_q, slots, positions, max_position)
    else:
        tables, lens, starts, cu = block_tables, context_lens, kv_starts, cu_seqlens_q
        batch = tables.shape[0]
        n_q = batch if is_decode else num_queries
        max_q = 1 if is_decode else max_query_len
        if n_q is None or max_q is None:
            raise ShapeMismatch("an unvalidated prefill plan needs num_queries and max_query_len")
    if is_decode:
        max_q = 1 if batch else 0
        cu = decode_cu_seqlens(batch, device)
    tables, lens, starts, cu = _int32(tables), _int32(lens), _int32(starts), _int32(cu)
    host = None
    if device.type == "cpu":
        host = HostIndex(
            lens.numpy().astype(np.int64),
            np.zeros(batch, np.int64) if starts is None else starts.numpy().astype(np.int64),
            cu.numpy().astype(np.int64),
        )
    return AttentionPlan(
        tables, lens, starts, cu, int(n_q), int(max_q), scale, is_decode,
        None if slots is None else slots.to(torch.int64).contiguous(),
        None if positions is None else positions.to(torch.int64).contiguous(),
        host, precision,
    )  # fmt: skip


def resolve_precision(precision: str | None) -> str:
    """``precision``, or the environment's default when None; anything else is refused (UnknownBackend)."""
    name = os.environ.get(PRECISION_ENV, DEFAULT_PRECISION) if precision is None else precision
    if name not in PRECISIONS:
        why = " (an int8 query costs +0.24 pp of perplexity, so it is not offered)" if name == "int8" else ""
        raise UnknownBackend(f"unknown attention precision {name!r}{why}; accepted: {', '.join(PRECISIONS)}")
    return name


def validate_values(
    pool: Any,
    tables: torch.Tensor,
    lens: torch.Tensor,
    starts: torch.Tensor | None,
    cu: torch.Tensor | None,
    num_queries: int | None,
    slots: torch.Tensor | None,
    positions: torch.Tensor | None,
    max_position: int | None,
    host: bool | None = None,
) -> tuple[int, int]:
    """Range checks of a step's metadata, one host read for all of them; returns (num_queries, max_query_len).

    Runs once per step (tests/test_plan.py counts the calls), on the caller's integers before any cast. On the
    CPU the same statistics come from numpy views of the tensors (no copy): torch's ~30 small ops of the
    device path (each statistic reshaped and cast for the one host read) cost several times numpy's per-op
    overhead on such small tensors (`_on_host`). ``host``: which of the two computes them (None: numpy for CPU
    tensors; the tests run both on the same metadata)."""
    stats: list = []
    host = tables.device.type == "cpu" if host is None else host
    if host:
        tables, lens, starts, cu, slots, positions = _on_host(tables, lens, starts, cu, slots, positions)

    def add(*xs: Any) -> int:
        stats.extend(xs)
        return len(stats) - len(xs)

    def filled(x: Any) -> bool:
        return x is not None and (x.size if host else x.numel()) > 0

    def wide(x: Any) -> Any:
        return x.astype(np.int64) if host else x.to(torch.int64)

    i_tab = add(tables.min(), tables.max()) if filled(tables) else None
    i_len = add(lens.min(), lens.max()) if filled(lens) else None
    i_start = add(starts.min(), starts.max()) if filled(starts) else None
    i_cu = None
    if cu is not None:
        c = wide(cu)
        counts = c[1:] - c[:-1]
        if filled(counts):
            i_cu = add(c[0], c[-1], counts.min(), counts.max(), (counts > wide(lens)).any())
        else:
            i_cu = add(c[0], c[-1])
    i_slot = add(*_slot_stats(slots)) if filled(slots) else None
    i_pos = add(positions.min(), positions.max()) if filled(positions) else None
    v = _read(stats, host)

    if i_tab is not None and (v[i_tab] < 0 or v[i_tab + 1] >= pool.num_blocks):
        raise PositionOutOfRange(
            f"block_tables entries must lie in [0, {pool.num_blocks}), got [{v[i_tab]}, {v[i_tab + 1]}]"
        )
    capacity = tables.shape[1] * pool.block_size
    if i_len is not None and (v[i_len] < 0 or v[i_len + 1] > min(capacity, INT32_MAX)):
        raise PositionOutOfRange(f"context_lens must lie in [0, {capacity}] (block_tables width x block_size)")
    if i_start is not None and (v[i_start] < 0 or v[i_start + 1] > INT32_MAX):
        raise PositionOutOfRange("kv_starts must lie in [0, 2**31)")
    batch = tables.shape[0]
    if cu is None:
        n_q, max_q = batch, 1 if batch else 0
        if num_queries is not None and num_queries != batch:
            raise ShapeMismatch(f"decode has one query per sequence ({batch}), got {num_queries}")
    else:
        first, last = v[i_cu], v[i_cu + 1]
        n_q = last if num_queries is None else num_queries
        max_q = v[i_cu + 3] if batch else 0
        if first != 0 or last != n_q or (batch and v[i_cu + 2] < 0) or last > INT32_MAX:
            raise ShapeMismatch(f"cu_seqlens_q must rise from 0 to the number of queries ({n_q})")
        if batch and v[i_cu + 4]:
            raise ShapeMismatch("a sequence has more queries than stored tokens (write K/V before attending)")
    for name, t in (("slots", slots), ("positions", positions)):
        if t is not None and t.shape[0] != n_q:
            raise ShapeMismatch(f"{name} must have one entry per query ({n_q}), got {t.shape[0]}")
    if i_slot is not None:
        _check_slot_stats(pool, *v[i_slot : i_slot + 3], slots.shape[0])
    if i_pos is not None:
        bound = INT32_MAX if max_position is None else max_position
        if v[i_pos] < 0 or v[i_pos + 1] >= bound:
            raise PositionOutOfRange(f"positions must lie in [0, {bound}) (rows of the cos/sin tables)")
    return int(n_q), int(max_q)


def _on_host(*tensors: torch.Tensor | None) -> tuple[np.ndarray | None, ...]:
    """Numpy views of CPU tensors (None stays None), for `validate_values`' host path."""
    return tuple(None if t is None else t.numpy() for t in tensors)


def _read(stats: list, host: bool) -> list[int]:
    """Statistics as Python ints: numpy scalars (``host``) one by one, tensors in one host read."""
    if host:
        return [int(x) for x in stats]
    return torch.stack([x.reshape(()).to(torch.int64) for x in stats]).tolist() if stats else []


def _slot_stats(slots: Any) -> tuple[Any, Any, Any]:
    """Lowest and highest slot and the number of distinct ones, of a tensor or (host path) a numpy array.
    Sorting finds repeats without torch.unique's own host sync (its output size), so the count joins the
    step's single host read."""
    ordered = np.sort(slots) if isinstance(slots, np.ndarray) else slots.sort().values
    distinct = slots.shape[0] - (ordered[1:] == ordered[:-1]).sum()
    return ordered[0], ordered[-1], distinct


def _check_slot_stats(pool: Any, lo: int, hi: int, distinct: int, n: int) -> None:
    if lo < 0 or hi >= pool.num_blocks * pool.block_size:
        limit = pool.num_blocks * pool.block_size
        raise PositionOutOfRange(f"slots must lie in [0, {limit}), got values in [{lo}, {hi}]")
    # Two rows written to one slot would leave one token's codes beside another token's scale.
    if distinct != n:
        raise ShapeMismatch("slots must be distinct within one write")


def check_slots(pool: Any, slots: Any, num_tokens: int) -> torch.Tensor:
    """Slots of a single write, checked (shape, dtype, device, range, distinct; one host read): int64 ``[n]``."""
    s = _index(slots, "slots", 1, pool.device, num_tokens)
    if s.numel():
        host = s.device.type == "cpu"
        lo, hi, distinct = _read(list(_slot_stats(s.numpy() if host else s)), host)
        _check_slot_stats(pool, lo, hi, distinct, num_tokens)
    return s.to(torch.int64).contiguous()
