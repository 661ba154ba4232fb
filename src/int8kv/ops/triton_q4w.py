"""Triton attention over the frozen 4-bit format ``int4_kchan64_vtok_asym_sink4_win64_v1`` (int8kv.quant4w), read
in place from an :class:`~int8kv.cache.pool_q4w.Int4SinkWindowPool` (its ``layer_pages`` and ``page_books``).

What one program reads (the pool's module docs give the shapes; ``H`` KV heads, ``d`` head_dim):

  sealed pages   k / v codes [num_blocks, 64, H, d / 2] uint8 (byte ``j`` = channel ``2j`` | channel ``2j + 1``
                 << 4), k scale / min [num_blocks, H, d] float16, v scale / min [num_blocks, 64, H] float16
  window pages   k / v [window_pages, 64, H, d] float16, found through ``window_of[block]``
  sink rows      k / v [sink_slots, 4, H, d] float16, found through ``sink_of[block_table[b, 0]]``

A query row at position ``p`` reads the stored form of its own prefix, as its decode step would
(ops.reference_q4w): ``c(p) = max(0, p + 1 - 64) // 64`` sealed pages, positions 0-3 from the sink rows and the
rest of ``[64 c(p), p]`` from the window pages. A prefill chunk's rows may therefore read one page in both
forms (the rows before the step that sealed it in F16, the later ones sealed).

The program layout is :mod:`int8kv.ops.triton`'s INT8 kernel's: one program per (sequence, KV head, query
block, KV split), the GQA group's query heads stacked with the block's query tokens into the rows of one tile,
online softmax in base 2, a window / chunk / kv_start raising the block's first key, softcap on the scores,
per-head sink logits in the last denominator (in that module's merge kernel when the keys are split). Key
tiles are ``block_n`` (16, 32 or 64) positions aligned to the page, so a tile lies in one page ``j``; per tile:

  sealed   when some row of the block reads page ``j`` sealed: the page's key scales ``s_i`` fold into the
           query (``q'_i = q_i s_i``, the bias ``sum_i q_i m_i``), the nibbles are unpacked in registers to
           float16 (exact: 0..15) and ``q' . c`` is one product; the softmax weights take the values'
           per-position scales (``sum_t (p_t s_t) c_t``) and ``sum_t p_t m_t`` joins each row.
  F16      when some row reads the tile's keys as F16 rows (the window pages, the sink rows below position 4).
  select   per (row, key): sealed iff ``j < c(p)`` and the key is not a sink; a tile read in one form only
           (every tile of a decode step) loads and multiplies that form only.

Both products keep float32-level accuracy the way the INT8 kernel does: the float32 side (the query, folded or
not, and the softmax weights) is split into a float16 high and low part, two float16 dots each. Nothing here
reads the device back but the plan's lengths, once per plan, for ``pool.check_reads`` (the pool's writes read
the plan on the host anyway); the page books go to the device once per pool generation on a GPU (on the CPU the
kernel reads the pool's own arrays).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import triton
import triton.language as tl

from ..errors import ShapeMismatch
from ..quant4w import BLOCK as PAGE
from ..quant4w import SINKS, WINDOW
from . import triton as tk
from .plan import AttentionPlan, AttentionVariant

__all__ = ["attend", "attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _q4w_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,
    out_ptr, stride_os, stride_ot, stride_oh,
    ml_ptr, stride_mls, stride_mlt, stride_mlh,
    kc_ptr, vc_ptr, stride_cb, stride_co, stride_ch, stride_cd,
    ks_ptr, km_ptr, stride_kb, stride_kh, stride_kd,
    vs_ptr, vm_ptr, stride_vb, stride_vo, stride_vh,
    kw_ptr, vw_ptr, stride_wb, stride_wo, stride_wh, stride_wd,
    ksk_ptr, vsk_ptr, stride_sb, stride_so, stride_sh, stride_sd,
    window_of_ptr, sink_of_ptr,
    bt_ptr, stride_btb, ctx_ptr, start_ptr, cu_ptr, sinks_ptr,
    num_kv_heads, head_dim, chunk, m_blocks, qk_scale, window, att_chunk, softcap,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_START: tl.constexpr,
    SPLIT: tl.constexpr,
    HILO: tl.constexpr,
    WINDOW: tl.constexpr = False,
    CHUNKED: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    PAGE_N: tl.constexpr = 64  # positions per page (quant4w.BLOCK); a sealed page waits 64 more (WINDOW)
    N_SINKS: tl.constexpr = 4  # positions 0-3: F16 sink rows (quant4w.SINKS)
    pid = tl.program_id(0)
    pid_bh = pid // m_blocks
    pid_m = pid % m_blocks
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads

    # Row r of the tile is query token t0 + r // GROUP, query head kvh * GROUP + r % GROUP (as the INT8 kernel).
    n_q, ctx, kv_lo, t0, t_local, qh, row_ok, token, d, d_ok, q = tk.query_tile(
        q_ptr, stride_qt, stride_qh, stride_qd, cu_ptr, ctx_ptr, start_ptr, b, kvh, pid_m, head_dim,
        GROUP, TOKENS, BLOCK_M, BLOCK_D, HAS_START,
    )  # fmt: skip
    q_hi, q_lo, q_max = tk.split16(q)
    row_scale = q_max * qk_scale

    row_limit = ctx - n_q + t_local + 1  # a row at position p sees keys < p + 1
    # Pages each row reads sealed, c(p) = max(0, p + 1 - 64) // 64; the block's first and last query's.
    row_pages = tl.maximum(row_limit - PAGE_N, 0) // PAGE_N
    pages_lo = tl.maximum(ctx - n_q + t0 + 1 - PAGE_N, 0) // PAGE_N
    pages_hi = tl.maximum(ctx - n_q + tl.minimum(t0 + TOKENS, n_q) - PAGE_N, 0) // PAGE_N
    if WINDOW or CHUNKED:
        row_low = tk.key_low(row_limit - 1, kv_lo, window, att_chunk, WINDOW, CHUNKED)
        kv_lo = tk.key_low(ctx - n_q + t0, kv_lo, window, att_chunk, WINDOW, CHUNKED)
    lo, hi = tk.kv_range(t0, n_q, ctx, kv_lo, pid_s, chunk, TOKENS, SPLIT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = bt_ptr + b * stride_btb
    sink_slot = tl.load(sink_of_ptr + tl.load(table)).to(tl.int64)
    nibble = (d % 2) * 4  # channel i: byte i // 2, low nibble for even i
    byte_col = (d // 2) * stride_cd

    # Tiles aligned to the page (BLOCK_N divides 64): one page's key scales fold into the query per tile.
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (n >= lo) & (n < hi)
        j = n0 // PAGE_N
        blk = tl.load(table + j).to(tl.int64)
        off = (n - j * PAGE_N).to(tl.int64)
        use_sealed = j < pages_hi  # some row reads page j sealed
        use_f16 = (j >= pages_lo) | (n0 < N_SINKS)  # some row reads F16 rows of this tile
        sealed = (j < row_pages)[:, None] & (n >= N_SINKS)[None, :]  # per (row, key)
        code_rows = blk * stride_cb + off * stride_co + kvh * stride_ch
        in_sink = n_ok & (n < N_SINKS)
        in_win = n_ok & (n >= N_SINKS) & (n >= pages_lo * PAGE_N)  # (j >= pages_lo): rows given back never read
        win_rows = tl.load(window_of_ptr + blk).to(tl.int64) * stride_wb + off * stride_wo + kvh * stride_wh
        sink_rows = sink_slot * stride_sb + off * stride_so + kvh * stride_sh

        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if use_sealed:
            k_scale = tl.load(ks_ptr + blk * stride_kb + kvh * stride_kh + d * stride_kd, mask=d_ok, other=0.0)
            k_min = tl.load(km_ptr + blk * stride_kb + kvh * stride_kh + d * stride_kd, mask=d_ok, other=0.0)
            bias = tl.sum(q * k_min.to(tl.float32)[None, :], axis=1)
            qf_hi, qf_lo, qf_max = tk.split16(q * k_scale.to(tl.float32)[None, :])
            kb = tl.load(kc_ptr + code_rows[None, :] + byte_col[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0)
            k_codes = ((kb.to(tl.int32) >> nibble[:, None]) & 15).to(tl.float16)
            s_sealed = tk.dot2(qf_hi, qf_lo, k_codes, HILO) * qf_max[:, None] + bias[:, None]
            s = tl.where(sealed, s_sealed * qk_scale, s)
        if use_f16:
            k16 = tl.load(
                kw_ptr + win_rows[None, :] + d[:, None] * stride_wd, mask=in_win[None, :] & d_ok[:, None], other=0.0
            )
            k16 += tl.load(
                ksk_ptr + sink_rows[None, :] + d[:, None] * stride_sd, mask=in_sink[None, :] & d_ok[:, None], other=0.0
            )
            s_f16 = tk.dot2(q_hi, q_lo, k16, HILO) * row_scale[:, None]
            s = tl.where(sealed, s, s_f16)
        if SOFTCAP:  # base-2 units, as the INT8 kernel's
            s = softcap * tk.tanh(s / softcap)
        seen = row_ok[:, None] & n_ok[None, :] & (n[None, :] < row_limit[:, None])
        if WINDOW or CHUNKED:
            seen = seen & (n[None, :] >= row_low[:, None])
        s = tl.where(seen, s, float("-inf"))

        m_new, alpha, p, l_i = tk.online_step(m_i, l_i, s)

        pv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if use_sealed:
            p_sealed = tl.where(sealed, p, 0.0)
            v_scale = tl.load(vs_ptr + blk * stride_vb + off * stride_vo + kvh * stride_vh, mask=n_ok, other=0.0)
            v_min = tl.load(vm_ptr + blk * stride_vb + off * stride_vo + kvh * stride_vh, mask=n_ok, other=0.0)
            v_scale = v_scale.to(tl.float32)
            # Weights times the value scales, scaled so the largest possible is 2^14 (the INT8 kernel's rule).
            sv_max = tl.max(v_scale, axis=0)
            sv_max = tl.where(sv_max > 0.0, sv_max, 1.0)
            pw = p_sealed * (v_scale * (16384.0 / sv_max))[None, :]
            pw_hi = pw.to(tl.float16)
            pw_lo = (pw - pw_hi.to(tl.float32)).to(tl.float16)
            vb = tl.load(vc_ptr + code_rows[:, None] + byte_col[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0)
            v_codes = ((vb.to(tl.int32) >> nibble[None, :]) & 15).to(tl.float16)
            pv += tk.dot2(pw_hi, pw_lo, v_codes, HILO) * (sv_max / 16384.0)
            pv += tl.sum(p_sealed * v_min.to(tl.float32)[None, :], axis=1)[:, None]
        if use_f16:
            pw = tl.where(sealed, 0.0, p) * 16384.0
            pw_hi = pw.to(tl.float16)
            pw_lo = (pw - pw_hi.to(tl.float32)).to(tl.float16)
            v16 = tl.load(
                vw_ptr + win_rows[:, None] + d[None, :] * stride_wd, mask=in_win[:, None] & d_ok[None, :], other=0.0
            )
            v16 += tl.load(
                vsk_ptr + sink_rows[:, None] + d[None, :] * stride_sd, mask=in_sink[:, None] & d_ok[None, :], other=0.0
            )
            pv += tk.dot2(pw_hi, pw_lo, v16, HILO) * (1.0 / 16384.0)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    tk.store_tile(
        out_ptr, stride_os, stride_ot, stride_oh, ml_ptr, stride_mls, stride_mlt, stride_mlh, sinks_ptr,
        acc, m_i, l_i, pid_s, token, qh, row_ok, d, d_ok, SPLIT, HAS_SINKS,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------------
_BOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> (generation, window_of, sink_of)


def _books(pool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's page books on its device: on the CPU its own arrays (zero copy, updated by its writes), on a
    GPU a copy per pool generation."""
    held = _BOOKS.get(pool)
    if held is not None and (pool.device.type == "cpu" or held[0] == pool.generation):
        return held[1], held[2]
    window_of, sink_of = pool.page_books()
    if pool.device.type == "cpu":
        books = torch.from_numpy(window_of), torch.from_numpy(sink_of)
    else:
        books = tuple(torch.from_numpy(a).to(pool.device) for a in (window_of, sink_of))  # int64, as on the CPU
    _BOOKS[pool] = (pool.generation, *books)
    return books


