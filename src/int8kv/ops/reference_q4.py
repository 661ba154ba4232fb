"""Float64 reference attention over the 4-bit format's codes (int8kv.quant4): the oracle for its kernels.

It computes what a kernel reading the codes computes, from the codes, never from a dequantized copy: per sealed
block, with the keys' channel scales ``s_i`` and minimums ``m_i`` and the values' per-position ``s_t``, ``m_t``,

    q . k_t       = sum_i (q_i s_i) c[t, i] + sum_i q_i m_i
    sum_t p_t v_t = sum_t (p_t s_t) c_v[t] + sum_t p_t m_t

and the open block's F16 rows as they are; then the same visibility (window, chunk), softcap and sinks as
:mod:`int8kv.ops.reference` (its :func:`~int8kv.ops.reference.visible_keys` and
:func:`~int8kv.ops.reference.probabilities`). Outputs are float64; a query with no visible key yields zeros.
"""

from __future__ import annotations

import math

import torch

from ..errors import ShapeMismatch
from ..quant4 import BLOCK, Q4Rows, unpack_nibbles
from .plan import AttentionVariant
from .reference import probabilities, visible_keys

__all__ = ["attend_q4"]


def _f64(a) -> torch.Tensor:
    return torch.from_numpy(a.astype("float64"))


def attend_q4(
    q: torch.Tensor,
    rows: Q4Rows,
    softmax_scale: float | None = None,
    kv_start: int = 0,
    variant: AttentionVariant | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [n, Hq, d]`` (the last ``n`` positions of the sequence: query ``i`` sits at
    position ``len(rows) - n + i``) over one layer's stored ``rows``; keys from ``kv_start`` on -> float64
    ``[n, Hq, d]``. ``Hq`` must be a multiple of the KV heads (query head ``h`` reads KV head ``h // group``)."""
    n, hq, d = q.shape
    ctx = len(rows)
    heads = rows.k_open.shape[1]
    if rows.k_open.shape[2] != d or hq % heads or n > ctx:
        raise ShapeMismatch(
            f"q {tuple(q.shape)} does not fit {ctx} stored rows of {heads} heads x {rows.k_open.shape[2]}"
        )
    group = hq // heads
    qq = q.double()

    def per_query_head(t: torch.Tensor, axis: int) -> torch.Tensor:
        return t.repeat_interleave(group, dim=axis)

    ck = per_query_head(_f64(unpack_nibbles(rows.k_codes)), 2)  # [blocks, BLOCK, Hq, d]
    ks, km = per_query_head(_f64(rows.k_scale), 1), per_query_head(_f64(rows.k_min), 1)  # [blocks, Hq, d]
    sealed = torch.einsum("nhi,bhi,bjhi->nhbj", qq, ks, ck) + torch.einsum("nhi,bhi->nhb", qq, km)[..., None]
    dots = torch.cat(
        [sealed.reshape(n, hq, -1), torch.einsum("nhi,thi->nht", qq, per_query_head(_f64(rows.k_open), 1))], -1
    )
    query_pos = torch.arange(ctx - n, ctx)
    visible = visible_keys(query_pos, torch.arange(ctx), kv_start, variant)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    p = probabilities(dots, visible, scale, variant)
    nsealed = rows.k_codes.shape[0] * BLOCK
    ps = p[..., :nsealed].reshape(n, hq, -1, BLOCK)
    cv = per_query_head(_f64(unpack_nibbles(rows.v_codes)), 2)  # [blocks, BLOCK, Hq, d]
    vs, vm = per_query_head(_f64(rows.v_scale), 2), per_query_head(_f64(rows.v_min), 2)  # [blocks, BLOCK, Hq]
    out = torch.einsum("nhbj,bjh,bjhi->nhi", ps, vs, cv) + torch.einsum("nhbj,bjh->nh", ps, vm)[..., None]
    return out + torch.einsum("nht,thi->nhi", p[..., nsealed:], per_query_head(_f64(rows.v_open), 1))
