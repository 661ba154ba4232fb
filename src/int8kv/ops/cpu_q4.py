"""CPU decode attention (numba) reading the 4-bit format's codes directly (int8kv.quant4).

Layout of one layer (``H`` KV heads, ``d`` head_dim, blocks of ``quant4.BLOCK`` = 16 positions): sealed blocks
in a pool, ``k_codes``/``v_codes`` uint8 ``[num_blocks, 16, H, d / 2]``, the keys' channel scales / minimums
float16 ``[num_blocks, H, d]``, the values' per-position scales / minimums float16 ``[num_blocks, 16, H]``;
each sequence's open block as F16 rows ``[batch, 16, H, d]``; ``block_tables`` int32 ``[batch, max_blocks]``
naming the sealed blocks of each sequence in position order; ``context_lens`` int32 ``[batch]``.

A work item is (sequence, key range): the sequence's visible keys cut at block boundaries into about two ranges
per thread (none shorter than MIN_SPLIT_KEYS), every KV head of a block read in turn, so a block's bytes are read
in memory order by one thread; the ranges' softmax states are merged at the end (flash-decoding). A call runs on
one thread or all of numba's, whichever measured cheaper for calls of its size (`cpu.ThreadChoice`); the items,
and so the numerics, are the same either way. Per sealed block (the vector kernels of `cpu_q4_simd` and
`cpu_simd`; the softmax scale is folded into q once per item):

    scores   per KV head: the key scales folded into the query (``q_i s_i``, and the bias ``sum_i q_i m_i``),
             the nibbles unpacked into int8 rows, then `qk16` (16 keys, every query head of the GQA group);
    softmax  online, every row of the block in one pass (softcap, the range's first key, `max16`, `expsum16`;
             the bias joins the maximum and the shift, not each score);
    values   per KV head: the weights times the values' scales and ``sum_t p_t m_t`` per row (`widen16`,
             `weights16`), the nibbles unpacked, then `pv16`.

Unpacking puts a row's even channels first (low nibbles), then its odd ones; q and the value accumulator are
kept in that order, which is undone once per item. While a block is computed, the next block's scales are
prefetched when it is entered and its codes a head's share before each head's call (`prefetch_scales`). A
head_dim the vector kernels do not take (not a multiple of 16) runs the same steps as plain loops, and the open
block's F16 rows (at most 15 per sequence) always do, their float16 values read through a 65,536-entry float32
table. Figures: docs/archive/benchmarks-2026.md, "4-bit KV".
"""

from __future__ import annotations

import math
import time

import numba
import numpy as np
from numba import njit

from ..numba_cache import share_compiles
from ..numba_threads import launch
from ..quant4 import BLOCK
from . import cpu_simd
from .calls import INDEX, Compiled, compiled_count, fan_out
from .cpu import normaliser, thread_choice
from .cpu_q4_simd import expsum16, fold, max16, unpack16, weights16, widen16
from .plan import AttentionVariant

__all__ = [
    "F16_TABLE", "MIN_SPLIT_KEYS", "decode_attention", "decode_items", "merge_items", "merge_parts", "new_parts",
    "prefetch_scales", "run_items", "softmax16", "unpacked_channel",
]

assert BLOCK == cpu_simd.LANES  # a sealed block is one call of the 16-key kernels

F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
NEG = np.float32(cpu_simd.NEG)  # the kernels' finite "minus infinity", defined once in cpu_simd
MIN_SPLIT_KEYS = 256  # shortest key range worth its own work item: the INT8 kernel's value, not measured here


@njit(fastmath=True, inline="always")
def unpacked_channel(i, half):
    """Where channel i sits in the unpacked order (even channels, then odd ones)."""
    return i // 2 + (i % 2) * half


