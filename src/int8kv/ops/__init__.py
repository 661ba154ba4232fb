"""Paged-cache operations behind one dispatcher.

Every public function takes `backend`: None picks "triton" when the cache lives on CUDA and "cpu" otherwise;
"reference" (float64 oracle, returned as float32), "cpu" (numba) and "triton" force one. Backend modules are
imported lazily, so importing int8kv never pulls in numba compilation or triton.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ..cache.paged import PagedKvCache
from ..errors import UnknownBackend
from .write import apply_rope, prepare_qkv, rms_norm, split_qkv

BACKENDS = ("reference", "cpu", "triton")

__all__ = [
    "BACKENDS",
    "append_paged_kv",
    "apply_rope",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_write",
    "resolve_backend",
    "rms_norm",
    "split_qkv",
]


def resolve_backend(cache: PagedKvCache, backend: str | None = None) -> str:
    if backend is None:
        return "triton" if cache.device.type == "cuda" else "cpu"
    if backend not in BACKENDS:
        raise UnknownBackend(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    return backend


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def append_paged_kv(
    cache: PagedKvCache,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Store already normed and rotated `k, v [tokens, num_kv_heads, head_dim]` at `slots`, encoded."""
    _module(resolve_backend(cache, backend)).append_paged_kv(cache, layer, k, v, slots)


def paged_write(
    cache: PagedKvCache,
    layer: int,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_style: str = "neox",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Split packed qkv, QK-norm, RoPE, then store k and v; returns float32 q `[tokens, num_q_heads, head_dim]`.

    Nothing is written unless every check passes (shapes, finiteness, float16 range).
    """
    cache.check_layer(layer)
    q, k, v = prepare_qkv(cache, qkv, positions, cos, sin, num_q_heads, q_norm_weight, k_norm_weight, eps, rope_style)
    append_paged_kv(cache, layer, k, v, slots, backend=backend)
    return q


def paged_decode_attention(
    cache: PagedKvCache,
    layer: int,
    q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float | None = None,
    kv_starts: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """`q [batch, Hq, D]` attends to its sequence's positions [kv_start, context_len); float32 `[batch, Hq, D]`."""
    name = resolve_backend(cache, backend)
    if name == "cpu":  # validates itself
        return _module(name).paged_decode_attention(
            cache, layer, q, block_tables, context_lens, softmax_scale, kv_starts
        )
    b = cache.attention_batch(layer, q, block_tables, context_lens, softmax_scale, kv_starts)
    out = _module(name).paged_decode_attention(
        cache, layer, b.q, b.block_tables, b.context_lens, b.softmax_scale, b.kv_starts
    )
    return out.to(torch.float32)


def paged_prefill_attention(
    cache: PagedKvCache,
    layer: int,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float | None = None,
    kv_starts: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal chunked prefill over `q [total, Hq, D]` packed by `cu_seqlens_q`; float32 `[total, Hq, D]`."""
    name = resolve_backend(cache, backend)
    if name == "cpu":
        return _module(name).paged_prefill_attention(
            cache, layer, q, cu_seqlens_q, block_tables, context_lens, softmax_scale, kv_starts
        )
    b = cache.attention_batch(layer, q, block_tables, context_lens, softmax_scale, kv_starts, cu_seqlens_q)
    out = _module(name).paged_prefill_attention(
        cache, layer, b.q, b.cu_seqlens_q, b.block_tables, b.context_lens, b.softmax_scale, b.kv_starts
    )
    return out.to(torch.float32)
