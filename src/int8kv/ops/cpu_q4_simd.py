"""Vector micro-kernels of the 4-bit decode kernel (`cpu_q4.py`), written as LLVM IR (numba intrinsics).

A sealed block of the 4-bit format holds 16 positions: keys with a float16 scale and minimum per channel, values
with a float16 scale and minimum per position, codes two a byte, the even channel in the low nibble. The block's
codes are unpacked by `unpack16` into int8 rows, each row's even channels (low nibbles) first and its odd ones
after, which the 16-key kernels of `cpu_simd` (`qk16` scores, `pv16` p . v) read as they read INT8 codes; the
query is kept in that order (and folded into the block's key scales by `fold`), and so is the p . v accumulator
until an item ends. These kernels do the rest:

  `fold`      q'_r = each query row times the block's key scales, and the bias sum_i q_i m_i of each row
              (float16 scales and minimums widened and split into even / odd channels in registers);
  `unpack16`  the nibbles of 16 rows of codes, a KV head apart in the pool, into int8 rows;
  `max16`     the largest of 16 scores;
  `expsum16`  the 16 weights e^(x - shift) of one row in place, and their sum (a polynomial in registers:
              numba's `math.exp` in a loop stays a libm call per score);
  `widen16`   one KV head's 16 value scales (or minimums), a head apart, as float32;
  `weights16` p_t s_t in place of p_t for the rows of one block, and sum_t p_t m_t into each row's running sum.

Vectors are <16 x float> (and <32 x i8> for the codes): one AVX-512 register, or two AVX2 ones; nothing here
names an instruction of one CPU, so the same IR compiles for either (tests/test_ops_cpu_q4_simd.py emits each
kernel for an AVX2-only core and an AVX-512 one, and runs the whole kernel compiled for AVX2 when asked).
Offsets, strides, rows and dim are int64 element counts; `fold` and `unpack16` take head_dim a multiple of 16
(callers check `cpu_simd.fits`, as for `qk16` / `pv16`).
"""

from __future__ import annotations

import math

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .cpu_simd import LANES, array_data, strided_lanes, vector_at

__all__ = ["expsum16", "fold", "max16", "unpack16", "weights16", "widen16"]

_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)
_HALVES = ir.VectorType(ir.HalfType(), LANES)
_BITS = ir.VectorType(ir.IntType(16), LANES)
_INTS = ir.VectorType(ir.IntType(32), LANES)
_FAST = ("fast",)


def _splat(value: float) -> ir.Constant:
    return ir.Constant(_VEC, [value] * LANES)


def _pick(builder, vec, picks: list[int]):
    """The lanes `picks` of `vec`, as a vector of len(picks) lanes."""
    mask = ir.Constant(ir.VectorType(ir.IntType(32), len(picks)), picks)
    return builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), mask)


def _sum(builder, vec):
    """The sum of a vector's lanes: halves added until one lane is left."""
    n = vec.type.count
    while n > 1:
        n //= 2
        vec = builder.fadd(_pick(builder, vec, list(range(n))), _pick(builder, vec, list(range(n, 2 * n))),
                           flags=_FAST)
    return builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))


def _max(builder, vec):
    """The largest of a vector's lanes (halves compared until one lane is left)."""
    n = vec.type.count
    while n > 1:
        n //= 2
        a, b = _pick(builder, vec, list(range(n))), _pick(builder, vec, list(range(n, 2 * n)))
        vec = builder.select(builder.fcmp_ordered(">", a, b), a, b)
    return builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))


def _widen(builder, bits):
    """<16 x i16> float16 bits -> <16 x float>."""
    return builder.fpext(builder.bitcast(bits, _HALVES), _VEC)


def _expect(arrays) -> None:
    for arr, dtype, what in arrays:
        if not isinstance(arr, types.Array) or arr.dtype != dtype:
            raise TypingError(f"{what} must be a {dtype} array")