@njit(fastmath=True, inline="always")
def _block_scores(qp, kc, ks, km, flat, blk, h, rows, row0, ksp, kmp, qf, bias, sflat, kbuf, fbuf, f16):
    """Raw scores q'.c (without the bias) of query rows row0..row0+rows (qp: q in the unpacked order, rows d
    apart) against the 16 keys of sealed block `blk`, KV head h -> sflat[(row0 + r)*16 + t], and each row's
    bias sum_i q_i m_i -> bias[row0 + r]. flat: kc, ks, km as flat views (made once per item). ksp, kmp
    (float32 [d]), qf (float32 [rows*d]), kbuf (int8 [16*d]), fbuf (float32 [16*d]): scratch."""
    heads, half = kc.shape[2], kc.shape[3]
    d = 2 * half
    vector = cpu_simd.fits(d)
    if vector:
        fold(qp, row0 * d, flat[1], flat[2], (blk * heads + h) * d, qf, bias, row0, rows, d)
    else:
        for i in range(d):
            ksp[unpacked_channel(i, half)] = f16[ks[blk, h, i] & 0xFFFF]  # int16 bits -> table index
            kmp[unpacked_channel(i, half)] = f16[km[blk, h, i] & 0xFFFF]
        for r in range(rows):
            b = np.float32(0.0)
            for i in range(d):
                x = qp[(row0 + r) * d + i]
                qf[r * d + i] = x * ksp[i]
                b += x * kmp[i]
            bias[row0 + r] = b
    if vector:
        unpack16(flat[0], (blk * BLOCK * heads + h) * half, heads * half, half, kbuf)
        cpu_simd.qk16(qf, 0, kbuf, 0, d, sflat, row0 * BLOCK, BLOCK, rows, d, fbuf)
        return
    for r in range(rows):
        for t in range(BLOCK):
            x = np.float32(0.0)
            for j in range(half):
                byte = kc[blk, t, h, j]
                x += qf[r * d + j] * np.float32(byte & 15) + qf[r * d + half + j] * np.float32(byte >> 4)
            sflat[(row0 + r) * BLOCK + t] = x


@njit(fastmath=True, inline="always")
def _block_values(vc, vflat, blk, h, rows, row0, vst, vmt, sflat, acc, macc, kbuf):
    """acc (unpacked order, rows d apart) += sum_t p_t s_t c_t and macc[row] += sum_t p_t m_t for query rows
    row0..row0+rows over the 16 values of sealed block `blk`, KV head h; p at sflat[row*16 + t] (scaled in
    place); vst, vmt: the block's value scales and minimums as float32 [heads, 16]; vflat: vc, flat."""
    heads, half = vc.shape[2], vc.shape[3]
    d = 2 * half
    weights16(sflat, row0 * BLOCK, BLOCK, vst, vmt, h * BLOCK, macc, row0, rows)
    if cpu_simd.fits(d):
        unpack16(vflat, (blk * BLOCK * heads + h) * half, heads * half, half, kbuf)
        cpu_simd.pv16(sflat, row0 * BLOCK, BLOCK, kbuf, 0, d, acc, row0 * d, rows, d)
        return
    for r in range(rows):
        for t in range(BLOCK):
            p = sflat[(row0 + r) * BLOCK + t]
            for j in range(half):
                byte = vc[blk, t, h, j]
                acc[(row0 + r) * d + j] += p * np.float32(byte & 15)
                acc[(row0 + r) * d + half + j] += p * np.float32(byte >> 4)


@njit(fastmath=True, inline="always")
def _open_block(qp, ko, vo, b, n_rows, skip, softcap, m, den, macc, bias, sflat, acc, f16):
    """The open block's first n_rows F16 rows (at most 15), every head: plain loops."""
    heads, d = ko.shape[2], ko.shape[3]
    half = d // 2
    g = m.shape[0] // heads
    for row in range(m.shape[0]):
        h = row // g
        bias[row] = 0.0
        for t in range(BLOCK):
            x = np.float32(0.0)
            if t < n_rows:
                for i in range(d):
                    x += qp[row * d + unpacked_channel(i, half)] * f16[ko[b, t, h, i]]
            sflat[row * BLOCK + t] = x
    softmax16(sflat, n_rows, skip, softcap, m, den, macc, bias, acc, d)
    for row in range(m.shape[0]):
        h = row // g
        for t in range(n_rows):
            p = sflat[row * BLOCK + t]
            for i in range(d):
                acc[row * d + unpacked_channel(i, half)] += p * f16[vo[b, t, h, i]]


