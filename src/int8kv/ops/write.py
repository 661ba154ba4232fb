"""The write path in plain torch, shared by every backend: split QKV, QK-norm, RoPE, then encode and store.

Runs on whatever device the tensors are on. Everything is validated and encoded before the first store, so
an error (bad shape, NaN, float16 overflow) leaves the cache untouched.
"""

from __future__ import annotations

import torch

from ..cache.paged import FLOAT_DTYPES, INDEX_DTYPES, PagedKvCache
from ..codec import encode
from ..errors import NonFiniteError, PositionOutOfRange, ShapeMismatch

ROPE_STYLES = ("neox", "gptj")


def split_qkv(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed `[tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]` -> float32 q, k, v `[tokens, heads, dim]`."""
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or qkv.shape[1] != width:
        got = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ShapeMismatch(f"qkv must be [tokens, {width}] ((q + 2 * kv heads) * head_dim), got {got}")
    if qkv.dtype not in FLOAT_DTYPES:
        raise ShapeMismatch(f"qkv must be float32, float16 or bfloat16, got {qkv.dtype}")
    x = qkv.to(torch.float32)
    q, k, v = x.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    tokens = qkv.shape[0]
    return (
        q.reshape(tokens, num_q_heads, head_dim),
        k.reshape(tokens, num_kv_heads, head_dim),
        v.reshape(tokens, num_kv_heads, head_dim),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over the last dimension (Qwen3-style QK-norm); identity when `weight` is None."""
    if weight is None:
        return x
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ShapeMismatch(f"norm weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    w = weight.to(device=x.device, dtype=torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox"
) -> torch.Tensor:
    """Rotary embedding of `x [tokens, heads, dim]` with `cos/sin [max_pos, dim // 2]` rows picked by position.

    "neox" rotates the pairs (i, i + dim/2) (rotate-half, Llama/NeoX); "gptj" rotates the pairs (2i, 2i + 1).
    """
    c = cos[positions].to(torch.float32).unsqueeze(1)
    s = sin[positions].to(torch.float32).unsqueeze(1)
    if style == "neox":
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)


def _check_rope_args(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: int, head_dim: int, style: str
) -> None:
    if style not in ROPE_STYLES:
        raise ShapeMismatch(f"rope_style must be one of {ROPE_STYLES}, got {style!r}")
    if head_dim % 2:
        raise ShapeMismatch(f"RoPE needs an even head_dim, got {head_dim}")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.shape[0] != tokens:
        raise ShapeMismatch(f"positions must be [{tokens}]")
    if positions.dtype not in INDEX_DTYPES:
        raise ShapeMismatch(f"positions must be int32/int64, got {positions.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != head_dim // 2:
            raise ShapeMismatch(f"{name} must be [max_pos, {head_dim // 2}]")
        if table.dtype not in (*FLOAT_DTYPES, torch.float64):
            raise ShapeMismatch(f"{name} must be a floating tensor, got {table.dtype}")
    if cos.shape != sin.shape:
        raise ShapeMismatch(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if positions.device.type == "cpu" and tokens and (int(positions.min()) < 0 or int(positions.max()) >= len(cos)):
        raise PositionOutOfRange(f"positions must lie in [0, {len(cos)}) (rows of the cos/sin tables)")


def _check_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteError(f"{what} holds NaN or inf")


def prepare_qkv(
    cache: PagedKvCache,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_style: str = "neox",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split, QK-norm and rotate: float32 q `[tokens, num_q_heads, dim]` and k, v `[tokens, num_kv_heads, dim]`."""
    if num_q_heads <= 0 or num_q_heads % cache.num_kv_heads:
        raise ShapeMismatch(f"num_q_heads ({num_q_heads}) must be a positive multiple of {cache.num_kv_heads}")
    q, k, v = split_qkv(qkv, num_q_heads, cache.num_kv_heads, cache.head_dim)
    _check_rope_args(positions, cos, sin, qkv.shape[0], cache.head_dim, rope_style)
    # cos/sin are not scanned whole (a full table per layer per step costs more than the step): a bad entry at
    # a used position makes q or k non-finite, and both are checked below or by the encoder.
    _check_finite(qkv, "qkv")
    pos = positions.to(torch.int64)
    q = apply_rope(rms_norm(q, q_norm_weight, eps), pos, cos, sin, rope_style)
    k = apply_rope(rms_norm(k, k_norm_weight, eps), pos, cos, sin, rope_style)
    _check_finite(q, "q after QK-norm and RoPE")
    return q, k, v


def append_paged_kv(cache: PagedKvCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Encode `k, v [tokens, num_kv_heads, head_dim]` in the cache's format and store them at `slots`."""
    cache.check_layer(layer)
    k = cache.check_rows(k, "k")
    v = cache.check_rows(v, "v")
    if k.shape[0] != v.shape[0]:
        raise ShapeMismatch(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    s = cache.check_slots(slots, k.shape[0])
    k_enc = encode(cache.format, k.to(cache.device))
    v_enc = encode(cache.format, v.to(cache.device))
    cache.write_rows(layer, s, k_enc, v_enc)
