"""Single-pass numba kernels for the V1 codec on CPU tensors.

torch's version of the codec makes ~10 passes over the data (isfinite, round to f16,
abs, amax, divide, round, clamp, cast); on a 2-core machine that runs at a few GB/s.
These kernels read each input row once, keep it in L1 and write codes and scale,
bit-identical to `codec.quantize_int8` (tested over random, tied and subnormal inputs).
fastmath stays off: RNE rounding and IEEE division are part of the format.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numba as nb
import numpy as np

from .numba_cache import share_compiles

# Elements below which one thread beats waking the pool: on a busy machine waking a second thread can
# take milliseconds, far longer than one thread needs for 64 Ki elements. (A decode step encodes a few hundred.)
SERIAL_ELEMENTS = 1 << 16


@contextmanager
def threads_for(elements: int) -> Iterator[int]:
    """Run the enclosed kernel on one thread for small inputs; yields the thread count to split work into."""
    threads = nb.get_num_threads()
    if elements >= SERIAL_ELEMENTS:
        yield threads
        return
    nb.set_num_threads(1)  # thread-local in numba
    try:
        yield 1
    finally:
        nb.set_num_threads(threads)


@nb.njit(inline="always")
def _round_f16_bits(a: np.int32) -> np.int32:
    # Round a float32 (sign-less bits) to 11 significant bits, ties to even: the float16
    # grid in its normal range. Subnormals are fixed up separately in float arithmetic.
    # (numba widens int32 arithmetic to int64; the casts let LLVM keep 32-bit vector lanes.)
    return np.int32((a + np.int32(0xFFF) + ((a >> 13) & np.int32(1))) & np.int32(~0x1FFF))


@nb.njit(inline="always")
def _rint_small(y: np.float32) -> np.float32:
    # Round half to even for |y| < 2^22: adding 1.5*2^23 leaves no fraction bits, so the FPU's
    # default rounding (nearest, ties to even) does the work; unlike np.rint it vectorizes.
    return (y + np.float32(12582912.0)) - np.float32(12582912.0)


@nb.njit(inline="always")
def _to_f16_grid(x: np.float32, normal: np.float32) -> np.float32:
    # Below 2^-14 float16 has a fixed 2^-24 step; above it, the 11-bit rounding done on the bits.
    sub = _rint_small(x * np.float32(16777216.0)) * np.float32(5.9604645e-08)
    return sub if abs(x) < np.float32(6.1035156e-05) else normal


@nb.njit(cache=True)  # a call, not inlined: numba's parfor pass failed on the inlined body ("unexpected cycle")
def _quantize_range(x: np.ndarray, q: np.ndarray, scale: np.ndarray, lo: int, hi: int) -> int:
    """Rows lo..hi - 1 of ``x`` into ``q`` and ``scale``; returns how many of them are bad (left unwritten)."""
    d = x.shape[1]
    bits = x.view(np.int32)
    buf = np.empty(d, np.int32)
    rounded = buf.view(np.float32)
    bad = 0
    for r in range(lo, hi):
        xr, br, qr = x[r], bits[r], q[r]
        # Max over the bit patterns of |x16|: an integer reduction vectorizes, and
        # inf/NaN/overflow all compare above the bits of 65504.
        amax_bits = np.int32(0)
        for j in range(d):
            b = br[j]
            mag = _round_f16_bits(np.int32(b & np.int32(0x7FFFFFFF)))
            buf[j] = np.int32((b & np.int32(-0x80000000)) | mag)
            amax_bits = max(amax_bits, mag)
        if amax_bits > np.int32(0x477FE000):
            bad += 1
            continue
        if amax_bits >= np.int32(0x38800000):
            amax = _bits_to_f32(amax_bits)
        else:  # the whole row lies in float16's subnormal range (rare): take the max the slow way
            amax = np.float32(0.0)
            for j in range(d):
                amax = max(amax, abs(_to_f16_grid(xr[j], rounded[j])))
        s = amax / np.float32(127.0)
        if s == 0:
            s = np.float32(1.0)
        scale[r] = s
        for j in range(d):
            c = _rint_small(_to_f16_grid(xr[j], rounded[j]) / s)
            qr[j] = np.int8(min(max(c, np.float32(-127.0)), np.float32(127.0)))
    return bad


@nb.njit(parallel=True, cache=True)
def quantize_rows(x: np.ndarray, q: np.ndarray, scale: np.ndarray, nthreads: int) -> int:
    """x float32 [rows, d] -> q int8 [rows, d], scale float32 [rows]; returns the count of bad rows."""
    rows = x.shape[0]
    chunk = (rows + nthreads - 1) // nthreads
    bad = 0
    for t in nb.prange(nthreads):
        bad += _quantize_range(x, q, scale, t * chunk, min(rows, (t + 1) * chunk))
    return bad


@nb.njit(cache=True)
def quantize_rows_serial(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> int:
    """`quantize_rows` on the calling thread, for inputs below SERIAL_ELEMENTS: no thread pool to set or wake.
    Through the parallel kernel on one thread a decode step's few values cost several times more inside a
    model's forward (torch's threads busy around it) than alone; the same code run serially takes neither the
    two set_num_threads calls nor the pool's launch."""
    return _quantize_range(x, q, scale, 0, x.shape[0])


