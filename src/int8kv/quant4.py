"""The frozen 4-bit KV codec (spec: docs/kv_file_format.md, "The 4-bit format"), as numpy functions.

Pieces, each bit-exact and shared by keys and values:

* :func:`round_input` - refuse NaN/inf and float16 overflow, round to float16 (as V1 does first);
* :func:`encode_groups` / :func:`decode_groups` - asymmetric 4-bit over groups along the last axis: a
  float16 scale and a float16 minimum per group, codes 0..15;
* :func:`pack_nibbles` / :func:`unpack_nibbles` - two codes a byte, the even-indexed code in the low nibble.

The format (:func:`encode_keys_block`, :func:`encode_values`, ...) is built from them below.
"""

from __future__ import annotations

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
