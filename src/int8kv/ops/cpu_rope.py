"""The write path's rotation of a decode step's few q / k rows on the CPU, in one compiled call.

A SmolLM2 decode step rotates 12 heads x 64 values per layer; torch's eight elementwise operations on them
(chunk, four products, a difference, a sum, cat) cost mostly per-operation overhead on so few values.
This loop does the same arithmetic in the same order (each product rounded, then the
difference or sum: no fused multiply-add, no reassociation), so its results are torch's bit for bit
(tests/test_write.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import share_compiles

__all__ = ["finite", "rope_neox", "split_rotate"]


@njit(inline="always")
def _rotate(x, c, s, out):
    """One head: out[i] = x[i] c[i] - x[i + half] s[i] and out[i + half] = x[i + half] c[i] + x[i] s[i] for
    i < half = len(x) / 2. Every row a slice indexed from 0, so LLVM can prove the indices non-negative and
    vectorises with plain loads and stores (indexed as x[t, h, i + half] it used gathers)."""
    half = x.shape[0] // 2
    xa, xb, oa, ob = x[:half], x[half:], out[:half], out[half:]
    for i in range(half):
        a = xa[i]
        b = xb[i]
        oa[i] = a * c[i] - b * s[i]
        ob[i] = b * c[i] + a * s[i]


@njit(inline="always")  # callers compile without fastmath: it lets LLVM assume every value finite
def finite(x) -> bool:
    """Whether every value of the C-contiguous ``x`` is finite (x - x is 0 for a finite x, NaN for inf and NaN),
    with no early exit and indexed from 0, so the loop vectorises without gathers. Also the CPU query check
    (`cpu.all_finite`)."""
    flat = x.reshape(-1)
    ok = True
    for i in range(flat.shape[0]):
        ok &= flat[i] - flat[i] == 0
    return ok


@njit(inline="always")
def finite_bits(x) -> bool:
    """`finite` for a C-contiguous float32 ``x``, on its bits (an exponent of all ones is inf or NaN): integer
    operations, so it holds inside fastmath functions too, where LLVM may fold ``x - x == 0`` to true. float32
    only (another dtype's bits would be read as int32): `finite` stays the check of any float array."""
    flat = x.reshape(-1).view(np.int32)
    ok = True
    for i in range(flat.shape[0]):
        ok &= (flat[i] & 0x7F800000) != 0x7F800000
    return ok


@njit(cache=True)
def _neox(x, c, s, out):
    """out[t, h, i] = x[t, h, i] c[t, i] - x[t, h, i + half] s[t, i] and out[t, h, i + half] = x[t, h, i + half]
    c[t, i] + x[t, h, i] s[t, i], for i < half = dim / 2; x any strides, c and s [tokens, half]."""
    tokens, heads, dim = x.shape
    for t in range(tokens):
        for h in range(heads):
            _rotate(x[t, h], c[t], s[t], out[t, h])


@njit(cache=True)
def split_rotate(qkv, c, s, q, k, v) -> int:
    """A planned decode step's packed rows ``qkv`` float32 ``[tokens, (hq + 2 hkv) dim]`` (C-contiguous) into
    ``q [tokens, hq, dim]`` and ``k [tokens, hkv, dim]`` rotated as `_neox` does (by ``c, s [tokens, dim / 2]``)
    and ``v [tokens, hkv, dim]`` copied (outputs float32, C-contiguous). Returns 1 where ``qkv`` holds NaN or inf
    (before anything is rotated), 2 where ``q`` does after the rotation (a table entry), else 0: the two refusals
    of the write path's general route (write.prepare_qkv), in its order. Heads are taken from the C-contiguous
    view one at a time (slices of it were strided arrays to numba, rotated with gathers) and the checks have no
    early exit: several times faster, the same bits (docs/archive/benchmarks-2026.md, "Loops that numba indexed
    with gathers")."""
    tokens, hq, dim = q.shape
    hkv = k.shape[1]
    if not finite(qkv):
        return 1
    heads = qkv.reshape(tokens, hq + 2 * hkv, dim)
    for t in range(tokens):
        ct, st = c[t], s[t]
        for h in range(hq):
            _rotate(heads[t, h], ct, st, q[t, h])
        for h in range(hkv):
            _rotate(heads[t, hq + h], ct, st, k[t, h])
            vh, src = v[t, h], heads[t, hq + hkv + h]
            for i in range(dim):
                vh[i] = src[i]
    return 0 if finite(q) else 2


share_compiles(globals())


def rope_neox(x: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The "neox" rotation (pairs i, i + dim / 2) of float32 ``x [tokens, heads, dim]`` by float32 ``c, s
    [tokens, dim / 2]``: a new C-contiguous float32 array."""
    out = np.empty(x.shape, np.float32)
    _neox(x, c, s, out)
    return out
