"""The frozen 4-bit KV codec (spec: docs/kv_file_format.md, "The 4-bit format"), as numpy functions.

Pieces, each bit-exact and shared by keys and values:

* :func:`round_input` - refuse NaN/inf and float16 overflow, round to float16 (as V1 does first);
* :func:`encode_groups` / :func:`decode_groups` - asymmetric 4-bit over groups along the last axis: a
  float16 scale and a float16 minimum per group, codes 0..15;
* :func:`pack_nibbles` / :func:`unpack_nibbles` - two codes a byte, the even-indexed code in the low nibble.

The format (:func:`encode_keys_block`, :func:`encode_values`, ...) is built from them below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import NonFiniteError, ShapeMismatch

LEVELS = 15  # the largest code
F16_MAX = float(np.finfo(np.float16).max)


def _first_bad(bad: np.ndarray) -> str:
    return f"{int(bad.sum())} value(s), first at index {tuple(int(i) for i in np.argwhere(bad)[0])}"


def round_input(x: object, what: str = "KV input") -> np.ndarray:
    """``x`` (a float16/float32/float64 array) rounded to float16 (round to nearest even), as float32.

    Raises NonFiniteError for NaN/inf or a value that overflows float16 (|x| >= 65520), ShapeMismatch for
    anything that is not a floating array with at least one dimension.
    """
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float16, np.float32, np.float64):
        raise ShapeMismatch(f"{what} must be a float16/float32/float64 numpy array, got {type(x).__name__}"
                            + (f" of {x.dtype}" if isinstance(x, np.ndarray) else ""))
    if x.ndim < 1:
        raise ShapeMismatch(f"{what} must have at least one dimension, got a 0-d array")
    bad = ~np.isfinite(x)
    if bad.any():
        raise NonFiniteError(f"{what} holds NaN or inf: {_first_bad(bad)}")
    # float64 -> float16 directly (one rounding): float64 -> float32 -> float16 could round twice.
    with np.errstate(over="ignore"):
        x16 = x.astype(np.float16)
    bad = ~np.isfinite(x16)
    if bad.any():
        raise NonFiniteError(f"{what} overflows float16 (|x| > 65504): {_first_bad(bad)}")
    return x16.astype(np.float32)


def encode_groups(x16: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode float16-valued float32 ``x16`` ``[..., n]`` (one group per last-axis row): codes uint8
    ``[..., n]`` in 0..15, scale float16 ``[...]``, minimum float16 ``[...]``.

    ``lo, hi`` = the group's min and max; ``scale = f16(f32(hi - lo) / 15)``; ``min = f16(lo)`` (exact);
    ``q = clamp(rint(f32(f32(x - min) / scale)), 0, 15)`` (ties to even), ``q = 0`` where ``scale == 0``.
    Every operation is one IEEE float32 operation rounded to nearest even.
    """
    lo = x16.min(axis=-1)
    hi = x16.max(axis=-1)
    scale = ((hi - lo) / np.float32(LEVELS)).astype(np.float16)
    mn = lo.astype(np.float16)
    s32 = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((x16 - mn.astype(np.float32)[..., None]) / s32)
    q = np.where(s32 > 0, np.clip(q, 0, LEVELS), 0).astype(np.uint8)
    return q, scale, mn


