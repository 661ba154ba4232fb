"""Float64 reference attention over the paged cache: the test oracle, written for clarity, not speed.

It gathers each sequence's rows through its block table, decodes them with the codec and runs a plain softmax.
Outputs are float64. A query with no visible key (empty window) yields zeros, as in every backend.
"""

from __future__ import annotations

import torch

from ..cache.pool import KvPool
from ..codec import decode
from .plan import AttentionPlan

__all__ = ["attend", "gather_kv", "paged_decode_attention", "paged_prefill_attention"]


def gather_kv(
    pool: KvPool, layer: int, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded float64 K and V of positions [0, context_len): `[context_len, num_kv_heads, head_dim]` each."""
    bs = pool.block_size
    pos = torch.arange(context_len, device=pool.device)
    blocks = block_table.to(pool.device).long()[pos // bs]
    offsets = pos % bs
    kc, vc, ks, vs = pool.layer_tensors(layer)
    k = decode(pool.format, kc[blocks, offsets], None if ks is None else ks[blocks, offsets])
    v = decode(pool.format, vc[blocks, offsets], None if vs is None else vs[blocks, offsets])
    return k.double(), v.double()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [ctx, Hkv, D], visible [n, ctx] bool -> [n, Hq, D] float64."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    vv = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->nht", q.double(), kk) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row is NaN after softmax: make it 0
    return torch.einsum("nht,thd->nhd", probs, vv)


def attend(pool: KvPool, layer: int, q: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Causal: query i of the n_b queries of sequence b sits at position context_len - n_b + i, and sees keys
    in [kv_start, its position]; decode is the case n_b = 1. ``q [num_queries, Hq, D]`` -> float64."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    cu = plan.cu_seqlens_q.tolist()
    lens = plan.context_lens.tolist()
    starts = [0] * plan.batch if plan.kv_starts is None else plan.kv_starts.tolist()
    for b in range(plan.batch):
        lo, hi, n = cu[b], cu[b + 1], lens[b]
        k, v = gather_kv(pool, layer, plan.block_tables[b], n)
        key_pos = torch.arange(n, device=q.device)[None, :]
        query_pos = (n - (hi - lo) + torch.arange(hi - lo, device=q.device))[:, None]
        visible = (key_pos >= starts[b]) & (key_pos <= query_pos)
        out[lo:hi] = _attend(q[lo:hi], k, v, visible, plan.softmax_scale)
    return out


def paged_decode_attention(cache, layer, q, block_tables, context_lens, softmax_scale=None, kv_starts=None):
    """The float64 oracle of :func:`int8kv.ops.paged_decode_attention` (tests compare backends with it)."""
    from . import as_pool, check_query, plan_attention

    pool = as_pool(cache)
    plan = plan_attention(pool, block_tables, context_lens, kv_starts=kv_starts, softmax_scale=softmax_scale)
    return attend(pool, pool.check_layer(layer), check_query(pool, q, plan), plan)


def paged_prefill_attention(
    cache, layer, q, cu_seqlens_q, block_tables, context_lens, softmax_scale=None, kv_starts=None
):
    """The float64 oracle of :func:`int8kv.ops.paged_prefill_attention`."""
    from . import as_pool, check_query, plan_attention

    pool = as_pool(cache)
    plan = plan_attention(
        pool, block_tables, context_lens, cu_seqlens_q=cu_seqlens_q, kv_starts=kv_starts,
        num_queries=q.shape[0], softmax_scale=softmax_scale,
    )  # fmt: skip
    return attend(pool, pool.check_layer(layer), check_query(pool, q, plan), plan)