@intrinsic
def fold(typingctx, q, qoff, scale, minimum, soff, out, bias, boff, rows, dim):
    """The query folded into one block's key scales, in the unpacked order: for r < rows,
    out[r*dim + k] = q[qoff + r*dim + k] * s'_k and bias[boff + r] = sum_k q[qoff + r*dim + k] * m'_k, where s', m'
    are f16(scale[soff + i]), f16(minimum[soff + i]) reordered as the rows of q already are (channel 2j at j,
    2j + 1 at dim/2 + j). q, out, bias: float32 flat; scale, minimum: int16 flat (float16 bits); dim a multiple
    of 16. 32 channels a step (16 where dim is an odd multiple of 16). Not a split of the scales into a buffer
    and a numba loop: that paid alias checks and remainder loops around two vector iterations per row."""
    _expect(((q, types.float32, "q"), (scale, types.int16, "scale"), (minimum, types.int16, "minimum"),
             (out, types.float32, "out"), (bias, types.float32, "bias")))
    sig = types.void(q, qoff, scale, minimum, soff, out, bias, boff, rows, dim)

    def codegen(context, builder, signature, args):
        q_arr, qo, s_arr, m_arr, so, out_arr, b_arr, bo, nrows, d = args
        qp, sp, mp, op, bp = (array_data(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 5, 6))
        i64 = qo.type
        half = builder.sdiv(d, ir.Constant(i64, 2))
        total = cgutils.alloca_once(builder, _VEC)

        def steps(width):
            """The rows' fold in steps of `width` channels (`width / 2` lanes of each parity)."""
            lanes = width // 2
            part = ir.VectorType(_F32, lanes)
            bits = ir.VectorType(ir.IntType(16), width)
            wide = ir.VectorType(_F32, width)
            evens, odds = list(range(0, width, 2)), list(range(1, width, 2))

            def split(base, col):
                raw = builder.load(vector_at(builder, base, builder.add(so, col), bits), align=2)
                v = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), width)), wide)
                return _pick(builder, v, evens), _pick(builder, v, odds)

            with cgutils.for_range(builder, nrows) as row:
                qrow = builder.add(qo, builder.mul(row.index, d))
                orow = builder.mul(row.index, d)
                builder.store(ir.Constant(_VEC, None), total)
                with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(i64, width))) as chunk:
                    col = builder.mul(chunk.index, ir.Constant(i64, width))
                    at = builder.sdiv(col, ir.Constant(i64, 2))
                    acc = None
                    scales, lows = split(sp, col), split(mp, col)
                    for sv, mv, shift in zip(scales, lows, (at, builder.add(at, half)), strict=True):
                        qv = builder.load(vector_at(builder, qp, builder.add(qrow, shift), part), align=4)
                        where = vector_at(builder, op, builder.add(orow, shift), part)
                        builder.store(builder.fmul(qv, sv, flags=_FAST), where, align=4)
                        term = builder.fmul(qv, mv, flags=_FAST)
                        acc = term if acc is None else builder.fadd(acc, term, flags=_FAST)
                    if lanes < LANES:  # into the low lanes of the row's 16-lane sum
                        acc = builder.shuffle_vector(acc, ir.Constant(part, None),
                                                     ir.Constant(_INTS, list(range(LANES))))
                    builder.store(builder.fadd(builder.load(total), acc, flags=_FAST), total)
                builder.store(_sum(builder, builder.load(total)), builder.gep(bp, [builder.add(bo, row.index)]))

        by32 = builder.icmp_signed("==", builder.srem(d, ir.Constant(i64, 32)), ir.Constant(i64, 0))
        with builder.if_else(by32) as (then, otherwise):
            with then:
                steps(32)
            with otherwise:
                steps(16)
        return context.get_dummy_value()

    return sig, codegen