@njit(fastmath=True, inline="always")
def softmax16(sflat, n_rows, skip, softcap, m, den, macc, bias, acc, d):
    """Fold one block's raw scores (16 per row: row r's at sflat[r*16], its score sflat[r*16 + t] + bias[r], the
    softmax scale already in them) into every row's running (max m, sum den, acc, macc); keys t < skip and
    t >= n_rows are hidden. The scores become the weights (0 for hidden keys). Every row in one pass, so that
    their dependency chains (max, then the exponentials) overlap, which row by row, interleaved with the dot
    products, they did not."""
    for r in range(m.shape[0]):
        at = r * BLOCK
        x = sflat[at : at + BLOCK]
        if softcap > 0:  # the bias goes in before the cap
            for t in range(BLOCK):
                x[t] = softcap * math.tanh((x[t] + bias[r]) / softcap)
            bias[r] = 0.0
        for t in range(skip):
            x[t] = NEG
        for t in range(n_rows, BLOCK):
            x[t] = NEG
        top = max16(sflat, at) + bias[r]
        if top > m[r]:
            corr = np.float32(math.exp(m[r] - top))
            den[r] *= corr
            macc[r] *= corr
            a = acc[r * d : (r + 1) * d]
            for i in range(d):
                a[i] *= corr
            m[r] = top
        # Hidden keys weigh exactly 0 (expsum16: below e^-87), also while no key has been seen (shift 0). An
        # early return for a block with nothing visible made this step about twice as slow (a branch per row).
        shift = m[r] - bias[r] if m[r] > NEG else np.float32(0.0)
        den[r] += expsum16(sflat, at, shift)


@njit(fastmath=True, inline="always")
def prefetch_scales(blk, positions, heads, d, k_scale, k_min, v_scale, v_min):
    """Prefetch the keys' channel scales and minimums and the values' per-position ones of sealed block `blk` of
    `positions` positions (flat arrays). Its codes are asked for a head's share at a time by the kernels, before
    each head's vector call: all of a block's lines at once left the INT8 kernel waiting on memory in the engine
    (ops/cpu.py, `_enter_run`)."""
    cpu_simd.prefetch(k_scale, blk * heads * d, heads * d)
    cpu_simd.prefetch(k_min, blk * heads * d, heads * d)
    cpu_simd.prefetch(v_scale, blk * positions * heads, positions * heads)
    cpu_simd.prefetch(v_min, blk * positions * heads, positions * heads)


