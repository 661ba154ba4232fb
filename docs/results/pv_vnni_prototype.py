"""Prototype, not in the package: p . v on int8 value codes with AVX-512 VNNI `vpdpbusd`, the weights as 16-bit
fixed point (each row's 16 weights over their max) split into two byte planes, against `cpu_simd.pv16`.

    PYTHONPATH=src python docs/results/pv_vnni_prototype.py [--no-transpose] [OUT.json]

Per 16 keys and 64 channels: each 4 keys' rows transposed to 4-key byte quads (8 unpacks), per row the weights
converted (max, scale, round, split, one broadcast per quad and plane), 32 `vpdpbusd` into int32, then
hi * 256 + lo converted to float32, the 128-bit blocks put back in channel order and added into acc. Checked
against float64; timed one thread, 2,048 keys hot in cache, ns per key. --no-transpose feeds the loaded rows
as they are (wrong sums, for the time of the rest).
"""

import json
import sys
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from int8kv.ops import cpu_simd
from int8kv.ops.cpu_simd import _F32, _FAST, _I32, _VEC, _load_f32, _mask, _splat, _store_f32, array_data

MODE = "notrans" if "--no-transpose" in sys.argv else ""
I8 = ir.IntType(8)
V64 = ir.VectorType(I8, 64)
V16I = ir.VectorType(_I32, 16)
V32S = ir.VectorType(ir.IntType(16), 32)


def _unpack(builder, a, b, lanes_elems, lo):
    """x86 unpack{lo,hi} per 128-bit lane of two vectors of lanes_elems elements per 128 bits."""
    n = a.type.count
    half = lanes_elems // 2
    mask = []
    for lane in range(n // lanes_elems):
        for i in range(half):
            src = lane * lanes_elems + (0 if lo else half) + i
            mask += [src, n + src]
    return builder.shuffle_vector(a, b, _mask(mask))


def _transpose4(builder, rows):
    """4 rows of 64 int8 -> 4 <16 x i32> whose dword 4L+p of vector k holds the 4 rows' channel 16L+4k+p."""
    r0, r1, r2, r3 = rows
    a = builder.bitcast(_unpack(builder, r0, r1, 16, True), V32S)
    b = builder.bitcast(_unpack(builder, r0, r1, 16, False), V32S)
    c = builder.bitcast(_unpack(builder, r2, r3, 16, True), V32S)
    d = builder.bitcast(_unpack(builder, r2, r3, 16, False), V32S)
    out = [
        _unpack(builder, a, c, 8, True),
        _unpack(builder, a, c, 8, False),
        _unpack(builder, b, d, 8, True),
        _unpack(builder, b, d, 8, False),
    ]
    return [builder.bitcast(x, V16I) for x in out]


def _blocks(builder, e):
    """e[k] lane 4L+p = channel 16L+4k+p -> out[L] lane 4k+p = channel 16L+4k+p (128-bit block transpose)."""
    out = []
    for L in range(4):
        m01 = _mask([4 * L + p for p in range(4)] + [16 + 4 * L + p for p in range(4)] + [0] * 8)
        x = builder.shuffle_vector(e[0], e[1], m01)
        y = builder.shuffle_vector(e[2], e[3], m01)
        out.append(builder.shuffle_vector(x, y, _mask(list(range(8)) + list(range(16, 24)))))
    return out


@intrinsic
def pv16b(typingctx, w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim):
    sig = types.void(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim)

    def codegen(context, builder, signature, args):
        w_arr, wo, ws, v_arr, vo, vs, acc_arr, ao, nrows, d = args
        wp = array_data(context, builder, signature.args[0], w_arr)
        vp = array_data(context, builder, signature.args[3], v_arr)
        ap = array_data(context, builder, signature.args[6], acc_arr)
        i64 = wo.type
        dot = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(V16I, [V16I, V16I, V16I]), "llvm.x86.avx512.vpdpbusd.512"
        )
        fmax = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32, [_VEC]), "llvm.vector.reduce.fmax.v16f32"
        )
        chunks = builder.udiv(d, ir.Constant(i64, 64))
        with cgutils.for_range(builder, chunks) as ch:
            col = builder.mul(ch.index, ir.Constant(i64, 64))
            quads = []
            for j in range(4):
                rws = []
                for t in range(4):
                    off = builder.add(builder.add(vo, col), builder.mul(vs, ir.Constant(i64, 4 * j + t)))
                    ptr = builder.bitcast(builder.gep(vp, [off]), V64.as_pointer())
                    rws.append(builder.load(ptr, align=1))
                quads.append(
                    _transpose4(builder, rws) if MODE != "notrans" else [builder.bitcast(r, V16I) for r in rws]
                )
            with cgutils.for_range(builder, nrows) as row:
                wv = _load_f32(builder, wp, builder.add(wo, builder.mul(row.index, ws)))
                top = builder.call(fmax, [wv])
                positive = builder.fcmp_ordered(">", top, ir.Constant(_F32, 0.0))
                with builder.if_then(positive):
                    inv = builder.fdiv(ir.Constant(_F32, 65535.0), top)
                    q = builder.fptoui(
                        builder.fadd(builder.fmul(wv, _splat(builder, inv)), _splat(builder, ir.Constant(_F32, 0.5))),
                        V16I,
                    )
                    lo = builder.bitcast(
                        builder.trunc(
                            builder.and_(q, _splat(builder, ir.Constant(_I32, 255), V16I)), ir.VectorType(I8, 16)
                        ),
                        ir.VectorType(_I32, 4),
                    )
                    hi = builder.bitcast(
                        builder.trunc(
                            builder.lshr(q, _splat(builder, ir.Constant(_I32, 8), V16I)), ir.VectorType(I8, 16)
                        ),
                        ir.VectorType(_I32, 4),
                    )
                    undef4 = ir.Constant(ir.VectorType(_I32, 4), ir.Undefined)
                    zero = ir.Constant(V16I, None)
                    acc_lo = [zero] * 4
                    acc_hi = [zero] * 4
                    for j in range(4):
                        wl = builder.shuffle_vector(lo, undef4, _mask([j] * 16))
                        wh = builder.shuffle_vector(hi, undef4, _mask([j] * 16))
                        for k in range(4):
                            acc_lo[k] = builder.call(dot, [acc_lo[k], wl, quads[j][k]])
                            acc_hi[k] = builder.call(dot, [acc_hi[k], wh, quads[j][k]])
                    sums = [
                        builder.sitofp(
                            builder.add(builder.shl(h, _splat(builder, ir.Constant(_I32, 8), V16I)), low), _VEC
                        )
                        for h, low in zip(acc_hi, acc_lo, strict=True)
                    ]
                    back = _splat(builder, builder.fdiv(top, ir.Constant(_F32, 65535.0)))
                    base = builder.add(builder.add(ao, builder.mul(row.index, d)), col)
                    for L, vec in enumerate(_blocks(builder, sums)):
                        where = builder.add(base, ir.Constant(i64, 16 * L))
                        old = _load_f32(builder, ap, where)
                        _store_f32(
                            builder, builder.fadd(old, builder.fmul(vec, back, flags=_FAST), flags=_FAST), ap, where
                        )
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=True)
def run_b(w, v, acc, rows, dim, keys, reps):
    for _ in range(reps):
        for k0 in range(0, keys, 16):
            pv16b(w, k0 % 64, 64, v, k0 * dim, dim, acc, 0, rows, dim)


