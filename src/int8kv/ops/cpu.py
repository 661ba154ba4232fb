"""Fast CPU attention over the paged cache (numba), reading INT8 (or F16) blocks directly.

One kernel serves decode and chunked prefill. A work item is (sequence, a few query rows, a key range) for every
KV head. Keys are processed TILE positions at a time: the tile's K rows of all heads are read block by block, in
memory order (a block is [block_size, num_kv_heads, head_dim], contiguous), converted once to float32 into a
small buffer that stays in cache, and used by every query head of each GQA group; then an online softmax
(flash-attention style: scores, running max, exp) and the same for V, accumulating p * scale_v * v.
The per-token INT8 scales are folded in, never materialised as a dequantized copy:
    q . (s_k k) = s_k (q . k)        sum_t p_t (s_v,t v_t) = sum_t (p_t s_v,t) v_t
Decode with fewer sequences than cores splits each sequence's keys into ranges (flash-decoding) and merges the
partial softmax states afterwards. See docs/design.md, "CPU attention backend".
Long prefill chunks (FLASH_MIN_QUERIES, FLASH_MIN_PAIRS) go instead through torch's fused CPU flash kernel, one
K/V tile at a time (`_flash_prefill`): there its blocked matmuls beat this kernel's dot products.
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba._dispatcher import compute_fingerprint
from numba.extending import intrinsic, overload

from ..cache.pool import KvPool
from ..errors import NonFiniteError
from ..numba_cache import share_compiles
from ..numba_threads import launch, thread_count
from . import cpu_simd
from .calls import INDEX, Compiled, call_at, compiled_count, fan_out, tag_of
from .cpu_rope import finite, finite_bits
from .parts import KERNELS as PARTS_KERNELS
from .parts import codes_and_scales, int8_codes
from .plan import AttentionPlan, AttentionVariant
from .thread_choice import ThreadChoice, thread_choice  # noqa: F401 (cpu.ThreadChoice: the kernels' modules)

__all__ = ["KERNELS", "attend", "prepare", "quantize_query_int16"]

TILE = 64  # key positions per online-softmax step: long enough for vector loops, the buffers fit in L2
ROWS_PER_ITEM = 32  # query rows x heads of a group per prefill work item: each converted K/V tile serves them all
MIN_SPLIT_KEYS = 256  # shortest key range worth its own decode work item
_NO_SCALE = np.empty((0, 0), np.float32)  # q_scale of the exact (float32 query) path
_NO_SINKS = np.empty(0, np.float32)  # sinks of a call without them
# q_scale of the int16 path: q stays float32 and each (row, head) is quantized to int16 inside the kernel
# (`_row_query`): in torch the same quantization is several small ops, each with its own dispatch, per call.
_INT16_QUERY = np.empty((0, 0), np.int16)
# A sequence whose chunk has at least FLASH_MIN_QUERIES queries and at least FLASH_MIN_PAIRS causal
# (query, key) pairs prefills through `_flash_prefill` (torch's fused flash kernel on K/V tiles). The bounds sit
# just above where the two paths tie: below them torch's per-call overhead outweighs the numba kernel's slower
# inner loop (docs/archive/benchmarks-2026.md, "Figures from code comments").
FLASH_MIN_QUERIES = 32
FLASH_MIN_PAIRS = 48 * 1024
FLASH_KEY_TILE = 1024  # keys converted to float32 per step: K + V tile of 1.5 MB at 3 KV heads x 64
FLASH_QUERY_ROWS = 1024  # (query, group head) rows per block: fewer, larger calls beat finer causal skipping
# Torch's CPU flash-attention kernel with the log-sum-exp of each row (torch >= 2.3), which the public
# scaled_dot_product_attention does not return and merging key tiles needs. It is a private op: should a torch
# release drop it, long chunks simply stay on the numba kernel.
_sdpa_tile = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# The formats this backend reads: the parts' pairs, and the 4-bit sink-and-window pool through ops.cpu_q4w.
KERNELS = PARTS_KERNELS | {"int4_sink_window"}
# Every run this backend prepares refuses a q holding NaN or inf itself (NonFiniteError, before any output is
# written), so `ops.check_query` leaves that pass to it: the item loop checks q's bits where it starts, nearly
# free there, while the Python check it replaces cost a numba dispatch and a `Tensor.numpy()` on every layer.
CHECKS_QUERY = True
NEG = np.float32(cpu_simd.NEG)  # finite "minus infinity": fastmath lets the compiler assume no inf anywhere

# exp's constants, defined once in cpu_simd (its vector exp must give this one's bits)
_EXP_LOW = np.float32(cpu_simd.EXP_LOW)
_LOG2E = np.float32(cpu_simd.LOG2E)
_LN2_HI = np.float32(cpu_simd.LN2_HI)
_LN2_LO = np.float32(cpu_simd.LN2_LO)
_P = tuple(np.float32(c) for c in cpu_simd.EXP_POLY)


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret int32 bits as float32 (what a C union would do); numba has no scalar bitcast."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(fastmath=True, inline="always")
def _exp_nonpos(x):
    """exp(x) for x <= 0, relative error < 5e-7. Unlike libm expf it inlines and vectorises (no SVML here)."""
    x = max(x, _EXP_LOW)  # keeps 2**n a normal float32; exp(-87) is below any weight that matters
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _P[0]
    p = p * r + _P[1]
    p = p * r + _P[2]
    p = p * r + _P[3]
    p = p * r + _P[4]
    p = p * r + _P[5]
    p = p * r + _P[6]
    p = p * r + _P[7]
    return p * _bits_to_f32((np.int32(n) + np.int32(127)) << 23)


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    """float16 bits (numba cannot load float16, so F16 blocks arrive as int16) -> float32. LLVM turns this into
    vcvtph2ps on F16C/AVX-512 CPUs, vectorised like the int8 path."""
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def _code_to_f32(x):  # typed by the overload below: int8 codes, or float16 bits viewed as int16
    raise NotImplementedError


@overload(_code_to_f32, inline="always")
def _code_to_f32_impl(x):
    if x == types.int8:
        return lambda x: np.float32(x)
    if x == types.int16:
        return lambda x: _f16_bits_to_f32(x)
    return None


def _tile_value(x, like):  # typed by the overload below: a code as the tile's element type
    raise NotImplementedError


@overload(_tile_value, inline="always")
def _tile_value_impl(x, like):
    if isinstance(like, types.Integer):  # int8 key codes against int16 query codes: kept as they are
        return lambda x, like: x
    return lambda x, like: _code_to_f32(x)


@njit(fastmath=True, inline="always")
def _scale_of(scales, block_id, offset, h):
    """The float32 scale of a stored row: INT8's own, or 1 for F16 (no scales)."""
    if scales is None:
        return np.float32(1.0)
    return scales[block_id, offset, h]


def _scales16(scales, block_id, offset, dst, doff, dstride):  # typed by the overload below
    """dst[doff + h * dstride + j] = the scale of row offset + j of block block_id, head h, for j < 16 and every
    head: INT8's own (one `cpu_simd.gather16`), or 1 for F16 (no scales)."""
    raise NotImplementedError


