"""Vector micro-kernels of the 4-bit decode kernel (`cpu_q4.py`), written as LLVM IR (numba intrinsics).

A sealed block of the 4-bit format holds 16 positions: keys with a float16 scale and minimum per channel, values
with a float16 scale and minimum per position, codes two a byte, the even channel in the low nibble. The block's
key codes are unpacked by `unpack16` (low nibbles, then high nibbles: the even channels first, then the odd ones)
into int8 rows that the INT8 kernels of `cpu_simd` (`qk16`, `pv16`) read; the query is folded into that order
once per block (`fold`), and the accumulator of p . v stays in it until the item ends. These kernels do the rest:

  `fold`      q'_r = the row's q times the block's key scales, the even channels then the odd ones, and the bias
              sum_i q_i m_i of each row (float16 scales and minimums widened in registers);
  `expsum16`  the 16 weights e^(x - shift) of one row in place, and their sum (a polynomial in registers:
              numba's `math.exp` in a loop stays a libm call per score);
  `weights16` p_t s_t in place of p_t for g rows of one block, and sum_t p_t m_t into each row's running sum
              (the 16 value scales and minimums, a KV head apart, gathered once for every row).

Vectors are <16 x float>: one AVX-512 register, two AVX2 ones; nothing here names an instruction of one CPU, so
the same IR compiles for either (tests/test_ops_cpu_q4.py emits it for an AVX2-only CPU too). Offsets, strides,
rows and dim are int64 element counts; `fold` takes head_dim a multiple of 16 (callers check
`cpu_simd.fits`), the others any head_dim.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .cpu_simd import LANES

__all__ = ["expsum16", "fold", "unpack16", "weights16"]

_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)
_HALVES = ir.VectorType(ir.HalfType(), LANES)
_BITS = ir.VectorType(ir.IntType(16), LANES)
_INTS = ir.VectorType(ir.IntType(32), LANES)
_FAST = ("fast",)


def _base(context, builder, aryty, value):
    return context.make_array(aryty)(context, builder, value).data


def _at(builder, base, offset, ty):
    """A pointer to a `ty` vector starting at base[offset]."""
    return builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())


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


def _widen(builder, bits):
    """<16 x i16> float16 bits -> <16 x float>."""
    return builder.fpext(builder.bitcast(bits, _HALVES), _VEC)


def _expect(arrays) -> None:
    for arr, dtype, what in arrays:
        if not isinstance(arr, types.Array) or arr.dtype != dtype:
            raise TypingError(f"{what} must be a {dtype} array")


@intrinsic
def fold(typingctx, q, qoff, scale, minimum, soff, out, ooff, bias, boff, rows, dim):
    """For r < rows: out[ooff + r*dim + j] = q_{2j} s_{2j} and out[ooff + r*dim + dim/2 + j] = q_{2j+1} s_{2j+1}
    (j < dim/2; q_i = q[qoff + r*dim + i], s_i = f16(scale[soff + i])), bias[boff + r] = sum_i q_i m_i
    (m_i = f16(minimum[soff + i])).

    q, out, bias: float32 flat; scale, minimum: int16 flat (float16 bits); dim a multiple of 16."""
    _expect(((q, types.float32, "q"), (scale, types.int16, "scale"), (minimum, types.int16, "minimum"),
             (out, types.float32, "out"), (bias, types.float32, "bias")))
    sig = types.void(q, qoff, scale, minimum, soff, out, ooff, bias, boff, rows, dim)

    def codegen(context, builder, signature, args):
        q_arr, qo, s_arr, m_arr, so, out_arr, oo, b_arr, bo, nrows, d = args
        qp, sp, mp, op, bp = (_base(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 5, 7))
        i64 = qo.type
        chunks = builder.sdiv(d, ir.Constant(i64, LANES))
        half = builder.sdiv(d, ir.Constant(i64, 2))
        evens, odds = list(range(0, LANES, 2)), list(range(1, LANES, 2))
        part = ir.VectorType(_F32, LANES // 2)
        total = cgutils.alloca_once(builder, _VEC)
        with cgutils.for_range(builder, nrows) as row:
            qrow = builder.add(qo, builder.mul(row.index, d))
            orow = builder.add(oo, builder.mul(row.index, d))
            builder.store(ir.Constant(_VEC, None), total)
            with cgutils.for_range(builder, chunks) as chunk:
                col = builder.mul(chunk.index, ir.Constant(i64, LANES))
                qv = builder.load(_at(builder, qp, builder.add(qrow, col), _VEC), align=4)
                sv = _widen(builder, builder.load(_at(builder, sp, builder.add(so, col), _BITS), align=2))
                mv = _widen(builder, builder.load(_at(builder, mp, builder.add(so, col), _BITS), align=2))
                folded = builder.fmul(qv, sv, flags=_FAST)
                at = builder.add(orow, builder.sdiv(col, ir.Constant(i64, 2)))
                builder.store(_pick(builder, folded, evens), _at(builder, op, at, part), align=4)
                builder.store(_pick(builder, folded, odds), _at(builder, op, builder.add(at, half), part), align=4)
                acc = builder.fadd(builder.load(total), builder.fmul(qv, mv, flags=_FAST), flags=_FAST)
                builder.store(acc, total)
            builder.store(_sum(builder, builder.load(total)), builder.gep(bp, [builder.add(bo, row.index)]))
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
        xp = _base(context, builder, signature.args[0], x_arr)
        ptr = _at(builder, xp, xo, _VEC)
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
def weights16(typingctx, s, soff, sstride, scale, minimum, voff, vstride, total, toff, rows):
    """For r < rows and t < 16, p = s[soff + r*sstride + t]: s[...] = p * f16(scale[voff + t*vstride]), and
    total[toff + r] += sum_t p * f16(minimum[voff + t*vstride]).

    s, total: float32 flat; scale, minimum: int16 flat (float16 bits, one per position, `vstride` apart)."""
    _expect(((s, types.float32, "s"), (scale, types.int16, "scale"), (minimum, types.int16, "minimum"),
             (total, types.float32, "total")))
    sig = types.void(s, soff, sstride, scale, minimum, voff, vstride, total, toff, rows)

    def codegen(context, builder, signature, args):
        s_arr, so, ss, sc_arr, mn_arr, vo, vs, t_arr, to, nrows = args
        sp, scp, mnp, tp = (_base(context, builder, signature.args[i], args[i]) for i in (0, 3, 4, 7))

        def gather(base):
            bits = ir.Constant(_BITS, ir.Undefined)
            at = vo
            for t in range(LANES):
                bits = builder.insert_element(bits, builder.load(builder.gep(base, [at])), ir.Constant(ir.IntType(32), t))
                at = builder.add(at, vs)
            return _widen(builder, bits)

        sv, mv = gather(scp), gather(mnp)
        with cgutils.for_range(builder, nrows) as row:
            ptr = _at(builder, sp, builder.add(so, builder.mul(row.index, ss)), _VEC)
            p = builder.load(ptr, align=4)
            builder.store(builder.fmul(p, sv, flags=_FAST), ptr, align=4)
            where = builder.gep(tp, [builder.add(to, row.index)])
            builder.store(builder.fadd(builder.load(where), _sum(builder, builder.fmul(p, mv, flags=_FAST)),
                                       flags=_FAST), where)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=True, inline="always")
def unpack16(codes, off, stride, half, dst):
    """16 rows of `half` bytes (row t at codes[off + t*stride]) -> int8 dst[t*2*half + j] = the low nibble of byte
    j, dst[t*2*half + half + j] = its high nibble: each row's even channels, then its odd ones. LLVM vectorises
    the inner loop (64 bytes a step on AVX-512, 32 on AVX2)."""
    for t in range(LANES):
        src = off + t * stride
        row = t * 2 * half
        for j in range(half):
            b = codes[src + j]
            dst[row + j] = np.int8(b & 15)
            dst[row + half + j] = np.int8(b >> 4)