@nb.njit(cache=True)
def quantize_store(k, v, slots, k_codes, k_scales, v_codes, v_scales) -> int:
    """Encode K and V rows ``k, v`` float32 ``[n, H, d]`` (C-contiguous) and store them at int64 ``slots [n]``:
    codes into ``k_codes`` / ``v_codes`` int8 ``[S, H, d]``, scales into ``k_scales`` / ``v_scales`` float32
    ``[S, H]``. Returns the count of bad rows; with any, nothing is stored. One call for what took a stack, an
    encode, four tensor wrappers and four ``index_copy_`` per layer of a decode step (`codec.quantize_int8_store`)."""
    n, h, d = k.shape
    qk = np.empty((n * h, d), np.int8)
    qv = np.empty((n * h, d), np.int8)
    sk = np.empty(n * h, np.float32)
    sv = np.empty(n * h, np.float32)
    bad = _quantize_range(k.reshape(n * h, d), qk, sk, 0, n * h)
    bad += _quantize_range(v.reshape(n * h, d), qv, sv, 0, n * h)
    if bad:
        return bad
    for i in range(n):
        s = slots[i]
        for j in range(h):
            r = i * h + j
            k_scales[s, j] = sk[r]
            v_scales[s, j] = sv[r]
            for c in range(d):
                k_codes[s, j, c] = qk[r, c]
                v_codes[s, j, c] = qv[r, c]
    return 0


@nb.njit(inline="always")
def _f16_code(x: np.float32, b: np.int32) -> np.int32:
    """The float16 bits of float32 ``x`` (``b``: its bits), rounded to nearest even as torch's cast does, or -1
    where that is not finite (NaN, inf, or a magnitude that rounds above 65504: from 65520 = 0x477FF000 up)."""
    sign = (b >> np.int32(16)) & np.int32(0x8000)
    a = np.int32(b & np.int32(0x7FFFFFFF))
    if a >= np.int32(0x477FF000):
        return np.int32(-1)
    if a >= np.int32(0x38800000):  # 2^-14 and up: 11 significant bits, the exponent rebiased (127 - 15) << 23
        return np.int32(sign | ((_round_f16_bits(a) - np.int32(0x38000000)) >> np.int32(13)))
    # Below 2^-14: multiples of 2^-24, x * 2^24 rounded to an integer (exact: a power-of-two scaling); 1024 is
    # the smallest normal's bits, which a value just below 2^-14 rounds up to.
    return np.int32(sign | np.int32(_rint_small(abs(x) * np.float32(16777216.0))))


@nb.njit(cache=True)
def f16_store(k, v, slots, k_codes, v_codes) -> int:
    """The F16 format's compiled store: float32 ``k, v [n, H, d]`` (C-contiguous) as float16 bits (``_f16_code``)
    into ``k_codes`` / ``v_codes`` (the pool's float16 rows ``[S, H, d]`` viewed as uint16) at int64 ``slots
    [n]``. Returns the count of rows (K's and V's) not finite in float16; with any, nothing is stored."""
    n, h, d = k.shape
    out = np.empty((2, n * h, d), np.uint16)
    bad = 0
    for side in range(2):
        x = (k if side == 0 else v).reshape(n * h, d)
        bits = x.view(np.int32)
        for r in range(n * h):
            refused = False
            for c in range(d):
                code = _f16_code(x[r, c], bits[r, c])
                refused |= code < 0
                out[side, r, c] = np.uint16(code & 0xFFFF)
            bad += refused
    if bad:
        return bad
    for i in range(n):
        s = slots[i]
        for j in range(h):
            for c in range(d):
                k_codes[s, j, c] = out[0, i * h + j, c]
                v_codes[s, j, c] = out[1, i * h + j, c]
    return 0


@nb.njit(inline="always")
def _bits_to_f32(b: np.int32) -> np.float32:
    one = np.empty(1, np.int32)
    one[0] = b
    return one.view(np.float32)[0]


@nb.njit(parallel=True, cache=True)
def dequantize_rows(q: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    rows, d = q.shape
    for r in nb.prange(rows):
        s = scale[r]
        for j in range(d):
            out[r, j] = np.float32(q[r, j]) * s


share_compiles(globals())  # one compile per signature across processes, and a safe disk cache (int8kv.numba_cache)