def decode_groups(q: np.ndarray, scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """float32 ``f32(f32(q) * f32(scale)) + f32(min)`` (two roundings, no fused multiply-add)."""
    prod = q.astype(np.float32) * scale.astype(np.float32)[..., None]
    return prod + mn.astype(np.float32)[..., None]


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes uint8 ``[..., n]`` (n even, each < 16) -> bytes ``[..., n / 2]``: byte j = q[2j] | q[2j+1] << 4."""
    if q.shape[-1] % 2:
        raise ShapeMismatch(f"4-bit rows need an even length, got {q.shape[-1]}")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes ``[..., m]`` -> codes uint8 ``[..., 2m]``: the low nibble first."""
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


# -- the format ---------------------------------------------------------------------------------------------
NAME = "int4_kchan16_vtok_asym_f16_v1"
VERSION = 1
# Positions per sealed block (keys share one scale and minimum per channel over a block): the paged cache's
# block size, so a block carries its own scales. Its cost in quality (docs/archive/benchmarks-2026.md, "4-bit KV",
# every token reading what its decode step reads): +1.54 % / +0.58 % perplexity on the licenses / the held-out
# text; 64-position blocks alone (0.281x F16 instead of 0.328x) are worse, with 4 F16 sink positions and a
# 64-position F16 window they give +0.11 % / +0.33 % (frozen as its own format: int8kv.quant4w).
BLOCK = 16


def bytes_per_position(head_dim: int) -> int:
    """Bytes of one sealed position of one KV head, keys and values together: the codes, the keys' channel
    scales and minimums shared by BLOCK positions, the values' own scale and minimum."""
    return head_dim // 2 + 4 * head_dim // BLOCK + head_dim // 2 + 4


def _rows(x: np.ndarray, what: str) -> np.ndarray:
    x16 = round_input(x, what)
    if x16.shape[-1] % 2:
        raise ShapeMismatch(f"{what} rows need an even head_dim, got {x16.shape[-1]}")
    return x16


def encode_values(v: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Value rows ``[..., d]`` -> packed codes uint8 ``[..., d / 2]``, scale float16 ``[...]``, minimum
    float16 ``[...]``: one group per row (per token and head)."""
    q, scale, mn = encode_groups(_rows(v, "V input"))
    return pack_nibbles(q), scale, mn


def decode_values(packed: np.ndarray, scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """float32 value rows ``[..., d]`` of :func:`encode_values`' output."""
    return decode_groups(unpack_nibbles(packed), scale, mn)


def encode_keys_block(k: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sealed block of keys ``[BLOCK, ..., d]`` (positions first) -> packed codes uint8
    ``[BLOCK, ..., d / 2]``, scale and minimum float16 ``[..., d]``: one group per channel over the block."""
    x16 = _rows(k, "K input")
    if x16.ndim < 2 or x16.shape[0] != BLOCK:
        raise ShapeMismatch(f"a key block is [{BLOCK}, ..., head_dim] (positions first), got {x16.shape}")
    q, scale, mn = encode_groups(np.moveaxis(x16, 0, -1))  # groups: [..., d, BLOCK]
    return pack_nibbles(np.ascontiguousarray(np.moveaxis(q, -1, 0))), scale, mn


def decode_keys_block(packed: np.ndarray, scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """float32 keys ``[BLOCK, ..., d]`` of :func:`encode_keys_block`' output."""
    q = np.moveaxis(unpack_nibbles(packed), 0, -1)  # [..., d, BLOCK]
    return np.moveaxis(decode_groups(q, scale, mn), -1, 0)


def value_problem(scale: np.ndarray, mn: np.ndarray) -> str | None:
    """Why stored scales / minimums (float16) are not ones the encoder writes, or None: a scale must be finite
    with its sign bit clear (+0 included: a constant group), a minimum finite."""
    if scale.dtype != np.float16 or mn.dtype != np.float16:
        return f"scales and minimums must be float16, got {scale.dtype} and {mn.dtype}"
    if not np.isfinite(scale).all() or np.signbit(scale).any():
        return "a scale is negative, -0, NaN or inf"
    if not np.isfinite(mn).all():
        return "a minimum is NaN or inf"
    return None


@dataclass(frozen=True)
class Q4Rows:
    """One layer's K/V of one sequence in this format (numpy): ``len(self) // BLOCK`` sealed blocks, then the
    open block's F16 rows. Shapes (``H`` KV heads, ``d`` head_dim): ``k_codes``/``v_codes`` uint8
    ``[blocks, BLOCK, H, d / 2]``, ``k_scale``/``k_min`` float16 ``[blocks, H, d]``, ``v_scale``/``v_min``
    float16 ``[blocks, BLOCK, H]``, ``k_open``/``v_open`` float16 ``[r, H, d]`` with ``r < BLOCK``."""

    k_codes: np.ndarray
    k_scale: np.ndarray
    k_min: np.ndarray
    v_codes: np.ndarray
    v_scale: np.ndarray
    v_min: np.ndarray
    k_open: np.ndarray
    v_open: np.ndarray

    def __len__(self) -> int:
        return self.k_codes.shape[0] * BLOCK + self.k_open.shape[0]


def encode_sequence(k: object, v: object) -> Q4Rows:
    """Positions ``[n, H, d]`` of keys and values (positions first, from position 0) -> :class:`Q4Rows`.

    Checks both inputs (shapes, values) before encoding anything."""
    k16, v16 = _rows(k, "K input"), _rows(v, "V input")
    if k16.ndim != 3 or k16.shape != v16.shape:
        raise ShapeMismatch(f"K and V must both be [positions, heads, head_dim], got {k16.shape} and {v16.shape}")
    n, heads, d = k16.shape
    sealed = n // BLOCK * BLOCK
    blocks_k = k16[:sealed].reshape(-1, BLOCK, heads, d)
    # [blocks, BLOCK, H, d] -> groups over positions: [blocks, H, d, BLOCK]
    q, k_scale, k_min = encode_groups(blocks_k.transpose(0, 2, 3, 1))
    q_v, v_scale, v_min = encode_groups(v16[:sealed].reshape(-1, BLOCK, heads, d))
    return Q4Rows(
        pack_nibbles(np.ascontiguousarray(q.transpose(0, 3, 1, 2))), k_scale, k_min,
        pack_nibbles(q_v), v_scale, v_min,
        k16[sealed:].astype(np.float16), v16[sealed:].astype(np.float16),
    )


def decode_sequence(rows: Q4Rows) -> tuple[np.ndarray, np.ndarray]:
    """float32 keys and values ``[n, H, d]`` of :class:`Q4Rows`."""
    blocks, _, heads, half = rows.k_codes.shape
    qk = unpack_nibbles(rows.k_codes).transpose(0, 2, 3, 1)  # [blocks, H, d, BLOCK]
    k = decode_groups(qk, rows.k_scale, rows.k_min).transpose(0, 3, 1, 2).reshape(-1, heads, 2 * half)
    v = decode_groups(unpack_nibbles(rows.v_codes), rows.v_scale, rows.v_min).reshape(-1, heads, 2 * half)
    return (np.concatenate([k, rows.k_open.astype(np.float32)]), np.concatenate([v, rows.v_open.astype(np.float32)]))
