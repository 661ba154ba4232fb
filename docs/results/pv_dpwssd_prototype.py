"""Prototype, not in the package: p . v on int8 value codes with int16 weights and the 512-bit `vpdpwssd` (written
as inline assembly: from the intrinsic LLVM emits most as `vpmaddwd` + `vpaddd`), against `cpu_simd.pv16`.

    PYTHONPATH=src python docs/results/pv_dpwssd_prototype.py [OUT.json]

Per 16 keys: two keys' rows sign-extended to int16 and interleaved in pairs (two `vpmovsxbw`, one
`vpunpcklwd` and one `vpunpckhwd` per 32 channels; the accumulator lanes then hold the channels in that
permuted order), one `vpdpwssd` per row, 32 channels and key pair into int32 with the pair's weights broadcast.
Per 64-key tile and row: the weights quantized to int16 over their max (the int16 query's quantizer, one scale
each), and the int32 sums folded into the float32 accumulator in channel order. Checked against float64 (relative
to max |p . v|); timed one thread, keys hot in cache, ns per key, best of 7: the whole (weights, dot products,
fold), and the dot products alone ("core", on weights quantized once). Needs AVX-512 VNNI.
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
from int8kv.ops.cpu_simd import _I32, _mask, _splat, array_data

I8, I16 = ir.IntType(8), ir.IntType(16)
V32B = ir.VectorType(I8, 32)
V32W = ir.VectorType(I16, 32)
V16D = ir.VectorType(_I32, 16)
# vpunpcklwd / vpunpckhwd of two keys' 32 channels: 128-bit lane L of `lo` holds channels 8L..8L+3 of both keys
# in pairs, of `hi` channels 8L+4..8L+7 (int32 lane 4L+j of lo is channel 8L+j, of hi channel 8L+4+j).
LO, HI = [], []
for L in range(4):
    for j in range(4):
        LO += [8 * L + j, 32 + 8 * L + j]
        HI += [8 * L + 4 + j, 32 + 8 * L + 4 + j]
CHAINS = 2  # independent sums per row and half: one chain of 8 would wait on the latency


@intrinsic
def pv16i(typingctx, w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim):
    """acc[aoff + r*dim + perm(i)] += sum_t w[woff + r*wstride + t] * v[voff + t*vstride + i], r < rows, t < 16:
    w int16, v int8, acc int32 in the permuted channel order above, dim a multiple of 32."""
    sig = types.void(w, woff, wstride, v, voff, vstride, acc, aoff, rows, dim)

    def codegen(context, builder, signature, args):
        w_arr, wo, ws, v_arr, vo, vs, a_arr, ao, nrows, d = args
        wp = builder.bitcast(array_data(context, builder, signature.args[0], w_arr), I16.as_pointer())
        vp = array_data(context, builder, signature.args[3], v_arr)
        ap = array_data(context, builder, signature.args[6], a_arr)
        i64 = wo.type
        fn = ir.InlineAsm(ir.FunctionType(V16D, [V16D, V16D, V16D]), "vpdpwssd $3, $2, $0", "=v,0,v,v")
        with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(i64, 32))) as blk:
            col = builder.mul(blk.index, ir.Constant(i64, 32))
            pairs = []
            for p in range(8):
                vals = []
                for t in (2 * p, 2 * p + 1):
                    off = builder.add(builder.add(vo, col), builder.mul(vs, ir.Constant(i64, t)))
                    raw = builder.load(builder.bitcast(builder.gep(vp, [off]), V32B.as_pointer()), align=1)
                    vals.append(builder.sext(raw, V32W))
                pairs.append((builder.bitcast(builder.shuffle_vector(vals[0], vals[1], _mask(LO)), V16D),
                              builder.bitcast(builder.shuffle_vector(vals[0], vals[1], _mask(HI)), V16D)))
            with cgutils.for_range(builder, nrows) as row:
                where = builder.add(builder.add(ao, builder.mul(row.index, d)), col)
                lo_ptr = builder.bitcast(builder.gep(ap, [where]), V16D.as_pointer())
                hi_at = builder.gep(ap, [builder.add(where, ir.Constant(i64, 16))])
                hi_ptr = builder.bitcast(hi_at, V16D.as_pointer())
                lo = [builder.load(lo_ptr, align=4)] + [ir.Constant(V16D, None)] * (CHAINS - 1)
                hi = [builder.load(hi_ptr, align=4)] + [ir.Constant(V16D, None)] * (CHAINS - 1)
                wrow = builder.add(wo, builder.mul(row.index, ws))
                for p in range(8):
                    pair_at = builder.gep(wp, [builder.add(wrow, ir.Constant(i64, 2 * p))])
                    wptr = builder.bitcast(pair_at, _I32.as_pointer())
                    wv = _splat(builder, builder.load(wptr, align=2), V16D)
                    c = p % CHAINS
                    lo[c] = builder.call(fn, [lo[c], pairs[p][0], wv])
                    hi[c] = builder.call(fn, [hi[c], pairs[p][1], wv])
                while len(lo) > 1:
                    lo = [builder.add(lo[0], lo[1])] + lo[2:]
                    hi = [builder.add(hi[0], hi[1])] + hi[2:]
                builder.store(lo[0], lo_ptr, align=4)
                builder.store(hi[0], hi_ptr, align=4)
        return context.get_dummy_value()
    return sig, codegen

TILE = 64
@njit(fastmath=True)
def run_float(w, v, acc, keys, rows, d, n):
    # w [rows, keys] float; v [keys, d] int8 (head rows, stride vs)
    for _ in range(n):
        acc[:] = 0
        for t in range(0, keys, 16):
            cpu_simd.pv16(w, t, keys, v, t * d, d, acc, 0, rows, d)

@njit(fastmath=True)
def run_int(w, v, acc, keys, rows, d, n, w16, acci):
    for _ in range(n):
        acc[:] = 0
        for p0 in range(0, keys, TILE):
            scales = np.empty(rows, np.float32)
            for r in range(rows):
                top = cpu_simd.absmax16(w, r * keys + p0, TILE)
                inv = np.float32(32767.0) / top if top > 0 else np.float32(0)
                scales[r] = top / np.float32(32767.0)
                src = w[r * keys + p0: r * keys + p0 + TILE]
                dst = w16[r * TILE: (r + 1) * TILE]
                for i in range(TILE):
                    dst[i] = np.int16(np.rint(src[i] * inv))
            acci[:] = 0
            for t in range(0, TILE, 16):
                pv16i(w16, t, TILE, v, (p0 + t) * d, d, acci, 0, rows, d)
            for r in range(rows):
                sc = scales[r]
                a = acc[r * d: (r + 1) * d]
                ai = acci[r * d: (r + 1) * d]
                for c in range(d // 32):
                    for L in range(4):
                        for j in range(4):
                            a[32 * c + 8 * L + j] += sc * np.float32(ai[32 * c + 4 * L + j])
                            a[32 * c + 8 * L + 4 + j] += sc * np.float32(ai[32 * c + 16 + 4 * L + j])

@njit(fastmath=True)
def run_core(v, keys, rows, d, n, w16, acci):
    for _ in range(n):
        for p0 in range(0, keys, TILE):
            for t in range(0, TILE, 16):
                pv16i(w16, t, TILE, v, (p0 + t) * d, d, acci, 0, rows, d)


def best_ns(fn, args, keys, reps):
    fn(*args[:-1], 1, *args[-1])
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        fn(*args[:-1], reps, *args[-1])
        best = min(best, (time.perf_counter() - start) / reps / keys * 1e9)
    return best


def main() -> None:
    result = {"command": "PYTHONPATH=src python docs/results/pv_dpwssd_prototype.py", "cases": []}
    rng = np.random.default_rng(0)
    for rows, d, keys in ((3, 64, 2048), (4, 128, 1024)):
        w = rng.random(rows * keys).astype(np.float32) ** 4
        v = rng.integers(-127, 128, keys * d).astype(np.int8)
        ref = w.reshape(rows, keys).astype(np.float64) @ v.reshape(keys, d).astype(np.float64)
        acc_f, acc_i = np.zeros(rows * d, np.float32), np.zeros(rows * d, np.float32)
        w16, acci = np.zeros(rows * TILE, np.int16), np.zeros(rows * d, np.int32)
        reps = 300_000 // keys
        case = {"rows": rows, "dim": d, "keys": keys,
                "ns_per_key": {"pv16": best_ns(run_float, (w, v, acc_f, keys, rows, d, ()), keys, reps),
                               "dpwssd": best_ns(run_int, (w, v, acc_i, keys, rows, d, (w16, acci)), keys, reps),
                               "dpwssd_core": best_ns(run_core, (v, keys, rows, d, (w16, acci)), keys, reps)}}
        run_float(w, v, acc_f, keys, rows, d, 1)
        run_int(w, v, acc_i, keys, rows, d, 1, w16, acci)
        top = np.abs(ref).max()
        case["rel_err"] = {"pv16": float(np.abs(acc_f.reshape(rows, d) - ref).max() / top),
                           "dpwssd": float(np.abs(acc_i.reshape(rows, d) - ref).max() / top)}
        result["cases"].append(case)
        print(case, flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


main()
