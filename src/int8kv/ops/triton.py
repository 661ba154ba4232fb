"""Triton kernels over the paged cache: fused V1 quantize-append and attention that reads INT8 directly.

The layout is the contract of docs/design.md. On a machine without a GPU these kernels run on CPU
tensors under ``TRITON_INTERPRET=1`` (which must be set before ``triton`` is first imported).

Attention, decode and prefill, is one kernel. A program owns one (sequence, KV head, query-token block,
KV split) and stacks the query heads of the GQA group with the query tokens into the rows of one tile,
so every K/V row it loads serves the whole group. INT8 rows are never dequantized into memory: the key
scale multiplies the score column (``q·(s·k) = s·(q·k)``) and the value scale multiplies the softmax
weight before ``p @ v``. Softmax is the online (flash) form in base 2. For long contexts with few
(sequence, head) pairs the KV range is split across programs (flash-decoding) and a second kernel merges
the partial results.

Both matrix products run on float16 tensor cores yet keep float32-level accuracy (relative error ~1e-6):
int8 codes and float16 values are exact in float16, and the float32 side (q, and the softmax weights) is
split into a float16 high part and a float16 low part, so each product is two dots. That is a third of the
tensor-core work of TF32x3 (decode must stay memory-bound) and works the same in the interpreter.

Constexpr switches, compiled and checked but off by default until timed on a GPU (``attention(...)``
options, docs/archive/benchmarks-2026.md for their registers): ``magic`` (int8 -> float16 by bit arithmetic instead of
I2F), ``hilo=False`` (one float16 product each, ~2e-4 relative error), ``block_n`` and ``num_stages``.
``python -m int8kv.bench.gpu_compile`` compiles every kernel and switch for sm_90/sm_80 without a GPU.

The backend interface of :mod:`int8kv.ops`: ``attend(pool, layer, q, plan)`` and ``store_rows(pool, layer,
k16, v16, slots)`` check no values: the :class:`~int8kv.ops.plan.AttentionPlan` was validated once for the
step (unit-stride int32 metadata) and the write path checked the rows. Neither reads the device back, so a
decode step with a plan built beforehand (``validate=False``) can be captured in a CUDA graph
(tests/test_ops_triton.py::test_steady_state_decode_step_reads_nothing_back). ``attention(pool, layer, q,
plan, **options)`` is ``attend`` with the tuning options; ``launch_plan`` the grid it would use;
``record_launches`` records launches instead of running them (the compile check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator

import torch
import triton
import triton.language as tl

from ..errors import LayerOutOfRange, ShapeMismatch, UnsupportedFormat
from .parts import KERNELS as PARTS_KERNELS
from .parts import codes_and_scales, int8_codes
from .plan import AttentionPlan, AttentionVariant, require_unit_stride

__all__ = [
    "KERNELS",
    "Launch",
    "LaunchShape",
    "attend",
    "attention",
    "is_compiled",
    "launch_plan",
    "record_launches",
    "store_rows",
]

#: The formats' ``kernel`` values read here: F16 and INT8 pages, and the 4-bit sink-and-window pool's
#: (ops/triton_q4w.py, dispatched by :func:`attention`).
KERNELS = PARTS_KERNELS | {"int4_sink_window"}
_LOG2E = 1.4426950408889634
_MIN_CHUNK = 256  # shortest KV range worth a split: below it the merge costs more than it saves
_MAX_SPLITS = 64


# --------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _rint_to_int32(y):
    # torch.round is round-half-to-even. libdevice's rint is not available in the interpreter and the
    # float magic-number trick depends on the compiler never reassociating, so round with floor plus an
    # exact tie test: y - floor(y) is exact for every finite float32.
    f = tl.floor(y)
    frac = y - f
    i = f.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))
    return i + up.to(tl.int32)


@triton.jit
def _encode_rows(
    x_ptr,
    stride_xt,
    stride_xh,
    stride_xd,
    codes_ptr,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    scales_ptr,
    stride_sb,
    stride_so,
    stride_sh,
    t,
    page,
    off,
    num_heads,
    head_dim,
    IS_INT8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    mask = h_ok[:, None] & (d[None, :] < head_dim)
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :] * stride_xd, mask=mask, other=0.0)
    # The wrapper hands over float16 already (it ran the finiteness checks on it), so this cast is exact;
    # it keeps the kernel correct for any float input too.
    x16 = x.to(tl.float16)
    dst = codes_ptr + page * stride_cb + off * stride_co + h[:, None] * stride_ch + d[None, :] * stride_cd
    if IS_INT8:
        x32 = x16.to(tl.float32)
        # Padding lanes hold 0 and cannot raise the max of |x|.
        amax = tl.max(tl.abs(x32), axis=1)
        # IEEE division, not the approximate one, so scales and codes match the torch codec bit for bit.
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        scale = tl.where(scale == 0.0, 1.0, scale)
        y = tl.math.div_rn(x32, tl.broadcast_to(scale[:, None], x32.shape))
        q = _rint_to_int32(y)
        q = tl.minimum(tl.maximum(q, -127), 127)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scales_ptr + page * stride_sb + off * stride_so + h * stride_sh, scale, mask=h_ok)
    else:
        tl.store(dst, x16, mask=mask)


@triton.jit
def _append_kernel(
    k_ptr,
    v_ptr,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_yt,
    stride_yh,
    stride_yd,
    slots_ptr,
    kc_ptr,
    vc_ptr,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    ks_ptr,
    vs_ptr,
    stride_sb,
    stride_so,
    stride_sh,
    num_heads,
    head_dim,
    PAGE: tl.constexpr,
    IS_INT8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    page = slot // PAGE
    off = slot % PAGE
    _encode_rows(
        k_ptr, stride_xt, stride_xh, stride_xd,
        kc_ptr, stride_cb, stride_co, stride_ch, stride_cd,
        ks_ptr, stride_sb, stride_so, stride_sh,
        t, page, off, num_heads, head_dim, IS_INT8, BLOCK_H, BLOCK_D,
    )  # fmt: skip
    _encode_rows(
        v_ptr, stride_yt, stride_yh, stride_yd,
        vc_ptr, stride_cb, stride_co, stride_ch, stride_cd,
        vs_ptr, stride_sb, stride_so, stride_sh,
        t, page, off, num_heads, head_dim, IS_INT8, BLOCK_H, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _key_low(pos, kv_lo, window, att_chunk, WINDOW: tl.constexpr, CHUNKED: tl.constexpr):
    """The lowest key a query at ``pos`` (a scalar or a vector) sees: kv_start, raised by a sliding window
    (``pos - window < key``) and by chunked attention (chunks of ``att_chunk`` counted from kv_start). Queries
    before kv_start see nothing whatever this returns (their causal limit is at or below it)."""
    low = kv_lo + pos * 0
    if WINDOW:
        low = tl.maximum(low, pos - window + 1)
    if CHUNKED:
        low = tl.maximum(low, kv_lo + (tl.maximum(pos - kv_lo, 0) // att_chunk) * att_chunk)
    return low


@triton.jit
def _tanh(x):
    """tanh from one exp2 (libdevice's tanh is not in the interpreter): absolute error ~1e-7."""
    e = tl.exp2(-2.885390081777927 * tl.abs(x))  # e^(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _kv_range(t0, n_q, ctx, kv_lo, pid_s, chunk, TOKENS: tl.constexpr, SPLIT: tl.constexpr):
    """Keys ``[lo, hi)`` one program scans: its query block's causal reach from ``kv_lo`` (kv_start, or the block's
    first query's window or chunk start), cut to its split.

    A query block past the sequence's last query (``t0 >= n_q``: a decoding sequence beside a long prefill
    chunk in one launch) gets the empty range instead of a full scan with every row masked.
    """
    kv_hi = ctx - n_q + tl.minimum(t0 + TOKENS, n_q)
    lo = kv_lo
    if SPLIT:
        lo = kv_lo + pid_s * chunk
        kv_hi = tl.minimum(kv_hi, lo + chunk)
    hi = tl.where(t0 < n_q, kv_hi, lo)
    return lo, hi


@triton.jit
def _codes_to_f16(x, IS_INT8: tl.constexpr, MAGIC: tl.constexpr):
    """Stored K/V codes as float16 (exact: int8 codes and F16 values are both float16 numbers).

    MAGIC converts int8 without an int-to-float instruction: 0x6480 is the float16 1152.0, whose unit in the
    last place is 1, so adding a code in [-128, 127] to its bits as int16 gives the float16 1152 + code;
    subtracting 1152 is exact.
    """
    if IS_INT8 and MAGIC:
        y = (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True)
        return y - 1152.0
    else:
        return x.to(tl.float16)


@triton.jit
def _query_tile(
    q_ptr, stride_qt, stride_qh, stride_qd, cu_ptr, ctx_ptr, start_ptr, b, kvh, pid_m, head_dim,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_START: tl.constexpr,
):  # fmt: skip
    """A program's query tile, shared by the attention kernels: sequence ``b``'s query count ``n_q``, its context
    length ``ctx`` and first visible key ``kv_lo``; row r of the tile is query token ``t0 + r // GROUP`` (of the
    sequence: ``t_local``; of the batch: ``token``), query head ``qh = kvh * GROUP + r % GROUP``; ``row_ok``,
    ``d`` / ``d_ok`` (the head_dim lanes) and the rows of q, float32 ``[BLOCK_M, BLOCK_D]`` (0 outside)."""
    # Metadata may come as int64; positions fit int32 and the loop bounds must share one type.
    q_begin = tl.load(cu_ptr + b).to(tl.int32)
    n_q = tl.load(cu_ptr + b + 1).to(tl.int32) - q_begin
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    kv_lo = 0
    if HAS_START:
        kv_lo = tl.load(start_ptr + b).to(tl.int32)
    t0 = pid_m * TOKENS
    r = tl.arange(0, BLOCK_M)
    t_local = t0 + r // GROUP
    qh = kvh * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (t_local < n_q)
    token = (q_begin + t_local).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + qh[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    return n_q, ctx, kv_lo, t0, t_local, qh, row_ok, token, d, d_ok, q


@triton.jit
def _split16(x):
    """float32 ``x`` [M, K] scaled per row to max |x| = 1, as float16 high and low parts, and the row scales.

    Tensor cores take float16 at twice the TF32 rate, and int8 codes, 4-bit codes and F16 values are exact in
    float16, so only the other operand needs care: it is carried as two float16 parts (hi + lo, about 22
    significant bits), each row first scaled to max |x| = 1 so neither part can overflow and the low part keeps
    clear of float16 subnormals. The row's scale goes back in after the product."""
    x_max = tl.max(tl.abs(x), axis=1)
    x_max = tl.where(x_max > 0.0, x_max, 1.0)
    x = x / x_max[:, None]
    x_hi = x.to(tl.float16)
    x_lo = (x - x_hi.to(tl.float32)).to(tl.float16)
    return x_hi, x_lo, x_max


@triton.jit
def _dot2(a_hi, a_lo, b, HILO: tl.constexpr):
    """``(a_hi + a_lo) @ b`` in float32 (float16 tensor-core products; ``a_hi @ b`` alone without HILO)."""
    if HILO:
        out = tl.dot(a_lo, b)
        out = tl.dot(a_hi, b, out)
    else:
        out = tl.dot(a_hi, b)
    return out


@triton.jit
def _online_step(m_i, l_i, s):
    """One tile of the online softmax (base 2): scores ``s`` [M, N] (-inf where masked) against the running max
    ``m_i`` and sum ``l_i`` [M] -> ``(m_new, alpha, p, l_new)``: the accumulator is rescaled by ``alpha`` before
    ``p``'s products join it."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with every key masked so far keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _store_tile(
    out_ptr, stride_os, stride_ot, stride_oh, ml_ptr, stride_mls, stride_mlt, stride_mlh, sinks_ptr,
    acc, m_i, l_i, pid_s, token, qh, row_ok, d, d_ok, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """A program's result: with SPLIT the unnormalised partials and their (m, l) for the merge kernel, which
    rescales them to a common max; else ``acc / l`` with the sinks (per query head logits) in the denominator."""
    out_rows = pid_s.to(tl.int64) * stride_os + token * stride_ot + qh * stride_oh
    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + out_rows[:, None] + d[None, :], acc, mask=out_mask)
        ml_rows = pid_s.to(tl.int64) * stride_mls + token * stride_mlt + qh * stride_mlh
        tl.store(ml_ptr + ml_rows, m_i, mask=row_ok)
        tl.store(ml_ptr + ml_rows + 1, l_i, mask=row_ok)
    else:
        if HAS_SINKS:
            z = tl.load(sinks_ptr + qh, mask=row_ok, other=0.0) * 1.4426950408889634
            l_i, f = _with_sink(l_i, m_i, z)
            acc = acc * f[:, None]
        # No visible key (kv_start at or past the limit) gives zeros rather than NaN.
        denom = tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(out_ptr + out_rows[:, None] + d[None, :], acc / denom[:, None], mask=out_mask)


@triton.jit
def _attention_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    out_ptr,
    stride_os,
    stride_ot,
    stride_oh,
    ml_ptr,
    stride_mls,
    stride_mlt,
    stride_mlh,
    k_ptr,
    v_ptr,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    ks_ptr,
    vs_ptr,
    stride_sb,
    stride_so,
    stride_sh,
    bt_ptr,
    stride_btb,
    ctx_ptr,
    start_ptr,
    cu_ptr,
    sinks_ptr,
    num_kv_heads,
    head_dim,
    chunk,
    m_blocks,
    qk_scale,
    window,
    att_chunk,
    softcap,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_INT8: tl.constexpr,
    HAS_START: tl.constexpr,
    SPLIT: tl.constexpr,
    MAGIC: tl.constexpr,
    HILO: tl.constexpr,
    WINDOW: tl.constexpr = False,
    CHUNKED: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    # Axis 0 folds (sequence, KV head) with the query block, query block fastest so neighbouring programs
    # share K/V in L2; axis 1 is the KV split (<= _MAX_SPLITS). A separate query-block axis would be grid
    # axis y, limited to 65,535 (an MQA prefill of 8 tokens per block reaches it at 524k tokens).
    pid = tl.program_id(0)
    pid_bh = pid // m_blocks
    pid_m = pid % m_blocks
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads

    n_q, ctx, kv_lo, t0, t_local, qh, row_ok, token, d, d_ok, q = _query_tile(
        q_ptr, stride_qt, stride_qh, stride_qd, cu_ptr, ctx_ptr, start_ptr, b, kvh, pid_m, head_dim,
        GROUP, TOKENS, BLOCK_M, BLOCK_D, HAS_START,
    )  # fmt: skip
    q_hi, q_lo, q_max = _split16(q)
    row_scale = q_max * qk_scale

    # The queries are the last n_q positions: row token i sees keys < ctx - n_q + i + 1, from its key_low.
    row_limit = ctx - n_q + t_local + 1
    if WINDOW or CHUNKED:
        row_low = _key_low(row_limit - 1, kv_lo, window, att_chunk, WINDOW, CHUNKED)
        # Rows' lows rise with their positions: the block's first query has the lowest; no key below it is read.
        kv_lo = _key_low(ctx - n_q + t0, kv_lo, window, att_chunk, WINDOW, CHUNKED)
    lo, hi = _kv_range(t0, n_q, ctx, kv_lo, pid_s, chunk, TOKENS, SPLIT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head_off = kvh * stride_kh
    scale_head_off = kvh * stride_sh

    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        # Each key of the tile is gathered through the block table, so a tile may span several pages
        # and the tile width does not depend on the page size.
        page = tl.load(bt_ptr + b * stride_btb + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        off = (n % PAGE).to(tl.int64)
        row_off = page * stride_kb + off * stride_ko + kv_head_off

        k_t = tl.load(k_ptr + row_off[None, :] + d[:, None] * stride_kd, mask=n_ok[None, :] & d_ok[:, None], other=0)
        k_t = _codes_to_f16(k_t, IS_INT8, MAGIC)
        s = _dot2(q_hi, q_lo, k_t, HILO) * row_scale[:, None]
        if IS_INT8:
            s_k = tl.load(ks_ptr + page * stride_sb + off * stride_so + scale_head_off, mask=n_ok, other=0.0)
            s = s * s_k[None, :]
        if SOFTCAP:  # softcap arrives in base-2 units too: c tanh(x / c) scales with the logit
            s = softcap * _tanh(s / softcap)
        seen = n_ok[None, :] & (n[None, :] < row_limit[:, None])
        if WINDOW or CHUNKED:
            seen = seen & (n[None, :] >= row_low[:, None])
        s = tl.where(seen, s, float("-inf"))

        m_new, alpha, p, l_i = _online_step(m_i, l_i, s)

        v = tl.load(v_ptr + row_off[:, None] + d[None, :] * stride_kd, mask=n_ok[:, None] & d_ok[None, :], other=0)
        v = _codes_to_f16(v, IS_INT8, MAGIC)
        # p (times the value scale for INT8) goes through float16 as hi + lo too. It is first scaled so its
        # largest possible value is 2^14: far from float16's max, and small weights stay out of subnormals.
        # For INT8 the tile's largest value scale is factored out and applied to the product instead.
        if IS_INT8:
            s_v = tl.load(vs_ptr + page * stride_sb + off * stride_so + scale_head_off, mask=n_ok, other=0.0)
            sv_max = tl.max(s_v, axis=0)
            sv_max = tl.where(sv_max > 0.0, sv_max, 1.0)
            pw = p * (s_v * (16384.0 / sv_max))[None, :]
            pv_scale = sv_max / 16384.0
        else:
            pw = p * 16384.0
            pv_scale = 1.0 / 16384.0
        pw_hi = pw.to(tl.float16)
        if HILO:
            pw_lo = (pw - pw_hi.to(tl.float32)).to(tl.float16)
            pv = tl.dot(pw_lo, v)
            pv = tl.dot(pw_hi, v, pv)
        else:
            pv = tl.dot(pw_hi, v)
        acc = acc * alpha[:, None] + pv * pv_scale
        m_i = m_new

    _store_tile(
        out_ptr, stride_os, stride_ot, stride_oh, ml_ptr, stride_mls, stride_mlt, stride_mlh, sinks_ptr,
        acc, m_i, l_i, pid_s, token, qh, row_ok, d, d_ok, SPLIT, HAS_SINKS,
    )  # fmt: skip


@triton.jit
def _with_sink(l_sum, m, z):
    """(denominator, factor) once a sink logit ``z`` (base 2) joins a softmax state of sum ``l_sum`` at max
    ``m``: both taken relative to max(m, z), the output is ``acc * factor / denominator``. A state that saw no
    key (m = -inf, acc = 0) stays 0."""
    big = tl.maximum(m, z)
    f = tl.exp2(m - big)
    return l_sum * f + tl.exp2(z - big), f


# The kernels' shared steps, for the 4-bit kernel (ops/triton_q4w.py).
key_low, tanh, kv_range, with_sink = _key_low, _tanh, _kv_range, _with_sink
query_tile, split16, dot2, online_step, store_tile = _query_tile, _split16, _dot2, _online_step, _store_tile


@triton.jit
def _merge_kernel(
    part_ptr,
    stride_ps,
    stride_pt,
    stride_ph,
    ml_ptr,
    stride_mls,
    stride_mlt,
    stride_mlh,
    out_ptr,
    stride_ot,
    stride_oh,
    sinks_ptr,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    # int64: num_splits x stride_ps may pass 2^31 elements where one split's plane does not.
    s = tl.arange(0, BLOCK_S).to(tl.int64)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    ml = ml_ptr + s * stride_mls + t * stride_mlt + h * stride_mlh
    m = tl.load(ml, mask=s_ok, other=float("-inf"))
    l_part = tl.load(ml + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_shift)
    l_sum = tl.sum(w * l_part, axis=0)
    part = tl.load(
        part_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], axis=0)
    if HAS_SINKS:  # the sink joins the merged state once, never a split's
        l_sum, f = _with_sink(l_sum, m_shift, tl.load(sinks_ptr + h) * 1.4426950408889634)
        o = o * f
    denom = tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o / denom, mask=d_ok)


# --------------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the wrappers would issue it: ``kernel[grid](*args, **kwargs)``."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict


_recording: list[Launch] | None = None


@contextlib.contextmanager
def record_launches():
    """Inside the block the wrappers record their kernel launches in the yielded list instead of running them.

    For compiling exactly what a call would launch (``int8kv.bench.gpu_compile``) and for checking that a
    call's host side reads nothing back from the device. Not thread-safe.
    """
    global _recording
    saved, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = saved


def _launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    if _recording is not None:
        _recording.append(Launch(kernel, tuple(grid), args, kwargs))
    else:
        kernel[grid](*args, **kwargs)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``, or record it inside :func:`record_launches` (for the kernels of
    other modules of this backend: ops/triton_q4w.py)."""
    _launch(kernel, grid, *args, **kwargs)


def is_compiled() -> bool:
    """Whether this module's kernels were bound to the compiler (False: ``TRITON_INTERPRET=1`` at first import)."""
    return type(_attention_kernel).__name__ == "JITFunction"


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(1, int(n))))