def _reads(plan: AttentionPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block ids a step reads (``pool.check_reads``'s arguments): the pages its last queries read sealed,
    the pages its first queries read as F16 rows, the sequences' first pages (their sink rows)."""
    tables = plan.block_tables.cpu().numpy().astype(np.int64)
    lens = plan.context_lens.cpu().numpy().astype(np.int64)
    cu = plan.cu_seqlens_q.cpu().numpy().astype(np.int64)
    first = lens - (cu[1:] - cu[:-1])
    sealed = [tables[b, : max(0, (lens[b] - WINDOW) // PAGE)] for b in range(plan.batch)]
    f16 = [tables[b, max(0, (first[b] + 1 - WINDOW) // PAGE) : (lens[b] - 1) // PAGE + 1]
           for b in range(plan.batch) if lens[b] > SINKS]  # fmt: skip
    empty = np.zeros(0, np.int64)
    return np.concatenate([empty, *sealed]), np.concatenate([empty, *f16]), tables[lens > 0, 0]


def attention(
    pool,
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
    hilo: bool = True,
    gpu: bool | None = None,
    variant: AttentionVariant | None = None,
) -> torch.Tensor:
    """Attention of ``q [num_queries, Hq, d]`` (float32, contiguous, checked by the caller like ``plan``) over
    ``pool``'s layer ``layer``, each query as its decode step reads the pool (module docs): float32, q's shape.
    The options are :func:`int8kv.ops.triton.attention`'s (``block_n`` at most 64: a key tile lies in one page).
    Refused (UnsupportedFormat, by ``pool.check_reads``): pages the pool does not hold as the step reads them."""
    pool.check_layer(layer)
    if block_n is not None and block_n > PAGE:
        raise ShapeMismatch(f"block_n must be at most {PAGE} (a key tile lies in one page), got {block_n}")
    reads = plan.derived("triton-q4w-reads", lambda: _reads(plan))
    checked = plan.derived("triton-q4w-checked", dict)  # layer -> (pool, the generation it was checked at)
    if checked.get(layer, (None, -1)) != (pool, pool.generation):
        pool.check_reads(layer, *reads)
        checked[layer] = (pool, pool.generation)
    kc, ks, km, vc, vs, vm, kw, vw, ksk, vsk = pool.layer_pages(layer)
    if (
        kc.stride() != vc.stride()
        or ks.stride() != km.stride()
        or vs.stride() != vm.stride()
        or (kw.stride() != vw.stride() or ksk.stride() != vsk.stride())
    ):
        raise ShapeMismatch("K and V pages of one layer must share strides")
    window_of, sink_of = _books(pool)
    device = kc.device
    total, num_q_heads, head_dim = q.shape
    num_kv_heads = pool.num_kv_heads
    group = num_q_heads // num_kv_heads
    batch = plan.batch
    width_bound = int(plan.block_tables.shape[1]) * PAGE
    kv_bound = width_bound if kv_bound is None else min(int(kv_bound), width_bound)
    kv_bound, window, att_chunk, softcap, sinks = tk.variant_args(plan, variant, kv_bound)
    if block_n is None:
        # 32-key tiles on a GPU too: compiled for sm_90 at SHAPE of bench/gpu_compile.py (decode, group 4, head_dim
        # 128, 4 warps) 64-key tiles spill (255 registers, a 992 B stack, 526 local loads / stores in the SASS),
        # 32-key tiles far less (144 B, 85; sm_80: 8 B, 5). Not timed on a GPU yet.
        block_n = 32
    launch = tk.launch_plan(
        device, batch=batch, num_kv_heads=num_kv_heads, group=group, max_q=plan.max_query_len, kv_bound=kv_bound,
        is_int8=True, block_m=block_m, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, gpu=gpu,
    )  # fmt: skip
    if launch.block_n > PAGE:
        raise ShapeMismatch(f"block_n must be at most {PAGE} (a key tile lies in one page), got {launch.block_n}")
    split = launch.num_splits > 1
    if total == 0 or batch == 0:
        return torch.zeros((total, num_q_heads, head_dim), dtype=torch.float32, device=device)
    out, part, ml, dst, dst_strides, ml_strides = tk.output_buffers(launch.num_splits, q.shape, device)
    has_start = plan.kv_starts is not None
    starts = plan.kv_starts if has_start else plan.context_lens
    opts = {k: v for k, v in (("num_warps", launch.num_warps), ("num_stages", launch.num_stages)) if v is not None}
    sink_logits = plan.context_lens if sinks is None else sinks
    tk.launch(
        _q4w_kernel, launch.grid(batch, num_kv_heads),
        q, *q.stride(), dst, *dst_strides, ml, *ml_strides,
        kc, vc, *kc.stride(), ks, km, *ks.stride(), vs, vm, *vs.stride(),
        kw, vw, *kw.stride(), ksk, vsk, *ksk.stride(), window_of, sink_of,
        plan.block_tables, plan.block_tables.stride(0), plan.context_lens, starts, plan.cu_seqlens_q, sink_logits,
        num_kv_heads, head_dim, launch.chunk, launch.m_blocks, plan.softmax_scale * _LOG2E,
        window, att_chunk, softcap,
        GROUP=group, TOKENS=launch.tokens_per_prog, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        BLOCK_D=tk.pow2(head_dim, 16), HAS_START=has_start, SPLIT=split, HILO=bool(hilo),
        WINDOW=window > 0, CHUNKED=att_chunk > 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None, **opts,
    )  # fmt: skip
    if split:
        tk.merge_splits(part, ml, out, sink_logits, launch.num_splits, head_dim, sinks is not None)
    return out


def attend(pool, layer: int, q: torch.Tensor, plan: AttentionPlan, variant: AttentionVariant | None = None):
    """:func:`attention` with the default launch: the Triton backend's ``attend`` for this pool."""
    return attention(pool, layer, q, plan, variant=variant)
