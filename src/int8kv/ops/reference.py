"""Float64 reference attention over the paged cache: the test oracle, written for clarity, not speed.

It gathers each sequence's rows through its block table, decodes them with the codec and runs a plain softmax.
Outputs are float64. A query with no visible key (empty window) yields zeros, as in every backend.
A window, chunk, softcap or sinks (:class:`~int8kv.ops.plan.AttentionVariant`) enter as transformers writes
them: a visibility mask built from the positions, ``softcap * tanh(x / softcap)`` on the scaled scores, and the
sink logit as one more softmax column dropped after normalisation. Only keys from the lowest one a query of the
step may see are gathered, so the oracle too never reads a key outside the window.
"""

from __future__ import annotations

import torch

from ..cache.pool import KvPool
from .plan import AttentionPlan, AttentionVariant

__all__ = ["attend", "gather_kv", "paged_decode_attention", "paged_prefill_attention", "probabilities", "visible_keys"]

KERNELS = None  # any format: rows are decoded by the format itself


def gather_kv(
    pool: KvPool, layer: int, block_table: torch.Tensor, context_len: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded float64 K and V of positions [first, context_len): `[context_len - first, num_kv_heads, head_dim]`."""
    bs = pool.block_size
    pos = torch.arange(first, context_len, device=pool.device)
    blocks = block_table.to(pool.device).long()[pos // bs]
    offsets = pos % bs
    k, v = (pool.format.spec.decode(tuple(t[blocks, offsets] for t in side)) for side in pool.layer_parts(layer))
    return k.double(), v.double()


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, start: int, variant: AttentionVariant | None):
    """[n, t] bool: which keys each query sees. Causal from ``start``, then transformers' overlays as written in
    its masking_utils: ``sliding_window_overlay`` (kv > q - window) and ``chunked_overlay`` with the left
    padding taken as ``start`` ((kv - pad) // chunk == (q - pad) // chunk)."""
    q, k = query_pos[:, None], key_pos[None, :]
    visible = (k >= start) & (k <= q)
    if variant is not None and variant.window is not None:
        visible &= k > q - variant.window
    if variant is not None and variant.chunk is not None:
        visible &= torch.div(k - start, variant.chunk, rounding_mode="floor") == torch.div(
            q - start, variant.chunk, rounding_mode="floor"
        )
    return visible


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
    variant: AttentionVariant | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [n, Hq, D], k/v [ctx, Hkv, D], visible [n, ctx] bool -> [n, Hq, D] float64."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    vv = v.repeat_interleave(group, dim=1)
    probs = probabilities(torch.einsum("nhd,thd->nht", q.double(), kk), visible, scale, variant)
    return torch.einsum("nht,thd->nhd", probs, vv)


def probabilities(
    dots: torch.Tensor, visible: torch.Tensor, scale: float, variant: AttentionVariant | None = None
) -> torch.Tensor:
    """Attention weights [n, Hq, ctx] float64 from the raw dot products ``q . k`` [n, Hq, ctx] (float64) and
    ``visible`` [n, ctx]: scaled, capped (softcap), masked, softmax with the sink column (then dropped)."""
    scores = dots * scale
    if variant is not None and variant.softcap is not None:  # Gemma 2: scaled scores, capped, then masked
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if variant is not None and variant.sinks is not None:  # gpt-oss: one more column, dropped after the softmax
        sink = variant.sinks.double().to(dots.device)[None, :, None].expand(dots.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        # A query that sees no key attends to nothing: zeros, as without a sink.
        return probs.masked_fill(~visible.any(dim=1)[:, None, None], 0.0)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row is NaN after softmax: make it 0


def attend(
    pool: KvPool, layer: int, q: torch.Tensor, plan: AttentionPlan, variant: AttentionVariant | None = None
) -> torch.Tensor:
    """Causal: query i of the n_b queries of sequence b sits at position context_len - n_b + i, and sees keys
    in [kv_start, its position], narrowed by ``variant``; decode is the case n_b = 1.
    ``q [num_queries, Hq, D]`` -> float64."""
    if getattr(pool, "writes_by_step", False):  # int8kv.cache.pool_q4w: each query reads its prefix's form
        from .reference_q4w import attend_pool

        return attend_pool(pool, layer, q, plan, variant)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    cu = plan.cu_seqlens_q.tolist()
    lens = plan.context_lens.tolist()
    starts = [0] * plan.batch if plan.kv_starts is None else plan.kv_starts.tolist()
    for b in range(plan.batch):
        lo, hi, n = cu[b], cu[b + 1], lens[b]
        query_pos = n - (hi - lo) + torch.arange(hi - lo, device=q.device)
        visible = visible_keys(query_pos, torch.arange(n, device=q.device), starts[b], variant)
        seen = visible.any(dim=0).nonzero()
        first = int(seen[0]) if seen.numel() else n  # keys below the lowest visible one are never gathered
        k, v = gather_kv(pool, layer, plan.block_tables[b], n, first)
        out[lo:hi] = _attend(q[lo:hi], k, v, visible[:, first:], plan.softmax_scale, variant)
    return out


def _checked_attend(pool, layer, q, plan, variant):
    from . import check_query, check_variant

    q = check_query(pool, q, plan)
    return attend(pool, pool.check_layer(layer), q, plan, check_variant(pool, q.shape[1], **variant))


def paged_decode_attention(cache, layer, q, block_tables, context_lens, softmax_scale=None, kv_starts=None, **variant):
    """The float64 oracle of :func:`int8kv.ops.paged_decode_attention` (tests compare backends with it)."""
    from . import as_pool, plan_attention

    pool = as_pool(cache)
    plan = plan_attention(pool, block_tables, context_lens, kv_starts=kv_starts, softmax_scale=softmax_scale)
    return _checked_attend(pool, layer, q, plan, variant)


def paged_prefill_attention(
    cache, layer, q, cu_seqlens_q, block_tables, context_lens, softmax_scale=None, kv_starts=None, **variant
):
    """The float64 oracle of :func:`int8kv.ops.paged_prefill_attention`."""
    from . import as_pool, plan_attention

    pool = as_pool(cache)
    plan = plan_attention(
        pool, block_tables, context_lens, cu_seqlens_q=cu_seqlens_q, kv_starts=kv_starts,
        num_queries=q.shape[0], softmax_scale=softmax_scale,
    )  # fmt: skip
    return _checked_attend(pool, layer, q, plan, variant)
