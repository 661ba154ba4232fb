"""Prototype: q . k on int8 codes for 16 keys with each key widened to int16 in registers (no int16 scratch),
against the package's `cpu_simd.QK16I[kind]`.

    PYTHONPATH=src python docs/results/qk_direct_prototype.py [OUT.json|-] [vnni512|vnni256|avx2]
    NUMBA_CPU_FEATURES=$(cat docs/results/avx2_features_emr.txt) NUMBA_CACHE_DIR=/tmp/nc_avx2 \
        PYTHONPATH=src python docs/results/qk_direct_prototype.py - avx2     # the AVX2 code path (16 registers)

512 bits ("direct_G"): for each 16 channels, the query rows' 16 int16 values loaded once (duplicated into both
halves), then per key pair two 16-byte loads joined and sign-extended (`vinserti128` + `vpmovsxbw`), one
`vpdpwssd` per row into that pair's accumulator; rows G at a time (8 accumulators each: 3 rows use 24 of the 32
registers), the rest in one block of its own size. The package's `vnni512` variant is this with G = 3 since it
was measured here; before, it sign-extended the 16 keys once into the int16 scratch and each row read them back
(figures in docs/benchmarks.md, "q . k widened in registers").
256 bits ("direct_GxK"): rows G at a time in passes of K keys, each key's 16 channels sign-extended from memory for
every row group, against the package's scratch. One thread, 16 keys a call over 512-2,048 keys hot in cache, ns
per (key, KV head), best of 9; every output checked bit for bit against float64.
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
from int8kv.ops.cpu_simd import _I32, _VEC, _data, _mask, _reduce, _store_f32

I8, I16 = ir.IntType(8), ir.IntType(16)
V16B, V32B = ir.VectorType(I8, 16), ir.VectorType(I8, 32)
V16W, V32W = ir.VectorType(I16, 16), ir.VectorType(I16, 32)
V16D = ir.VectorType(_I32, 16)


def _rows_block256(builder, step, qp, qo, kp, ko, ks, op, oo, os_, d, row0, group, keys):
    """256 bits: rows [row0, row0 + group), the 16 keys in passes of `keys` (a row group's accumulators must fit
    in 16 registers), each key's 16 channels sign-extended from memory for every row of the group."""
    i64 = qo.type
    acc_ty = ir.VectorType(_I32, 8)

    def vec(base, offset, ty):
        return builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())

    slots = [[cgutils.alloca_once(builder, acc_ty) for _ in range(16)] for _ in range(group)]
    for rs in slots:
        for s in rs:
            builder.store(ir.Constant(acc_ty, None), s)
    for first in range(0, 16, keys):
        with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(i64, 16))) as chunk:
            col = builder.mul(chunk.index, ir.Constant(i64, 16))
            qvs = []
            for r in range(group):
                qrow = builder.add(qo, builder.mul(builder.add(row0, ir.Constant(i64, r)), d))
                qvs.append(builder.load(vec(qp, builder.add(qrow, col), V16W), align=2))
            key = builder.add(builder.add(ko, col), builder.mul(ks, ir.Constant(i64, first)))
            for t in range(first, first + keys):
                kv = builder.sext(builder.load(vec(kp, key, V16B), align=1), V16W)
                key = builder.add(key, ks)
                for r in range(group):
                    builder.store(step(builder, builder.load(slots[r][t]), qvs[r], kv), slots[r][t])
    for r in range(group):
        sums = [builder.load(s) for s in slots[r]]
        parts = [_reduce(builder, sums[i : i + 8], lambda b, x, y: b.add(x, y)) for i in (0, 8)]
        total = builder.shuffle_vector(parts[0], parts[1], _mask(list(range(16))))
        at = builder.add(oo, builder.mul(builder.add(row0, ir.Constant(i64, r)), os_))
        _store_f32(builder, builder.sitofp(total, _VEC), op, at)