pow2 = _pow2  # the block sizes' rule, for ops/triton_q4w.py


def _layer_tensors(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(k codes, v codes, k scales, v scales)`` of one layer of a pool (or a paged cache), checked: a format
    these kernels read, the parts' shapes, one set of strides for K and V."""
    pool = getattr(cache, "pool", cache)
    try:
        index = operator.index(layer)
    except TypeError:
        raise LayerOutOfRange(f"layer must be an integer, got {layer!r}") from None
    if not 0 <= index < pool.num_layers:
        raise LayerOutOfRange(f"layer {layer!r} is outside [0, {pool.num_layers})")
    fmt = pool.format
    if fmt.spec.kernel not in KERNELS:
        raise UnsupportedFormat(f"the triton backend has no kernels for the {fmt.value} format")
    lead = (pool.num_blocks, pool.block_size, pool.num_kv_heads)
    k, v = (fmt.spec.check_parts(side, lead, pool.head_dim, f"{name}[{index}]")
            for name, side in zip("kv", pool.layer_parts(index), strict=True))  # fmt: skip
    (kc, ks), (vc, vs) = codes_and_scales(fmt, k), codes_and_scales(fmt, v)
    # One set of strides is passed for K and V (codes) and one for both scale tensors.
    if kc.stride() != vc.stride() or (ks is not None and vs is not None and ks.stride() != vs.stride()):
        raise ShapeMismatch("K and V storage of one layer must share strides")
    return kc, vc, ks, vs


def store_rows(cache, layer: int, k16: torch.Tensor, v16: torch.Tensor, slots: torch.Tensor) -> None:
    """Encode float16 ``k16``, ``v16`` ``[tokens, num_kv_heads, head_dim]`` into ``slots [tokens]`` of ``layer``.

    INT8 rows are quantized in the kernel with the V1 codec (codes and scales bit-identical to
    ``codec.quantize_int8``); F16 rows are stored as given. The write path (:mod:`int8kv.ops.write`) has run
    every check (shapes, device, slot range and distinctness, NaN/inf, float16 range) before this is called;
    nothing here reads the device back, so a step's writes can be captured in a CUDA graph.
    """
    kc, vc, ks, vs = _layer_tensors(cache, layer)
    # The kernel reads slot t at ``slots_ptr + t``: a strided view would store rows at the wrong slots.
    # Planned slots are contiguous already; this catches the write path's caller-vouched slots (a host-side
    # stride comparison, no device read).
    require_unit_stride(slots=slots)
    tokens = int(k16.shape[0])
    if tokens == 0:
        return
    is_int8 = int8_codes(cache.format)
    sk = ks if is_int8 else kc
    sv = vs if is_int8 else vc
    s_strides = ks.stride() if is_int8 else (0, 0, 0)
    _launch(
        _append_kernel, (tokens,),
        k16, v16, *k16.stride(), *v16.stride(), slots,
        kc, vc, *kc.stride(), sk, sv, *s_strides,
        cache.num_kv_heads, cache.head_dim,
        PAGE=cache.block_size, IS_INT8=is_int8,
        BLOCK_H=_pow2(cache.num_kv_heads), BLOCK_D=_pow2(cache.head_dim),
    )  # fmt: skip


# Resident CTAs per SM of the default decode configuration (BLOCK_N 64, 4 warps, 3 stages), from the
# registers ptxas allocates for sm_90 (`python -m int8kv.bench.gpu_compile`, docs/archive/benchmarks-2026.md): INT8
# 249-255 registers x 128 threads -> 2 CTAs in 65,536 registers; F16 155-163 -> 3. Shared memory (31 KiB
# INT8, 46 KiB F16 per CTA, of 228 KiB) is not the limit. sm_80 allocates fewer (INT8 168-188): 2 or 3.
_CTAS_PER_SM = {True: 2, False: 3}


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, read once per process (0 for other devices)."""
    if device.type != "cuda":
        return 0
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _split_chunk(kv_bound: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, chunk) once the chunk is rounded up to whole key tiles; the split count may shrink."""
    chunk = triton.cdiv(triton.cdiv(kv_bound, max(1, splits)), block_n) * block_n
    return triton.cdiv(kv_bound, chunk), chunk


def _num_splits(programs: int, kv_bound: int, block_n: int, slots: int) -> int:
    """KV splits per program so ``programs x splits`` fills whole waves of ``slots`` resident CTAs.

    Chooses the fewest splits whose last wave is within 5 % as full as the best choice (every extra split is
    one more partial result to write and merge); no split when there is no device, or the range is short.
    """
    if slots <= 0 or programs <= 0 or kv_bound < 2 * _MIN_CHUNK:
        return 1
    limit = min(kv_bound // _MIN_CHUNK, _MAX_SPLITS)
    fill = {}
    for want in range(1, limit + 1):
        real, _ = _split_chunk(kv_bound, want, block_n)
        work = programs * real
        fill.setdefault(real, work / (triton.cdiv(work, slots) * slots))
    best = max(fill.values())
    return min(s for s, f in fill.items() if f >= best - 0.05)


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    """How one attention call is cut into programs (host integers only: no device read)."""

    block_m: int
    block_n: int
    tokens_per_prog: int
    m_blocks: int
    num_splits: int
    chunk: int
    num_warps: int | None
    num_stages: int | None

    def grid(self, batch: int, num_kv_heads: int) -> tuple[int, int]:
        return (batch * num_kv_heads * self.m_blocks, self.num_splits)


def _plan_launch(
    device: torch.device,
    *,
    batch: int,
    num_kv_heads: int,
    group: int,
    max_q: int,
    kv_bound: int,
    is_int8: bool,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    gpu: bool | None = None,
) -> LaunchShape:
    on_gpu = device.type == "cuda" if gpu is None else gpu
    if block_m is None:
        # Decode needs only the group's rows; prefill stacks several tokens to reuse each K/V tile more.
        block_m = _pow2(group, 16) if max_q == 1 else _pow2(group, 64 if on_gpu else 16)
    if block_m < group or block_m < 16 or block_m & (block_m - 1):
        raise ShapeMismatch(f"block_m must be a power of two >= max(16, group={group}), got {block_m}")
    if block_n is None:
        block_n = 64 if on_gpu else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ShapeMismatch(f"block_n must be a power of two >= 16, got {block_n}")
    tokens_per_prog = block_m // group
    m_blocks = max(1, triton.cdiv(max(max_q, 0), tokens_per_prog))
    kv_bound = max(1, kv_bound)
    if num_splits is None:
        slots = _CTAS_PER_SM[is_int8] * _sm_count(device)
        num_splits = _num_splits(batch * num_kv_heads * m_blocks, kv_bound, block_n, slots)
    num_splits, chunk = _split_chunk(kv_bound, min(int(num_splits), triton.cdiv(kv_bound, block_n)), block_n)
    if num_warps is None and on_gpu and block_m >= 64:
        # A 64-row tile keeps q twice (hi, lo), acc, scores and p in registers; 8 warps halve each
        # thread's share. Untuned guess: gpu_check times the decode configurations, not prefill.
        num_warps = 8
    return LaunchShape(block_m, block_n, tokens_per_prog, m_blocks, num_splits, chunk, num_warps, num_stages)


def _variant_args(plan: AttentionPlan, variant: AttentionVariant | None, kv_bound: int):
    """A call's variant as the kernels take it: ``(kv_bound, window, att_chunk, softcap, sinks)``, the window and
    chunk 0 and the softcap 0.0 when unset (the softcap in base-2 units, as the kernels' scores), ``sinks`` the
    per-head logits or None, and ``kv_bound`` lowered to the most keys a program reads under a window or chunk."""
    if variant is None:
        return kv_bound, 0, 0, 0.0, None
    # A program's keys start at its first query's low: at most window (or chunk) + its queries - 1 of them.
    for span in (variant.window, variant.chunk):
        if span is not None:
            kv_bound = min(kv_bound, span + max(plan.max_query_len, 1) - 1)
    softcap = 0.0 if variant.softcap is None else variant.softcap * _LOG2E  # scores are in base 2
    return kv_bound, variant.window or 0, variant.chunk or 0, softcap, variant.sinks


def _output_buffers(num_splits: int, shape: torch.Size, device: torch.device):
    """``(out, part, ml, dst, dst_strides, ml_strides)`` for a launch of ``num_splits`` KV splits over queries of
    ``shape`` ``[tokens, Hq, d]``: ``out`` float32 of that shape; with splits the kernel writes the partials
    ``part [splits, tokens, Hq, d]`` and their (max, sum) ``ml [splits, tokens, Hq, 2]`` for :func:`merge_splits`,
    without it ``out`` directly (``part`` None, ``ml`` an unused stand-in)."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    if num_splits > 1:
        part = torch.empty((num_splits, *shape), dtype=torch.float32, device=device)
        ml = torch.empty((num_splits, *shape[:2], 2), dtype=torch.float32, device=device)
        return out, part, ml, part, part.stride()[:3], ml.stride()[:3]
    return out, None, out, out, (0, *out.stride()[:2]), (0, 0, 0)  # ml: never touched without a split


def attention(
    cache,
    layer: int,
    q: torch.Tensor,
    plan: AttentionPlan,
    *,
    kv_bound: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    magic: bool = False,
    hilo: bool = True,
    gpu: bool | None = None,
    variant: AttentionVariant | None = None,
) -> torch.Tensor:
    """:func:`attend` with its tuning options (benchmarks, compile checks); reads nothing back from the device.

    ``q [plan.num_queries, num_q_heads, head_dim]``, checked by the caller like ``plan``. ``kv_bound``: the
    longest context when the caller knows it on the host (else the block table's width x block size), fewer
    splits for the same result. ``magic`` and ``hilo`` pick the int8 -> float16 conversion and whether both
    products carry a float16 low part (see the kernel); ``gpu`` plans block sizes as for a GPU (or not)
    whatever the device (default: the device's kind). The other options override :func:`launch_plan`'s choice.
    ``variant``: the call's window, chunk, softcap and sinks (checked by the dispatcher); a window or chunk
    also bounds each program's key range, so the split count follows it rather than the context.
    A pool that ``writes_by_step`` (int8kv.cache.pool_q4w) goes to its own kernel (ops/triton_q4w.py), with
    these options but ``magic`` (no int8 codes there).
    """
    if getattr(cache, "writes_by_step", False):
        if magic:
            raise UnsupportedFormat(f"magic converts int8 codes; the {cache.format.name} pool holds none")
        from .triton_q4w import attention as attention_q4w

        return attention_q4w(
            cache, layer, q, plan, kv_bound=kv_bound, num_splits=num_splits, block_m=block_m, block_n=block_n,
            num_warps=num_warps, num_stages=num_stages, hilo=hilo, gpu=gpu, variant=variant,
        )  # fmt: skip
    kc, vc, ks, vs = _layer_tensors(cache, layer)
    device = kc.device
    block_tables, context_lens, kv_starts = plan.block_tables, plan.context_lens, plan.kv_starts
    total, num_q_heads, head_dim = q.shape
    num_kv_heads = cache.num_kv_heads
    group = num_q_heads // num_kv_heads
    batch = plan.batch
    page = cache.block_size
    is_int8 = int8_codes(cache.format)
    # Without a host read the block table's width is the only bound on any sequence's KV range.
    width_bound = int(block_tables.shape[1]) * page
    kv_bound = width_bound if kv_bound is None else min(int(kv_bound), width_bound)
    kv_bound, window, att_chunk, softcap, sinks = _variant_args(plan, variant, kv_bound)
    launch = _plan_launch(
        device, batch=batch, num_kv_heads=num_kv_heads, group=group, max_q=plan.max_query_len, kv_bound=kv_bound,
        is_int8=is_int8, block_m=block_m, block_n=block_n, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, gpu=gpu,
    )  # fmt: skip
    split = launch.num_splits > 1

    if total == 0 or batch == 0:
        return torch.zeros((total, num_q_heads, head_dim), dtype=torch.float32, device=device)
    out, part, ml, dst, dst_strides, ml_strides = _output_buffers(launch.num_splits, q.shape, device)

    sk = ks if is_int8 else kc
    sv = vs if is_int8 else vc
    s_strides = ks.stride() if is_int8 else (0, 0, 0)
    has_start = kv_starts is not None
    starts = kv_starts if has_start else context_lens
    launch_opts = {}
    if launch.num_warps is not None:
        launch_opts["num_warps"] = launch.num_warps
    if launch.num_stages is not None:
        launch_opts["num_stages"] = launch.num_stages

    _launch(
        _attention_kernel, launch.grid(batch, num_kv_heads),
        q, *q.stride(),
        dst, *dst_strides,
        ml, *ml_strides,
        kc, vc, *kc.stride(),
        sk, sv, *s_strides,
        block_tables, block_tables.stride(0),
        context_lens, starts, plan.cu_seqlens_q, context_lens if sinks is None else sinks,
        num_kv_heads, head_dim, launch.chunk, launch.m_blocks, plan.softmax_scale * _LOG2E,
        window, att_chunk, softcap,
        GROUP=group, TOKENS=launch.tokens_per_prog, PAGE=page,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_D=_pow2(head_dim, 16),
        IS_INT8=is_int8, HAS_START=has_start, SPLIT=split, MAGIC=bool(magic and is_int8), HILO=bool(hilo),
        WINDOW=window > 0, CHUNKED=att_chunk > 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        **launch_opts,
    )  # fmt: skip
    if split:
        merge_splits(
            part, ml, out, context_lens if sinks is None else sinks, launch.num_splits, head_dim, sinks is not None
        )
    return out


variant_args, output_buffers = _variant_args, _output_buffers  # the host side's, for ops/triton_q4w.py


def merge_splits(part, ml, out, sinks, num_splits: int, head_dim: int, has_sinks: bool) -> None:
    """Merge the KV splits' unnormalised partials ``part [splits, tokens, Hq, d]`` and their ``ml [splits, tokens,
    Hq, 2]`` (max, sum) into ``out [tokens, Hq, d]``, with the ``sinks`` logits when ``has_sinks``."""
    total, num_q_heads = out.shape[:2]
    _launch(
        _merge_kernel, (total, num_q_heads),
        part, *part.stride()[:3],
        ml, *ml.stride()[:3],
        out, *out.stride()[:2], sinks,
        num_splits, head_dim,
        BLOCK_S=_pow2(num_splits), BLOCK_D=_pow2(head_dim), HAS_SINKS=has_sinks,
    )  # fmt: skip


def attend(cache, layer: int, q: torch.Tensor, plan: AttentionPlan, variant: AttentionVariant | None = None):
    """Causal attention of ``q [num_queries, num_q_heads, head_dim]`` over a validated ``plan``.

    The ``n_b`` queries of sequence ``b`` (``cu_seqlens_q[b]:cu_seqlens_q[b+1]``) are its last ``n_b``
    positions; query ``i`` sees keys in ``[kv_start, context_len - n_b + i + 1)``; decode is ``n_b = 1``.
    Returns float32 of q's shape; a query with no visible key gets zeros. ``variant``: a window, chunk, softcap
    or sinks (:class:`~int8kv.ops.plan.AttentionVariant`): a lower bound on each row's keys, a cap on the
    scores, a sink logit in the final denominator (in the merge kernel when the keys are split).
    """
    return attention(cache, layer, q, plan, variant=variant)


def launch_plan(device: torch.device, **shape) -> LaunchShape:
    """The block sizes, split count and grid an attention call would use (host integers only).

    ``shape``: ``batch``, ``num_kv_heads``, ``group``, ``max_q``, ``kv_bound``, ``is_int8`` and optionally the
    overrides of :func:`attention` (``block_m``, ``block_n``, ``num_splits``, ``num_warps``, ``num_stages``,
    ``gpu``)."""
    return _plan_launch(device, **shape)