# e^y = 2^n 2^f with y log2(e) = n + f, n an integer, |f| <= 1/2; 2^f by its Taylor series to degree 7 (relative
# error below 1e-8 on that range, under float32's rounding). Weights of y < -87 (2^n below float32's normals:
# e^-87 = 1.6e-38 of the largest weight) are 0, so a masked score (-1e30) weighs exactly nothing.
_EXP2 = [math.log(2) ** k / math.factorial(k) for k in range(8)]
_LOWEST = -87.0


@intrinsic
def expsum16(typingctx, x, off, shift):
    """x[off + t] = e^(x[off + t] - shift) for t < 16 (0 below e^-87), in place; returns their sum (float32).
    x: float32 flat; shift: float32 (the row's running maximum, so every weight is at most 1)."""
    _expect(((x, types.float32, "x"),))
    sig = types.float32(x, off, types.float32)

    def codegen(context, builder, signature, args):
        x_arr, xo, top = args
        xp = array_data(context, builder, signature.args[0], x_arr)
        ptr = vector_at(builder, xp, xo, _VEC)
        undef = ir.Constant(_VEC, ir.Undefined)
        shift_v = builder.shuffle_vector(builder.insert_element(undef, top, ir.Constant(ir.IntType(32), 0)), undef,
                                         ir.Constant(_INTS, [0] * LANES))
        y = builder.fsub(builder.load(ptr, align=4), shift_v, flags=_FAST)
        low = builder.fcmp_ordered("<", y, _splat(_LOWEST))
        y = builder.select(low, _splat(_LOWEST), y)  # keeps 2^n a normal number; those lanes become 0 below
        t = builder.fmul(y, _splat(1 / math.log(2)), flags=_FAST)
        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC]), "llvm.floor.v16f32")
        n = builder.call(floor, [builder.fadd(t, _splat(0.5), flags=_FAST)])
        f = builder.fsub(t, n, flags=_FAST)
        poly = _splat(_EXP2[-1])
        for c in reversed(_EXP2[:-1]):
            poly = builder.fadd(builder.fmul(poly, f, flags=_FAST), _splat(c), flags=_FAST)
        exponent = builder.shl(builder.add(builder.fptosi(n, _INTS), ir.Constant(_INTS, [127] * LANES)),
                               ir.Constant(_INTS, [23] * LANES))
        e = builder.fmul(poly, builder.bitcast(exponent, _VEC), flags=_FAST)
        e = builder.select(low, ir.Constant(_VEC, None), e)
        builder.store(e, ptr, align=4)
        return _sum(builder, e)

    return sig, codegen


@intrinsic
def max16(typingctx, x, off):
    """The largest of x[off : off + 16] (float32 flat). A loop of `max` in numba stays a chain of 16 dependent
    compares, a large share of the softmax step."""
    _expect(((x, types.float32, "x"),))
    sig = types.float32(x, off)

    def codegen(context, builder, signature, args):
        xp = array_data(context, builder, signature.args[0], args[0])
        return _max(builder, builder.load(vector_at(builder, xp, args[1], _VEC), align=4))

    return sig, codegen


