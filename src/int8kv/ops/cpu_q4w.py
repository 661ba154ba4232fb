"""CPU attention (numba) over the frozen 4-bit format ``int4_kchan64_vtok_asym_sink4_win64_v1``
(int8kv.quant4w), read in place from an :class:`~int8kv.cache.pool_q4w.Int4SinkWindowPool`.

Every query row reads the stored form of its own prefix, as its decode step would (ops.reference_q4w): a row at
position ``p`` reads ``c = max(0, (p + 1 - 64) // 64)`` sealed pages, its sequence's sinks (positions 0-3) from
their F16 sink slot and positions ``[64 c, p]`` from the F16 window pages. A work item is (query row, key
range): a decode row's visible keys cut into about two ranges per thread (``cpu_q4.decode_items``: none shorter
than 256 keys, cut at 16-key boundaries), a prefill chunk one item per query row (each row as its own decode
step: correct, no key load shared between rows); the ranges' softmax states are merged at the end, with the
sinks. One thread or all of numba's, whichever measured cheaper for calls of that size (``cpu.ThreadChoice``);
the items, and so the numerics, are the same either way.

Keys go 16 at a time, every KV head of them in turn (q scaled by the softmax scale once per item), into two
online-softmax states merged at the end of the item, one for the F16 rows and one for the sealed ones:

  sealed   per 64-position page and KV head the key scales are folded into q once (``cpu_q4_simd.fold``:
           ``q'_i = q_i s_i`` and the bias ``sum_i q_i m_i`` of each row); per 16 keys ``cpu_simd.qk16`` scores
           the packed codes against q' and, after the softmax, the weights take the values' per-position scales
           and ``sum_t p_t m_t`` joins each row's running sum (``weights16``) and ``pv16`` adds the value codes.
           Both micro-kernels read the nibbles in place (16 bytes hold the low nibbles of 16 channels and the
           high ones of 16 more), in the split order (even channels, then odd ones), so q' and this state's
           accumulator are kept in that order; a head_dim that is an odd multiple of 16 has its codes unpacked first
           (``unpack16``, the same order), a separate specialisation. Without the folded scales and the 64-key
           pages, the same steps as the older 4-bit kernel (ops/cpu_q4.py).
  F16      window rows straight from their pages (``qk16`` / ``pv16`` on float16 bits), the (at most 4) sink
           rows copied into a zeroed 16-row buffer first; channels in order.
  softmax  ``cpu_q4.softmax16``: online, the softcap, the range's bounds as masked lanes (rows of a 16-key run
           outside the range are read, never weighed: page rows and codes are always finite).

head_dim must be a multiple of 16 (the vector kernels'); another is refused by name (UnsupportedFormat). Cold
compile, one thread (the serial kernel and `_run_items`): 5.3 s of CPU; the parallel twin 4.2 s more; the
unpacking specialisation 5.0 s. Figures: docs/archive/benchmarks-2026.md, "4-bit KV".
"""

from __future__ import annotations

import math
import time
import weakref

import numba
import numpy as np
import torch
from numba import njit, types
from numba.extending import overload

from ..errors import UnsupportedFormat
from ..numba_cache import share_compiles
from ..quant4w import BLOCK as PAGE
from ..quant4w import SINKS, WINDOW
from . import cpu_simd
from .calls import Compiled, compiled_count
from .cpu import thread_choice
from .cpu_q4 import NEG, decode_items, merge_items, new_parts, prefetch_scales, run_items, softmax16, unpacked_channel
from .cpu_q4_simd import fold, unpack16, weights16, widen16
from .plan import AttentionPlan, AttentionVariant

__all__ = ["attend"]

LANES = cpu_simd.LANES
_NO_SINKS = np.zeros(0, np.float32)
# The kernels' `unpack` argument where head_dim is an odd multiple of 16 (None otherwise: 4-bit rows read in place).
_UNPACK = np.zeros(0, np.int8)


def _codes_buffer(unpack, d):  # typed by the overload below
    """Scratch for 16 unpacked rows of 4-bit codes (int8 [16 * d]), or None where they are read in place."""
    raise NotImplementedError


