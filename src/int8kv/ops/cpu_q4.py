"""CPU decode attention (numba) reading the 4-bit format's codes directly (int8kv.quant4).

Layout of one layer (``H`` KV heads, ``d`` head_dim, blocks of ``quant4.BLOCK`` = 16 positions): sealed blocks
in a pool, ``k_codes``/``v_codes`` uint8 ``[num_blocks, 16, H, d / 2]``, the keys' channel scales / minimums
float16 ``[num_blocks, H, d]``, the values' per-position scales / minimums float16 ``[num_blocks, 16, H]``;
each sequence's open block as F16 rows ``[batch, 16, H, d]``; ``block_tables`` int32 ``[batch, max_blocks]``
naming the sealed blocks of each sequence in position order; ``context_lens`` int32 ``[batch]``.

A work item is (sequence, key range): the sequence's visible keys cut at block boundaries into about two ranges
per thread (none shorter than MIN_SPLIT_KEYS), every KV head of a block read in turn, so a block's bytes are read
in memory order by one thread; the ranges' softmax states are merged at the end (flash-decoding). Per sealed
block and KV head (the vector kernels of `cpu_q4_simd` and `cpu_simd`):

    scores   the key scales folded into the query once (``q_i s_i``, the bias ``sum_i q_i m_i``), the codes'
             nibbles unpacked into int8 rows, then `qk16` (16 keys, every query head of the GQA group);
    softmax  online, per block: scale, softcap, the range's first key, `expsum16`;
    values   the weights times the values' scales and ``sum_t p_t m_t`` per row (`weights16`), the nibbles
             unpacked, then `pv16`.

Unpacking puts a row's even channels first (low nibbles), then its odd ones; the folded query and the value
accumulator use that order, which is undone once per item. The next block is prefetched while one is computed.
A head_dim the vector kernels do not take (not a multiple of 16) runs the same steps as plain loops, and the
open block's F16 rows (at most 15 per sequence) always do, their float16 values read through a 65,536-entry
float32 table.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from ..quant4 import BLOCK
from . import cpu_simd
from .cpu_q4_simd import expsum16, fold, unpack16, weights16
from .plan import AttentionVariant

__all__ = ["F16_TABLE", "MIN_SPLIT_KEYS", "decode_attention", "decode_items"]

assert BLOCK == cpu_simd.LANES  # a sealed block is one call of the 16-key kernels

F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
NEG = np.float32(-1e30)
MIN_SPLIT_KEYS = 256  # shortest key range worth its own work item


@njit(fastmath=True, inline="always")
def _channel(i, half):
    """Where channel i sits in the unpacked order (even channels, then odd ones)."""
    return i // 2 + (i % 2) * half


@njit(fastmath=True, inline="always")
def _block_scores(qflat, qoff, kc, ks, km, blk, h, rows, qf, bias, sflat, soff, kbuf, fbuf, f16):
    """Raw scores (q . k, the bias included) of `rows` query rows (q at qflat[qoff], rows contiguous) against the
    16 keys of sealed block `blk`, KV head h -> sflat[soff + r*16 + t]. qf (float32 [rows*d]), bias, kbuf (int8
    [16*d]), fbuf (float32 [16*d]): scratch."""
    heads, half = kc.shape[2], kc.shape[3]
    d = 2 * half
    kflat = kc.reshape(-1)
    if cpu_simd.fits(d):
        fold(qflat, qoff, ks.reshape(-1), km.reshape(-1), (blk * heads + h) * d, qf, 0, bias, 0, rows, d)
        unpack16(kflat, (blk * BLOCK * heads + h) * half, heads * half, half, kbuf)
        cpu_simd.qk16(qf, 0, kbuf, 0, d, sflat, soff, BLOCK, rows, d, fbuf)
        for r in range(rows):
            b = bias[r]
            for t in range(BLOCK):
                sflat[soff + r * BLOCK + t] += b
        return
    for r in range(rows):
        b = np.float32(0.0)
        for i in range(d):
            qi = qflat[qoff + r * d + i]
            qf[r * d + _channel(i, half)] = qi * f16[ks[blk, h, i] & 0xFFFF]  # int16 bits -> table index
            b += qi * f16[km[blk, h, i] & 0xFFFF]
        for t in range(BLOCK):
            x = b
            for j in range(half):
                byte = kc[blk, t, h, j]
                x += qf[r * d + j] * np.float32(byte & 15) + qf[r * d + half + j] * np.float32(byte >> 4)
            sflat[soff + r * BLOCK + t] = x


@njit(fastmath=True, inline="always")
def _block_values(vc, vs, vm, blk, h, rows, sflat, soff, accflat, aoff, macc, kbuf):
    """acc (unpacked order, rows at accflat[aoff], d apart) += sum_t p_t s_t c_t and macc[r] += sum_t p_t m_t
    over the 16 values of sealed block `blk`, KV head h; p at sflat[soff + r*16 + t] (scaled in place)."""
    heads, half = vc.shape[2], vc.shape[3]
    d = 2 * half
    weights16(sflat, soff, BLOCK, vs.reshape(-1), vm.reshape(-1), blk * BLOCK * heads + h, heads, macc, 0, rows)
    if cpu_simd.fits(d):
        unpack16(vc.reshape(-1), (blk * BLOCK * heads + h) * half, heads * half, half, kbuf)
        cpu_simd.pv16(sflat, soff, BLOCK, kbuf, 0, d, accflat, aoff, rows, d)
        return
    for r in range(rows):
        for t in range(BLOCK):
            p = sflat[soff + r * BLOCK + t]
            for j in range(half):
                byte = vc[blk, t, h, j]
                accflat[aoff + r * d + j] += p * np.float32(byte & 15)
                accflat[aoff + r * d + half + j] += p * np.float32(byte >> 4)


@njit(fastmath=True, inline="always")
def _open_scores(qflat, qoff, ko, b, h, n_rows, rows, sflat, soff, f16):
    """Scores of `rows` query rows against the open block's first n_rows F16 keys (KV head h)."""
    d = ko.shape[3]
    for r in range(rows):
        for t in range(n_rows):
            x = np.float32(0.0)
            for i in range(d):
                x += qflat[qoff + r * d + i] * f16[ko[b, t, h, i]]
            sflat[soff + r * BLOCK + t] = x
        for t in range(n_rows, BLOCK):
            sflat[soff + r * BLOCK + t] = np.float32(0.0)


