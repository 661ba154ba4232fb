"""Float64 reference attention over the paged cache: the test oracle, written for clarity, not speed.

It gathers each sequence's rows through its block table, decodes them with the codec and runs a plain softmax.
Outputs are float64. A query with no visible key (empty window) yields zeros, as in every backend.
"""

from __future__ import annotations

import torch

from ..cache.paged import PagedKvCache
from ..codec import decode
from .write import append_paged_kv

__all__ = ["append_paged_kv", "gather_kv", "paged_decode_attention", "paged_prefill_attention"]


def gather_kv(
    cache: PagedKvCache, layer: int, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded float64 K and V of positions [0, context_len): `[context_len, num_kv_heads, head_dim]` each."""
    bs = cache.block_size
    pos = torch.arange(context_len, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // bs]
    offsets = pos % bs
    ks, vs = cache.k_scales[layer], cache.v_scales[layer]
    k = decode(cache.format, cache.k_codes[layer][blocks, offsets], None if ks is None else ks[blocks, offsets])
    v = decode(cache.format, cache.v_codes[layer][blocks, offsets], None if vs is None else vs[blocks, offsets])
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


def paged_decode_attention(
    cache: PagedKvCache,
    layer: int,
    q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float | None = None,
    kv_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q [batch, Hq, D]` attends to positions [kv_start, context_len) of its sequence."""
    scale = cache.head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        start = 0 if kv_starts is None else int(kv_starts[b])
        k, v = gather_kv(cache, layer, block_tables[b], n)
        visible = (torch.arange(n, device=q.device) >= start)[None, :]
        out[b] = _attend(q[b : b + 1], k, v, visible, scale)[0]
    return out


def paged_prefill_attention(
    cache: PagedKvCache,
    layer: int,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float | None = None,
    kv_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal: query i of the n_b queries of sequence b sits at position context_len - n_b + i."""
    scale = cache.head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(cu_seqlens_q.shape[0] - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(context_lens[b])
        start = 0 if kv_starts is None else int(kv_starts[b])
        k, v = gather_kv(cache, layer, block_tables[b], n)
        key_pos = torch.arange(n, device=q.device)[None, :]
        query_pos = (n - (hi - lo) + torch.arange(hi - lo, device=q.device))[:, None]
        visible = (key_pos >= start) & (key_pos <= query_pos)
        out[lo:hi] = _attend(q[lo:hi], k, v, visible, scale)
    return out
