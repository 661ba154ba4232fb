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

__all__ = ["attend_q4", "sealed_scores", "sealed_values"]


def f64(a) -> torch.Tensor:
    return torch.from_numpy(a.astype("float64"))


def per_query_head(t: torch.Tensor, group: int, axis: int) -> torch.Tensor:
    """KV-head axis ``axis`` of ``t`` repeated for the ``group`` query heads that read each KV head."""
    return t.repeat_interleave(group, dim=axis)


def sealed_scores(q: torch.Tensor, k_codes, k_scale, k_min, group: int) -> torch.Tensor:
    """``q [n, Hq, d]`` (float64) . the sealed blocks' keys (per channel: ``scale * code + min``; packed codes
    ``[blocks, B, Hk, d / 2]``, scale and minimum ``[blocks, Hk, d]``) -> float64 ``[n, Hq, blocks * B]``."""
    n, hq, _ = q.shape
    ck = per_query_head(f64(unpack_nibbles(k_codes)), group, 2)  # [blocks, B, Hq, d]
    ks, km = per_query_head(f64(k_scale), group, 1), per_query_head(f64(k_min), group, 1)  # [blocks, Hq, d]
    dots = torch.einsum("nhi,bhi,bjhi->nhbj", q, ks, ck) + torch.einsum("nhi,bhi->nhb", q, km)[..., None]
    return dots.reshape(n, hq, -1)


def sealed_values(p: torch.Tensor, v_codes, v_scale, v_min, group: int) -> torch.Tensor:
    """Probabilities ``p [n, Hq, blocks, B]`` over the sealed blocks' values (per position: ``scale * code + min``;
    packed codes ``[blocks, B, Hk, d / 2]``, scale and minimum ``[blocks, B, Hk]``) -> float64 ``[n, Hq, d]``."""
    cv = per_query_head(f64(unpack_nibbles(v_codes)), group, 2)  # [blocks, B, Hq, d]
    vs, vm = per_query_head(f64(v_scale), group, 2), per_query_head(f64(v_min), group, 2)  # [blocks, B, Hq]
    return torch.einsum("nhbj,bjh,bjhi->nhi", p, vs, cv) + torch.einsum("nhbj,bjh->nh", p, vm)[..., None]


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
    sealed = sealed_scores(qq, rows.k_codes, rows.k_scale, rows.k_min, group)
    dots = torch.cat([sealed, torch.einsum("nhi,thi->nht", qq, per_query_head(f64(rows.k_open), group, 1))], -1)
    query_pos = torch.arange(ctx - n, ctx)
    visible = visible_keys(query_pos, torch.arange(ctx), kv_start, variant)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    p = probabilities(dots, visible, scale, variant)
    nsealed = rows.k_codes.shape[0] * BLOCK
    out = sealed_values(p[..., :nsealed].reshape(n, hq, -1, BLOCK), rows.v_codes, rows.v_scale, rows.v_min, group)
    return out + torch.einsum("nht,thi->nhi", p[..., nsealed:], per_query_head(f64(rows.v_open), group, 1))