@njit(fastmath=True, inline="always")
def _open_values(vo, b, h, n_rows, rows, sflat, soff, accflat, aoff, f16):
    d = vo.shape[3]
    half = d // 2
    for r in range(rows):
        for t in range(n_rows):
            p = sflat[soff + r * BLOCK + t]
            for i in range(d):
                accflat[aoff + r * d + _channel(i, half)] += p * f16[vo[b, t, h, i]]


@njit(fastmath=True, inline="always")
def _online(sflat, soff, n_rows, skip, sm, softcap, m, den, macc, accflat, aoff, r, d):
    """Fold the raw scores sflat[soff : soff + n_rows] of row r into its running (max m, sum den, acc, macc);
    the first `skip` keys are hidden. The scores become the weights (0 for hidden keys and for t >= n_rows)."""
    top = NEG
    for t in range(BLOCK):
        x = sflat[soff + t] * sm
        if softcap > 0:
            x = softcap * math.tanh(x / softcap)
        if t < skip or t >= n_rows:
            x = NEG
        sflat[soff + t] = x
        top = max(top, x)
    if top <= NEG:  # nothing visible in this block for this row: it weighs nothing
        for t in range(BLOCK):
            sflat[soff + t] = np.float32(0.0)
        return
    if top > m[r]:
        corr = np.float32(math.exp(m[r] - top))
        den[r] *= corr
        macc[r] *= corr
        for i in range(d):
            accflat[aoff + i] *= corr
        m[r] = top
    den[r] += expsum16(sflat, soff, m[r])


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
    qflat = q.reshape(-1)
    qf = np.empty(g * d, np.float32)
    bias = np.empty(g, np.float32)
    kbuf = np.empty(BLOCK * d, np.int8)
    fbuf = np.empty(BLOCK * d, np.float32)
    s = np.empty(hq * BLOCK, np.float32)
    acc = np.zeros(hq * d, np.float32)
    macc = np.zeros(hq, np.float32)
    m = np.full(hq, NEG, np.float32)
    den = np.zeros(hq, np.float32)
    kflat, vflat = kc.reshape(-1), vc.reshape(-1)
    block_bytes = BLOCK * heads * half
    last = (hi - 1) // BLOCK
    for j in range(lo // BLOCK, last + 1):
        base = j * BLOCK
        skip = max(lo - base, 0)
        if j < sealed:
            blk = tables[b, j]
            if j + 1 < sealed and j < last:
                nxt = tables[b, j + 1]
                cpu_simd.prefetch(kflat, nxt * block_bytes, block_bytes)
                cpu_simd.prefetch(vflat, nxt * block_bytes, block_bytes)
            for h in range(heads):
                row = h * g
                _block_scores(qflat, (b * hq + row) * d, kc, ks, km, blk, h, g, qf, bias, s, row * BLOCK, kbuf,
                              fbuf, f16)
                for r in range(g):
                    _online(s, (row + r) * BLOCK, BLOCK, skip, sm, softcap, m[row:], den[row:], macc[row:], acc,
                            (row + r) * d, r, d)
                _block_values(vc, vs, vm, blk, h, g, s, row * BLOCK, acc, row * d, macc[row:], kbuf)
        else:
            n_rows = n - base
            for h in range(heads):
                row = h * g
                _open_scores(qflat, (b * hq + row) * d, ko, b, h, n_rows, g, s, row * BLOCK, f16)
                for r in range(g):
                    _online(s, (row + r) * BLOCK, n_rows, skip, sm, softcap, m[row:], den[row:], macc[row:], acc,
                            (row + r) * d, r, d)
                _open_values(vo, b, h, n_rows, g, s, row * BLOCK, acc, row * d, f16)
    for h in range(hq):
        part_m[it, h] = m[h]
        part_l[it, h] = den[h]
        for i in range(d):
            part_acc[it, h, i] = acc[h * d + _channel(i, half)] + macc[h]


@njit(fastmath=True, inline="always")
def _merge(part_m, part_l, part_acc, firsts, sinks, out):
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
            if total <= 0:
                continue
            if sinks.shape[0] > 0:
                z = sinks[h]
                if z > top:  # relative to the larger of the two, so neither exponential overflows
                    f = np.float32(math.exp(top - z))
                    inv = f / (total * f + np.float32(1.0))
                else:
                    inv = np.float32(1.0) / (total + np.float32(math.exp(z - top)))
            else:
                inv = np.float32(1.0) / total
            for i in range(d):
                o[i] *= inv


@njit(parallel=True, fastmath=True, cache=True)
def _decode(q, kc, ks, km, vc, vs, vm, ko, vo, tables, lens, items, firsts, sm, softcap, sinks, f16, out):
    """Every work item (static split of the items over the threads: they are about equal by construction),
    then the merge on the calling thread."""
    n_items, hq, d = items.shape[0], q.shape[1], q.shape[2]
    part_m = np.empty((n_items, hq), np.float32)
    part_l = np.empty((n_items, hq), np.float32)
    part_acc = np.empty((n_items, hq, d), np.float32)
    for it in prange(n_items):
        _run_item(it, q, kc, ks, km, vc, vs, vm, ko, vo, tables, lens, items, sm, softcap, f16, part_m, part_l,
                  part_acc)
    _merge(part_m, part_l, part_acc, firsts, sinks, out)


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
    items, firsts = decode_items(np.minimum(lows, lens), lens, numba.get_num_threads())
    softcap = 0.0 if variant is None or variant.softcap is None else variant.softcap
    sinks = np.zeros(0, np.float32) if variant is None or variant.sinks is None else variant.sinks.numpy()
    out = np.zeros(q.shape, np.float32)
    _decode(
        np.ascontiguousarray(q, np.float32), k_codes, k_scale.view(np.int16), k_min.view(np.int16), v_codes,
        v_scale.view(np.int16), v_min.view(np.int16), k_open.view(np.uint16), v_open.view(np.uint16),
        block_tables, context_lens, items, firsts, np.float32(1 / math.sqrt(d) if softmax_scale is None else
        softmax_scale), np.float32(softcap), sinks.astype(np.float32), F16_TABLE, out,
    )  # fmt: skip
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