@njit(fastmath=True)
def run_a(w, v, acc, rows, dim, keys, reps):
    for _ in range(reps):
        for k0 in range(0, keys, 16):
            cpu_simd.pv16(w, k0 % 64, 64, v, k0 * dim, dim, acc, 0, rows, dim)


rng = np.random.default_rng(0)
results = []
for rows, dim in ((3, 64), (4, 128)):
    keys = 2048
    v = rng.integers(-127, 128, size=keys * dim).astype(np.int8)
    w = (rng.random(rows * 64 + 64) ** 4).astype(np.float32)  # peaky weights in [0, 1)
    a = np.zeros(rows * dim, np.float32)
    b = np.zeros(rows * dim, np.float32)
    run_a(w, v, a, rows, dim, keys, 1)
    run_b(w, v, b, rows, dim, keys, 1)
    ref = np.zeros(rows * dim)
    for k0 in range(0, keys, 16):
        ww = w[k0 % 64 :].astype(np.float64)
        for r in range(rows):
            for t in range(16):
                ref[r * dim : (r + 1) * dim] += ww[r * 64 + t] * v[(k0 + t) * dim : (k0 + t + 1) * dim]
    scale = np.abs(ref).max()
    errs = (float(np.abs(a - ref).max() / scale), float(np.abs(b - ref).max() / scale))
    print(rows, dim, f"err float {errs[0]:.2e}  bytes {errs[1]:.2e}")
    result = {"rows": rows, "dim": dim, "rel_err_pv16": errs[0], "rel_err_vnni": errs[1], "ns_per_key": {}}
    reps = 2000 if dim == 64 else 800
    for f in (run_a, run_b, run_a, run_b):
        acc = np.zeros(rows * dim, np.float32)
        t0 = time.perf_counter()
        f(w, v, acc, rows, dim, keys, reps)
        dt = time.perf_counter() - t0
        print(f"  {f.__name__} {dt / (reps * keys) * 1e9:.2f} ns per key")
        result["ns_per_key"].setdefault("pv16" if f is run_a else "vnni", []).append(dt / (reps * keys) * 1e9)
    results.append(result)
out = [a for a in sys.argv[1:] if not a.startswith("--")]
if out:
    with open(out[0], "w") as f:
        json.dump({"mode": MODE or "transpose", "results": results}, f, indent=1)
