"""`qk16i`'s row groups: the package's kernel (`cpu_simd.QK16I[kind]`) against the same blocks built with other
row-group sizes and, on 256 bits, other key passes.

    PYTHONPATH=src python docs/results/qk_row_groups.py [OUT.json|-] [vnni512|vnni256|avx2]
    NUMBA_CPU_FEATURES=$(cat docs/results/avx2_features_emr.txt) NUMBA_CACHE_DIR=/tmp/nc_avx2 \
        PYTHONPATH=src python docs/results/qk_row_groups.py OUT.json avx2     # the AVX2 code path (16 registers)

512 bits ("rows_G"): `cpu_simd._direct_rows` with query rows G at a time (8 accumulators a row: 3 rows use 24 of
the 32 registers), the rest in one block of its own size. 256 bits ("rows_GxK"): `cpu_simd._direct_rows256`,
rows G at a time in passes of K keys. One thread, 16 keys a call over 512-2,048 keys hot in cache, ns per (key,
KV head), best of 9; every output checked bit for bit against float64.
"""

import json
import sys
import time

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from int8kv.ops import cpu_simd


def make_kernel(kind: str, group: int, keys: int = 16):
    """`cpu_simd._direct_kernel` with rows `group` at a time (and, on 256 bits, passes of `keys`)."""
    step = cpu_simd._dot_step(kind)
    if kind == "vnni512":
        block = cpu_simd._direct_rows
    else:
        def block(builder, step, *args):
            cpu_simd._direct_rows256(builder, step, *args, keys)

    def qk_rows(typingctx, q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim):
        sig = types.void(q, qoff, k, koff, kstride, out, ooff, ostride, rows, dim)

        def codegen(context, builder, signature, args):
            *pointers, nrows, d = cpu_simd._score_args(context, builder, signature, args)
            cpu_simd._direct_kernel(builder, step, tuple(pointers), nrows, d, group, block)
            return context.get_dummy_value()

        return sig, codegen

    qk_rows.__name__ = f"qk_rows_{kind}_{group}_{keys}"
    return intrinsic(qk_rows)


def runner(kernel):
    @njit(fastmath=True)
    def run(q, k, out, keys, hkv, rows, d, n):
        for _ in range(n):
            for t in range(0, keys, 16):
                for h in range(hkv):
                    kernel(q, h * rows * d, k, t * hkv * d + h * d, hkv * d, out, h * rows * keys + t, keys, rows, d)
    return run


def best_ns(runs: dict, args: tuple, per_call: int, reps: int, rounds: int = 9) -> dict:
    """Each runner's best ns per call over `rounds` rounds, the runners taking turns within a round (so the VM's
    drift reaches all of them alike)."""
    for run in runs.values():
        run(*args, 1)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(*args, reps)
            best[name] = min(best[name], (time.perf_counter() - start) / reps / per_call * 1e9)
    return best


def main() -> None:
    result = {"command": "PYTHONPATH=src python docs/results/qk_row_groups.py", "cpu_dot": cpu_simd.DOT,
              "cases": []}
    rng = np.random.default_rng(0)
    kind = sys.argv[2] if len(sys.argv) > 2 else "vnni512"
    result["kind"] = kind
    result["keys_per_row_group"] = cpu_simd.keys_per_row_group()
    if kind == "vnni512":
        kernels = {f"rows_{g}": make_kernel(kind, g) for g in (4, 2)}
    else:
        kernels = {f"rows_{g}x{k}": make_kernel(kind, g, k) for g, k in ((1, 8), (2, 4), (3, 2), (4, 2))}
    kernels = {"qk16i": cpu_simd.QK16I[kind], **kernels}
    for hkv, rows, d, keys in ((3, 3, 64, 2048), (8, 4, 128, 1024), (2, 7, 128, 1024), (4, 2, 64, 1024),
                               (1, 8, 256, 512), (5, 5, 32, 512)):
        q = rng.integers(-32767, 32768, hkv * rows * d).astype(np.int16)
        k = rng.integers(-127, 128, keys * hkv * d).astype(np.int8)
        ref = np.einsum("hrd,thd->hrt", q.reshape(hkv, rows, d).astype(np.float64),
                        k.reshape(keys, hkv, d).astype(np.float64))
        reps = max(1, 400_000 // (keys * hkv))
        runs = {name: runner(kernel) for name, kernel in kernels.items()}
        for name, run in runs.items():  # each kernel's scores first, exact against float64
            out = np.zeros(hkv * rows * keys, np.float32)
            run(q, k, out, keys, hkv, rows, d, 1)
            assert np.array_equal(out.reshape(hkv, rows, keys), ref.astype(np.float32)), name
        out = np.zeros(hkv * rows * keys, np.float32)
        case = {"kv_heads": hkv, "rows": rows, "dim": d, "keys": keys,
                "ns_per_key_head": best_ns(runs, (q, k, out, keys, hkv, rows, d), keys * hkv, reps)}
        result["cases"].append(case)
        print(case, flush=True)
    if len(sys.argv) > 1 and sys.argv[1] != "-":
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


main()