@overload(_codes_buffer, inline="always")
def _codes_buffer_impl(unpack, d):
    if isinstance(unpack, types.NoneType):
        return lambda unpack, d: None
    return lambda unpack, d: np.empty(LANES * d, np.int8)


def _sealed_scores(qf, kc, at, stride, half, s, soff, g, d, codes, fbuf):  # typed by the overload below
    """`qk16` of g rows of the folded query (split order) against 16 rows of 4-bit codes: the packed bytes in
    place (`codes` None: head_dim a multiple of 32), else unpacked into `codes` first (`unpack16`)."""
    raise NotImplementedError


@overload(_sealed_scores, inline="always")
def _sealed_scores_impl(qf, kc, at, stride, half, s, soff, g, d, codes, fbuf):
    # A compile-time choice: with a runtime `if head_dim % 32` around both paths the call took 1.5-1.75x the INT8
    # kernel's time (SmolLM2's shape, one thread, INT8 in the same run), 1.4x with one path compiled.
    if isinstance(codes, types.NoneType):
        return lambda qf, kc, at, stride, half, s, soff, g, d, codes, fbuf: cpu_simd.qk16(
            qf, 0, kc, at, stride, s, soff, LANES, g, d, fbuf)

    def unpacked(qf, kc, at, stride, half, s, soff, g, d, codes, fbuf):
        unpack16(kc, at, stride, half, codes)
        cpu_simd.qk16(qf, 0, codes, 0, d, s, soff, LANES, g, d, fbuf)

    return unpacked


def _sealed_values(s, soff, vc, at, stride, half, accp, aoff, g, d, codes):  # typed by the overload below
    """`pv16` of 16 rows of 4-bit value codes into the split-order accumulator, read as `_sealed_scores` reads
    the keys."""
    raise NotImplementedError


@overload(_sealed_values, inline="always")
def _sealed_values_impl(s, soff, vc, at, stride, half, accp, aoff, g, d, codes):
    if isinstance(codes, types.NoneType):
        return lambda s, soff, vc, at, stride, half, accp, aoff, g, d, codes: cpu_simd.pv16(
            s, soff, LANES, vc, at, stride, accp, aoff, g, d)

    def unpacked(s, soff, vc, at, stride, half, accp, aoff, g, d, codes):
        unpack16(vc, at, stride, half, codes)
        cpu_simd.pv16(s, soff, LANES, codes, 0, d, accp, aoff, g, d)

    return unpacked


@njit(fastmath=True, inline="always")
def _weight(m, den, top):
    """e^(m - top) for a softmax state that saw a key (den > 0), else 0."""
    return np.float32(math.exp(m - top)) if den > 0 else np.float32(0.0)