@overload(_scales16, inline="always")
def _scales16_impl(scales, block_id, offset, dst, doff, dstride):
    if isinstance(scales, types.NoneType):

        def ones(scales, block_id, offset, dst, doff, dstride):
            for h in range(dst.shape[0] // dstride):
                dst[doff + h * dstride : doff + h * dstride + cpu_simd.LANES] = np.float32(1.0)

        return ones

    def gather(scales, block_id, offset, dst, doff, dstride):
        size = scales.itemsize
        first = (block_id * scales.strides[0] + offset * scales.strides[1]) // size
        cpu_simd.gather16(scales, first, scales.strides[1] // size, scales.shape[2], scales.strides[2] // size, dst,
                          doff, dstride)

    return gather


@njit(fastmath=True, inline="always")
def _load_tile(codes, scales, table, p0, nt, dst, dst_scale):
    """Positions [p0, p0 + nt) of every head -> dst[h, t] (float32) and dst_scale[h, t] (1 for F16), reading
    each block in memory order."""
    bs = codes.shape[1]
    hkv = codes.shape[2]
    d = codes.shape[3]
    index = p0 // bs
    offset = p0 - index * bs
    t = 0
    while t < nt:
        run = min(bs - offset, nt - t)
        block_id = table[index]
        block = codes[block_id]
        for j in range(run):
            for h in range(hkv):
                src = block[offset + j, h]
                row = dst[h, t + j]
                for i in range(d):
                    row[i] = _tile_value(src[i], row[0])
                dst_scale[h, t + j] = _scale_of(scales, block_id, offset + j, h)
        t += run
        index += 1
        offset = 0


def _zero(q):  # typed by the overload below: the accumulator of a dot product with q's elements
    raise NotImplementedError


@overload(_zero, inline="always")
def _zero_impl(q):
    if isinstance(q, types.Integer):
        return lambda q: np.int32(0)
    return lambda q: np.float32(0.0)


def _prod(x, k):  # typed by the overload below: one term of q . k, exact in int32 for integer codes
    raise NotImplementedError


@overload(_prod, inline="always")
def _prod_impl(x, k):
    if isinstance(x, types.Integer):
        # int16 query codes x int8 key codes (the int16 path's keys outside the 16-key runs): |product| < 2^22
        return lambda x, k: np.int32(x) * np.int32(k)
    return lambda x, k: x * k


@njit(fastmath=True, inline="always")
def _scores(qr, kt, nt, out):
    """out[t] = q . k_t for t < nt (float32 q and keys); four keys per pass share each load of q."""
    d = qr.shape[0]
    t = 0
    while t + 4 <= nt:
        k0, k1, k2, k3 = kt[t], kt[t + 1], kt[t + 2], kt[t + 3]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for i in range(d):
            x = qr[i]
            a0 += x * k0[i]
            a1 += x * k1[i]
            a2 += x * k2[i]
            a3 += x * k3[i]
        out[t], out[t + 1], out[t + 2], out[t + 3] = a0, a1, a2, a3
        t += 4
    while t < nt:
        k0 = kt[t]
        a0 = np.float32(0.0)
        for i in range(d):
            a0 += qr[i] * k0[i]
        out[t] = a0
        t += 1


@njit(fastmath=True, inline="always")
def _scores_pair(qa, qb, kt, nt, out_a, out_b):
    """`_scores` for two query rows at once, each key load feeding both (8 sums in registers), over the first
    nt // 4 * 4 keys: returns that count; the caller runs `_scores` on the rest of each row (see `_attend_item`)."""
    d = qa.shape[0]
    t = 0
    while t + 4 <= nt:
        k0, k1, k2, k3 = kt[t], kt[t + 1], kt[t + 2], kt[t + 3]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for i in range(d):
            x = qa[i]
            y = qb[i]
            c0, c1, c2, c3 = k0[i], k1[i], k2[i], k3[i]
            a0 += x * c0
            a1 += x * c1
            a2 += x * c2
            a3 += x * c3
            b0 += y * c0
            b1 += y * c1
            b2 += y * c2
            b3 += y * c3
        out_a[t], out_a[t + 1], out_a[t + 2], out_a[t + 3] = a0, a1, a2, a3
        out_b[t], out_b[t + 1], out_b[t + 2], out_b[t + 3] = b0, b1, b2, b3
        t += 4
    return t


@njit(fastmath=True, inline="always")
def _accumulate(acc, w, vt, nt):
    """acc += sum_t w[t] v_t; four values per pass so acc is loaded and stored a quarter as often."""
    d = acc.shape[0]
    t = 0
    while t + 4 <= nt:
        v0, v1, v2, v3 = vt[t], vt[t + 1], vt[t + 2], vt[t + 3]
        w0, w1, w2, w3 = w[t], w[t + 1], w[t + 2], w[t + 3]
        for i in range(d):
            acc[i] += w0 * v0[i] + w1 * v1[i] + w2 * v2[i] + w3 * v3[i]
        t += 4
    while t < nt:
        v0 = vt[t]
        w0 = w[t]
        for i in range(d):
            acc[i] += w0 * v0[i]
        t += 1


@njit(fastmath=True, inline="always")
def _accumulate_pair(acc_a, acc_b, wa, wb, vt, nt):
    """`_accumulate` for two rows, each value load feeding both accumulators, over the first nt // 4 * 4 values:
    returns that count; the caller runs `_accumulate` on the rest of each row (as `_scores_pair`)."""
    d = acc_a.shape[0]
    t = 0
    while t + 4 <= nt:
        v0, v1, v2, v3 = vt[t], vt[t + 1], vt[t + 2], vt[t + 3]
        a0, a1, a2, a3 = wa[t], wa[t + 1], wa[t + 2], wa[t + 3]
        b0, b1, b2, b3 = wb[t], wb[t + 1], wb[t + 2], wb[t + 3]
        for i in range(d):
            c0, c1, c2, c3 = v0[i], v1[i], v2[i], v3[i]
            acc_a[i] += a0 * c0 + a1 * c1 + a2 * c2 + a3 * c3
            acc_b[i] += b0 * c0 + b1 * c1 + b2 * c2 + b3 * c3
        t += 4
    return t


def _capped(x, cap):  # typed by the overload below: a logit, softcapped when cap is (c, 1 / c)
    raise NotImplementedError


@overload(_capped, inline="always")
def _capped_impl(x, cap):
    # None compiles the plain kernel: a runtime `if cap > 0` around the tanh loop cost 10-14 % of a decode call
    # (SmolLM2 shape, 512-2,048 keys, one thread, same process and inputs), with the plain loop unchanged.
    if isinstance(cap, types.NoneType):
        return lambda x, cap: x
    return lambda x, cap: cap[0] * np.tanh(x * cap[1])


def _cap_pair(cap):  # typed by the overload below: the softcap as the kernels take it
    raise NotImplementedError


@overload(_cap_pair, inline="always")
def _cap_pair_impl(cap):
    """None stays None; a float32 array [c, 1 / c] becomes the pair (c, 1 / c), held in registers by the score
    loops. The entry takes the array, not the pair: a tuple inside a tuple cannot cross into numba's parallel
    loop (calls.fan_out's arguments)."""
    if isinstance(cap, types.NoneType):
        return lambda cap: None
    return lambda cap: (cap[0], cap[1])


@njit(fastmath=True, inline="always")
def _softmax_step(s, k_scale, q_scale, nt, r, m, denom, acc, cap):
    """Fold this tile's raw scores s[:nt] of row r into the running (max m, sum denom, acc); s becomes exp weights.
    A raw score is q . k in codes: the logit is s[t] * k_scale[t] * q_scale (q_scale 1 for a float32 query),
    capped to c tanh(logit / c) when cap is (c, 1 / c) (logit softcapping; libm's tanhf, not vectorised), as is
    without a cap (None)."""
    mx = m[r]
    for t in range(nt):
        x = _capped(s[t] * (k_scale[t] * q_scale), cap)
        s[t] = x
        mx = max(mx, x)
    total = np.float32(0.0)
    for t in range(nt):
        e = _exp_nonpos(s[t] - mx)
        s[t] = e
        total += e
    _move_max(r, mx, total, m, denom, acc)


@njit(fastmath=True, inline="always")
def _move_max(r, mx, total, m, denom, acc):
    """Row r's running state takes a tile whose weights sum to `total` relative to the new max `mx`: the sum so
    far and the accumulator are rescaled by e^(m[r] - mx) (skipped when the max did not move)."""
    alpha = _exp_nonpos(m[r] - mx)
    denom[r] = denom[r] * alpha + total
    m[r] = mx
    if alpha != np.float32(1.0):
        a = acc[r]
        for i in range(a.shape[0]):
            a[i] *= alpha


def _tile_weights(s, k_scale, v_scale, q_scale, nt, r, m, denom, acc, cap):  # typed by the overload below
    """`_softmax_step` for row r, then s[t] *= v_scale[t] (p_t * s_v,t: the value scales folded into the weights):
    the decode row kernel's softmax. Without a softcap through `cpu_simd.logits16` / `weights16` (16 lanes a
    vector; the same weights bit for bit, the tile's sum of weights in another order), with one as before."""
    raise NotImplementedError


@overload(_tile_weights, inline="always")
def _tile_weights_impl(s, k_scale, v_scale, q_scale, nt, r, m, denom, acc, cap):
    if isinstance(cap, types.NoneType):

        def vectors(s, k_scale, v_scale, q_scale, nt, r, m, denom, acc, cap):
            mx = cpu_simd.logits16(s, 0, nt, k_scale, 0, q_scale, m[r])
            _move_max(r, mx, cpu_simd.weights16(s, 0, nt, mx, v_scale, 0), m, denom, acc)

        return vectors

    def loops(s, k_scale, v_scale, q_scale, nt, r, m, denom, acc, cap):
        _softmax_step(s, k_scale, q_scale, nt, r, m, denom, acc, cap)
        for j in range(nt):
            s[j] *= v_scale[j]

    return loops


def _row_low(lows, row, lo):  # typed by the overload below: the first key row `row` of an item sees
    raise NotImplementedError


@overload(_row_low, inline="always")
def _row_low_impl(lows, row, lo):
    if isinstance(lows, types.NoneType):  # no window or chunk: the item's range
        return lambda lows, row, lo: lo
    return lambda lows, row, lo: max(lows[row], lo)


def _tile_offset(lows, low, p0):  # typed by the overload below: a row's first visible key within a tile
    raise NotImplementedError


@overload(_tile_offset, inline="always")
def _tile_offset_impl(lows, low, p0):
    # Without a window or chunk every row starts at the item's first key: a constant 0 keeps the plain kernel
    # as it was (a runtime max(low - p0, 0) and the views it offsets cost 13 % of a 16-query prefill chunk at
    # 2,048 keys, SmolLM2 shape, same process and inputs).
    if isinstance(lows, types.NoneType):
        return lambda lows, low, p0: 0
    return lambda lows, low, p0: max(low - p0, 0)


@njit(fastmath=True, cache=True)
def _attend_item(q, sm, caps, kc, ks, vc, vs, tables, seq, row0, nrows, lo, hi, limits, lows, m, denom, acc):
    """Online-softmax attention of query rows [row0, row0 + nrows), all heads, over keys [lo, hi) of sequence
    `seq` (its block table tables[seq]), row i seeing keys [lows[row0 + i], limits[row0 + i]) of them (lows
    None: from lo).
    State per (KV head, row of its group): running max m, sum denom, unnormalised output acc.
    q is float32 (the exact path: several rows and head_dims the row kernels do not take are never quantized).
    sm: the softmax scale, applied with the key scales to each tile's raw scores (never to a copy of q); caps:
    None, or the softcap c as float32 [c, 1 / c]."""
    cap = _cap_pair(caps)
    table = tables[seq]
    hkv = kc.shape[2]
    d = kc.shape[3]
    g = q.shape[1] // hkv
    rows = nrows * g
    qr = np.empty((hkv, rows, d), q.dtype)
    qs = np.full((hkv, rows), sm, np.float32)
    limit = np.empty(rows, np.int64)
    low = np.empty(rows, np.int64)
    for h in range(hkv):
        for i in range(nrows):
            for j in range(g):
                for c in range(d):  # element by element: a row slice assignment compiles numba's shape-error message
                    qr[h, i * g + j, c] = q[row0 + i, h * g + j, c]
    for i in range(nrows):
        for j in range(g):
            low[i * g + j] = _row_low(lows, row0 + i, lo)
            limit[i * g + j] = min(limits[row0 + i], hi)
    m[:] = NEG
    denom[:] = 0.0
    acc[:] = 0.0
    tile = np.empty((hkv, TILE, d), np.float32)
    tile_scale = np.empty((hkv, TILE), np.float32)
    s = np.empty((hkv, rows, TILE), np.float32)
    end = limit.max()
    p0 = lo
    while p0 < end:
        nt = min(TILE, end - p0)
        _load_tile(kc, ks, table, p0, nt, tile, tile_scale)  # K, then V, into the one float32 tile
        for h in range(hkv):
            kt = tile[h]
            ksc = tile_scale[h]
            sh = s[h]
            mh = m[h]
            dh = denom[h]
            ah = acc[h]
            qh = qr[h]
            qsh = qs[h]
            r = 0
            while r < rows:  # row r sees keys [p0 + a, p0 + a + n) of this tile
                a = _tile_offset(lows, low[r], p0)
                n = min(limit[r] - p0, nt) - a
                # same window and causal cut: share key loads
                paired = (r + 1 < rows and a == _tile_offset(lows, low[r + 1], p0)
                          and n == min(limit[r + 1] - p0, nt) - a)
                # Each helper has one call site (the paired keys first, then each row's rest and its softmax):
                # numba inlines them, and three copies of `_scores`, `_accumulate` and `_softmax_step` made one
                # INT8 specialisation take 7.4-7.6 s to compile cold, one copy 4.4-4.7 (the same bits, and a
                # 16-query chunk at 2,048 keys 0.97x the time: docs/archive/benchmarks-2026.md "Kernel compile time").
                step = 2 if paired else 1
                if n > 0:
                    done = _scores_pair(qh[r], qh[r + 1], kt[a:], n, sh[r, a:], sh[r + 1, a:]) if paired else 0
                    for rr in range(r, r + step):
                        _scores(qh[rr], kt[a + done:], n - done, sh[rr, a + done:])
                        _softmax_step(sh[rr, a:], ksc[a:], qsh[rr], n, rr, mh, dh, ah, cap)
                r += step
        _load_tile(vc, vs, table, p0, nt, tile, tile_scale)
        for h in range(hkv):
            vt = tile[h]
            vsc = tile_scale[h]
            sh = s[h]
            ah = acc[h]
            for r in range(rows):  # p_t * s_v,t: the value scales folded into the weights
                for t in range(_tile_offset(lows, low[r], p0), min(limit[r] - p0, nt)):
                    sh[r, t] *= vsc[t]
            r = 0
            while r < rows:
                a = _tile_offset(lows, low[r], p0)
                n = min(limit[r] - p0, nt) - a
                paired = (r + 1 < rows and a == _tile_offset(lows, low[r + 1], p0)
                          and n == min(limit[r + 1] - p0, nt) - a)
                step = 2 if paired else 1
                if n > 0:
                    done = _accumulate_pair(ah[r], ah[r + 1], sh[r, a:], sh[r + 1, a:], vt[a:], n) if paired else 0
                    for rr in range(r, r + step):
                        _accumulate(ah[rr], sh[rr, a + done:], vt[a + done:], n - done)
                r += step
        p0 += nt


@njit(fastmath=True, inline="always")
def _dot_codes(qv, krow):
    """q . k for one key row of codes (int8, or F16 bits as int16): float32 for a float32 q, exact integers for
    int16 query codes (int8 keys)."""
    total = _zero(qv[0])
    for i in range(qv.shape[0]):
        total += _prod(qv[i], _tile_value(krow[i], qv[0]))
    return total


QUERY_CODE_MAX = 32767  # int16 query codes: rounding error <= max|q| / 65,534 per element


@njit(fastmath=True, inline="always")
def _quantize_rows(x, d, sm, codes, scale):
    """Each row of d values of the flat float32 ``x`` as symmetric int16 codes, ``x ~ codes * scale / sm``:
    codes [len(x)] int16 in [-32767, 32767], scale [rows] float32 with the softmax scale sm folded in; a row of
    zeros gets scale 0. Each row is a slice indexed from 0: indexed as x[h * d + i], LLVM could not rule out a
    negative index and vectorised the rounding with gathers and scattered stores; the range comes from
    `cpu_simd.absmax16`. Together several times faster, the same codes and scales (each work item quantizes its
    row; docs/archive/benchmarks-2026.md, "Loops that numba indexed with gathers")."""
    vector = d - d % cpu_simd.LANES
    for h in range(x.shape[0] // d):
        row = x[h * d : (h + 1) * d]
        out = codes[h * d : (h + 1) * d]
        top = cpu_simd.absmax16(x, h * d, vector)
        for i in range(vector, d):
            top = max(top, abs(row[i]))
        inv = np.float32(QUERY_CODE_MAX) / top if top > 0 else np.float32(0.0)
        scale[h] = top / np.float32(QUERY_CODE_MAX) * sm
        for i in range(d):
            out[i] = np.int16(np.rint(row[i] * inv))


def _row_query(q, q_scale, row, sm):  # typed by the overload below
    """Query row ``row`` as the score kernels take it, ``(values [Hq * d], logit scale per head [Hq])``: float32
    values and sm (exact path), or the row quantized here to int16 codes (int16 path, q_scale the `_INT16_QUERY`
    marker)."""
    raise NotImplementedError


@overload(_row_query, inline="always")
def _row_query_impl(q, q_scale, row, sm):
    if isinstance(q_scale.dtype, types.Integer):

        def quantized(q, q_scale, row, sm):
            values = q[row].reshape(-1)
            codes = np.empty(values.shape[0], np.int16)
            scale = np.empty(q.shape[1], np.float32)
            _quantize_rows(values, q.shape[2], sm, codes, scale)
            return codes, scale

        return quantized
    return lambda q, q_scale, row, sm: (q[row].reshape(-1), np.full(q.shape[1], sm, np.float32))


def _scores16(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):  # typed by the overload below
    """Scores of 16 keys: `cpu_simd.qk16` for float32 q (buf its scratch), `cpu_simd.qk16i` for int16 query codes
    (widened in registers: buf unused)."""
    raise NotImplementedError


@overload(_scores16, inline="always")
def _scores16_impl(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):
    if isinstance(q.dtype, types.Integer):
        return lambda q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf: cpu_simd.qk16i(
            q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim)
    return lambda q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf: cpu_simd.qk16(
        q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf)


@njit(fastmath=True, inline="always")
def _enter_run(table, pos, bs, left, tile_start, blocks, flat, block_elems, spread):
    """The run of keys from position `pos` to the end of its block (at most `left`): ``(block_id, offset, run,
    following, count)``. A run that starts a block or a tile prefetches the next block of `flat` (K in the score
    pass, V in the value pass) while this one is computed; in a block longer than a tile, a run of 16 keys
    prefetches the 16 keys after it instead. Whole, here, or, for a run of the vector kernels' 16 keys with
    `spread` (INT8 codes), a head's share before each head's call by the caller, `following` then being the first
    element of the `count` to prefetch (-1 otherwise). INT8 spreads its prefetch because a whole block's burst of
    line requests likely takes the core's line-fill slots the compute's own loads then wait for; F16's blocks,
    twice the bytes, were slower spread, so they stay whole. One block ahead beats none, most for keys from DRAM
    (a head's rows are 1 KB apart); two ahead gained nothing (docs/archive/benchmarks-2026.md, "The next block's
    prefetch, a head's share at a time")."""
    index = pos // bs
    offset = pos - index * bs
    run = min(bs - offset, left)
    lanes = cpu_simd.LANES
    following = -1
    count = block_elems
    if (offset == 0 or tile_start) and index + 1 < blocks:
        following = table[index + 1] * block_elems
    elif bs > TILE and run >= lanes and offset + 2 * lanes <= bs:
        # A block longer than a tile (the transformers drop-in's: a batch row's whole storage is one block, so
        # there is no next block to ask for): the 16 keys after this run, in the same block. The drop-in's kernel
        # call is markedly faster with this request ahead than with none; 32 keys ahead are no better, 64 worse
        # (docs/archive/benchmarks-2026.md, "The keys after a run").
        count = lanes * (block_elems // bs)
        following = (table[index] * bs + offset + lanes) * (block_elems // bs)
    if following >= 0 and (not spread or run < lanes):
        cpu_simd.prefetch(flat, following, count)
        following = -1
    return table[index], offset, run, following, count


@njit(fastmath=True, cache=True)
def _attend_row(q, q_scale, sm, caps, kc, ks, vc, vs, tables, seq, row, lo, hi, m, denom, acc):
    """Attention of one query row (all heads; sm the softmax scale) over keys [lo, hi) of one sequence, the
    decode fast path. q and q_scale as `_row_query` takes them: float32 q (exact), or float32 q quantized here to
    int16 (int16 path), whose q . k runs in int32 (`qk16i`).
    Keys go TILE at a time: runs of 16 keys inside one block through the vector kernels of `cpu_simd` (scores,
    then p . v), the rest (a run cut short by a block's end or the range's) one key at a time. State as in
    `_attend_item` with nrows = 1 (sequence `seq`, softcap `caps`): m, denom [hkv, g], acc [hkv, g, d]."""
    cap = _cap_pair(caps)
    table = tables[seq]
    hkv = kc.shape[2]
    d = kc.shape[3]
    bs = kc.shape[1]
    g = q.shape[1] // hkv
    kflat = kc.reshape(-1)
    vflat = vc.reshape(-1)
    qflat, q_logit = _row_query(q, q_scale, row, sm)
    accflat = acc.reshape(-1)
    s = np.empty((hkv, g, TILE), np.float32)
    sflat = s.reshape(-1)
    k_scale = np.empty((hkv, TILE), np.float32)
    v_scale = np.empty((hkv, TILE), np.float32)
    k_scale_flat = k_scale.reshape(-1)
    v_scale_flat = v_scale.reshape(-1)
    kbuf = np.empty(cpu_simd.LANES * d if qflat.itemsize == 4 else 0, qflat.dtype)  # `qk16`'s 16 keys as float32
    m[:] = NEG
    denom[:] = 0.0
    acc[:] = 0.0
    row_stride = hkv * d
    block_elems = bs * row_stride
    spread = kflat.itemsize == 1  # INT8 codes: the next block prefetched a head's share at a time (`_enter_run`)
    blocks = min(table.shape[0], (hi + bs - 1) // bs)  # table entries this range may read
    lanes = cpu_simd.LANES
    p0 = lo
    while p0 < hi:
        nt = min(TILE, hi - p0)
        t = 0
        while t < nt:  # scores of the tile, and both scales
            block_id, offset, run, following, count = _enter_run(table, p0 + t, bs, nt - t, t == 0, blocks, kflat,
                                                                 block_elems, spread)
            if run >= lanes:
                run = lanes
                base = (block_id * bs + offset) * row_stride
                _scales16(ks, block_id, offset, k_scale_flat, t, TILE)
                _scales16(vs, block_id, offset, v_scale_flat, t, TILE)
                for h in range(hkv):
                    if following >= 0:
                        cpu_simd.prefetch(kflat, following + h * (count // hkv), count // hkv)
                    _scores16(qflat, h * g * d, kflat, base + h * d, row_stride, sflat, h * g * TILE + t,
                              TILE, g, d, kbuf)
            else:
                for j in range(run):
                    for h in range(hkv):
                        k_scale[h, t + j] = _scale_of(ks, block_id, offset + j, h)
                        v_scale[h, t + j] = _scale_of(vs, block_id, offset + j, h)
                        krow = kc[block_id, offset + j, h]
                        for r in range(g):
                            head = (h * g + r) * d
                            s[h, r, t + j] = _dot_codes(qflat[head : head + d], krow)
            t += run
        for h in range(hkv):
            for r in range(g):
                _tile_weights(s[h, r], k_scale[h], v_scale[h], q_logit[h * g + r], nt, r, m[h], denom[h], acc[h], cap)
        t = 0
        while t < nt:  # p . v
            block_id, offset, run, following, count = _enter_run(table, p0 + t, bs, nt - t, t == 0, blocks, vflat,
                                                                 block_elems, spread)
            if run >= lanes:
                run = lanes
                base = (block_id * bs + offset) * row_stride
                for h in range(hkv):
                    if following >= 0:
                        cpu_simd.prefetch(vflat, following + h * (count // hkv), count // hkv)
                    cpu_simd.pv16(sflat, h * g * TILE + t, TILE, vflat, base + h * d, row_stride, accflat,
                                  h * g * d, g, d)
            else:
                for j in range(run):
                    for h in range(hkv):
                        vrow = vc[block_id, offset + j, h]
                        for r in range(g):
                            weight = s[h, r, t + j]
                            a = acc[h, r]
                            for i in range(d):
                                a[i] += weight * _code_to_f32(vrow[i])
            t += run
        p0 += nt


@njit(fastmath=True, inline="always")
def _item_state(it, q, kc, items):
    """Work item `it`'s fields and the unnormalised softmax state (m, denom, acc) its rows fill."""
    hkv = kc.shape[2]
    g = q.shape[1] // hkv
    seq, row0, nrows = items[it, 0], items[it, 1], items[it, 2]
    lo, hi, split = items[it, 3], items[it, 4], items[it, 5]
    rows = nrows * g
    m = np.empty((hkv, rows), np.float32)
    denom = np.empty((hkv, rows), np.float32)
    acc = np.empty((hkv, rows, kc.shape[3]), np.float32)
    return seq, row0, nrows, lo, hi, split, m, denom, acc


@njit(fastmath=True, inline="always")
def _store_item(q, kc, sinks, out, part_m, part_l, part_acc, row0, nrows, split, m, denom, acc):
    """One split: normalised rows go to `out` (with the sinks, unless `sinks` is empty); several: the unnormalised
    state (m, l, acc) of each split goes to part_* for the merge (`_merge_states`), which adds the sinks once."""
    hkv = kc.shape[2]
    d = kc.shape[3]
    g = q.shape[1] // hkv
    direct = part_m.shape[0] == 0
    for h in range(hkv):
        for i in range(nrows):
            for j in range(g):
                r = i * g + j
                head = h * g + j
                if direct:
                    inv = normaliser(denom[h, r], m[h, r], sinks, head)
                    for c in range(d):
                        out[row0 + i, head, c] = acc[h, r, c] * inv
                else:
                    part_m[split, row0 + i, head] = m[h, r]
                    part_l[split, row0 + i, head] = denom[h, r]
                    for c in range(d):
                        part_acc[split, row0 + i, head, c] = acc[h, r, c]


# Work item `it` = items[it] = (sequence, row0, nrows, key lo, key hi, split), whole: the kernel over its rows
# and keys, then its rows stored (`_store_item`). Two leaves, each compiled once per specialisation and called
# by address from `_run_items` (ops/calls.py: numba would otherwise build each again inside every caller):
# `_row_item` for a single query row through the vector kernels (`_attend_row`: float32 kernels for an exact
# row, integer ones for int16 rows on INT8 blocks), where the head_dim fits them (`_work`); `_general_item` for
# the rest (`_attend_item`: several rows, or a head_dim the row kernels do not take). A call compiles only the
# leaves its items use: a decode-only run never builds `_general_item`. Each leaf calls its kernel by address
# too (`_attend_row` at leaves[4]; `_attend_item` at leaves[6] without lows or leaves[8] with them; the
# signature tag in the slot after each checked first), for two reasons:
# - the same bits whatever was compiled when. Linked into the leaf, the kernel's machine code depended on
#   whether numba had just compiled it (its IR inlined into the leaf and optimised again) or loaded it from the
#   disk cache, so a perplexity differed between the process that compiled and the next one that loaded; called
#   by address, both give the same bits (docs/results/cpu_bits.py; docs/archive/benchmarks-2026.md, "Kernel
#   compile time");
# - a window's key lows specialise the row leaf but not `_attend_row`, and each leaf specialisation no longer
#   optimises the whole kernel again, which shortens a cold compile.
@njit(fastmath=True, cache=True)
def _row_item(it, leaves, q, q_scale, sm, cap, sinks, kc, ks, vc, vs, tables, items, limits, lows, out, part_m,
              part_l, part_acc):
    seq, row0, nrows, lo, hi, split, m, denom, acc = _item_state(it, q, kc, items)
    first, end = max(lows[row0], lo), min(hi, limits[row0])
    attend = (q, q_scale, sm, cap, kc, ks, vc, vs, tables, seq, row0, first, end, m, denom, acc)
    if leaves[5] != tag_of(attend):
        raise TypeError("_row_item: the kernel at this address was compiled for other argument types")
    call_at(leaves[4], attend)
    _store_item(q, kc, sinks, out, part_m, part_l, part_acc, row0, nrows, split, m, denom, acc)


@njit(fastmath=True, cache=True)
def _general_item(it, leaves, q, q_scale, sm, cap, sinks, kc, ks, vc, vs, tables, items, limits, lows, out, part_m,
                  part_l, part_acc):
    seq, row0, nrows, lo, hi, split, m, denom, acc = _item_state(it, q, kc, items)
    if leaves[6] != 0:  # every row from the item's first key: `_attend_item` specialised without lows
        plain = (q, sm, cap, kc, ks, vc, vs, tables, seq, row0, nrows, lo, hi, limits, None, m, denom, acc)
        if leaves[7] != tag_of(plain):
            raise TypeError("_general_item: the kernel at this address was compiled for other argument types")
        call_at(leaves[6], plain)
    else:  # a window or chunk: each row from its own lowest key
        bounded = (q, sm, cap, kc, ks, vc, vs, tables, seq, row0, nrows, lo, hi, limits, lows, m, denom, acc)
        if leaves[9] != tag_of(bounded):
            raise TypeError("_general_item: the kernel at this address was compiled for other argument types")
        call_at(leaves[8], bounded)
    _store_item(q, kc, sinks, out, part_m, part_l, part_acc, row0, nrows, split, m, denom, acc)


@njit(fastmath=True, inline="always")
def _new_states(splits, out):
    """(m, l, acc) buffers of `splits` key ranges for every (row, head) of `out [n, Hq, D]`."""
    n, hq, d = out.shape
    return (np.empty((splits, n, hq), np.float32), np.empty((splits, n, hq), np.float32),
            np.empty((splits, n, hq, d), np.float32))


@njit(fastmath=True, cache=True)
def _run_items(first, last, merge, splits, leaves, q, q_scale, sm, cap, sinks, kc, ks, vc, vs, tables, items, limits,
               lows, out, part_m, part_l, part_acc):
    """Work items first..last - 1, each through its leaf (`_row_item` if it has one row and leaves[0] is set,
    else `_general_item`), then, with `merge` and splits > 1, the merge of the split states in part_*
    (`_merge_states`). ``leaves`` int64 [8]: (row leaf address, its signature tag, general leaf address, its
    tag, then the same for the kernels they call, `_attend_row` and `_attend_item`), 0 for what the call does not
    use (`_leaves`); a leaf's tag that does not match the arguments' types raises TypeError before any item runs,
    a kernel's before the leaf calls it. A serial call runs this from
    Python; a parallel one through `calls.fan_out` (merge False; the merge follows on the calling thread). Worker w
    of a parallel call runs items lists[w]..lists[w + 1] (`_assign_items`): numba's dynamic schedule
    (`parallel_chunksize(1)`, items handed out one at a time) gained nothing from a second thread on a decode
    call's few items, where this fixed split does. A serial call (`merge`) passes empty part_* and allocates the
    `splits` states here, saving three numpy allocations in Python."""
    if not finite_bits(q):  # the backend's query check (CHECKS_QUERY): each worker's, before it writes anything
        raise NonFiniteError("q holds NaN or inf")
    if merge and splits > 1:
        part_m, part_l, part_acc = _new_states(splits, out)
    args = (q, q_scale, sm, cap, sinks, kc, ks, vc, vs, tables, items, limits, lows, out, part_m, part_l, part_acc)
    tag = tag_of((first, leaves) + args)
    if (leaves[0] != 0 and leaves[1] != tag) or (leaves[2] != 0 and leaves[3] != tag):
        raise TypeError("_run_items: a leaf at this address was compiled for other argument types")
    for it in range(first, last):
        if items[it, 2] == 1 and leaves[0] != 0:
            call_at(leaves[0], (it, leaves) + args)
        else:
            call_at(leaves[2], (it, leaves) + args)
    if merge and part_m.shape[0]:
        _merge_states(part_m, part_l, part_acc, out, sinks)


_ITEMS = Compiled(_run_items)
_ROW_ITEM = Compiled(_row_item)
_GENERAL_ITEM = Compiled(_general_item)
_ATTEND_ROW = Compiled(_attend_row)
_ATTEND_ITEM = Compiled(_attend_item)
_NO_PARTS = (np.empty((0, 0, 0), np.float32), np.empty((0, 0, 0), np.float32), np.empty((0, 0, 0, 0), np.float32))
_NO_LEAVES = np.zeros(10, np.int64)  # a `leaves` array for typing the leaves' signatures (`_leaves`): values unused
_LEAVES: dict[tuple, np.ndarray] = {}  # (fingerprint of the arguments, uses, bounded) -> `_leaves`' answer


_CAPS: dict[float, np.ndarray] = {}  # softcap c -> float32 [c, 1 / c], read only by the kernels


def _cap_array(softcap: float) -> np.ndarray:
    cap = _CAPS.get(softcap)
    if cap is None:
        cap = _CAPS[softcap] = np.array([softcap, 1.0 / softcap], np.float32)
        cap.setflags(write=False)
    return cap


def _leaves(args: tuple, uses: tuple[bool, bool], bounded: bool) -> np.ndarray:
    """`_run_items`' ``leaves`` for the arguments ``args`` (all of `_run_items`' from q on): the address and
    signature tag of `_row_item` and of `_general_item` where ``uses`` says the call's items need them (compiled
    or loaded on first use), else 0, then those of the kernel each calls for the argument types the leaf passes
    it: `_attend_row`, then `_attend_item` without lows (slots 6, 7) or, for a ``bounded`` call (a window or
    chunk), with them (slots 8, 9). `_entry` keeps them in the plan's work under its key (the pool's format,
    whether a softcap is set): with the query path, the tables and ``bounded`` (the work's own), those fix every
    argument's type (q is float32 and contiguous, sinks float32, lows an int64 array, the rest made by `_work`
    and `_run`); should one differ, the tag checks in `_run_items` and the leaves raise instead. Calling by address
    skips numba's argument fingerprinting, a fixed cost on every call. Every plan's work asks once (a decode step
    plans anew), and the answer depends only on the argument types, so it is also kept across plans by the
    fingerprint of ``args``: finding the addresses again each step cost several times more than finding them
    kept (docs/results/first_layer_split.py).

    The leaves and the item loop take the rows' lowest keys as an array in every call (the rows' kv_starts
    without a window or chunk) and only `_attend_item` is specialised on their absence, where a constant first
    key keeps its tile loops as fast as they were (`_tile_offset`): one specialisation of `_run_items`,
    `_row_item`, `_general_item` and `calls.fan_out` where there were two, each taking seconds of CPU to compile
    (docs/archive/benchmarks-2026.md, "Kernel compile time (numba, CPU)")."""
    kinds = (compute_fingerprint(args), uses, bounded)
    leaves = _LEAVES.get(kinds)
    if leaves is None:
        q, q_scale, sm, cap, _, kc, ks, vc, vs, tables, _, limits, lows = args[:13]
        with_it = (INDEX, _NO_LEAVES, *args)
        # The item's state as `_item_state` makes it: m, denom [hkv, rows], acc [hkv, rows, d], float32.
        m, acc = np.empty((1, 1), np.float32), np.empty((1, 1, 1), np.float32)
        row = general = attend_row = plain = with_lows = (0, 0)
        if uses[0]:
            row = _ROW_ITEM.address(with_it)
            attend_row = _ATTEND_ROW.address((q, q_scale, sm, cap, kc, ks, vc, vs, tables, *[INDEX] * 4, m, m, acc))
        if uses[1]:
            general = _GENERAL_ITEM.address(with_it)
            attend = (q, sm, cap, kc, ks, vc, vs, tables, *[INDEX] * 5, limits, lows if bounded else None, m, m, acc)
            if bounded:
                with_lows = _ATTEND_ITEM.address(attend)
            else:
                plain = _ATTEND_ITEM.address(attend)
        leaves = _LEAVES[kinds] = np.array([*row, *general, *attend_row, *plain, *with_lows], np.int64)
    return leaves


def _entry(found: dict, key: tuple, uses: tuple, bounded: bool, splits: int, args: tuple, o: np.ndarray,
           sinks: np.ndarray) -> tuple:
    """What every call of one work and ``key`` passes unchanged, found once and kept in the work (``found``):
    ``(leaves, fan_out's address and tag for _run_items, the merge's address and tag, ran)``; (0, 0) for no merge
    (a single key range); ``ran`` [serial, parallel]: whether a call in that mode has run. Looked up piece by
    piece each call (four tuples built, four dict reads, the leaves' argument tuple), this was a sizeable part of a
    decode call's fixed cost."""
    entry = found.get(key)
    if entry is None:  # callers look first themselves: even a Python call of this function counts on the hot path
        parts = _new_parts(splits, o) if splits > 1 else _NO_PARTS
        leaves = _leaves((*args, *parts), uses, bounded)
        at = _ITEMS.address((INDEX, INDEX, False, splits, leaves, *args, *parts))
        merge = _MERGE.address((*parts, o, sinks)) if splits > 1 else (0, 0)
        entry = found[key] = (leaves, at, merge, [False, False])
    return entry


def _new_parts(splits: int, o: np.ndarray) -> tuple:
    """The split states `_new_states` allocates inside a serial call, from Python: a parallel call's workers
    write them, so the runner allocates them once and keeps them in the work between calls."""
    n, hq, d = o.shape
    return (np.empty((splits, n, hq), np.float32), np.empty((splits, n, hq), np.float32),
            np.empty((splits, n, hq, d), np.float32))


@njit(fastmath=True, inline="always")
def normaliser(total, mx, sinks, head):
    """1 / the softmax denominator of a row whose unnormalised state has sum `total` relative to max `mx`: with
    a sink logit z (`sinks[head]`; sinks empty, `_NO_SINKS`: none) the denominator is total + e^(z - mx), computed
    relative to max(mx, z) so neither exponential overflows. A row that saw no key (total 0) gets 0: zeros.
    A runtime test, once per row and head (not per key), instead of a specialisation per None-or-array: one
    specialisation fewer per window and softcap combination, each 50-80 s of CPU to compile. Shared with the
    4-bit kernel's merge (ops/cpu_q4.py)."""
    if sinks.shape[0] == 0:
        return _inverse(total)
    return _with_sink(total, mx, sinks[head])


@njit(fastmath=True, inline="always")
def _inverse(total):
    """`normaliser` without a sink: 1 / total, or 0 for a row that saw no key."""
    if total <= 0:
        return np.float32(0.0)
    return np.float32(1.0) / total


@njit(fastmath=True, inline="always")
def _with_sink(total, mx, z):
    """`normaliser` with the sink logit z."""
    if total <= 0:
        return np.float32(0.0)
    if z <= mx:
        return np.float32(1.0) / (total + _exp_nonpos(z - mx))
    f = _exp_nonpos(mx - z)  # out = acc e^(mx - z) / (total e^(mx - z) + 1)
    return f / (total * f + np.float32(1.0))


@njit(fastmath=True, cache=True)
def _merge_states(part_m, part_l, part_acc, out, sinks):
    """Combine split softmax states: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, plus the head's sink
    (once, here, never per split) in the denominator. A few microseconds of work: never worth waking the
    thread pool (after a parallel call it runs on the calling thread)."""
    nsplit, n, hq, d = part_acc.shape
    for w in range(n * hq):
        row = w // hq
        head = w % hq
        mx = NEG
        for sp in range(nsplit):
            mx = max(mx, part_m[sp, row, head])
        total = np.float32(0.0)
        o = out[row, head]
        for c in range(d):  # a loop, not `o[:] = 0`: inside a parallel kernel an array expression became a
            o[c] = 0.0  # parallel region of its own, one thread launch per (row, head)
        for sp in range(nsplit):
            if part_l[sp, row, head] > 0:
                wgt = _exp_nonpos(part_m[sp, row, head] - mx)
                total += wgt * part_l[sp, row, head]
                a = part_acc[sp, row, head]
                for c in range(d):
                    o[c] += wgt * a[c]
        inv = normaliser(total, mx, sinks, head)
        for c in range(d):
            o[c] *= inv


_MERGE = Compiled(_merge_states)
_KERNEL = (_run_items, _row_item, _general_item, _attend_row, _attend_item, _merge_states)  # what a call compiles


# -- host side ----------------------------------------------------------------------------------------------
# id(pool) -> {layer: numpy views}, an entry dropped when its pool is (weakref.finalize): a plain dict read, where
# a WeakKeyDictionary's lookup is a Python method building a weak reference on every call.
_VIEWS: dict[int, dict] = {}


def _layer_arrays(pool: KvPool, layer: int) -> tuple:
    """Zero-copy numpy views of one layer; F16 codes are viewed as int16 bits. Kept per pool (a pool's tensors
    live as long as it does): building them on every layer call was a sizeable share of a short decode."""
    views = _VIEWS.get(id(pool))
    if views is None:
        views = _VIEWS[id(pool)] = {}
        weakref.finalize(pool, _VIEWS.pop, id(pool), None)
    arrays = views.get(layer)
    if arrays is None:
        k, v = pool.layer_parts(layer)
        (kc, ks), (vc, vs) = codes_and_scales(pool.format, k), codes_and_scales(pool.format, v)
        if not int8_codes(pool.format):
            kc, vc = kc.view(torch.int16), vc.view(torch.int16)
        arrays = views[layer] = (kc.numpy(), None if ks is None else ks.numpy(), vc.numpy(),
                                 None if vs is None else vs.numpy())
    return arrays


@njit(cache=True)
def _num_splits(sequences: int, longest: int, threads: int) -> int:
    """Key ranges per sequence so that about two work items exist per thread (the fixed assignment can then
    even out a few long sequences), but none shorter than MIN_SPLIT_KEYS. A single sequence gets one range per
    thread: its ranges are equal by construction, and two per thread cost each worker a second state to store
    and the merge two more to read (docs/archive/benchmarks-2026.md, "The call's fixed cost")."""
    want = threads if sequences == 1 else (2 * threads + max(sequences, 1) - 1) // max(sequences, 1)
    return max(1, min(want, longest // MIN_SPLIT_KEYS))


# `_assign_items` and `_decode_items` are compiled: a decode step plans its items every step (the lengths grow),
# and the same work in numpy, ~20 calls on arrays of a few elements, each paying numpy's per-call overhead,
# cost more a step than the whole gap between the transformers drop-in and DynamicCache at short contexts.
@njit(cache=True)
def _longest_first(cost: np.ndarray) -> np.ndarray:
    """Indices of ``cost`` by decreasing value, equal values in index order: a bottom-up merge sort written out
    (numba's own stable argsort took 1.8 s of the 4.8 s this module's item loop needed to compile)."""
    n = cost.shape[0]
    order = np.arange(n)
    spare = np.empty(n, np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            i, j = lo, mid
            for k in range(lo, hi):
                if i < mid and (j >= hi or cost[order[i]] >= cost[order[j]]):  # the left run first on a tie
                    spare[k] = order[i]
                    i += 1
                else:
                    spare[k] = order[j]
                    j += 1
        order, spare = spare, order
        width *= 2
    return order


@njit(cache=True)
def _assign_items(items: np.ndarray, row_limits: np.ndarray, workers: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Items regrouped by worker, longest first to the least loaded (greedy LPT: within 4/3 of the best split),
    ``(items, lists, pairs)``: worker w runs items lists[w]..lists[w + 1]; pairs is the total (query row, key)
    pairs, an upper bound of the work. A fixed assignment replaces numba's dynamic schedule, whose
    `parallel_chunksize` context adds a fixed cost to every call."""
    n = items.shape[0]
    cost = np.empty(n, np.int64)
    pairs = 0
    for i in range(n):
        last_row = min(items[i, 1] + max(items[i, 2], 1) - 1, row_limits.shape[0] - 1)
        cost[i] = max(min(row_limits[last_row], items[i, 4]) - items[i, 3], 0) * items[i, 2]
        pairs += cost[i]
    order = _longest_first(cost)
    load = np.zeros(workers, np.int64)
    owner = np.empty(n, np.int64)
    for i in order:
        w = 0
        for j in range(1, workers):
            if load[j] < load[w]:
                w = j
        owner[i] = w
        load[w] += cost[i] + 1
    grouped = np.empty((n, items.shape[1]), np.int64)
    lists = np.zeros(workers + 1, np.int64)
    k = 0
    for w in range(workers):  # by worker, longest first within one
        for i in order:
            if owner[i] == w:
                for c in range(items.shape[1]):
                    grouped[k, c] = items[i, c]
                k += 1
        lists[w + 1] = k
    return grouped, lists, pairs


@njit(cache=True)
def _decode_items(lens: np.ndarray, starts: np.ndarray, threads: int) -> tuple[np.ndarray, int]:
    """One decode row per sequence b, its keys [starts[b], lens[b]) cut into `splits` ranges of whole 16-key runs
    (so blocks of 16 stay aligned; the last range may be shorter or empty): ``(items [batch * splits, 6], splits)``,
    an item (sequence, row, rows 1, first key, end key, split index)."""
    batch = lens.shape[0]
    longest = 0
    for b in range(batch):
        longest = max(longest, lens[b] - starts[b])
    splits = _num_splits(batch, longest, threads)
    items = np.empty((batch * splits, 6), np.int64)
    for b in range(batch):
        chunk = -(-max(lens[b] - starts[b], 0) // splits)
        chunk = -(-chunk // cpu_simd.LANES) * cpu_simd.LANES
        for split in range(splits):
            lo = starts[b] + split * chunk
            i = b * splits + split
            items[i, 0] = b
            items[i, 1] = b
            items[i, 2] = 1
            items[i, 3] = lo
            items[i, 4] = max(min(lo + chunk, lens[b]), lo)
            items[i, 5] = split
    return items, splits


def _prefill_items(
    cu: np.ndarray, lens: np.ndarray, starts: np.ndarray, group: int, variant: AttentionVariant | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Work items of a prefill step, each query row's causal limit and, with a window or chunk (``variant``),
    each row's lowest visible key (else None: kv_start)."""
    counts = cu[1:] - cu[:-1]
    seq_of_row = np.repeat(np.arange(len(counts)), counts)
    index_in_seq = np.arange(cu[-1]) - cu[seq_of_row]
    # Query i of the n_b new tokens sits at position ctx - n_b + i and sees keys up to and including itself,
    # from its sequence's kv_start or, with a window or chunk, from its own lowest key.
    row_limits = lens[seq_of_row] - counts[seq_of_row] + index_in_seq + 1
    row_starts = starts[seq_of_row]
    lows = None if variant is None else variant.key_lows(row_limits - 1, row_starts).astype(np.int64)
    per_item = max(1, ROWS_PER_ITEM // group)
    tiles = -(-counts // per_item)
    seq = np.repeat(np.arange(len(counts)), tiles)
    k = np.arange(tiles.sum()) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    row0 = cu[seq] + k * per_item
    nrows = np.minimum(per_item, counts[seq] - k * per_item)
    # An item's keys start at its first row's lowest key: the rows' lows rise with their positions.
    first_key = starts[seq] if lows is None or not len(row0) else lows[row0]
    items = np.stack([seq, row0, nrows, first_key, lens[seq], np.zeros_like(seq)], axis=1)
    return items.astype(np.int64), row_limits.astype(np.int64), lows


@njit(fastmath=True, cache=True)
def _quantize_query16(x, d, codes, scale):
    _quantize_rows(x, d, np.float32(1.0), codes, scale)


def quantize_query_int16(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int16 path's quantizer, the same code the kernel runs on each decode row: ``(codes [n, Hq, D] int16
    in [-32767, 32767], scales [n, Hq] float32)``, ``q ~ codes * scale``, ``|q - codes * scale| <= scale / 2``
    up to float32 rounding; a row of zeros gets scale 0. (The kernel folds the softmax scale into `scale`.)"""
    x = q.float().contiguous().numpy()
    codes = np.empty(x.shape, np.int16)
    scale = np.empty(x.shape[:2], np.float32)
    _quantize_query16(x.reshape(-1), x.shape[2], codes.reshape(-1), scale.reshape(-1))
    return torch.from_numpy(codes), torch.from_numpy(scale)


@njit(cache=True)  # no fastmath: it lets LLVM assume every value finite
def all_finite(a):
    """Whether every value of the C-contiguous float array ``a`` is finite (x - x is 0 for a finite x, NaN for
    inf and NaN). The CPU backend's query check where no item loop runs (CHECKS_QUERY). Indexed from 0: iterating
    the array itself compiled to gathers, several times slower (docs/archive/benchmarks-2026.md, "Loops that numba
    indexed with gathers"): the write path's check, `cpu_rope.finite`."""
    return finite(a)


_FITS: dict[tuple, bool] = {}  # (cpu_simd.fits or int_fits, head_dim) -> its answer (jitted: each call a dispatch)
_NO_ROWS = np.empty(0, np.int64)  # the flash path's sequences of a decode step: none


def _rows_fit(fits, head_dim: int) -> bool:
    """``fits(head_dim)`` for a jitted predicate of cpu_simd (`fits`, `int_fits`), remembered per head_dim."""
    key = (fits, head_dim)
    answer = _FITS.get(key)
    if answer is None:
        answer = _FITS[key] = bool(fits(head_dim))
    return answer


def _int16_rows(head_dim: int) -> bool:
    return _rows_fit(cpu_simd.int_fits, head_dim)  # False without a variant (DOT None)


def _query_path(plan: AttentionPlan, pool: KvPool) -> str:
    """How the call multiplies q and k: "int16" (decode rows quantized in the kernel) or "exact" (float32):
    integers need INT8 keys, and the int16 path quantizes decode steps only (a prefill under it runs exact), of a
    head_dim the integer kernels take on this CPU (else exact too). Decided here, so such a call runs the exact
    kernel itself: an int16 specialisation whose rows all fell back to the float32 branch inside it was another
    compiled function, and its results matched the exact kernel's bit for bit only when both came from one
    compile (a fresh clone's suite once saw them differ)."""
    if not int8_codes(pool.format) or (
        plan.precision == "int16" and not (plan.is_decode and _int16_rows(pool.head_dim))
    ):
        return "exact"
    return plan.precision


def _runner(pool: KvPool, plan: AttentionPlan, work: tuple, cap: np.ndarray | None, sinks: np.ndarray, path: str):
    """``run(pool, layer, q)``: the numba kernel over the plan's work ``(items, row_limits, lows, bounded, splits,
    pairs, lists, tables, choice, uses, found)`` (lows: each row's lowest key, its kv_start without a window or
    chunk; bounded: whether a window or chunk set them; uses: whether the items need the row and the general leaf;
    found: the addresses and buffers kept for this work, `_entry`), for pools of ``pool``'s format and q of the
    work's number of heads; ``cap`` the softcap c as float32 ``[c, 1 / c]`` (None: none), ``sinks`` float32
    ``[Hq]`` (empty: none), ``path`` the query path (`_query_path`). What every call shares is bound here once,
    so a call is one Python frame down to `calls.fan_out` (there were five, the work unpacked and its tuples
    rebuilt at each call)."""
    items, row_limits, lows, bounded, splits, pairs, lists, tables, choice, uses, found = work
    # Decode writes every row (an item per sequence, or the merge); prefill may leave rows to the flash path or
    # to zeros (queries before a window's start). numpy allocates: its fixed cost is a fraction of torch.empty's.
    new = np.empty if plan.is_decode else np.zeros
    q_scale = _INT16_QUERY if path == "int16" else _NO_SCALE
    sm = plan.softmax_scale
    key = (pool.format, cap is None)
    workers = lists.shape[0] - 1
    no_items = items.shape[0] == 0

    def run(pool: KvPool, layer: int, q: torch.Tensor) -> torch.Tensor:
        if no_items or q.numel() == 0:  # no item loop to check q (CHECKS_QUERY): the flash path's rows, or none
            if q.numel() and not all_finite(q.numpy()):
                raise NonFiniteError("q holds NaN or inf")
            return torch.zeros(q.shape, dtype=torch.float32)
        o = new(q.shape, np.float32)
        args = (q.numpy(), q_scale, sm, cap, sinks, *_layer_arrays(pool, layer), tables, items, row_limits, lows, o)
        entry = found.get(key)
        if entry is None:
            entry = _entry(found, key, uses, bounded, splits, args, o, sinks)
        units = pairs * q.shape[1]
        parallel = choice.parallel(units, workers)
        timed = choice.timed
        if timed:
            # Only an entry's first call in a mode can compile (or load) a specialisation: its addresses are
            # found (`_entry`) and every later call passes arguments of the same types. Counting the compiled
            # specialisations on every timed call (one in eight) was a noticeable share of a decode call.
            fresh = not entry[3][parallel]
            compiled = compiled_count(*_KERNEL) if fresh else 0
            start = time.perf_counter()
        if not parallel:
            _run_items(0, items.shape[0], True, splits, entry[0], *args, *_NO_PARTS)
        elif splits > 1:
            # The split-state buffers are kept in the work between calls (taken out while a call uses them, so a
            # concurrent call allocates its own): numpy's three allocations and the merge's own dispatch were
            # about a tenth of a short decode call. The merge runs on the calling thread within fan_out's call.
            parts = found.pop("parts", None)
            if parts is None or parts[2].shape != (splits, *o.shape):
                parts = _new_parts(splits, o)
            launch(fan_out, *entry[1], lists, (False, splits, entry[0], *args, *parts), *entry[2], (*parts, o, sinks))
            found["parts"] = parts
        else:
            # No merge to run (then = 0), but its arguments of the same types as a merge's: one specialisation of
            # fan_out for calls with and without split keys (each ~0.9 s of CPU to compile).
            launch(fan_out, *entry[1], lists, (False, splits, entry[0], *args, *_NO_PARTS), 0, 0,
                   (*_NO_PARTS, o, sinks))
        if timed:
            seconds = time.perf_counter() - start
            # A call that compiled (or loaded from numba's disk cache) a specialisation measured that, not the
            # kernel: one such 0.23 s sample once made the serial estimate 5,000x too high and every call parallel.
            none_compiled = not fresh or compiled_count(*_KERNEL) == compiled
            choice.record(parallel, units, workers, seconds if none_compiled else None)
        entry[3][parallel] = True
        return torch.from_numpy(o)

    return run


# -- long prefill chunks: K/V tiles through torch's fused flash kernel, merged by log-sum-exp --------------
def _load_rows(codes: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """K or V rows of `slots` as float32 `[kv_heads, tile, head_dim]`; only this tile is ever converted.
    INT8 scales go on the tile, not on the scores or weights: q . (s_k k) = s_k (q . k) and
    sum_t p_t (s_v,t v_t) = sum_t (p_t s_v,t) v_t either way, but the tile has head_dim values per key where the
    scores have one per query row (hundreds), and the scaling rides along with the int8 -> float32 conversion."""
    rows = codes.index_select(0, slots)
    if scales is None:
        return rows.to(torch.float32).transpose(0, 1)
    return torch.mul(rows, scales.index_select(0, slots).unsqueeze(2)).transpose(0, 1)


def _attend_tile(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, state: list | None,
    empty: torch.Tensor | None = None,
):  # fmt: skip
    """Attention of `q [1, kv_heads, rows, head_dim]` to one K/V tile, folded into the running [output, log-sum-exp]
    of the earlier tiles (None: this is the first). Torch's fused CPU flash kernel does the tile: it keeps each
    row's scores in cache through max, exp and sum, where separate amax / exp / sum calls stream the score tile
    through memory several times (3x slower here). It returns the tile's log-sum-exp, all a merge needs:
        o = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b)
    `empty` [rows] marks rows that see no key of the tile: torch returns output 0 and log-sum-exp 0 (not -inf)
    for them, so their log-sum-exp is set to NEG and they weigh nothing in the merge."""
    out, lse = _sdpa_tile(q, k, v, 0.0, False, attn_mask=mask, scale=1.0)
    if empty is not None:
        lse = lse.masked_fill(empty, float(NEG))
    lse = lse.unsqueeze(3)
    if state is None:
        return [out, lse]
    total = torch.logaddexp(state[1], lse)
    state[0].mul_(torch.exp(state[1] - total)).add_(out.mul_(torch.exp(lse - total)))
    state[1] = total
    return state


def _tile_mask(lows: torch.Tensor, first: int, p0: int, p1: int, group: int) -> torch.Tensor:
    """The additive mask of keys [p0, p1) for queries at positions first, first + 1, ... seeing keys
    [lows[i], first + i]: `[len(lows) * group, p1 - p0]`, 0 or -inf, rows (query, head of the group)."""
    key = torch.arange(p0, p1)[None, :]
    pos = torch.arange(first, first + lows.shape[0])[:, None]
    hidden = (key > pos) | (key < lows[:, None])
    return torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf")).repeat_interleave(group, dim=0)


def _flash_sequence(
    q: torch.Tensor, layer_rows: tuple, slots: torch.Tensor, first: int, start: int,
    lows: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of `q [kv_heads, n, group, head_dim]` (softmax scale folded in), whose query i sits at
    position first + i >= start, over keys [start, first + n) at `slots` (indexed by position - start). With
    `lows` (int64 [n], a window or chunk) query i sees keys from lows[i] only; `sinks [kv_heads, group]`: the
    heads' sink logits, added to each row's denominator at the end, e^lse / (e^lse + e^z) = sigmoid(lse - z)."""
    kc, ks, vc, vs = layer_rows
    hkv, n, group, d = q.shape
    out = torch.empty(hkv, n, group, d)
    per_block = max(1, FLASH_QUERY_ROWS // group)

    def attend(qb, lo, hi, mask, state, empty=None):
        tile = slots[lo - start : hi - start]
        k, v = _load_rows(kc, ks, tile).unsqueeze(0), _load_rows(vc, vs, tile).unsqueeze(0)
        return _attend_tile(qb, k, v, mask, state, empty)

    for i0 in range(0, n, per_block):
        i1 = min(n, i0 + per_block)
        nq = i1 - i0
        # Rows are (query, head of the group), so one K/V tile serves the whole group in each matmul.
        qb = q[:, i0:i1].reshape(1, hkv, nq * group, d)
        # Keys from the block's last query's low to the block's first position are visible to all its queries:
        # plain tiles, no mask. Below that low (a window or chunk) tiles are masked, and some rows may see none
        # of their keys. The causal cut falls in the block's own nq keys, one masked tile in which every row
        # sees itself.
        diag = first + i0
        block_lows = torch.full((nq,), start) if lows is None else lows[i0:i1]
        common = int(block_lows[-1])
        state = None
        for p0 in range(int(block_lows[0]), diag, FLASH_KEY_TILE):
            p1 = min(diag, p0 + FLASH_KEY_TILE)
            if p0 >= common:
                state = attend(qb, p0, p1, None, state)
            else:
                empty = (block_lows >= p1).repeat_interleave(group)
                state = attend(qb, p0, p1, _tile_mask(block_lows, diag, p0, p1, group), state, empty)
        state = attend(qb, diag, first + i1, _tile_mask(block_lows, diag, diag, first + i1, group), state)
        o = state[0]
        if sinks is not None:
            z = sinks[:, None, :].expand(hkv, nq, group).reshape(1, hkv, nq * group, 1)
            o = o * torch.sigmoid(state[1] - z)
        out[:, i0:i1] = o.view(hkv, nq, group, d)
    return out


def _flash_prefill(
    pool: KvPool, layer: int, q_all: torch.Tensor, plan: AttentionPlan, out: torch.Tensor, seqs,
    variant: AttentionVariant | None = None, lows: np.ndarray | None = None,
):  # fmt: skip
    """Fill the rows of sequences `seqs` in `out [total, Hq, D]`, one sequence at a time. `lows`: each query
    row's lowest visible key (a window or chunk; None: kv_start)."""
    hkv, d, bs = pool.num_kv_heads, pool.head_dim, pool.block_size
    assert plan.host is not None
    cu, lens, starts = plan.host.cu_seqlens_q, plan.host.context_lens, plan.host.kv_starts
    k, v = pool.layer_rows(layer)
    layer_rows = (*codes_and_scales(pool.format, k), *codes_and_scales(pool.format, v))
    group = q_all.shape[1] // hkv
    for b in seqs:
        lo, hi, ctx = int(cu[b]), int(cu[b + 1]), int(lens[b])
        first = ctx - (hi - lo)  # position of the chunk's first query
        skip = max(0, int(starts[b]) - first)  # queries before the window start see nothing: zeros
        if lo + skip >= hi:
            continue
        start = int(starts[b])
        row_lows = None if lows is None else torch.from_numpy(lows[lo + skip : hi])
        least = start if row_lows is None else int(row_lows[0])  # keys below it are never read
        pos = torch.arange(least, ctx)
        slots = plan.block_tables[b].long()[pos // bs] * bs + pos % bs
        q = q_all[lo + skip : hi] * plan.softmax_scale
        q = q.view(hi - lo - skip, hkv, group, d).transpose(0, 1)
        sinks = None if variant is None or variant.sinks is None else variant.sinks.view(hkv, group)
        o = _flash_sequence(q, layer_rows, slots, first + skip, least, row_lows, sinks)
        out[lo + skip : hi] = o.transpose(0, 1).reshape(hi - lo - skip, hkv * group, d)


def _work(plan: AttentionPlan, pool: KvPool, num_q_heads: int, threads: int, variant: AttentionVariant | None) -> tuple:
    """The plan's work items, assigned to workers, its block tables as numpy and the ThreadChoice of this kind of
    call, which sequences take the flash path, and the query rows' lowest keys for it (None: their kv_starts):
    the same for every layer with the same window and chunk, so built by the first such layer and kept in the
    plan (``plan.derived``). A window or chunk shrinks each item's key range to the keys its rows may see, so a
    decode row costs ~window keys at any context and keys below every row's window are never read."""
    host = plan.host
    assert host is not None, "the cpu backend needs a plan built for a CPU pool"
    group = num_q_heads // pool.num_kv_heads
    lens, starts, cu = host.context_lens, host.kv_starts, host.cu_seqlens_q
    bounded = variant if variant is not None and variant.bounds_keys else None
    if plan.is_decode:
        lows = None if bounded is None else bounded.key_lows(lens - 1, starts).astype(np.int64)
        items, splits = _decode_items(lens, starts if lows is None else lows, threads)
        row_limits, long = lens, None  # no prefill chunks: none takes the flash path
    else:
        items, row_limits, lows = _prefill_items(cu, lens, starts, group, bounded)
        splits = 1
        counts = cu[1:] - cu[:-1]
        if lows is None:
            pairs = counts * (lens - counts) + counts * (counts + 1) // 2  # visible (query, key) pairs
        else:
            seen = np.maximum(row_limits - lows, 0)
            pairs = np.bincount(np.repeat(np.arange(len(counts)), counts), seen, len(counts)).astype(np.int64)
        long = (counts >= FLASH_MIN_QUERIES) & (pairs >= FLASH_MIN_PAIRS)
        if _sdpa_tile is None or (variant is not None and variant.softcap is not None):
            long[:] = False  # torch's fused kernel has no hook on the scores: capped chunks stay on the numba kernel
        items = items[~long[items[:, 0]]]
    workers = max(1, min(threads, items.shape[0]))
    if items.shape[0]:
        items, lists, pairs_total = _assign_items(items, row_limits, workers)
    else:
        lists, pairs_total = np.zeros(2, np.int64), 0
    integer_q = _query_path(plan, pool)
    capped = variant is not None and variant.softcap is not None  # tanh per score: another cost per unit
    choice = thread_choice((pool.format, integer_q, plan.is_decode, num_q_heads, pool.head_dim, capped))
    fit = _rows_fit(cpu_simd.fits, pool.head_dim) if integer_q == "exact" else _int16_rows(pool.head_dim)
    if plan.is_decode:  # one row per item
        uses = (fit and items.shape[0] > 0, not fit and items.shape[0] > 0)
    else:
        single = items[:, 2] == 1
        uses = (fit and bool(single.any()), bool((~single).any()) or (not fit and items.shape[0] > 0))
    # The kernels take each row's lowest key in every call (`_leaves`): without a window or chunk, its kv_start.
    row_lows = lows
    if lows is None:
        row_lows = host.kv_starts if plan.is_decode else np.repeat(host.kv_starts, cu[1:] - cu[:-1])
    tables = plan.block_tables.numpy()
    work = (items, row_limits, row_lows, lows is not None, splits, pairs_total, lists, tables, choice, uses, {})
    return work, _NO_ROWS if long is None else np.flatnonzero(long), lows


def prepare(pool: KvPool, plan: AttentionPlan, num_q_heads: int, variant: AttentionVariant | None = None):
    """`attend` for every layer that shares ``plan``, ``num_q_heads`` and ``variant``: ``run(pool, layer, q)``,
    with the work items, thread choice, query path and softcap resolved here once (`ops.PreparedAttention`).

    Without a variant the ``run`` itself is kept in the plan, per number of query heads, numba thread count and
    format, so `ops.attention` called layer after layer with one plan resolves it once; most of what is left
    of a call's fixed cost is asking numba's thread count, which `numba_threads.thread_count` does far faster
    than `numba.get_num_threads` (docs/archive/benchmarks-2026.md, "Per-call cost of `ops.attention`")."""
    if getattr(pool, "writes_by_step", False):  # int8kv.cache.pool_q4w: its own kernel
        from .cpu_q4w import attend as attend_q4w

        def checked(pool: KvPool, layer: int, q: torch.Tensor) -> torch.Tensor:
            if not all_finite(q.numpy()):  # CHECKS_QUERY
                raise NonFiniteError("q holds NaN or inf")
            return attend_q4w(pool, layer, q, plan, variant)

        return checked
    threads = thread_count()
    if variant is None:
        key = ("cpu-run", num_q_heads, threads, pool.format)
        return plan.derived(key, lambda: _prepare(pool, plan, num_q_heads, None, threads))
    return _prepare(pool, plan, num_q_heads, variant, threads)


def _prepare(pool: KvPool, plan: AttentionPlan, num_q_heads: int, variant: AttentionVariant | None, threads: int):
    """`prepare`'s ``run``, built."""
    key: tuple = ("cpu-work", num_q_heads, threads)
    cap, sinks = None, _NO_SINKS
    if variant is not None:
        if variant.softcap is not None:
            cap = _cap_array(variant.softcap)
        sinks = _NO_SINKS if variant.sinks is None else variant.sinks.numpy()
        if variant.bounds_keys or cap is not None:  # sinks alone change no key range: the plain work serves them
            key = (*key, variant.window, variant.chunk, cap is not None)
    work, long, lows = plan.derived(key, lambda: _work(plan, pool, num_q_heads, threads, variant))
    kernel = _runner(pool, plan, work, cap, sinks, _query_path(plan, pool))
    if not long.size:
        return kernel

    def run(pool: KvPool, layer: int, q: torch.Tensor) -> torch.Tensor:
        out = kernel(pool, layer, q)
        _flash_prefill(pool, layer, q, plan, out, long, variant, lows)
        return out

    return run


def attend(pool: KvPool, layer: int, q: torch.Tensor, plan: AttentionPlan, variant: AttentionVariant | None = None):
    """Causal attention of ``q [num_queries, Hq, D]`` (float32, contiguous) over ``plan``: float32, q's shape.
    ``variant``: a window, chunk, softcap or sinks of this call (:class:`~.plan.AttentionVariant`)."""
    return prepare(pool, plan, q.shape[1], variant)(pool, layer, q)


share_compiles(globals())  # one compile per signature across processes, and a safe disk cache (int8kv.numba_cache)