@intrinsic
def weights16(typingctx, s, soff, sstride, scale, minimum, voff, total, toff, rows):
    """For r < rows and t < 16, with p = s[soff + r*sstride + t]: s[...] = p * scale[voff + t], and
    total[toff + r] += sum_t p * minimum[voff + t] (one block's value scales and minimums, float32). All float32
    flat. Not a numba loop over views, which was several times slower."""
    _expect(((s, types.float32, "s"), (scale, types.float32, "scale"), (minimum, types.float32, "minimum"),
             (total, types.float32, "total")))
    sig = types.void(s, soff, sstride, scale, minimum, voff, total, toff, rows)

    def codegen(context, builder, signature, args):
        s_arr, so, ss, sc_arr, mn_arr, vo, t_arr, to, nrows = args
        sp, scp, mnp, tp = (array_data(context, builder, signature.args[i], args[i]) for i in (0, 3, 4, 6))
        sv = builder.load(vector_at(builder, scp, vo, _VEC), align=4)
        mv = builder.load(vector_at(builder, mnp, vo, _VEC), align=4)
        with cgutils.for_range(builder, nrows) as row:
            ptr = vector_at(builder, sp, builder.add(so, builder.mul(row.index, ss)), _VEC)
            p = builder.load(ptr, align=4)
            builder.store(builder.fmul(p, sv, flags=_FAST), ptr, align=4)
            where = builder.gep(tp, [builder.add(to, row.index)])
            low = _sum(builder, builder.fmul(p, mv, flags=_FAST))
            builder.store(builder.fadd(builder.load(where), low, flags=_FAST), where)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def widen16(typingctx, bits, off, stride, out, ooff):
    """out[ooff + t] = f16(bits[off + t*stride]) for t < 16: one KV head's 16 value scales (or minimums) of a
    block, a head apart in the pool, as float32. bits: int16 flat (float16 bits); out: float32 flat. Converted in
    registers, not through the float16 table (two dependent loads a value)."""
    _expect(((bits, types.int16, "bits"), (out, types.float32, "out")))
    sig = types.void(bits, off, stride, out, ooff)

    def codegen(context, builder, signature, args):
        b_arr, bo, bs, o_arr, oo = args
        bp = array_data(context, builder, signature.args[0], b_arr)
        op = array_data(context, builder, signature.args[3], o_arr)
        vec = strided_lanes(builder, bp, bo, bs, _BITS)
        builder.store(_widen(builder, vec), vector_at(builder, op, oo, _VEC), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def unpack16(typingctx, codes, off, stride, half, dst):
    """16 rows of `half` bytes (row t at codes[off + t*stride]) -> int8 dst[t*2*half + j] = the low nibble of byte
    j, dst[t*2*half + half + j] = its high nibble: each row's even channels, then its odd ones. half a multiple
    of 8 (head_dim of 16). Steps of 32 bytes, then of 16 and 8, each over the 16 rows unrolled: numba did not
    vectorise the plain loop, and a loop over rows of 16-byte steps spent more on its counting and addressing
    than on the work."""
    _expect(((codes, types.uint8, "codes"), (dst, types.int8, "dst")))
    sig = types.void(codes, off, stride, half, dst)

    def codegen(context, builder, signature, args):
        c_arr, co, cs, h, d_arr = args
        cp = array_data(context, builder, signature.args[0], c_arr)
        dp = array_data(context, builder, signature.args[4], d_arr)
        i64 = co.type
        row_out = builder.mul(h, ir.Constant(i64, 2))

        def rows(width, col):
            """Bytes [col, col + width) of every row."""
            ty = ir.VectorType(ir.IntType(8), width)
            src, dst_at = builder.add(co, col), col
            for _ in range(LANES):
                raw = builder.load(vector_at(builder, cp, src, ty), align=1)
                builder.store(builder.and_(raw, ir.Constant(ty, [15] * width)), vector_at(builder, dp, dst_at, ty),
                              align=1)
                builder.store(builder.lshr(raw, ir.Constant(ty, [4] * width)),
                              vector_at(builder, dp, builder.add(dst_at, h), ty), align=1)
                src = builder.add(src, cs)
                dst_at = builder.add(dst_at, row_out)

        wide = builder.sdiv(h, ir.Constant(i64, 32))
        with cgutils.for_range(builder, wide) as chunk:
            rows(32, builder.mul(chunk.index, ir.Constant(i64, 32)))
        col = builder.mul(wide, ir.Constant(i64, 32))
        for width in (16, 8):  # what is left of half: at most one step of each
            left = builder.sub(h, col)
            with builder.if_then(builder.icmp_signed(">=", left, ir.Constant(i64, width))):
                rows(width, col)
            col = builder.select(builder.icmp_signed(">=", left, ir.Constant(i64, width)),
                                 builder.add(col, ir.Constant(i64, width)), col)
        return context.get_dummy_value()

    return sig, codegen