@njit(fastmath=True, inline="always")
def _run_item(it, q, heads, unpack, sm, softcap, kc, ks, km, vc, vs, vm, kw, vw, k_sink, v_sink, tables,
              window_of, sink_of, seq_of, len_of, items, part_m, part_l, part_acc):
    """Work item `it` = items[it] (query row, keys [lo, hi)): the unnormalised softmax state of every query head
    over those keys, as the row's decode step reads them -> part_m / part_l / part_acc[it]. All storage arrays
    flat (one layer, the shapes of pool_q4w's module docs). F16 rows add into `acc` (channels in order), sealed
    rows into `accp` (the split order the 4-bit rows are read in), summed at the end."""
    row, lo, hi = items[it, 0], items[it, 1], items[it, 2]
    hq, d = q.shape[1], q.shape[2]
    g = hq // heads
    half = d // 2
    n = len_of[row]
    table = tables[seq_of[row]]
    sealed = max(0, (n - WINDOW) // PAGE)
    qn = np.empty(hq * d, np.float32)  # q times the softmax scale (scores come out scaled), for F16 rows
    qp = np.empty(hq * d, np.float32)  # the same in the split order, folded into each sealed page's key scales
    for h in range(hq):
        for i in range(d):
            x = q[row, h, i] * sm
            qn[h * d + i] = x
            qp[h * d + unpacked_channel(i, half)] = x
    qf = np.empty((heads, g * d), np.float32)
    page_bias = np.zeros(hq, np.float32)
    bias = np.zeros(hq, np.float32)
    vst = np.empty(heads * LANES, np.float32)
    vmt = np.empty(heads * LANES, np.float32)
    codes = _codes_buffer(unpack, d)
    rows16 = np.zeros(LANES * d, np.int16)  # the sink rows, then zeros (finite: masked lanes weigh 0 x 0)
    fbuf = np.empty(LANES * d, np.float32)
    s = np.empty(hq * LANES, np.float32)
    # Two online-softmax states, merged at the end: the F16 rows' (channels in order) and the sealed rows' (the
    # split order, and sum_t p_t m_t of the values' minimums in macc). One state whose sealed accumulator was
    # rescaled after each run took 1.4x the INT8 kernel's time, two 1.0-1.2x (SmolLM2's shape, one thread).
    acc = np.zeros(hq * d, np.float32)
    m = np.full(hq, NEG, np.float32)
    den = np.zeros(hq, np.float32)
    no_min = np.zeros(hq, np.float32)  # the F16 state's macc: stays 0
    no_bias = np.zeros(hq, np.float32)
    accp = np.zeros(hq * d, np.float32)
    mp = np.full(hq, NEG, np.float32)
    denp = np.zeros(hq, np.float32)
    macc = np.zeros(hq, np.float32)
    row_f16 = heads * d
    sinks = min(n, SINKS)
    if lo < sinks:  # the sinks' F16 rows
        at = sink_of[table[0]] * SINKS * row_f16
        for side in range(2):
            src = k_sink if side == 0 else v_sink
            for h in range(heads):
                for t in range(sinks):
                    for i in range(d):
                        rows16[t * d + i] = src[at + t * row_f16 + h * d + i]
                if side == 0:
                    cpu_simd.qk16(qn, h * g * d, rows16, 0, d, s, h * g * LANES, LANES, g, d, fbuf)
                else:
                    cpu_simd.pv16(s, h * g * LANES, LANES, rows16, 0, d, acc, h * g * d, g, d)
            if side == 0:
                softmax16(s, min(hi, sinks), lo, softcap, m, den, no_min, no_bias, acc, d)
    first = max(lo, SINKS)  # below it, the sinks (done)
    share = LANES * half  # 16 positions' codes of one KV head, in elements (two codes a byte)
    page = -1
    p0 = first // LANES * LANES
    while p0 < hi:
        skip = max(first - p0, 0)
        count = min(hi - p0, LANES)
        j = p0 // PAGE
        off = p0 - j * PAGE
        if j < sealed:
            blk = table[j]
            ahead = j + 1 < sealed and (j + 1) * PAGE < hi
            if j != page:  # a new page: its key scales into q
                page = j
                if ahead:
                    prefetch_scales(table[j + 1], PAGE, heads, d, ks, km, vs, vm)
                for h in range(heads):
                    fold(qp, h * g * d, ks, km, (blk * heads + h) * d, qf[h], page_bias, h * g, g, d)
            base = (blk * PAGE + off) * heads
            # The same 16 positions of the next page, their codes a head's share before each head's call.
            nxt = (table[j + 1] * PAGE + off) * heads * half if ahead else -1
            for h in range(heads):
                if nxt >= 0:
                    cpu_simd.prefetch(kc, nxt + h * share, share)
                _sealed_scores(qf[h], kc, (base + h) * half, heads * half, half, s, h * g * LANES, g, d, codes, fbuf)
            for r in range(hq):  # softmax16 folds the bias into capped scores and zeroes it: a copy per run
                bias[r] = page_bias[r]
            softmax16(s, count, skip, softcap, mp, denp, macc, bias, accp, d)
            for h in range(heads):
                widen16(vs, base + h, heads, vst, h * LANES)
                widen16(vm, base + h, heads, vmt, h * LANES)
            for h in range(heads):
                weights16(s, h * g * LANES, LANES, vst, vmt, h * LANES, macc, h * g, g)
                if nxt >= 0:
                    cpu_simd.prefetch(vc, nxt + h * share, share)
                _sealed_values(s, h * g * LANES, vc, (base + h) * half, heads * half, half, accp, h * g * d, g, d,
                               codes)
        else:
            at = (window_of[table[j]] * PAGE + off) * row_f16
            for h in range(heads):
                cpu_simd.qk16(qn, h * g * d, kw, at + h * d, row_f16, s, h * g * LANES, LANES, g, d, fbuf)
            softmax16(s, count, skip, softcap, m, den, no_min, no_bias, acc, d)
            for h in range(heads):
                cpu_simd.pv16(s, h * g * LANES, LANES, vw, at + h * d, row_f16, acc, h * g * d, g, d)
        p0 += LANES
    for h in range(hq):
        top = max(m[h] if den[h] > 0 else NEG, mp[h] if denp[h] > 0 else NEG)
        wf, ws = _weight(m[h], den[h], top), _weight(mp[h], denp[h], top)
        part_m[it, h] = top
        part_l[it, h] = wf * den[h] + ws * denp[h]
        for i in range(d):
            part_acc[it, h, i] = wf * acc[h * d + i] + ws * (accp[h * d + unpacked_channel(i, half)] + macc[h])


@njit(fastmath=True, cache=True)
def _run_items(first, last, merge, q, heads, unpack, sm, softcap, sinks, kc, ks, km, vc, vs, vm, kw, vw, k_sink,
               v_sink, tables, window_of, sink_of, seq_of, len_of, items, firsts, out, part_m, part_l, part_acc):
    """Work items first..last - 1 (`_run_item`), then with `merge` the merge into `out`: the whole kernel. A
    serial call runs it from Python, a parallel one through `calls.fan_out` (merge False; `merge_parts` follows on the
    calling thread), which calls it by address: its machine code is built once (ops/calls.py)."""
    for it in range(first, last):
        _run_item(it, q, heads, unpack, sm, softcap, kc, ks, km, vc, vs, vm, kw, vw, k_sink, v_sink, tables,
                  window_of, sink_of, seq_of, len_of, items, part_m, part_l, part_acc)
    if merge:
        merge_items(part_m, part_l, part_acc, firsts, sinks, out)


_ITEMS = Compiled(_run_items)


# -- host side ----------------------------------------------------------------------------------------------
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> {layer: flat numpy views}


def _layer_arrays(pool, layer: int) -> tuple[np.ndarray, ...]:
    """Flat zero-copy numpy views of one layer (float16 as int16 bits), kept per pool."""
    views = _VIEWS.get(pool)
    if views is None:
        views = _VIEWS[pool] = {}
    arrays = views.get(layer)
    if arrays is None:
        arrays = views[layer] = tuple(
            (t.view(torch.int16) if t.dtype == torch.float16 else t).numpy().reshape(-1)
            for t in pool.layer_pages(layer))
    return arrays


def _work(plan: AttentionPlan, pool, num_q_heads: int, threads: int, variant: AttentionVariant | None) -> tuple:
    """The plan's rows (sequence and stored length of each), work items assigned to workers, each row's first
    item, the pages the rows read (sealed, F16, first pages) and the ThreadChoice of this kind of call: the same
    for every layer with the same window and chunk (kept in the plan)."""
    host = plan.host
    assert host is not None, "the cpu backend needs a plan built for a CPU pool"
    lens, starts, cu = host.context_lens, host.kv_starts, host.cu_seqlens_q
    counts = cu[1:] - cu[:-1]
    seq_of = np.repeat(np.arange(plan.batch), counts)
    len_of = (lens[seq_of] - counts[seq_of] + np.arange(cu[-1]) - cu[seq_of] + 1).astype(np.int64)
    lows = starts[seq_of]
    if variant is not None and variant.bounds_keys:
        lows = variant.key_lows(len_of - 1, lows)
    items, firsts = decode_items(np.minimum(lows, len_of), len_of, threads)
    lists = _assign(items, max(1, min(threads, items.shape[0])))
    tables = plan.block_tables.numpy()
    first_pos = lens - counts
    sealed = [tables[b, : max(0, (lens[b] - WINDOW) // PAGE)] for b in range(plan.batch)]
    f16 = [tables[b, max(0, (first_pos[b] + 1 - WINDOW) // PAGE) : (lens[b] - 1) // PAGE + 1]
           for b in range(plan.batch) if lens[b] > SINKS]
    firsts_pages = tables[lens > 0, 0]
    reads = tuple(np.concatenate([np.zeros(0, np.int64), *[a.astype(np.int64) for a in x]]) for x in (sealed, f16))
    capped = variant is not None and variant.softcap is not None
    choice = thread_choice(("q4w", plan.is_decode, num_q_heads, pool.head_dim, capped))
    units = int((len_of - np.minimum(lows, len_of)).sum()) * num_q_heads
    return (tables, seq_of, len_of, items, firsts, lists, units, choice), (*reads, firsts_pages.astype(np.int64))


def _assign(items: np.ndarray, workers: int) -> np.ndarray:
    """Worker w runs items lists[w]..lists[w + 1]: `workers` runs of about equal keys, in the items' order (each
    row's items stay one run, as merge_items reads them)."""
    if not items.shape[0]:
        return np.zeros(2, np.int64)
    ends = np.cumsum(np.maximum(items[:, 2] - items[:, 1], 0) + 1)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, workers) / workers, side="left") + 1
    return np.concatenate([[0], np.minimum(cuts, len(items)), [len(items)]]).astype(np.int64)


def attend(pool, layer: int, q: torch.Tensor, plan: AttentionPlan, variant: AttentionVariant | None = None):
    """Attention of ``q [num_queries, Hq, d]`` (float32, contiguous) over ``pool``'s layer ``layer``, each query
    as its decode step reads the pool (module docs): float32, q's shape. ``variant``: a window, chunk, softcap or
    sinks of this call. Refused (UnsupportedFormat): a head_dim not a multiple of 16, and pages the pool does
    not hold as the step reads them (``pool.check_reads``)."""
    if not cpu_simd.fits(pool.head_dim):
        raise UnsupportedFormat(f"the cpu kernel for {pool.format.name} needs a head_dim that is a multiple of "
                                f"{LANES}, got {pool.head_dim}")
    threads = numba.get_num_threads()
    bounded = variant is not None and variant.bounds_keys
    capped = variant is not None and variant.softcap is not None  # another ThreadChoice: tanh per score
    key = ("cpu-q4w", q.shape[1], threads, capped, *((variant.window, variant.chunk) if bounded else ()))
    work, reads = plan.derived(key, lambda: _work(plan, pool, q.shape[1], threads, variant))
    tables, seq_of, len_of, items, firsts, lists, units, choice = work
    checked = plan.derived("cpu-q4w-checked", dict)  # layer -> (pool, the pool's generation it was checked at)
    if checked.get(layer, (None, -1)) != (pool, pool.generation):  # check_reads is a few % of a call: once a generation
        pool.check_reads(layer, *reads)
        checked[layer] = (pool, pool.generation)
    out = np.zeros(q.shape, np.float32)
    if items.shape[0] == 0:
        return torch.from_numpy(out)
    softcap = 0.0 if variant is None or variant.softcap is None else variant.softcap
    sinks = _NO_SINKS if variant is None or variant.sinks is None else variant.sinks.numpy()
    window_of, sink_of = pool.page_books()
    parallel = choice.parallel(units, lists.shape[0] - 1)
    compiled = compiled_count(_run_items)
    start = time.perf_counter()
    unpack = None if pool.head_dim % 32 == 0 else _UNPACK
    n, hq, d = items.shape[0], q.shape[1], q.shape[2]
    parts = new_parts(n, hq, d)
    args = (q.numpy(), pool.num_kv_heads, unpack, np.float32(plan.softmax_scale), np.float32(softcap), sinks,
            *_layer_arrays(pool, layer), tables, window_of, sink_of, seq_of, len_of, items, firsts, out, *parts)
    run_items(_ITEMS, n, parallel, lists, args, firsts, sinks, out)
    if choice.timed:  # a call that compiled (or loaded) a specialisation measured that, not the kernel
        seconds = time.perf_counter() - start
        none_compiled = compiled_count(_run_items) == compiled
        choice.record(parallel, units, lists.shape[0] - 1, seconds if none_compiled else None)
    return torch.from_numpy(out)


share_compiles(globals())  # one compile per signature across processes, and a safe disk cache (int8kv.numba_cache)
