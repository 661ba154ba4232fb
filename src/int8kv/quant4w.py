"""The frozen 4-bit KV format with F16 sinks and a recent F16 window (spec: docs/kv_file_format.md, "The 4-bit
format with sinks and a window"), as numpy functions, bit-exact.

``int4_kchan64_vtok_asym_sink4_win64_v1``: keys per channel over sealed 64-position blocks, values per position,
both asymmetric with a float16 scale and minimum (the group rule, the float16 rounding of the inputs and the
nibble order are :mod:`int8kv.quant4`'s, reused here unchanged); positions 0-3 of a sequence (the sinks) are
kept in F16 for good and left out of block 0's key groups; a block is sealed (encoded) once 64 positions follow
it, so the 64-127 most recent positions are F16 rows.

Per layer, sequence and KV head the stored form of ``n`` positions is a function of the inputs and ``n`` alone
(:func:`encode_sequence`), whatever chunks they were written in: sealing encodes the F16 rows, which hold the
inputs rounded to float16 exactly, and rounding a float16 value again changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ShapeMismatch
from .quant4 import decode_groups, encode_groups, pack_nibbles, round_input, unpack_nibbles, value_problem

__all__ = [
    "BLOCK", "NAME", "SINKS", "VERSION", "WINDOW", "Q4WRows", "bytes_at", "decode_sealed", "decode_sequence",
    "encode_sequence", "f16_positions", "rows_problem", "seal_block", "sealed_blocks", "sealed_bytes_per_position",
    "stored_bytes", "value_problem",
]

NAME = "int4_kchan64_vtok_asym_sink4_win64_v1"
VERSION = 1
# Positions per sealed block: one key group per (head, channel) spans a block, so its scale and minimum cost
# 4 bytes per channel per 64 positions. 64, not 16: 16-position blocks reach a lower KL but miss the bytes
# targets (0.30x / 0.28x of F16's at head_dim 64 / 128), which 64 meets with the sinks and the window at a
# perplexity cost of a few tenths of a percent (docs/archive/benchmarks-2026.md, "4-bit KV: candidates, the
# chosen format, its decode kernel").
BLOCK = 64
# The first positions of a sequence, F16 for good: small models park attention there (attention sinks), so
# their error reaches every later query. One sink measured as good as four (KL 3.0 / 2.8 against 2.8 / 2.8);
# four is what the full runs measured.
SINKS = 4
# Positions a block waits after its last one before it is sealed: a 32-position window measured KL 4.0 / 3.8
# against 2.8 / 2.8 at 64.
WINDOW = 64


def sealed_blocks(n: int) -> int:
    """Blocks sealed in a sequence of ``n`` positions: block ``b`` once ``n >= 64 b + 128`` (``BLOCK + WINDOW``
    past its start), i.e. by the step that appends position ``64 b + 127``, before that step's attention."""
    return max(0, (n - WINDOW) // BLOCK)


def f16_positions(n: int) -> tuple[range, range]:
    """The positions a sequence of ``n`` stores as F16 rows: the sinks ``[0, min(n, 4))`` and the window, from
    the end of the last sealed block (or the sinks) to ``n``."""
    sinks = min(n, SINKS)
    return range(sinks), range(max(sealed_blocks(n) * BLOCK, sinks), n)


@dataclass(frozen=True)
class Q4WRows:
    """One layer's K/V of one sequence in this format (numpy): ``c`` sealed blocks, the sinks' F16 rows and the
    window's. Shapes (``H`` KV heads, ``d`` head_dim): ``k_codes`` / ``v_codes`` uint8 ``[c, 64, H, d / 2]``,
    ``k_scale`` / ``k_min`` float16 ``[c, H, d]``, ``v_scale`` / ``v_min`` float16 ``[c, 64, H]``,
    ``k_sink`` / ``v_sink`` float16 ``[s, H, d]`` (``s = min(n, 4)``), ``k_window`` / ``v_window`` float16
    ``[r, H, d]``: positions ``[64 c, n)``, or ``[s, n)`` before a block is sealed."""

    k_codes: np.ndarray
    k_scale: np.ndarray
    k_min: np.ndarray
    k_sink: np.ndarray
    k_window: np.ndarray
    v_codes: np.ndarray
    v_scale: np.ndarray
    v_min: np.ndarray
    v_sink: np.ndarray
    v_window: np.ndarray

    def __len__(self) -> int:
        c = self.k_codes.shape[0]
        return (c * BLOCK if c else self.k_sink.shape[0]) + self.k_window.shape[0]


def _rows(x: object, what: str) -> np.ndarray:
    x16 = round_input(x, what)
    if x16.ndim != 3 or x16.shape[-1] % 2:
        raise ShapeMismatch(f"{what} must be [positions, heads, head_dim] with an even head_dim, got {x16.shape}")
    return x16


def seal_block(k16: np.ndarray, v16: np.ndarray, first: bool) -> tuple[np.ndarray, ...]:
    """Encode one block's float16-valued float32 rows ``[64, H, d]`` (keys, values): ``first`` for block 0,
    whose rows 0-3 (the sinks) are left out of the key groups and stored as code bytes 0 with value scale and
    minimum +0. Returns ``k_codes, k_scale, k_min, v_codes, v_scale, v_min`` (shapes of :class:`Q4WRows`,
    without the block axis)."""
    if k16.shape[0] != BLOCK or k16.shape != v16.shape:
        raise ShapeMismatch(f"a block is [{BLOCK}, heads, head_dim] of keys and of values, got {k16.shape}, "
                            f"{v16.shape}")
    lo = SINKS if first else 0
    # Keys: one group per (head, channel) over the block's positions [lo, 64): [H, d, positions].
    qk, k_scale, k_min = encode_groups(np.ascontiguousarray(k16[lo:].transpose(1, 2, 0)))
    qv, v_scale, v_min = encode_groups(v16[lo:])  # values: one group per (position, head)
    heads, d = k16.shape[1:]
    k_codes = np.zeros((BLOCK, heads, d // 2), np.uint8)
    v_codes = np.zeros((BLOCK, heads, d // 2), np.uint8)
    k_codes[lo:] = pack_nibbles(np.ascontiguousarray(qk.transpose(2, 0, 1)))
    v_codes[lo:] = pack_nibbles(qv)
    vs = np.zeros((BLOCK, heads), np.float16)
    vm = np.zeros((BLOCK, heads), np.float16)
    vs[lo:], vm[lo:] = v_scale, v_min
    return k_codes, k_scale, k_min, v_codes, vs, vm


def decode_sealed(k_codes, k_scale, k_min, v_codes, v_scale, v_min) -> tuple[np.ndarray, np.ndarray]:
    """float32 keys and values ``[c, 64, H, d]`` of sealed blocks (the sink rows of block 0 decode to whatever
    their stored bytes say, 0 as the encoder writes them; readers take the sinks from their F16 rows)."""
    qk = unpack_nibbles(k_codes).transpose(0, 2, 3, 1)  # [c, H, d, 64]
    k = decode_groups(qk, k_scale, k_min).transpose(0, 3, 1, 2)
    v = decode_groups(unpack_nibbles(v_codes), v_scale, v_min)
    return k, v


def encode_sequence(k: object, v: object) -> Q4WRows:
    """Positions ``[n, H, d]`` of keys and values (positions first, from position 0) -> :class:`Q4WRows`.

    Checks both inputs (shapes, values) before encoding anything."""
    k16, v16 = _rows(k, "K input"), _rows(v, "V input")
    if k16.shape != v16.shape:
        raise ShapeMismatch(f"K and V must have one shape, got {k16.shape} and {v16.shape}")
    n, heads, d = k16.shape
    c = sealed_blocks(n)
    parts = [seal_block(k16[b * BLOCK : (b + 1) * BLOCK], v16[b * BLOCK : (b + 1) * BLOCK], b == 0)
             for b in range(c)]
    shapes = ((BLOCK, heads, d // 2), (heads, d), (heads, d), (BLOCK, heads, d // 2), (BLOCK, heads), (BLOCK, heads))
    stacked = [np.stack([p[i] for p in parts]) if parts else np.zeros((0, *shape), np.uint8 if i in (0, 3)
                                                                        else np.float16)
               for i, shape in enumerate(shapes)]
    sinks, window = f16_positions(n)
    k_codes, k_scale, k_min, v_codes, v_scale, v_min = stacked
    return Q4WRows(
        k_codes=k_codes, k_scale=k_scale, k_min=k_min, k_sink=k16[sinks].astype(np.float16),
        k_window=k16[window].astype(np.float16), v_codes=v_codes, v_scale=v_scale, v_min=v_min,
        v_sink=v16[sinks].astype(np.float16), v_window=v16[window].astype(np.float16),
    )


def decode_sequence(rows: Q4WRows) -> tuple[np.ndarray, np.ndarray]:
    """float32 keys and values ``[n, H, d]`` as the decode step at the sequence's last position reads them:
    sealed blocks decoded, the sinks and the window as their F16 rows."""
    n = len(rows)
    heads, d = rows.k_window.shape[1:] if rows.k_window.size or not rows.k_sink.size else rows.k_sink.shape[1:]
    k = np.zeros((n, heads, d), np.float32)
    v = np.zeros((n, heads, d), np.float32)
    c = rows.k_codes.shape[0]
    if c:
        dk, dv = decode_sealed(rows.k_codes, rows.k_scale, rows.k_min, rows.v_codes, rows.v_scale, rows.v_min)
        k[: c * BLOCK], v[: c * BLOCK] = dk.reshape(-1, heads, d), dv.reshape(-1, heads, d)
    sinks, window = f16_positions(n)
    k[sinks], v[sinks] = rows.k_sink, rows.v_sink
    k[window], v[window] = rows.k_window, rows.v_window
    return k, v


def rows_problem(rows: Q4WRows) -> str | None:
    """Why a stored form is not one the encoder writes, or None: scales / minimums by :func:`value_problem`,
    F16 rows finite, block 0's sink rows zero (code bytes, value scales and minimums)."""
    for what, s, m in (("key", rows.k_scale, rows.k_min), ("value", rows.v_scale, rows.v_min)):
        if (problem := value_problem(s, m)) is not None:
            return f"{what} {problem}"
    for what, x in (("k_sink", rows.k_sink), ("v_sink", rows.v_sink), ("k_window", rows.k_window),
                    ("v_window", rows.v_window)):
        if x.dtype != np.float16 or not np.isfinite(x).all():
            return f"{what} must hold finite float16 rows"
    if rows.k_codes.shape[0] and (rows.k_codes[0, :SINKS].any() or rows.v_codes[0, :SINKS].any()
                                  or rows.v_scale[0, :SINKS].view(np.uint16).any()
                                  or rows.v_min[0, :SINKS].view(np.uint16).any()):
        return "block 0 stores something at a sink position (the encoder writes zeros there)"
    return None


def sealed_bytes_per_position(head_dim: int) -> float:
    """Bytes of one sealed position of one KV head, keys and values together: both codes, the keys' channel
    scale and minimum shared by 64 positions, the value's own scale and minimum: ``17 d / 16 + 4``."""
    return head_dim // 2 + 4 * head_dim / BLOCK + head_dim // 2 + 4


def stored_bytes(n: int, head_dim: int) -> int:
    """Bytes the stored form of ``n`` positions takes per layer and KV head, keys and values: the sealed blocks
    (block 0's sink rows included, as stored) and the F16 rows (sinks and window, ``4 d`` each)."""
    sinks, window = f16_positions(n)
    sealed = int(sealed_blocks(n) * BLOCK * sealed_bytes_per_position(head_dim))
    return sealed + (len(sinks) + len(window)) * 4 * head_dim


def bytes_at(n: int, head_dim: int) -> float:
    """:func:`stored_bytes` per position against F16's ``4 d``."""
    return stored_bytes(n, head_dim) / (n * 4 * head_dim)