def make_direct(kind: str, group: int, keys: int = 16):
    """The package's row groups (`cpu_simd._direct_kernel`) with rows `group` at a time: its own 512-bit block
    (`_direct_rows`), or the 256-bit one above in passes of `keys`."""
    step = cpu_simd._dot_step(kind)
    if kind == "vnni512":
        block = cpu_simd._direct_rows
    else:
        def block(builder, step, *args):
            _rows_block256(builder, step, *args, keys)

    def qk_direct(typingctx, q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf):
        sig = types.void(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim, buf)  # buf unused (`qk16i`'s)

        def codegen(context, builder, signature, args):
            q_arr, qo, k_arr, ko, ks, o_arr, oo, os_, nrows, d, _ = args
            qp = _data(context, builder, signature.args[0], q_arr)
            kp = _data(context, builder, signature.args[2], k_arr)
            op = _data(context, builder, signature.args[5], o_arr)
            cpu_simd._direct_kernel(builder, step, (qp, qo, kp, ko, ks, op, oo, os_), nrows, d, group, block)
            return context.get_dummy_value()

        return sig, codegen

    qk_direct.__name__ = f"qk_direct_{kind}_{group}_{keys}"
    return intrinsic(qk_direct)




def runner(kernel):
    @njit(fastmath=True)
    def run(q, k, out, keys, hkv, rows, d, n, buf):
        for _ in range(n):
            for t in range(0, keys, 16):
                for h in range(hkv):
                    kernel(q, h * rows * d, k, t * hkv * d + h * d, hkv * d, out, h * rows * keys + t, keys, rows, d,
                           buf)
    return run


def best_ns(fn, args, per_call, reps):
    fn(*args[:7], 1, args[7])
    best = float("inf")
    for _ in range(9):
        start = time.perf_counter()
        fn(*args[:7], reps, args[7])
        best = min(best, (time.perf_counter() - start) / reps / per_call * 1e9)
    return best


def main() -> None:
    result = {"command": "PYTHONPATH=src python docs/results/qk_direct_prototype.py", "cpu_dot": cpu_simd.DOT,
              "cases": []}
    rng = np.random.default_rng(0)
    kind = sys.argv[2] if len(sys.argv) > 2 else "vnni512"
    result["kind"] = kind
    current = runner(cpu_simd.QK16I[kind])
    if kind == "vnni512":
        kernels = {f"direct_{g}": make_direct(kind, g) for g in (3, 4, 2)}
    else:
        kernels = {f"direct_{g}x{k}": make_direct(kind, g, k) for g, k in ((1, 8), (2, 4), (3, 4), (3, 2), (4, 2))}
    for hkv, rows, d, keys in ((3, 3, 64, 2048), (8, 4, 128, 1024), (2, 7, 128, 1024), (4, 2, 64, 1024),
                               (1, 8, 256, 512), (5, 5, 32, 512)):
        q = rng.integers(-32767, 32768, hkv * rows * d).astype(np.int16)
        k = rng.integers(-127, 128, keys * hkv * d).astype(np.int8)
        ref = np.einsum("hrd,thd->hrt", q.reshape(hkv, rows, d).astype(np.float64),
                        k.reshape(keys, hkv, d).astype(np.float64))
        buf = np.zeros(16 * d, np.int16)
        reps = max(1, 400_000 // (keys * hkv))
        case = {"kv_heads": hkv, "rows": rows, "dim": d, "keys": keys, "ns_per_key_head": {}}
        out = np.zeros(hkv * rows * keys, np.float32)
        case["ns_per_key_head"]["qk16i"] = best_ns(current, (q, k, out, keys, hkv, rows, d, buf), keys * hkv, reps)
        assert np.array_equal(out.reshape(hkv, rows, keys), ref.astype(np.float32))
        for name, kernel in kernels.items():
            out = np.zeros(hkv * rows * keys, np.float32)
            case["ns_per_key_head"][name] = best_ns(runner(kernel), (q, k, out, keys, hkv, rows, d, buf),
                                                    keys * hkv, reps)
            assert np.array_equal(out.reshape(hkv, rows, keys), ref.astype(np.float32)), name
        result["cases"].append(case)
        print(case, flush=True)
    if len(sys.argv) > 1 and sys.argv[1] != "-":
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


main()
