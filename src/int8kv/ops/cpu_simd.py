"""Vector micro-kernels for the CPU attention backend, written as LLVM IR (numba intrinsics).

The numba loops of `cpu.py` compute one dot product per key: LLVM vectorises it over head_dim and then pays a
16-lane horizontal sum per (key, query row), and the INT8 codes go through a float32 tile in memory first.
Measured single-threaded at SmolLM2's shape (9 q / 3 kv heads, head_dim 64, 7,000 keys): 30.5 ns per
(key, KV head), of which converting K and V into the tiles took 10 ns, the dot products 6 ns and the p . v
updates 6 ns. These kernels work on 16 keys at once, straight from the pool's blocks (22 ns; 19 with the next
block prefetched; of the 22, scores 12, values 8, softmax 5 by ablation):

  `qk16`  scores of g query rows against 16 keys: 16 vector accumulators (one per key, 16 lanes of head_dim
          each), codes converted once into a scratch, then one transpose-and-add tree turns the 16 accumulators into
          the 16 scores (15 adds and 30 shuffles per row instead of 16 horizontal sums of 8 operations each).
  `pv16`  acc[r, :] += sum_t w[r, t] v_t for g rows and 16 values: each value row converted once in registers
          and used by every row; an accumulator chunk stays in a register across the 16 keys.

Both take flat arrays with element offsets and strides (keys: 16 rows, `kstride` elements apart, head_dim
contiguous), so one kernel serves any number of KV heads and any block layout whose head rows are contiguous.
The code element is int8 (INT8 codes: sign-extended, converted to float32) or int16 (F16 bits: bitcast to half,
widened). head_dim must be a multiple of 16 (callers check `fits`); g and head_dim are runtime loop counts, so
nothing is specialised per model. The 16 keys are unrolled; vectors are <16 x float>, which LLVM maps to one
AVX-512 register or two AVX2 registers (or four NEON ones) on other CPUs.

Summation order differs from a plain loop (16 lane sums, then the tree), like any vectorised float32 dot;
the float64-oracle tests bound it.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

__all__ = ["LANES", "fits", "prefetch", "pv16", "qk16"]

LANES = 16  # keys per call and float32 lanes per vector
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VEC = ir.VectorType(_F32, LANES)
_FAST = ("fast",)


@njit(inline="always")
def fits(head_dim: int) -> bool:
    """Whether these kernels handle rows of ``head_dim`` values (callable from Python and from numba code)."""
    return head_dim > 0 and head_dim % LANES == 0


def _mask(lanes: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(lanes)), lanes)


def _data(context, builder, aryty, value):
    return context.make_array(aryty)(context, builder, value).data


def _load_codes(builder, base, offset, elem):
    """16 codes at base[offset] (unaligned) as <16 x float>: int8 sign-extended, int16 read as half bits."""
    ptr = builder.bitcast(builder.gep(base, [offset]), ir.VectorType(elem, LANES).as_pointer())
    raw = builder.load(ptr, align=1)
    if elem.width == 8:
        return builder.sitofp(raw, _VEC)
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VEC)


def _load_f32(builder, base, offset):
    ptr = builder.bitcast(builder.gep(base, [offset]), _VEC.as_pointer())
    return builder.load(ptr, align=4)


def _store_f32(builder, value, base, offset):
    ptr = builder.bitcast(builder.gep(base, [offset]), _VEC.as_pointer())
    builder.store(value, ptr, align=4)


def _reduce16(builder, vecs: list) -> ir.Value:
    """16 vectors -> one vector whose lane t is the sum of vecs[t]'s lanes. Each level pairs neighbours and
    halves the lanes each one still spreads over: 16 lanes -> 8 -> 4 -> 2 -> 1, keeping token order."""
    width = LANES
    while len(vecs) > 1:
        half = width // 2
        groups = LANES // width  # tokens already packed per vector, each over `width` lanes
        lo, hi = [], []
        for source in range(2):
            for group in range(groups):
                start = source * LANES + group * width
                lo += range(start, start + half)
                hi += range(start + half, start + width)
        lo_mask, hi_mask = _mask(lo), _mask(hi)
        vecs = [
            builder.fadd(
                builder.shuffle_vector(a, b, lo_mask), builder.shuffle_vector(a, b, hi_mask), flags=_FAST
            )
            for a, b in zip(vecs[0::2], vecs[1::2], strict=True)
        ]
        width = half
    return vecs[0]


def _check(codes) -> ir.IntType:
    if not isinstance(codes, types.Array) or codes.dtype not in (types.int8, types.int16):
        raise TypingError("codes must be an int8 or int16 array")
    return ir.IntType(codes.dtype.bitwidth)


@intrinsic
def qk16(typingctx, q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):
    """out[ooff + r*ostride + t] = sum_i q[qoff + r*dim + i] * k[koff + t*kstride + i] for r < rows, t < 16.

    q: float32 flat array (the rows' values, contiguous by row); k: int8 codes or int16 F16 bits, flat;
    out: float32 flat; offsets, strides, rows and dim: int64 element counts (dim a multiple of 16); buf: float32
    scratch of at least 16 * dim values. The 16 keys are converted into buf once and read by every row (an FMA
    with a memory operand) rather than converted again for each row: fewer vector operations, though the
    whole kernel measured the same either way (22.0 vs 22.1 ns per (key, KV head), 3 rows of 64)."""
    elem = _check(k)
    sig = types.void(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf)

    def codegen(context, builder, signature, args):
        q_arr, qo, k_arr, ko, ks, out_arr, oo, os_, nrows, d, buf_arr = args
        qp = _data(context, builder, signature.args[0], q_arr)
        kp = _data(context, builder, signature.args[2], k_arr)
        op = _data(context, builder, signature.args[5], out_arr)
        bp = _data(context, builder, signature.args[10], buf_arr)
        i64 = qo.type
        chunks = builder.sdiv(d, ir.Constant(i64, LANES))
        with cgutils.for_range(builder, chunks) as chunk:
            col = builder.mul(chunk.index, ir.Constant(i64, LANES))
            key = builder.add(ko, col)
            at = col
            for _ in range(LANES):
                _store_f32(builder, _load_codes(builder, kp, key, elem), bp, at)
                key = builder.add(key, ks)
                at = builder.add(at, d)
        slots = [cgutils.alloca_once(builder, _VEC) for _ in range(LANES)]
        zero = ir.Constant(_VEC, None)
        with cgutils.for_range(builder, nrows) as row:
            for slot in slots:
                builder.store(zero, slot)
            qrow = builder.add(qo, builder.mul(row.index, d))
            with cgutils.for_range(builder, chunks) as chunk:
                col = builder.mul(chunk.index, ir.Constant(i64, LANES))
                qv = _load_f32(builder, qp, builder.add(qrow, col))
                at = col
                for slot in slots:
                    kv = _load_f32(builder, bp, at)
                    acc = builder.load(slot)
                    builder.store(builder.fadd(acc, builder.fmul(qv, kv, flags=_FAST), flags=_FAST), slot)
                    at = builder.add(at, d)
            total = _reduce16(builder, [builder.load(slot) for slot in slots])
            _store_f32(builder, total, op, builder.add(oo, builder.mul(row.index, os_)))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def pv16(typingctx, w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim):
    """acc[aoff + r*dim + i] += sum_t w[woff + r*wstride + t] * v[voff + t*vstride + i] for r < rows, t < 16.

    w: float32 flat (the weights, value scales already folded in); v: int8 codes or int16 F16 bits, flat;
    acc: float32 flat, rows contiguous; offsets, strides, rows and dim: int64 element counts."""
    elem = _check(v)
    sig = types.void(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim)

    def codegen(context, builder, signature, args):
        w_arr, wo, ws, v_arr, vo, vs, acc_arr, ao, nrows, d = args
        wp = _data(context, builder, signature.args[0], w_arr)
        vp = _data(context, builder, signature.args[3], v_arr)
        ap = _data(context, builder, signature.args[6], acc_arr)
        i64 = wo.type
        chunks = builder.sdiv(d, ir.Constant(i64, LANES))
        undef = ir.Constant(_VEC, ir.Undefined)
        splat = _mask([0] * LANES)
        with cgutils.for_range(builder, chunks) as chunk:
            col = builder.mul(chunk.index, ir.Constant(i64, LANES))
            values = []
            offset = builder.add(vo, col)
            for _ in range(LANES):
                values.append(_load_codes(builder, vp, offset, elem))
                offset = builder.add(offset, vs)
            with cgutils.for_range(builder, nrows) as row:
                where = builder.add(builder.add(ao, builder.mul(row.index, d)), col)
                wrow = builder.add(wo, builder.mul(row.index, ws))
                # Four independent chains of four: one chain of 16 dependent adds would wait on the FPU's
                # latency (4 cycles each) instead of its throughput.
                chains = [_load_f32(builder, ap, where), None, None, None]
                for t, value in enumerate(values):
                    weight = builder.load(builder.gep(wp, [builder.add(wrow, ir.Constant(i64, t))]))
                    wv = builder.shuffle_vector(builder.insert_element(undef, weight, ir.Constant(_I32, 0)),
                                                undef, splat)
                    term = builder.fmul(wv, value, flags=_FAST)
                    c = chains[t % 4]
                    chains[t % 4] = term if c is None else builder.fadd(c, term, flags=_FAST)
                left = builder.fadd(chains[0], chains[1], flags=_FAST)
                right = builder.fadd(chains[2], chains[3], flags=_FAST)
                _store_f32(builder, builder.fadd(left, right, flags=_FAST), ap, where)
        return context.get_dummy_value()

    return sig, codegen


_LINE = 64  # bytes per cache line on the CPUs this targets (x86-64, most arm64)


@intrinsic
def prefetch(typingctx, array, offset, count):
    """Ask the CPU to start loading elements [offset, offset + count) of a flat array into cache, one request per
    64-byte line; returns at once. The kernels read a block head by head, rows a KV-head apart, an access the
    hardware prefetchers follow poorly when the blocks are scattered: they prefetch the next block whole."""
    if not isinstance(array, types.Array):
        raise TypingError("prefetch takes an array")
    sig = types.void(array, offset, count)

    def codegen(context, builder, signature, args):
        arr, start, n = args
        base = _data(context, builder, signature.args[0], arr)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        first = builder.bitcast(builder.gep(base, [start]), i8p)
        size = ir.Constant(start.type, context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype)))
        lines = builder.udiv(builder.add(builder.mul(n, size), ir.Constant(start.type, _LINE - 1)),
                             ir.Constant(start.type, _LINE))
        with cgutils.for_range(builder, lines) as line:
            where = builder.gep(first, [builder.mul(line.index, ir.Constant(start.type, _LINE))])
            # read, keep in all cache levels, data cache
            builder.call(fn, [where, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
