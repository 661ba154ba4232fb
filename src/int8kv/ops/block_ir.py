"""LLVM IR pieces shared by the block-weight matmul kernels (int8kv.ops.cpu_packed, int8kv.ops.cpu_gguf).

Both multiply float32 x by weights decoded from 32-weight blocks into two <16 x float> halves, with one fused
multiply-add per product (`fma`) into 32 lanes, and add the lanes as one fixed tree (`sum_lanes`): the summation
order the two modules share, so a row of Q4_1 / Q8_0 blocks gives the same bits through either. `chunk` is the
output-row split of their parallel loops.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit

HALF = 16  # lanes of one vector: a 32-weight block is two
F32 = ir.FloatType()
I32 = ir.IntType(32)
VEC = ir.VectorType(F32, HALF)
BYTES = ir.VectorType(ir.IntType(8), HALF)
CONTRACT = ("contract",)  # fuse a multiply and its add into one rounding; nothing reassociated


def splat(builder, value, vtype=VEC):
    """``value`` (a scalar) in every lane of a ``vtype`` vector."""
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(I32, vtype.count), [0] * vtype.count))


def fma(builder, a, b, c):
    """a b + c with one rounding."""
    return builder.fadd(builder.fmul(a, b, flags=CONTRACT), c, flags=CONTRACT)


def sum_lanes(builder, lo, hi):
    """The 32 lanes of (lo, hi) added as a fixed tree: lo + hi, then halves 16 -> 8 -> 4 -> 2 -> 1."""
    v = builder.fadd(lo, hi)
    width = HALF
    while width > 1:
        half = width // 2
        a = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, half), list(range(half))))
        b = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, half), list(range(half, width))))
        v = builder.fadd(a, b)
        width = half
    return builder.extract_element(v, ir.Constant(I32, 0))


@njit(inline="always")
def chunk(index: int, chunks: int, n: int) -> tuple[int, int]:
    """Rows [first, last) of chunk ``index`` of ``chunks`` over n rows (sizes differ by at most one)."""
    return index * n // chunks, (index + 1) * n // chunks
