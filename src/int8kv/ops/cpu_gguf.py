"""Matrix products over GGUF weight blocks read in place, as a .gguf file stores them, for the CPU.

    y[i, n] = sum_k x[i, k] * w[n, k]         w[n, k] decoded from the file's block bytes of row n

A weight matrix (n, k) is a C-contiguous uint8 array (n, k / block_weights * block_bytes): exactly the file's
bytes, ggml's block structs one after another along each row (float16 scales little-endian):

    q4_0  32 weights, 18 bytes   {f16 d; 16 bytes qs}                       w = d (q - 8)
    q4_1  32 weights, 20 bytes   {f16 d, m; 16 bytes qs}                    w = d q + m
    q5_0  32 weights, 22 bytes   {f16 d; u32 qh; 16 bytes qs}               w = d (q - 16)
    q5_1  32 weights, 24 bytes   {f16 d, m; u32 qh; 16 bytes qs}            w = d q + m
    q8_0  32 weights, 34 bytes   {f16 d; 32 int8 qs}                        w = d q
    q4_k  256 weights, 144 bytes {f16 d, dmin; 12 bytes of 6-bit scales and mins; 128 bytes qs}
                                 sub-block s of 32: w = (d sc_s) q - (dmin m_s)
    q5_k  256 weights, 176 bytes {f16 d, dmin; 12 bytes scales; 32 bytes qh; 128 bytes qs}, as q4_k, 5-bit q
    q6_k  256 weights, 210 bytes {128 bytes ql; 64 bytes qh; 16 int8 scales; f16 d}
                                 16 weights per scale: w = (d sc) (q - 32), 6-bit q

(gguf-py's gguf/quants.py is the reference for the bit positions.) Every decoded weight is bit for bit gguf-py's
float32 dequantized value: gguf-py computes in float32, and each of its products is exact in float32 (an 11-bit
float16 significand times integers of at most 6 + 6 bits: q4_k's d sc q needs 21 bits, q6_k's d sc (q - 32) 23),
so the one rounding left is the + m / - dmin m_s of the affine kinds, which the kernels do as gguf-py does (a fused
multiply-add of an exact product rounds the same way). The float16 scales are converted in the kernel from their
bits (an exact `fpext half to float`).

The kernels are LLVM IR (through numba): each sub-block of 32 weights is decoded into two <16 x float> registers
from the block bytes (nibbles, high bits and scales unpacked in registers), shared by up to four rows of x, and
multiplied in 32 lanes: lane j accumulates the j-th weight of every sub-block of the row, in order, with one
rounding per product-and-add (fused multiply-add), then the 32 lanes are added as a fixed tree. That is
int8kv.ops.cpu_packed's summation order, so a Q4_1 or Q8_0 row gives bit for bit what cpu_packed's kernel gives
over the same blocks, and a row's result depends neither on the thread count nor on the other rows of x.

For decode (one to three rows of x, the per-token matvec; tools/gguf_kernel_ab.py measures it), the kernels that
take one row of x at a time differ: a block's scales (computed once per 256 weights, or per 16 blocks of 32, as
vectors) are kept in memory, each sub-block reading its own with a broadcasting load; on AVX-512 the 4-bit kinds
make a sub-block's 16 possible weights (a q + b, q = 0..15, gguf-py's values) as one vector and pick each weight by
its code with a permute, where converting and scaling the codes took two float operations; Q4_K weight rows go two
a pass (four accumulator chains where one row has two, each x vector loaded once for both), with the next pair's
blocks prefetched. None of it moves a sum: each row keeps its lanes and tree.

More than DENSE_ROWS rows of x (a prefill chunk) decode a tile of output rows at a time to float32 (at most
TILE_BYTES, never the whole matrix) into a buffer kept per thread, and multiply it with torch's matmul.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ..errors import ShapeMismatch, UnsupportedWeights
from ..numba_cache import require_jit, share_compiles
from ..numba_threads import launch
from .block_ir import BYTES, CONTRACT, F32, HALF, I32, VEC, chunk, fma, splat, sum_lanes
from .cpu_simd import array_data, target_features, vector_at

require_jit(__name__)

__all__ = [
    "DENSE_ROWS",
    "KINDS",
    "LAYOUTS",
    "TILE_BYTES",
    "RowOutOfRange",
    "block_matmul",
    "check_blocks",
    "decode_rows_checked",
    "dense_matmul",
    "dequantize",
    "dequantize_rows",
    "kind_id",
    "matmul",
    "matmul_checked",
    "tile_rows",
]

SUB = 32  # weights per kernel step (two 16-lane halves); every kind's block is a whole number of them
# kind -> (weights per block, bytes per block), in the order of the kernels' kind ids
LAYOUTS = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
}  # fmt: skip
KINDS = tuple(LAYOUTS)
# Rows of x above which tiles of weights are decoded to float32 for torch's matmul. The block kernel re-decodes each
# sub-block per four rows of x, so its cost grows with the rows while the tiles' decode does not; 16 rows is
# about where the two cost the same across the quant types and shapes tried (docs/archive/benchmarks-2026.md,
# "Packed GGUF weights").
DENSE_ROWS = 16
TILE_BYTES = 8 << 20  # float32 bytes of one decoded tile (whole output rows; at least 256 rows, at most 1024)

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_WORDS = ir.VectorType(I32, HALF)


# ---------------------------------------------------------------------------------------------------------
# IR pieces
# ---------------------------------------------------------------------------------------------------------
def _bytes16(builder, base, offset):
    """16 bytes at base[offset] as <16 x i8> (no alignment)."""
    return builder.load(vector_at(builder, base, offset, BYTES), align=1)


def _byte(builder, base, offset):
    return builder.load(builder.gep(base, [offset]))


def _f16(builder, base, offset):
    """The float16 at base[offset] (2 bytes, little-endian) as an exact float32."""
    bits = builder.load(vector_at(builder, base, offset, _I16), align=1)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)


def _bytes_of(value):
    return ir.Constant(BYTES, [value] * HALF)


def _nibbles(builder, raw, shift):
    """(raw >> shift) & 15 per byte; shift an int or an i8 value."""
    if isinstance(shift, int):
        shifted = builder.lshr(raw, _bytes_of(shift)) if shift else raw
    else:
        shifted = builder.lshr(raw, splat(builder, shift, BYTES))
    return builder.and_(shifted, _bytes_of(15))


def _qh_bits(builder, qh, first):
    """Bits first..first+15 of the 32-bit qh word, each as 16 in a byte: (qh >> (first + j) & 1) << 4."""
    words = builder.lshr(splat(builder, qh, _WORDS), ir.Constant(_WORDS, list(range(first, first + HALF))))
    bits = builder.trunc(builder.and_(words, ir.Constant(_WORDS, [1] * HALF)), BYTES)
    return builder.shl(bits, _bytes_of(4))


_SCALE_GROUP = 16  # 32-weight blocks whose float16 scales are converted together, as one vector


def _k_scales(builder, kind: str, row, bb, a_arr, b_arr) -> None:
    """The scales of the 8 sub-blocks of the K-quant block at row[bb], as float32 into a_arr (and b_arr), computed
    as vectors. q4_k / q5_k (gguf-py's Q4_K.get_scale_min over bytes 4..15): a[s] = d sc_s, b[s] = -(dmin m_s),
    s < 4: sc = scales[s] & 63, m = scales[s + 4] & 63; else the low 4 bits from scales[s + 4] and the high 2 from
    the top bits of scales[s - 4] (sc) and scales[s] (m). q6_k: a[2 s + h] = d * int8 scales[2 s + h] (16 lanes)."""
    k = lambda v: builder.add(bb, ir.Constant(bb.type, v))  # noqa: E731
    if kind == "q6_k":
        d = _f16(builder, row, k(208))
        a = builder.fmul(splat(builder, d, VEC), builder.sitofp(_bytes16(builder, row, k(192)), VEC))
        builder.store(a, builder.bitcast(a_arr, VEC.as_pointer()), align=4)
        return
    v8i8, v8f = ir.VectorType(_I8, 8), ir.VectorType(F32, 8)
    raw = _bytes16(builder, row, k(4))  # bytes 4..19 of the block: the 12 scale bytes first
    lanes = lambda idx: builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(I32, 8), idx))  # noqa: E731
    c8 = lambda v: ir.Constant(v8i8, [v] * 8)  # noqa: E731
    top = lambda v: builder.shl(builder.lshr(v, c8(6)), c8(4))  # noqa: E731
    low = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
    x1, x2 = lanes([0, 1, 2, 3, 8, 9, 10, 11]), lanes([0, 1, 2, 3, 0, 1, 2, 3])
    y1, y2 = lanes([4, 5, 6, 7, 8, 9, 10, 11]), lanes([4, 5, 6, 7, 4, 5, 6, 7])
    sc = builder.select(low, builder.and_(x1, c8(63)), builder.or_(builder.and_(x1, c8(15)), top(x2)))
    mn = builder.select(low, builder.and_(y1, c8(63)), builder.or_(builder.lshr(y1, c8(4)), top(y2)))
    d = splat(builder, _f16(builder, row, bb), v8f)
    dmin = splat(builder, _f16(builder, row, k(2)), v8f)
    a = builder.fmul(d, builder.uitofp(sc, v8f))  # exact (11 + 6 bits)
    b = builder.fneg(builder.fmul(dmin, builder.uitofp(mn, v8f)))  # - dmin m, exact
    builder.store(a, builder.bitcast(a_arr, v8f.as_pointer()), align=4)
    builder.store(b, builder.bitcast(b_arr, v8f.as_pointer()), align=4)


def _group_scales(builder, kind: str, row, first, d_arr, m_arr) -> None:
    """The float16 d (and m) of the 32-weight blocks first .. first + _SCALE_GROUP (i64 block index), converted
    as one vector into d_arr (m_arr)."""
    nbytes = LAYOUTS[kind][1]
    base = builder.mul(first, ir.Constant(first.type, nbytes))
    words = ir.Constant(_WORDS, ir.Undefined)
    for i in range(_SCALE_GROUP):  # the block's first 4 bytes: d, then m (q4_1, q5_1) or the codes' first bytes
        at = builder.add(base, ir.Constant(first.type, i * nbytes)) if i else base
        word = builder.load(vector_at(builder, row, at, I32), align=1)
        words = builder.insert_element(words, word, ir.Constant(I32, i))
    halves = ir.VectorType(ir.HalfType(), _SCALE_GROUP)

    def to_float(w):  # the low 16 bits of each word, as float16 -> float32 (exact)
        return builder.fpext(builder.bitcast(builder.trunc(w, ir.VectorType(_I16, _SCALE_GROUP)), halves), VEC)

    builder.store(to_float(words), builder.bitcast(d_arr, VEC.as_pointer()), align=4)
    if kind.endswith("_1"):
        high = builder.lshr(words, ir.Constant(_WORDS, [16] * HALF))
        builder.store(to_float(high), builder.bitcast(m_arr, VEC.as_pointer()), align=4)


def _sub_block(builder, kind: str, row, bb, s: int, scales):
    """Sub-block s (a Python int: 0 for the 32-weight kinds, 0..7 for the K-quants) of the block at byte bb
    (i64) of a weight row at `row` (i8*): (a_lo, b_lo, a_hi, b_hi, q_lo, q_hi), the weights of lanes 0-15 being
    a_lo q_lo + b_lo (b None: a_lo q_lo), of lanes 16-31 the same with _hi; a, b float32 scalars, q
    <16 x float> codes (signed for the kinds whose weights are d (q - offset)). ``scales``: (a_lo, b_lo, a_hi,
    b_hi) already decoded, or None (a 32-weight block: read here)."""
    k = lambda v: builder.add(bb, ir.Constant(bb.type, v))  # noqa: E731  (a byte of the block)
    if kind in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        affine = kind.endswith("_1")
        if scales is None:
            d = _f16(builder, row, bb)
            scales = (d, _f16(builder, row, k(2)) if affine else None)
        d, m = scales[0], scales[1]
        if kind == "q8_0":
            q_lo = builder.sitofp(_bytes16(builder, row, k(2)), VEC)
            q_hi = builder.sitofp(_bytes16(builder, row, k(18)), VEC)
            return d, None, d, None, q_lo, q_hi
        at = 4 if affine else 2
        if kind.startswith("q5"):
            qh = builder.load(vector_at(builder, row, k(at), I32), align=1)
            at += 4
        raw = _bytes16(builder, row, k(at))
        lo, hi = _nibbles(builder, raw, 0), _nibbles(builder, raw, 4)
        if kind.startswith("q5"):
            lo = builder.or_(lo, _qh_bits(builder, qh, 0))
            hi = builder.or_(hi, _qh_bits(builder, qh, HALF))
        if affine:
            return d, m, d, m, builder.uitofp(lo, VEC), builder.uitofp(hi, VEC)
        offset = _bytes_of(16 if kind == "q5_0" else 8)
        q_lo = builder.sitofp(builder.sub(lo, offset), VEC)
        q_hi = builder.sitofp(builder.sub(hi, offset), VEC)
        return d, None, d, None, q_lo, q_hi
    a_lo, b_lo, a_hi, b_hi = scales
    if kind == "q6_k":
        h, p = s // 4, s % 4  # ql bytes 64 h + 32 (p % 2), nibble p // 2; qh bytes 128 + 32 h, bits 2 p
        codes = []
        for half in (0, HALF):
            ql = _nibbles(builder, _bytes16(builder, row, k(64 * h + 32 * (p % 2) + half)), 4 * (p // 2))
            qh = builder.lshr(_bytes16(builder, row, k(128 + 32 * h + half)), _bytes_of(2 * p))
            qh = builder.shl(builder.and_(qh, _bytes_of(3)), _bytes_of(4))
            codes.append(builder.sitofp(builder.sub(builder.or_(ql, qh), _bytes_of(32)), VEC))
        return a_lo, None, a_hi, None, codes[0], codes[1]
    qs = 48 if kind == "q5_k" else 16
    codes = []
    for half in (0, HALF):
        q = _nibbles(builder, _bytes16(builder, row, k(qs + 32 * (s // 2) + half)), 4 * (s % 2))
        if kind == "q5_k":
            qh = builder.lshr(_bytes16(builder, row, k(16 + half)), _bytes_of(s))
            q = builder.or_(q, builder.shl(builder.and_(qh, _bytes_of(1)), _bytes_of(4)))
        codes.append(builder.uitofp(q, VEC))
    return a_lo, b_lo, a_hi, b_hi, codes[0], codes[1]


def _prefetch(builder, base, offset, nbytes: int) -> None:
    """Ask for the cache lines of base[offset .. offset + nbytes) (a hint: never faults)."""
    fnty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), I32, I32, I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    for at in range(0, nbytes, 64):
        ptr = builder.gep(base, [builder.add(offset, ir.Constant(offset.type, at))])
        builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _stage_scales(builder, rows, arrays, in_memory: bool, ahead, offset, nbytes: int, fill) -> None:
    """Every row's scales for the next stretch of blocks into its arrays (``fill(row, a_arr, b_arr)``), kept in
    memory if asked, and the rows ahead prefetched from byte ``offset`` for ``nbytes``: what both the K-quant
    superblock loop and the 16-block group loop do before their blocks."""
    for row, (a_arr, b_arr) in zip(rows, arrays, strict=True):
        fill(row, a_arr, b_arr)
    if in_memory:
        _in_memory(builder, arrays)
    for base in ahead:
        _prefetch(builder, base, offset, nbytes)


def _in_memory(builder, arrays) -> None:
    """Keep the scale arrays in memory: an empty asm statement that may read them, so that LLVM keeps their stores
    and reads each scale with a broadcasting load (vbroadcastss m32), not a lane extract and a broadcast."""
    ptrs = [a for pair in arrays for a in pair]
    fnty = ir.FunctionType(ir.VoidType(), [p.type for p in ptrs])
    asm = ir.InlineAsm(fnty, "", ",".join(["r"] * len(ptrs)) + ",~{memory}", side_effect=True)
    builder.call(asm, ptrs)


def _each_sub_block(builder, kind: str, rows, nsub, body, ahead=(), in_memory=False):
    """``body(bb, s, t, scales)`` for every sub-block of the weight rows at ``rows`` (i8* each, decoded side by
    side): bb the i64 byte offset of its block, s its index in the block (a Python int), t its index in the row
    (i64), scales one (a_lo, b_lo, a_hi, b_hi) decoded (or None) per row. K-quants: a loop over blocks, each block's
    scales computed as vectors and its 8 sub-blocks unrolled. 32-weight kinds: the float16 scales of 16 blocks
    converted as one vector, then those blocks; the last nsub % 16 blocks read their own."""
    weights, nbytes = LAYOUTS[kind]
    i64 = nsub.type
    c = lambda v: ir.Constant(i64, v)  # noqa: E731
    with builder.goto_entry_block():
        arrays = [(builder.alloca(ir.ArrayType(F32, HALF)), builder.alloca(ir.ArrayType(F32, HALF))) for _ in rows]
    at = lambda arr, i: builder.load(builder.gep(arr, [ir.Constant(I32, 0), i]))  # noqa: E731
    if weights > SUB:
        per = weights // SUB
        with cgutils.for_range(builder, builder.udiv(nsub, c(per))) as loop:
            bb = builder.mul(loop.index, c(nbytes))
            first = builder.mul(loop.index, c(per))
            _stage_scales(builder, rows, arrays, in_memory, ahead, bb, nbytes,
                          lambda row, a_arr, b_arr: _k_scales(builder, kind, row, bb, a_arr, b_arr))
            for s in range(per):
                scales = []
                for a_arr, b_arr in arrays:
                    if kind == "q6_k":
                        lo, hi = at(a_arr, ir.Constant(I32, 2 * s)), at(a_arr, ir.Constant(I32, 2 * s + 1))
                        scales.append((lo, None, hi, None))
                    else:
                        a, b = at(a_arr, ir.Constant(I32, s)), at(b_arr, ir.Constant(I32, s))
                        scales.append((a, b, a, b))
                body(bb, s, builder.add(first, c(s)) if s else first, scales)
        return
    affine = kind.endswith("_1")
    groups = builder.udiv(nsub, c(_SCALE_GROUP))
    with cgutils.for_range(builder, groups) as loop:
        first = builder.mul(loop.index, c(_SCALE_GROUP))
        _stage_scales(builder, rows, arrays, in_memory, ahead, builder.mul(first, c(nbytes)), _SCALE_GROUP * nbytes,
                      lambda row, a_arr, b_arr: _group_scales(builder, kind, row, first, a_arr, b_arr))
        with cgutils.for_range(builder, c(_SCALE_GROUP)) as inner:  # a constant trip count: LLVM unrolls it
            t = builder.add(first, inner.index)
            scales = [(at(a_arr, inner.index), at(b_arr, inner.index) if affine else None) for a_arr, b_arr in arrays]
            body(builder.mul(t, c(nbytes)), 0, t, scales)
    with cgutils.for_range_slice(builder, builder.mul(groups, c(_SCALE_GROUP)), nsub, c(1)) as (t, _):
        body(builder.mul(t, c(nbytes)), 0, t, [None] * len(rows))  # the last nsub % 16 blocks read their own scales


# 4-bit kinds on AVX-512: a sub-block's 16 possible weights (a q + b, q = 0..15, each rounded once as gguf-py's)
# are made as one vector, and each weight is the lane its code picks (vpermps, which reads an index's low 4 bits):
# one permute a 16 weights where converting the codes and scaling them took two float operations.
_TABLES = "+avx512f" in target_features().split(",")
_TABLE_KINDS = ("q4_0", "q4_1", "q4_k")
_IOTA = ir.Constant(VEC, [float(v) for v in range(HALF)])


def _permute(builder, table, idx):
    fnty = ir.FunctionType(VEC, [VEC, _WORDS])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [table, idx])


def _sub_block_weights(builder, kind: str, row, bb, s: int, scales, tables=False):
    """The weights (w_lo, w_hi) of sub-block s of the block at byte bb (`_sub_block`'s arguments): <16 x float>
    each, gguf-py's values; ``tables``: by a table of the 16 values where the kind and the CPU allow."""
    if not (tables and _TABLES and kind in _TABLE_KINDS):
        a_lo, b_lo, a_hi, b_hi, q_lo, q_hi = _sub_block(builder, kind, row, bb, s, scales)
        return _weights(builder, a_lo, b_lo, q_lo), _weights(builder, a_hi, b_hi, q_hi)
    k = lambda v: builder.add(bb, ir.Constant(bb.type, v))  # noqa: E731
    if kind == "q4_k":
        a, b = scales[0], scales[1]
        halves = [_bytes16(builder, row, k(16 + 32 * (s // 2) + h)) for h in (0, HALF)]
        shift = 4 * (s % 2)
    else:
        if scales is None:
            scales = (_f16(builder, row, bb), _f16(builder, row, k(2)) if kind == "q4_1" else None)
        a, b = scales
        raw = _bytes16(builder, row, k(4 if kind == "q4_1" else 2))
        halves, shift = [raw, raw], None
    if kind == "q4_0":
        table = _weights(builder, a, None, builder.fsub(_IOTA, ir.Constant(VEC, [8.0] * HALF)))
    else:
        table = _weights(builder, a, b, _IOTA)
    out = []
    for h, raw in enumerate(halves):
        idx = builder.zext(raw, _WORDS)
        step = shift if shift is not None else 4 * h  # 32-weight kinds: the low nibbles, then the high ones
        if step:
            idx = builder.lshr(idx, ir.Constant(_WORDS, [step] * HALF))
        out.append(_permute(builder, table, idx))
    return out[0], out[1]


def _weights(builder, a, b, q):
    """a q (+ b) over 16 lanes: the product is exact, so the one rounding is the add's, as gguf-py's."""
    av = splat(builder, a, VEC)
    if b is None:
        return builder.fmul(av, q)
    return builder.fadd(builder.fmul(av, q, flags=CONTRACT), splat(builder, b, VEC), flags=CONTRACT)


def _each_kind(builder, kind_value, emit):
    """``emit(kind)`` in the branch of a switch on the kind id (KINDS' order); an unknown id does nothing."""
    end = builder.append_basic_block("kinds.end")
    switch = builder.switch(kind_value, end)
    for index, kind in enumerate(KINDS):
        block = builder.append_basic_block(f"kind.{kind}")
        switch.add_case(ir.Constant(kind_value.type, index), block)
        builder.position_at_end(block)
        emit(kind)
        builder.branch(end)
    builder.position_at_end(end)


def _rows_dot(wrows: int, group: int):
    """``wrows`` weight rows (``bstride`` bytes apart) against ``group`` rows of x: each sub-block decoded once,
    each x row loaded once for the weight rows, each (weight row, x row) float32 sum stored to out. A sum's lanes
    and tree are the same whatever wrows and group."""

    def codegen(context, builder, signature, args):
        kind, x, xo, xs, blocks, bo, bstride, nsub, o, oo, ostride = args
        xp, bp, op = (array_data(context, builder, signature.args[a], v) for a, v in ((1, x), (4, blocks), (8, o)))
        i64 = xo.type
        rows = [builder.gep(bp, [builder.add(bo, builder.mul(bstride, ir.Constant(i64, w)))]) for w in range(wrows)]
        zero = ir.Constant(VEC, [0.0] * HALF)
        with builder.goto_entry_block():
            accs = [[(builder.alloca(VEC), builder.alloca(VEC)) for _ in range(group)] for _ in range(wrows)]
        for per_row in accs:
            for pair in per_row:
                for a in pair:
                    builder.store(zero, a)
        starts = [builder.add(xo, builder.mul(xs, ir.Constant(i64, i))) for i in range(group)]

        def body(kind_name, bb, s, t, scales):
            ws = []
            for row, sc in zip(rows, scales, strict=True):
                ws.append(_sub_block_weights(builder, kind_name, row, bb, s, sc, tables=group == 1))
            step = builder.mul(t, ir.Constant(i64, SUB))
            for i, start in enumerate(starts):
                xb = builder.add(start, step)
                x_lo = builder.load(vector_at(builder, xp, xb, VEC), align=4)
                x_hi = builder.load(vector_at(builder, xp, builder.add(xb, ir.Constant(i64, HALF)), VEC), align=4)
                for (w_lo, w_hi), per_row in zip(ws, accs, strict=True):
                    acc_lo, acc_hi = per_row[i]
                    builder.store(fma(builder, x_lo, w_lo, builder.load(acc_lo)), acc_lo)
                    builder.store(fma(builder, x_hi, w_hi, builder.load(acc_hi)), acc_hi)

        # Two rows a pass read two streams of a row's length each, which the hardware prefetcher loses at each
        # jump to the next pair: the next pass's blocks are asked for as these are read.
        ahead = [builder.gep(r, [builder.mul(bstride, ir.Constant(i64, wrows))]) for r in rows] if wrows > 1 else []
        _each_kind(builder, kind,
                   lambda name: _each_sub_block(builder, name, rows, nsub, lambda *a: body(name, *a), ahead,
                                                in_memory=group == 1))  # fmt: skip
        for w, per_row in enumerate(accs):
            for i, (acc_lo, acc_hi) in enumerate(per_row):
                where = builder.add(oo, builder.add(builder.mul(ostride, ir.Constant(i64, i)), ir.Constant(i64, w)))
                total = sum_lanes(builder, builder.load(acc_lo), builder.load(acc_hi))
                builder.store(total, builder.gep(op, [where]))
        return context.get_dummy_value()

    return codegen


def _check_arrays(x, blocks, out):
    if not isinstance(x, types.Array) or x.dtype != types.float32:
        raise TypingError("x must be a float32 array")
    if not isinstance(out, types.Array) or out.dtype != types.float32:
        raise TypingError("out must be a float32 array")
    if not isinstance(blocks, types.Array) or blocks.dtype != types.uint8:
        raise TypingError("blocks must be a uint8 array")


def _make_dots(wrows: int, group: int):
    @intrinsic
    def dots(typingctx, kind, x, xoff, xstride, blocks, boff, bstride, nsub, out, ooff, ostride):
        """For w < wrows, i < group: out[ooff + i ostride + w] = sum over nsub sub-blocks t, lanes j of
        x[xoff + i xstride + 32 t + j] w[32 t + j], w decoded from the row of `kind` blocks at byte
        boff + w bstride. Flat arrays, int64 kind id, offsets and strides."""
        _check_arrays(x, blocks, out)
        sig = types.void(kind, x, xoff, xstride, blocks, boff, bstride, nsub, out, ooff, ostride)
        return sig, _rows_dot(wrows, group)

    return dots


@intrinsic
def _decode_row(typingctx, kind, blocks, boff, nsub, out, ooff):
    """out[ooff + 32 t + j] = the weight j of sub-block t < nsub of the row of `kind` blocks at byte boff."""
    _check_arrays(out, blocks, out)
    sig = types.void(kind, blocks, boff, nsub, out, ooff)

    def codegen(context, builder, signature, args):
        kind_value, blocks_value, bo, n_sub, o, oo = args
        row = builder.gep(array_data(context, builder, signature.args[1], blocks_value), [bo])
        op = array_data(context, builder, signature.args[4], o)
        i64 = bo.type

        def body(kind_name, bb, s, t, scales):
            w_lo, w_hi = _sub_block_weights(builder, kind_name, row, bb, s, scales[0])
            at = builder.add(oo, builder.mul(t, ir.Constant(i64, SUB)))
            builder.store(w_lo, vector_at(builder, op, at, VEC), align=4)
            at = builder.add(at, ir.Constant(i64, HALF))
            builder.store(w_hi, vector_at(builder, op, at, VEC), align=4)

        _each_kind(builder, kind_value,
                   lambda name: _each_sub_block(builder, name, [row], n_sub, lambda *a: body(name, *a)))  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


# Four rows of x per decoded sub-block: a batch-8 decode step decodes each block twice instead of 8 times. Fewer
# rows of x take two weight rows a pass: four accumulator chains where one row has two (latency), x loaded once.
_GROUP = 4
_dots_group = _make_dots(1, _GROUP)
_dots_pair = _make_dots(2, 1)
_dots_one = _make_dots(1, 1)
# Kind ids whose rows go two a pass at fewer than _GROUP rows of x: Q4_K (faster by 7-12% at one row, in cache
# and from memory). Q6_K and Q8_0 were not faster in cache, and slower from memory (Q8_0 49152 x 2048: 1.75x).
_PAIRS = (KINDS.index("q4_k"),)


@njit(parallel=True, cache=True)
def _matmul(kind, x, blocks, out):
    """out (m, n) = x (m, k) times the weights of blocks (n, row bytes) transposed."""
    rows, k = x.shape
    n, row_bytes = blocks.shape
    nsub = k // SUB
    xf = x.ravel()
    bf = blocks.ravel()
    of = out.ravel()
    pairs = n // 2 if kind in _PAIRS else 0
    chunks = min(pairs if pairs else n, 256)
    full = rows - rows % _GROUP
    for c in prange(chunks):
        if pairs:
            first, last = chunk(c, chunks, pairs)
            lo, hi = 2 * first, (n if c == chunks - 1 else 2 * last)  # the last chunk takes an odd last row
        else:
            lo, hi = chunk(c, chunks, n)
        for r in range(lo, hi):
            for i in range(0, full, _GROUP):
                _dots_group(kind, xf, i * k, k, bf, r * row_bytes, row_bytes, nsub, of, i * n + r, n)
            if not pairs:
                for i in range(full, rows):
                    _dots_one(kind, xf, i * k, k, bf, r * row_bytes, row_bytes, nsub, of, i * n + r, n)
        if pairs:
            for i in range(full, rows):
                for r in range(lo, hi - 1, 2):
                    _dots_pair(kind, xf, i * k, k, bf, r * row_bytes, row_bytes, nsub, of, i * n + r, n)
                if (hi - lo) % 2:
                    r = hi - 1
                    _dots_one(kind, xf, i * k, k, bf, r * row_bytes, row_bytes, nsub, of, i * n + r, n)


@njit(parallel=True, cache=True)
def _decode_rows(kind, blocks, ids, out):
    """out (len(ids), k) = the weights of rows ids of blocks (a range of rows: ids = np.arange(first, last))."""
    m, k = out.shape
    row_bytes = blocks.shape[1]
    nsub = k // SUB
    bf = blocks.ravel()
    of = out.ravel()
    for i in prange(m):
        _decode_row(kind, bf, ids[i] * row_bytes, nsub, of, i * k)


share_compiles(globals())


# ---------------------------------------------------------------------------------------------------------
# Python entry points
# ---------------------------------------------------------------------------------------------------------
def kind_id(kind: str) -> int:
    """The kernels' id of ``kind`` (a name of KINDS, any case); UnsupportedWeights for any other."""
    name = str(kind).lower()
    if name not in LAYOUTS:
        raise UnsupportedWeights(f"no GGUF block kernel for {kind!r} (kernels: {', '.join(KINDS)})")
    return KINDS.index(name)


def check_blocks(kind: str, blocks: np.ndarray) -> int:
    """k, the weights per row of ``blocks``: a C-contiguous uint8 array (n, whole blocks of ``kind``) with n >= 1
    and at least one block per row. UnsupportedWeights for an unknown kind, ShapeMismatch for any other array."""
    weights, nbytes = LAYOUTS[KINDS[kind_id(kind)]]
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or blocks.ndim != 2:
        raise ShapeMismatch(
            f"{kind} blocks must be a 2-d uint8 array, got "
            f"{getattr(blocks, 'dtype', type(blocks).__name__)} {getattr(blocks, 'shape', '')}"
        )
    if not blocks.flags.c_contiguous:
        raise ShapeMismatch(f"{kind} blocks must be C-contiguous")
    n, row_bytes = blocks.shape
    if n < 1 or row_bytes < nbytes or row_bytes % nbytes:
        raise ShapeMismatch(f"{kind} blocks must be (n >= 1, a multiple of {nbytes} bytes), got {blocks.shape}")
    return row_bytes // nbytes * weights


def _check_x(x: np.ndarray, k: int) -> None:
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != k or x.dtype != np.float32:
        raise ShapeMismatch(f"x must be float32 (m, {k}), got {getattr(x, 'dtype', type(x).__name__)} "
                            f"{getattr(x, 'shape', '')}")  # fmt: skip
    if not x.flags.c_contiguous:
        raise ShapeMismatch("x must be C-contiguous")


def matmul(x: np.ndarray, kind: str, blocks: np.ndarray) -> np.ndarray:
    """x (m, k) C-contiguous float32 times the weights of ``blocks`` (n rows of ``kind`` blocks, module docs)
    transposed: float32 (m, n). Up to DENSE_ROWS rows run the block kernel, more a decoded tile at a time."""
    k = check_blocks(kind, blocks)
    _check_x(x, k)
    return matmul_checked(x, kind_id(kind), blocks)


def block_matmul(x: np.ndarray, kind: str, blocks: np.ndarray) -> np.ndarray:
    """:func:`matmul` by the block kernel, whatever the rows of x."""
    k = check_blocks(kind, blocks)
    _check_x(x, k)
    return _block(x, kind_id(kind), blocks)


def dense_matmul(x: np.ndarray, kind: str, blocks: np.ndarray) -> np.ndarray:
    """:func:`matmul` by decoded tiles and torch's matmul, whatever the rows of x."""
    k = check_blocks(kind, blocks)
    _check_x(x, k)
    return _dense(x, kind_id(kind), blocks)


def matmul_checked(x: np.ndarray, kid: int, blocks: np.ndarray) -> np.ndarray:
    """:func:`matmul` for arrays already checked (a layer checks its blocks once and x's width per call)."""
    return _dense(x, kid, blocks) if x.shape[0] > DENSE_ROWS else _block(x, kid, blocks)


def _block(x: np.ndarray, kid: int, blocks: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], blocks.shape[0]), np.float32)
    if x.shape[0]:
        launch(_matmul, kid, x, blocks, out)
    return out


_SCRATCH = threading.local()  # per thread: the float32 buffer that decoded tiles go through


def _tile_buffer(size: int) -> np.ndarray:
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.buf = np.empty(size, np.float32)
    return buf


def tile_rows(n: int, k: int) -> int:
    """Output rows per decoded tile: TILE_BYTES of float32, at least 256 rows and at most 1024, at most n."""
    return min(n, max(256, min(1024, TILE_BYTES // (4 * k))))


def _dense(x: np.ndarray, kid: int, blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    k = x.shape[1]
    m = x.shape[0]
    out_t = torch.empty((n, m), dtype=torch.float32)  # rows of W x^T: each tile's product lands contiguous
    if m == 0:
        return out_t.t().contiguous().numpy()
    tile = tile_rows(n, k)
    buf = _tile_buffer(tile * k)
    xt = torch.from_numpy(x).t()
    for first in range(0, n, tile):
        rows = min(tile, n - first)
        w = buf[: rows * k].reshape(rows, k)
        launch(_decode_rows, kid, blocks, np.arange(first, first + rows), w)
        torch.mm(torch.from_numpy(w), xt, out=out_t[first : first + rows])
    return out_t.t().contiguous().numpy()


def dequantize(kind: str, blocks: np.ndarray, first: int = 0, last: int | None = None) -> np.ndarray:
    """The float32 weights (last - first, k) of rows first..last (default: all) of ``blocks``: gguf-py's
    dequantized values bit for bit."""
    k = check_blocks(kind, blocks)
    n = blocks.shape[0]
    last = n if last is None else last
    if not (0 <= first <= last <= n):
        raise ShapeMismatch(f"rows {first}..{last} are outside the {n} rows of the blocks")
    out = np.empty((last - first, k), np.float32)
    if last > first:
        launch(_decode_rows, kind_id(kind), blocks, np.arange(first, last), out)
    return out


def dequantize_rows(kind: str, blocks: np.ndarray, row_ids) -> np.ndarray:
    """The float32 weights (len(row_ids), k) of the rows ``row_ids`` (ints in [0, n), any order, repeats
    allowed) of ``blocks``: an embedding lookup that decodes only the rows it is asked for. IndexError
    (ShapeMismatch) for an id out of range."""
    k = check_blocks(kind, blocks)
    ids = np.ascontiguousarray(np.asarray(row_ids).reshape(-1))
    if ids.size and ids.dtype.kind not in "iu":
        raise ShapeMismatch(f"row ids must be integers, got {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    return decode_rows_checked(kind_id(kind), blocks, ids, k)


class RowOutOfRange(ShapeMismatch, IndexError):
    """A row id (an embedding's token id) outside the rows of the blocks."""


def decode_rows_checked(kid: int, blocks: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """:func:`dequantize_rows` for checked blocks and a C-contiguous int64 id array (range checked here)."""
    n = blocks.shape[0]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
        bad = ids[(ids < 0) | (ids >= n)][0]
        raise RowOutOfRange(f"row id {int(bad)} is outside [0, {n})")
    out = np.empty((ids.size, k), np.float32)
    if ids.size:
        launch(_decode_rows, kid, blocks, ids, out)
    return out
