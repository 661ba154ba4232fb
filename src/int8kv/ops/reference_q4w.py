"""Float64 reference attention over the stored form of ``int4_kchan64_vtok_asym_sink4_win64_v1``
(:mod:`int8kv.quant4w`): the oracle for the caches and kernels that hold it.

As :mod:`int8kv.ops.reference_q4`, from the codes, never from a dequantized copy: per sealed block, with the
keys' channel scales ``s_i`` and minimums ``m_i`` and the values' per-position ``s_t``, ``m_t``,

    q . k_t       = sum_i (q_i s_i) c[t, i] + sum_i q_i m_i
    sum_t p_t v_t = sum_t (p_t s_t) c_v[t] + sum_t p_t m_t

and the F16 rows (the sinks, which replace block 0's first four positions, and the window) as they are; then
the visibility (window, chunk), softcap and sinks of :mod:`int8kv.ops.reference`. Every query reads the one
stored form it is given: a decode step reads the form of its sequence's length, and a prefill that scores
each token as its decode step would gives query ``i`` the form of its own prefix (tests/test_quant4w.py).
"""

from __future__ import annotations

import math

import torch

from ..errors import ShapeMismatch
from ..quant4w import BLOCK, Q4WRows, f16_positions, sealed_blocks
from .plan import AttentionVariant
from .reference import probabilities, visible_keys
from .reference_q4 import f64, per_query_head, sealed_scores, sealed_values

__all__ = ["attend_pool", "attend_q4w", "query_runs"]


def attend_q4w(
    q: torch.Tensor,
    rows: Q4WRows,
    softmax_scale: float | None = None,
    kv_start: int = 0,
    variant: AttentionVariant | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [n, Hq, d]`` (the last ``n`` positions: query ``i`` sits at position
    ``len(rows) - n + i``) over one layer's stored ``rows``; keys from ``kv_start`` on -> float64 ``[n, Hq, d]``.
    ``Hq`` must be a multiple of the KV heads (query head ``h`` reads KV head ``h // group``)."""
    n, hq, d = q.shape
    ctx = len(rows)
    heads, dim = rows.k_window.shape[1:] if rows.k_window.shape[0] else rows.k_sink.shape[1:]
    if dim != d or hq % heads or n > ctx or n < 1:
        raise ShapeMismatch(f"q {tuple(q.shape)} does not fit {ctx} stored rows of {heads} heads x {dim}")
    group = hq // heads
    qq = q.double()
    sinks, window = (torch.tensor(list(r), dtype=torch.long) for r in f16_positions(ctx))
    blocks = rows.k_codes.shape[0]
    nsealed = blocks * BLOCK
    dots = torch.zeros(n, hq, ctx, dtype=torch.float64)
    if blocks:
        dots[..., :nsealed] = sealed_scores(qq, rows.k_codes, rows.k_scale, rows.k_min, group)
    for where, k16 in ((sinks, rows.k_sink), (window, rows.k_window)):
        dots[..., where] = torch.einsum("nhi,thi->nht", qq, per_query_head(f64(k16), group, 1))
    visible = visible_keys(torch.arange(ctx - n, ctx), torch.arange(ctx), kv_start, variant)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    p = probabilities(dots, visible, scale, variant)
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    if blocks:
        ps = p[..., :nsealed].clone()
        ps[..., sinks] = 0.0  # block 0's sink positions are read from their F16 rows below
        out += sealed_values(ps.reshape(n, hq, blocks, BLOCK), rows.v_codes, rows.v_scale, rows.v_min, group)
    for where, v16 in ((sinks, rows.v_sink), (window, rows.v_window)):
        out += torch.einsum("nht,thi->nhi", p[..., where], per_query_head(f64(v16), group, 1))
    return out


def query_runs(length: int, queries: int) -> list[tuple[int, int]]:
    """The last ``queries`` positions of a sequence of ``length``, as runs ``[lo, hi)`` of queries (indices from
    0) that read the same sealed pages: the stored form of the run's last prefix holds, below each query's own
    position, exactly the rows that query's decode step reads (the same blocks sealed, the same F16 rows)."""
    first = length - queries
    runs, lo = [], 0
    for i in range(1, queries + 1):
        if i == queries or sealed_blocks(first + i + 1) != sealed_blocks(first + lo + 1):
            runs.append((lo, i))
            lo = i
    return runs


def attend_pool(pool, layer: int, q: torch.Tensor, plan, variant: AttentionVariant | None = None) -> torch.Tensor:
    """The reference backend over an :class:`~int8kv.cache.pool_q4w.Int4SinkWindowPool`: query ``i`` of the
    ``n_b`` queries of sequence ``b`` (position ``p = context_len - n_b + i``) attends over the pool's stored
    form of ``p + 1`` positions, as its decode step would (one form per :func:`query_runs` run).
    ``q [num_queries, Hq, d]`` -> float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    tables, lens, cu = plan.block_tables.tolist(), plan.context_lens.tolist(), plan.cu_seqlens_q.tolist()
    starts = [0] * plan.batch if plan.kv_starts is None else plan.kv_starts.tolist()
    qc = q.detach().cpu()
    for b in range(plan.batch):
        m = cu[b + 1] - cu[b]
        for lo, hi in query_runs(lens[b], m):
            form = pool.stored_form(layer, tables[b], lens[b] - m + hi)
            rows = slice(cu[b] + lo, cu[b] + hi)
            out[rows] = attend_q4w(qc[rows], form, plan.softmax_scale, starts[b], variant)
    return out.to(q.device)