@njit(fastmath=True, inline="always")
def _run_item(it, q, kc, ks, km, vc, vs, vm, ko, vo, tables, lens, items, sm, softcap, f16, part_m, part_l,
              part_acc):
    """Work item `it` = items[it] (sequence b, keys [lo, hi)): the unnormalised softmax state of every query head
    over those keys -> part_m / part_l / part_acc[it] (channel order)."""
    b, lo, hi = items[it, 0], items[it, 1], items[it, 2]
    hq, d = q.shape[1], q.shape[2]
    heads = kc.shape[2]
    g = hq // heads
    half = d // 2
    n = lens[b]
    sealed = n // BLOCK
    qp = np.empty(hq * d, np.float32)  # q times the softmax scale, in the unpacked order: scores come out scaled
    for h in range(hq):
        for i in range(d):
            qp[h * d + unpacked_channel(i, half)] = q[b, h, i] * sm
    ksp = np.empty(d, np.float32)
    kmp = np.empty(d, np.float32)
    vst = np.empty(heads * BLOCK, np.float32)
    vmt = np.empty(heads * BLOCK, np.float32)
    qf = np.empty(g * d, np.float32)
    bias = np.empty(hq, np.float32)
    kbuf = np.empty(BLOCK * d, np.int8)
    fbuf = np.empty(BLOCK * d, np.float32)
    s = np.empty(hq * BLOCK, np.float32)
    acc = np.zeros(hq * d, np.float32)
    macc = np.zeros(hq, np.float32)
    m = np.full(hq, NEG, np.float32)
    den = np.zeros(hq, np.float32)
    kflat, vflat = kc.reshape(-1), vc.reshape(-1)
    ksb, kmb, vsb, vmb = ks.reshape(-1), km.reshape(-1), vs.reshape(-1), vm.reshape(-1)
    last = (hi - 1) // BLOCK
    share = BLOCK * half  # a block's codes of one KV head, in elements (two codes a byte)
    for j in range(lo // BLOCK, last + 1):
        skip = max(lo - j * BLOCK, 0)
        if j >= sealed:
            _open_block(qp, ko, vo, b, n - j * BLOCK, skip, softcap, m, den, macc, bias, s, acc, f16)
            continue
        blk = tables[b, j]
        nxt = -1  # the next block's codes start, prefetched a head's share before each head's call
        if j + 1 < sealed and j < last:
            nxt = tables[b, j + 1] * share * heads
            prefetch_scales(tables[b, j + 1], BLOCK, heads, d, ksb, kmb, vsb, vmb)
        for h in range(heads):
            if nxt >= 0:
                cpu_simd.prefetch(kflat, nxt + h * share, share)
            _block_scores(qp, kc, ks, km, (kflat, ksb, kmb), blk, h, g, h * g, ksp, kmp, qf, bias, s, kbuf, fbuf, f16)
        softmax16(s, BLOCK, skip, softcap, m, den, macc, bias, acc, d)
        for h in range(heads):  # the block's value scales and minimums, [heads, 16]
            widen16(vsb, blk * BLOCK * heads + h, heads, vst, h * BLOCK)
            widen16(vmb, blk * BLOCK * heads + h, heads, vmt, h * BLOCK)
        for h in range(heads):
            if nxt >= 0:
                cpu_simd.prefetch(vflat, nxt + h * share, share)
            _block_values(vc, vflat, blk, h, g, h * g, vst, vmt, s, acc, macc, kbuf)
    for h in range(hq):
        part_m[it, h] = m[h]
        part_l[it, h] = den[h]
        for i in range(d):
            part_acc[it, h, i] = acc[h * d + unpacked_channel(i, half)] + macc[h]


@njit(fastmath=True, inline="always")
def merge_items(part_m, part_l, part_acc, firsts, sinks, out):
    """out[b, h] = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink_h - M)) over the items
    firsts[b]..firsts[b + 1] of sequence b; zeros for a head that saw no key."""
    batch, hq, d = out.shape
    for b in range(batch):
        for h in range(hq):
            top = NEG
            for it in range(firsts[b], firsts[b + 1]):
                if part_l[it, h] > 0:
                    top = max(top, part_m[it, h])
            total = np.float32(0.0)
            o = out[b, h]
            for i in range(d):
                o[i] = 0.0
            for it in range(firsts[b], firsts[b + 1]):
                if part_l[it, h] > 0:
                    w = np.float32(math.exp(part_m[it, h] - top))
                    total += w * part_l[it, h]
                    a = part_acc[it, h]
                    for i in range(d):
                        o[i] += w * a[i]
            inv = normaliser(total, top, sinks, h)  # 0 for a head that saw no key
            for i in range(d):
                o[i] *= inv


@njit(fastmath=True, cache=True)
def merge_parts(part_m, part_l, part_acc, firsts, sinks, out):
    """`merge_items` as its own call: the merge after a parallel run (here and in ops/cpu_q4w.py)."""
    merge_items(part_m, part_l, part_acc, firsts, sinks, out)


@njit(fastmath=True, cache=True)
def _run_items(first, last, merge, q, kc, ks, km, vc, vs, vm, ko, vo, tables, lens, items, firsts, sm, softcap,
               sinks, f16, out, part_m, part_l, part_acc):
    """Work items first..last - 1, then with `merge` the merge into `out`: the whole kernel. A serial call runs it
    from Python, a parallel one through `calls.fan_out` (merge False; `merge_parts` follows on the calling
    thread), which calls it by address, so its machine code is built once (ops/calls.py)."""
    for it in range(first, last):
        _run_item(it, q, kc, ks, km, vc, vs, vm, ko, vo, tables, lens, items, sm, softcap, f16, part_m, part_l,
                  part_acc)
    if merge:
        merge_items(part_m, part_l, part_acc, firsts, sinks, out)


_ITEMS = Compiled(_run_items)


def new_parts(n: int, hq: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The part_* buffers of `_run_items`: each of the ``n`` items' unnormalised state (max, sum, output) per
    query head, for the merge."""
    return np.empty((n, hq), np.float32), np.empty((n, hq), np.float32), np.empty((n, hq, d), np.float32)


def run_items(items: Compiled, n: int, parallel: bool, lists: np.ndarray | None, args: tuple, firsts: np.ndarray,
              sinks: np.ndarray, out: np.ndarray) -> None:
    """A 4-bit kernel's ``_run_items(first, last, merge, *args)`` over its ``n`` items (``args`` ending in ``out``
    and the three part_* buffers): on the calling thread, merge included; or, ``parallel``, worker w on items
    lists[w]..lists[w + 1] through `calls.fan_out`, then `merge_parts` on the calling thread. Here and in
    ops/cpu_q4w.py."""
    if parallel:
        launch(fan_out, *items.address((INDEX, INDEX, False, *args)), lists, (False, *args), 0, 0, ())
        merge_parts(*args[-3:], firsts, sinks, out)
    else:
        items.dispatcher(0, n, True, *args)


def decode_items(lows: np.ndarray, lens: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """Work items ``[n, 3]`` int64 (sequence, first key, end) and each sequence's first item ``[batch + 1]``:
    sequence b's keys [lows[b], lens[b]) in about ``2 * threads / batch`` ranges (at least MIN_SPLIT_KEYS keys
    each, one for a shorter span), cut at block boundaries; none for a sequence that sees no key."""
    batch = len(lens)
    span = np.maximum(lens - lows, 0)
    want = -(-2 * threads // max(batch, 1))
    splits = np.clip(np.minimum(want, span // MIN_SPLIT_KEYS), 1, None)
    chunk = -(-span // splits)
    rows = []
    for b in range(batch):
        if span[b] == 0:
            continue
        cuts = [int(lows[b])]
        for k in range(1, int(splits[b])):
            cut = -(-(int(lows[b]) + k * int(chunk[b])) // BLOCK) * BLOCK  # up to a block boundary
            if cuts[-1] < cut < lens[b]:
                cuts.append(cut)
        cuts.append(int(lens[b]))
        rows += [(b, a, z) for a, z in zip(cuts[:-1], cuts[1:], strict=False)]
    items = np.array(rows, np.int64).reshape(-1, 3)
    firsts = np.searchsorted(items[:, 0], np.arange(batch + 1)).astype(np.int64)
    return items, firsts


def decode_attention(
    q: np.ndarray, k_codes: np.ndarray, k_scale: np.ndarray, k_min: np.ndarray, v_codes: np.ndarray,
    v_scale: np.ndarray, v_min: np.ndarray, k_open: np.ndarray, v_open: np.ndarray, block_tables: np.ndarray,
    context_lens: np.ndarray, kv_starts: np.ndarray | None = None, softmax_scale: float | None = None,
    variant: AttentionVariant | None = None,
) -> np.ndarray:  # fmt: skip
    """One query token per sequence (``q [batch, Hq, d]`` float32, at position ``context_len - 1``) over the
    layout above -> float32 ``[batch, Hq, d]``; ``variant``: a window, chunk, softcap or sinks. The caller has
    checked the layout (shapes, block ids, lengths); this runs the kernel. A query that sees no key yields
    zeros, and no key below the first query's lowest visible one is read."""
    batch, _, d = q.shape
    lens = context_lens.astype(np.int64)
    starts = np.zeros(batch, np.int64) if kv_starts is None else kv_starts.astype(np.int64)
    lows = starts if variant is None else variant.key_lows(lens - 1, starts)
    threads = numba.get_num_threads()
    items, firsts = decode_items(np.minimum(lows, lens), lens, threads)
    softcap = 0.0 if variant is None or variant.softcap is None else variant.softcap
    sinks = np.zeros(0, np.float32) if variant is None or variant.sinks is None else variant.sinks.numpy()
    out = np.zeros(q.shape, np.float32)
    # One thread or all, whichever has measured cheaper for calls of this size (cpu.ThreadChoice: on a loaded
    # machine waking a second thread can cost more than the call); the items, so the numerics, are the same.
    choice = thread_choice(("q4-decode", q.shape[1], d, variant is not None and variant.softcap is not None))
    work = int((lens - np.minimum(lows, lens)).sum()) * q.shape[1]
    parallel = choice.parallel(work, threads)
    compiled = compiled_count(_run_items)
    start = time.perf_counter()
    n, hq = items.shape[0], q.shape[1]
    sinks = sinks.astype(np.float32)
    parts = new_parts(n, hq, d)
    args = (
        np.ascontiguousarray(q, np.float32), k_codes, k_scale.view(np.int16), k_min.view(np.int16), v_codes,
        v_scale.view(np.int16), v_min.view(np.int16), k_open.view(np.uint16), v_open.view(np.uint16),
        block_tables, context_lens, items, firsts, np.float32(1 / math.sqrt(d) if softmax_scale is None else
        softmax_scale), np.float32(softcap), sinks, F16_TABLE, out, *parts,
    )  # fmt: skip
    lists = None
    if parallel:  # the items are about equal by construction: an equal count per thread
        workers = max(1, min(threads, n))
        lists = (np.arange(workers + 1, dtype=np.int64) * n) // workers
    run_items(_ITEMS, n, parallel, lists, args, firsts, sinks, out)
    if choice.timed:  # a call that compiled a specialisation measured that, not the kernel
        seconds = time.perf_counter() - start
        none_compiled = compiled_count(_run_items) == compiled
        choice.record(parallel, work, threads, seconds if none_compiled else None)
    return out


