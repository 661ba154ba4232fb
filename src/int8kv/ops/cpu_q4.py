"""CPU decode attention (numba) reading the 4-bit format's codes directly (int8kv.quant4).

Layout of one layer (``H`` KV heads, ``d`` head_dim, blocks of ``quant4.BLOCK`` = 16 positions): sealed blocks
in a pool, ``k_codes``/``v_codes`` uint8 ``[num_blocks, 16, H, d / 2]``, the keys' channel scales / minimums
float16 ``[num_blocks, H, d]``, the values' per-position scales / minimums float16 ``[num_blocks, 16, H]``;
each sequence's open block as F16 rows ``[batch, 16, H, d]``; ``block_tables`` int32 ``[batch, max_blocks]``
naming the sealed blocks of each sequence in position order; ``context_lens`` int32 ``[batch]``.

One work item is (sequence, KV head): every query head of the GQA group is served by each byte read. Per sealed
block the key scales are folded into the query once (``q_i s_i``, ``sum_i q_i m_i``), so a score is a dot
product of the folded query with the block's nibbles, unpacked in registers; the values' scale joins the
weight (``p_t s_t``) and their minimum one sum per block (``sum_t p_t m_t``). The softmax is online, per block.
float16 scales are read through a 65,536-entry float32 table (256 KiB, stays in L2) instead of a converted copy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..quant4 import BLOCK

__all__ = ["F16_TABLE", "decode_attention"]

F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
NEG = np.float32(-1e30)


@njit(parallel=True, fastmath=True)
def _decode(q, kc, ks, km, vc, vs, vm, ko, vo, tables, lens, starts, scale, window, softcap, sinks, f16, out):
    batch, hq, d = q.shape
    heads = kc.shape[2]
    group = hq // heads
    half = d // 2
    for w in prange(batch * heads):
        b = w // heads
        g = w % heads
        n = lens[b]
        lo = starts[b]
        if window > 0:
            lo = max(lo, n - window)
        sealed = n // BLOCK
        qf = np.empty((group, d), np.float32)
        bias = np.empty(group, np.float32)
        sc = np.empty((group, BLOCK), np.float32)
        acc = np.zeros((group, d), np.float32)
        mx = np.full(group, NEG, np.float32)
        den = np.zeros(group, np.float32)
        first = lo // BLOCK
        for j in range(first, sealed + 1):
            rows = BLOCK if j < sealed else n - sealed * BLOCK
            if rows == 0:
                break
            base = j * BLOCK
            if j < sealed:
                blk = tables[b, j]
                for hh in range(group):
                    s = np.float32(0.0)
                    for i in range(d):
                        qi = q[b, g * group + hh, i]
                        qf[hh, i] = qi * f16[ks[blk, g, i]]
                        s += qi * f16[km[blk, g, i]]
                    bias[hh] = s
                for t in range(BLOCK):
                    for hh in range(group):
                        s = bias[hh]
                        for i in range(half):
                            byte = kc[blk, t, g, i]
                            s += qf[hh, 2 * i] * np.float32(byte & 15) + qf[hh, 2 * i + 1] * np.float32(byte >> 4)
                        sc[hh, t] = s
            else:
                for t in range(rows):
                    for hh in range(group):
                        s = np.float32(0.0)
                        for i in range(d):
                            s += q[b, g * group + hh, i] * f16[ko[b, t, g, i]]
                        sc[hh, t] = s
            for hh in range(group):
                top = NEG
                for t in range(rows):
                    x = sc[hh, t] * scale
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if base + t < lo:
                        x = NEG
                    sc[hh, t] = x
                    top = max(top, x)
                if top <= NEG:  # nothing visible in this block for this head: it weighs nothing
                    for t in range(rows):
                        sc[hh, t] = np.float32(0.0)
                    continue
                new = max(mx[hh], top)
                corr = np.float32(math.exp(mx[hh] - new))
                den[hh] *= corr
                for i in range(d):
                    acc[hh, i] *= corr
                mx[hh] = new
                for t in range(rows):
                    sc[hh, t] = np.float32(math.exp(sc[hh, t] - new)) if sc[hh, t] > NEG else np.float32(0.0)
                    den[hh] += sc[hh, t]
            if j < sealed:
                for hh in range(group):
                    pm = np.float32(0.0)
                    for t in range(BLOCK):
                        p = sc[hh, t]
                        pm += p * f16[vm[blk, t, g]]
                        pv = p * f16[vs[blk, t, g]]
                        for i in range(half):
                            byte = vc[blk, t, g, i]
                            acc[hh, 2 * i] += pv * np.float32(byte & 15)
                            acc[hh, 2 * i + 1] += pv * np.float32(byte >> 4)
                    for i in range(d):
                        acc[hh, i] += pm
            else:
                for hh in range(group):
                    for t in range(rows):
                        p = sc[hh, t]
                        for i in range(d):
                            acc[hh, i] += p * f16[vo[b, t, g, i]]
        for hh in range(group):
            h = g * group + hh
            total = den[hh]
            if sinks.shape[0] > 0 and total > 0:
                total += np.float32(math.exp(sinks[h] - mx[hh]))
            inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
            for i in range(d):
                out[b, h, i] = acc[hh, i] * inv


def decode_attention(
    q: np.ndarray, k_codes: np.ndarray, k_scale: np.ndarray, k_min: np.ndarray, v_codes: np.ndarray,
    v_scale: np.ndarray, v_min: np.ndarray, k_open: np.ndarray, v_open: np.ndarray, block_tables: np.ndarray,
    context_lens: np.ndarray, kv_starts: np.ndarray | None = None, softmax_scale: float | None = None,
    window: int | None = None, softcap: float | None = None, sinks: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """One query token per sequence (``q [batch, Hq, d]`` float32, at position ``context_len - 1``) over the
    layout above -> float32 ``[batch, Hq, d]``. The caller has checked the layout (shapes, block ids, lengths);
    this runs the kernel. A query that sees no key yields zeros."""
    batch, _, d = q.shape
    out = np.empty(q.shape, np.float32)
    starts = np.zeros(batch, np.int32) if kv_starts is None else kv_starts.astype(np.int32)
    _decode(
        np.ascontiguousarray(q, np.float32), k_codes, k_scale.view(np.uint16), k_min.view(np.uint16), v_codes,
        v_scale.view(np.uint16), v_min.view(np.uint16), k_open.view(np.uint16), v_open.view(np.uint16),
        block_tables, context_lens, starts, np.float32(1 / math.sqrt(d) if softmax_scale is None else softmax_scale),
        window or 0, np.float32(softcap or 0), np.zeros(0, np.float32) if sinks is None else sinks.astype(np.float32),
        F16_TABLE, out,
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
