"""The write path's rotation of a decode step's few q / k rows on the CPU, in one compiled call.

A SmolLM2 decode step rotates 12 heads x 64 values per layer; torch's eight elementwise operations on them
(chunk, four products, a difference, a sum, cat) took 19 us a layer in a step at 512 tokens, most of it
per-operation overhead. This loop does the same arithmetic in the same order (each product rounded, then the
difference or sum: no fused multiply-add, no reassociation), so its results are torch's bit for bit
(tests/test_write.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import share_compiles

__all__ = ["rope_neox", "split_rotate"]


@njit(cache=True)
def _neox(x, c, s, out):
    """out[t, h, i] = x[t, h, i] c[t, i] - x[t, h, i + half] s[t, i] and out[t, h, i + half] = x[t, h, i + half]
    c[t, i] + x[t, h, i] s[t, i], for i < half = dim / 2; x any strides, c and s [tokens, half]."""
    tokens, heads, dim = x.shape
    half = dim // 2
    for t in range(tokens):
        for h in range(heads):
            for i in range(half):
                a = x[t, h, i]
                b = x[t, h, i + half]
                out[t, h, i] = a * c[t, i] - b * s[t, i]
                out[t, h, i + half] = b * c[t, i] + a * s[t, i]


@njit(cache=True)
def split_rotate(qkv, c, s, q, k, v) -> int:
    """A planned decode step's packed rows ``qkv`` float32 ``[tokens, (hq + 2 hkv) dim]`` (C-contiguous) into
    ``q [tokens, hq, dim]`` and ``k [tokens, hkv, dim]`` rotated by `_neox` (by ``c, s [tokens, dim / 2]``) and
    ``v [tokens, hkv, dim]`` copied (outputs float32, C-contiguous). Returns 1 where ``qkv`` holds NaN or inf
    (before anything is rotated), 2 where ``q`` does after the rotation (a table entry), else 0: the two refusals
    of the write path's general route (write.prepare_qkv), in its order."""
    tokens, hq, dim = q.shape
    hkv = k.shape[1]
    for t in range(tokens):
        for j in range(qkv.shape[1]):
            if not np.isfinite(qkv[t, j]):
                return 1
    heads = qkv.reshape(tokens, hq + 2 * hkv, dim)
    _neox(heads[:, :hq], c, s, q)
    _neox(heads[:, hq : hq + hkv], c, s, k)
    v[:] = heads[:, hq + hkv :]
    for t in range(tokens):
        for h in range(hq):
            for i in range(dim):
                if not np.isfinite(q[t, h, i]):
                    return 2
    return 0


share_compiles(globals())


def rope_neox(x: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The "neox" rotation (pairs i, i + dim / 2) of float32 ``x [tokens, heads, dim]`` by float32 ``c, s
    [tokens, dim / 2]``: a new C-contiguous float32 array."""
    out = np.empty(x.shape, np.float32)
    _neox(x, c, s, out)
    return out