def layout_from_rows(seqs: list, order: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The kernel's layout of a batch of :class:`~int8kv.quant4.Q4Rows` (one per sequence, one layer): the
    keyword arguments of :func:`decode_attention` but ``q``. ``order``: a permutation of the sealed blocks'
    pool slots (a pool after many allocations and frees); default in order."""
    heads, d = seqs[0].k_open.shape[1:]
    counts = [s.k_codes.shape[0] for s in seqs]
    total = sum(counts)
    slot = np.arange(total) if order is None else np.asarray(order)
    tables = np.zeros((len(seqs), max(1, max(counts))), np.int32)
    pool = {
        "k_codes": np.zeros((total, BLOCK, heads, d // 2), np.uint8),
        "k_scale": np.zeros((total, heads, d), np.float16), "k_min": np.zeros((total, heads, d), np.float16),
        "v_codes": np.zeros((total, BLOCK, heads, d // 2), np.uint8),
        "v_scale": np.zeros((total, BLOCK, heads), np.float16), "v_min": np.zeros((total, BLOCK, heads), np.float16),
    }  # fmt: skip
    k_open = np.zeros((len(seqs), BLOCK, heads, d), np.float16)
    v_open = np.zeros((len(seqs), BLOCK, heads, d), np.float16)
    at = 0
    for b, s in enumerate(seqs):
        ids = slot[at : at + counts[b]]
        tables[b, : counts[b]] = ids
        for name in pool:
            pool[name][ids] = getattr(s, name)
        k_open[b, : s.k_open.shape[0]] = s.k_open
        v_open[b, : s.v_open.shape[0]] = s.v_open
        at += counts[b]
    lens = np.array([len(s) for s in seqs], np.int32)
    return {**pool, "k_open": k_open, "v_open": v_open, "block_tables": tables, "context_lens": lens}


share_compiles(globals())  # one compile per signature across processes, and a safe disk cache (int8kv.numba_cache)
