"""Matrix products over block-quantized weights as GGUF files store them (Q4_1, Q8_0), for the CPU.

    y[i, n] = sum_k x[i, k] * w[n, k]         w[n, k] decoded from its block of 32 weights along k

A GGUF model's Linear weights are blocks of 32: Q4_1 holds a scale d, a minimum m and 32 4-bit codes q
(w = d q + m), Q8_0 a scale d and 32 int8 codes (w = d q); d and m are float16 values. transformers decodes them
to float32 once, and a decode step then reads 4 bytes per weight where the file holds 0.625 (Q4_1) or 1.0625
(Q8_0), so the matmuls over those float32 weights take most of a small model's decode step
(docs/archive/benchmarks-2026.md, "Decode cost per 1,000 tokens of context"). These kernels read the blocks and
decode each weight in registers, to exactly the float32 value transformers made of it (d q is exact in float32: an
11-bit significand times a code of at most 8 bits; + m rounds once, as the decoder's own float32 arithmetic does),
and multiply it with x. They differ from the float32 product only in summation order.

Layouts (one weight row n, `blocks` = k / 32 blocks; all arrays C-contiguous):

    q4_1   codes  uint8   (n, k / 2)   block b's bytes [16 b, 16 b + 16): byte j holds q_j (low nibble) and
                                       q_{j+16} (high nibble), the GGUF order
           scale  float32 (n, blocks)  d (a float16 value)
           low    float32 (n, blocks)  m (a float16 value)
    q8_0   codes  int8    (n, k)
           scale  float32 (n, blocks)

Summation order, fixed by the code and not by the CPU's vector width: 32 lanes, lane j accumulating the j-th
weight of every block in block order with one rounding per product-and-add (fused multiply-add), then the 32
lanes added as a fixed tree. A row's result does not depend on the thread count or on the other rows of x.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ..numba_cache import require_jit, share_compiles
from ..numba_threads import launch
from .block_ir import BYTES, HALF, VEC, chunk, fma, splat, sum_lanes
from .cpu_simd import array_data, vector_at

require_jit(__name__)

__all__ = [
    "BLOCK", "KINDS", "block_ranges", "check_parts", "decode_q4_1", "decode_q8_0", "encode_q4_1", "encode_q8_0",
    "matmul_q4_1", "matmul_q8_0", "matmul_rows",
]

BLOCK = 32  # weights per block along the input dimension (GGUF's QK4_1 and QK8_0)


def _vec_at(builder, base, offset, vtype, align):
    return builder.load(vector_at(builder, base, offset, vtype), align=align)


def _rows_dot(codes_dtype, group: int):
    """The codegen of one weight row against ``group`` rows of x, over `blocks` blocks: each block decoded once,
    each x row's float32 sum stored to out. A row's lanes and tree are the same whatever the group."""
    nibbles = codes_dtype == types.uint8

    def codegen(context, builder, signature, args):
        x, xo, xs, c, co, s, so, lo_arr, blocks, o, oo, ostride = args
        xp, cp, sp, mp, op = (array_data(context, builder, signature.args[a], v)
                              for a, v in ((0, x), (3, c), (5, s), (7, lo_arr), (9, o)))  # fmt: skip
        i64 = xo.type
        zero = ir.Constant(VEC, [0.0] * HALF)
        # Accumulators live in allocas that LLVM promotes to registers: per x row, one chain per half block.
        with builder.goto_entry_block():
            accs = [(builder.alloca(VEC), builder.alloca(VEC)) for _ in range(group)]
        for pair in accs:
            for a in pair:
                builder.store(zero, a)
        rows = [builder.add(xo, builder.mul(xs, ir.Constant(i64, i))) for i in range(group)]
        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            sb = builder.add(so, b)
            d = splat(builder, builder.load(builder.gep(sp, [sb])))
            if nibbles:
                raw = _vec_at(builder, cp, builder.add(co, builder.mul(b, ir.Constant(i64, HALF))), BYTES, 1)
                q_lo = builder.uitofp(builder.and_(raw, ir.Constant(BYTES, [15] * HALF)), VEC)
                q_hi = builder.uitofp(builder.lshr(raw, ir.Constant(BYTES, [4] * HALF)), VEC)
                m = splat(builder, builder.load(builder.gep(mp, [sb])))
                w_lo = fma(builder, d, q_lo, m)  # d q exact: one rounding, as the decoder's d * q + m
                w_hi = fma(builder, d, q_hi, m)
            else:
                cb = builder.add(co, builder.mul(b, ir.Constant(i64, BLOCK)))
                q_lo = builder.sitofp(_vec_at(builder, cp, cb, BYTES, 1), VEC)
                q_hi = builder.sitofp(_vec_at(builder, cp, builder.add(cb, ir.Constant(i64, HALF)), BYTES, 1), VEC)
                w_lo = builder.fmul(d, q_lo)  # exact
                w_hi = builder.fmul(d, q_hi)
            step = builder.mul(b, ir.Constant(i64, BLOCK))
            for start, (acc_lo, acc_hi) in zip(rows, accs, strict=True):
                xb = builder.add(start, step)
                x_lo = _vec_at(builder, xp, xb, VEC, 4)
                x_hi = _vec_at(builder, xp, builder.add(xb, ir.Constant(i64, HALF)), VEC, 4)
                builder.store(fma(builder, x_lo, w_lo, builder.load(acc_lo)), acc_lo)
                builder.store(fma(builder, x_hi, w_hi, builder.load(acc_hi)), acc_hi)
        for i, (acc_lo, acc_hi) in enumerate(accs):
            where = builder.add(oo, builder.mul(ostride, ir.Constant(i64, i)))
            builder.store(sum_lanes(builder, builder.load(acc_lo), builder.load(acc_hi)), builder.gep(op, [where]))
        return context.get_dummy_value()

    return codegen


def _make_dots(group: int):
    @intrinsic
    def dots(typingctx, x, xoff, xstride, codes, coff, scale, soff, low, blocks, out, ooff, ostride):
        """For i < group: out[ooff + i ostride] = sum over `blocks` blocks of x[xoff + i xstride + 32 b + j] w_b[j];
        w decoded from codes at coff (byte or element offset of the row's first block), scale[soff + b] and
        (Q4_1) low[soff + b]. Flat arrays, int64 offsets and strides."""
        for arr in (x, scale, low, out):
            if not isinstance(arr, types.Array) or arr.dtype != types.float32:
                raise TypingError("x, scale, low and out must be float32 arrays")
        if not isinstance(codes, types.Array) or codes.dtype not in (types.uint8, types.int8):
            raise TypingError("codes must be uint8 (Q4_1) or int8 (Q8_0)")
        sig = types.void(x, xoff, xstride, codes, coff, scale, soff, low, blocks, out, ooff, ostride)
        return sig, _rows_dot(codes.dtype, group)

    return dots


# Four rows of x per decoded block: a batch-8 decode step decodes each block twice instead of 8 times.
_GROUP = 4
_dots_group = _make_dots(_GROUP)
_dots_one = _make_dots(1)


@njit(parallel=True, cache=True)
def _matmul(x, codes, scale, low, out):
    """out (m, n) = x (m, k) times the decoded weights (n, k) transposed; codes (n, k/2) uint8 or (n, k) int8."""
    rows, k = x.shape
    n = codes.shape[0]
    blocks = k // BLOCK
    per_row = codes.shape[1]
    xf = x.ravel()
    cf = codes.ravel()
    sf = scale.ravel()
    lf = low.ravel()
    of = out.ravel()
    chunks = min(n, 256)
    for c in prange(chunks):
        first, last = chunk(c, chunks, n)
        for r in range(first, last):
            i = 0
            while i + _GROUP <= rows:
                _dots_group(xf, i * k, k, cf, r * per_row, sf, r * blocks, lf, blocks, of, i * n + r, n)
                i += _GROUP
            while i < rows:
                _dots_one(xf, i * k, k, cf, r * per_row, sf, r * blocks, lf, blocks, of, i * n + r, n)
                i += 1


@njit(parallel=True, cache=True)
def _decode(codes, scale, low, out):
    """out (n, k) float32 = the decoded weights."""
    n, k = out.shape
    blocks = k // BLOCK
    nibbles = codes.shape[1] * 2 == k
    for r in prange(n):
        for b in range(blocks):
            d = scale[r, b]
            m = low[r, b] if nibbles else np.float32(0)
            for j in range(HALF):
                if nibbles:
                    byte = np.int32(codes[r, b * HALF + j])
                    out[r, b * BLOCK + j] = d * np.float32(byte & 15) + m
                    out[r, b * BLOCK + HALF + j] = d * np.float32(byte >> 4) + m
                else:
                    out[r, b * BLOCK + j] = d * np.float32(codes[r, b * BLOCK + j])
                    out[r, b * BLOCK + HALF + j] = d * np.float32(codes[r, b * BLOCK + HALF + j])


@njit(parallel=True, cache=True)
def _ranges(w, low, high):
    """low / high (n, k / 32): each block's smallest and largest weight."""
    n, blocks = low.shape
    for r in prange(n):
        for b in range(blocks):
            lo = w[r, b * BLOCK]
            hi = lo
            for j in range(1, BLOCK):
                v = w[r, b * BLOCK + j]
                lo = min(lo, v)
                hi = max(hi, v)
            low[r, b] = lo
            high[r, b] = hi


@njit(parallel=True, cache=True)
def _encode(w, scale, low, codes) -> int:
    """codes for w given each block's scale (and Q4_1's low): the codes, and how many rows do not decode back
    to w exactly (0: every weight is its block's d q + m bit for bit). codes (n, k/2) uint8 or (n, k) int8."""
    n, k = w.shape
    blocks = k // BLOCK
    nibbles = codes.shape[1] * 2 == k
    bad = np.zeros(n, np.int64)
    for r in prange(n):
        for b in range(blocks):
            d = scale[r, b]
            m = low[r, b] if nibbles else np.float32(0)
            inv = np.float32(1) / d if d > 0 else np.float32(0)
            for j in range(HALF if nibbles else BLOCK):
                v = w[r, b * BLOCK + j]
                q = np.float32(np.rint((v - m) * inv)) if nibbles else np.float32(np.rint(v * inv))
                if nibbles:
                    q = min(max(q, np.float32(0)), np.float32(15))
                    u = w[r, b * BLOCK + HALF + j]
                    p = min(max(np.float32(np.rint((u - m) * inv)), np.float32(0)), np.float32(15))
                    if d * q + m != v or d * p + m != u:
                        bad[r] += 1
                    codes[r, b * HALF + j] = np.uint8(q) | (np.uint8(p) << 4)
                else:
                    q = min(max(q, np.float32(-127)), np.float32(127))
                    if d * q != v:
                        bad[r] += 1
                    codes[r, b * BLOCK + j] = np.int8(q)
    return int((bad > 0).sum())


share_compiles(globals())

_NO_LOW = np.zeros((1, 1), np.float32)
# Each kind's codes: dtype, weights per byte, and the arrays its weights take (codes, scale[, low]).
_LAYOUTS = {"q4_1": (np.uint8, 2, 3), "q8_0": (np.int8, 1, 2)}
KINDS = tuple(_LAYOUTS)


def check_parts(kind: str, parts: tuple[np.ndarray, ...], k: int) -> None:
    """ValueError unless ``parts`` are the arrays of ``kind`` ("q4_1": codes, scale, low; "q8_0": codes, scale;
    module docs) for rows of ``k`` weights."""
    if kind not in _LAYOUTS:
        raise ValueError(f"no block kernel for {kind!r}")
    dtype, per_byte, count = _LAYOUTS[kind]
    if len(parts) != count or k % BLOCK or k < BLOCK:
        raise ValueError(f"{kind} takes {count} arrays for rows of a multiple of {BLOCK} weights, got {len(parts)}"
                         f" arrays for rows of {k}")
    codes, scales = parts[0], parts[1:]
    n = codes.shape[0] if codes.ndim == 2 else -1
    if codes.dtype != dtype or codes.shape != (n, k // per_byte) or not codes.flags.c_contiguous:
        raise ValueError(f"{kind} codes must be C-contiguous {np.dtype(dtype)} ({n}, {k // per_byte})")
    for s in scales:
        if s.dtype != np.float32 or s.shape != (n, k // BLOCK) or not s.flags.c_contiguous:
            raise ValueError(f"{kind} scales must be C-contiguous float32 ({n}, {k // BLOCK}), got {s.dtype} {s.shape}")


def matmul_rows(x: np.ndarray, parts: tuple[np.ndarray, ...]) -> np.ndarray:
    """x (m, k) C-contiguous float32 times the weights of ``parts`` (checked by check_parts) transposed: (m, n).
    Only x's width is checked here: the per-call path of a layer whose parts were checked once."""
    codes = parts[0]
    q4 = len(parts) == 3
    if x.ndim != 2 or x.shape[1] != codes.shape[1] * (2 if q4 else 1):
        raise ValueError(f"x must be (m, {codes.shape[1] * (2 if q4 else 1)}), got {x.shape}")
    out = np.empty((x.shape[0], codes.shape[0]), np.float32)
    launch(_matmul, x, codes, parts[1], parts[2] if q4 else _NO_LOW, out)
    return out


def matmul_q4_1(x: np.ndarray, codes: np.ndarray, scale: np.ndarray, low: np.ndarray) -> np.ndarray:
    """x (m, k) float32 times Q4_1 weights (n rows; module docs) transposed: (m, n) float32."""
    check_parts("q4_1", (codes, scale, low), codes.shape[1] * 2 if codes.ndim == 2 else 0)
    _check_x(x, codes.shape[1] * 2)
    return matmul_rows(x, (codes, scale, low))


def matmul_q8_0(x: np.ndarray, codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x (m, k) float32 times Q8_0 weights (n rows; module docs) transposed: (m, n) float32."""
    check_parts("q8_0", (codes, scale), codes.shape[1] if codes.ndim == 2 else 0)
    _check_x(x, codes.shape[1])
    return matmul_rows(x, (codes, scale))


def _check_x(x: np.ndarray, k: int) -> None:
    if x.ndim != 2 or x.shape[1] != k or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"x must be C-contiguous float32 (m, {k}), got {x.dtype} {x.shape}")


def block_ranges(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each block's smallest and largest weight, (n, k / 32) each, of a C-contiguous float32 (n, k)."""
    low = np.empty((w.shape[0], w.shape[1] // BLOCK), np.float32)
    high = np.empty_like(low)
    launch(_ranges, w, low, high)
    return low, high


def encode_q4_1(w: np.ndarray, scale: np.ndarray, low: np.ndarray) -> np.ndarray | None:
    """The Q4_1 codes of w (n, k) float32 with these blocks' d and m, or None unless they decode to w exactly."""
    codes = np.empty((w.shape[0], w.shape[1] // 2), np.uint8)
    return codes if launch(_encode, w, scale, low, codes) == 0 else None


def encode_q8_0(w: np.ndarray, scale: np.ndarray) -> np.ndarray | None:
    """The Q8_0 codes of w (n, k) float32 with these blocks' d, or None unless they decode to w exactly."""
    codes = np.empty(w.shape, np.int8)
    return codes if launch(_encode, w, scale, _NO_LOW, codes) == 0 else None


def decode_q4_1(codes: np.ndarray, scale: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The float32 weights (n, k) of Q4_1 blocks."""
    out = np.empty((codes.shape[0], codes.shape[1] * 2), np.float32)
    launch(_decode, codes, scale, low, out)
    return out


def decode_q8_0(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weights (n, k) of Q8_0 blocks."""
    out = np.empty(codes.shape, np.float32)
    launch(_decode, codes, scale, _NO_LOW, out)
    return out
