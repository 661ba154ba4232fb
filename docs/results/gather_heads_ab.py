"""`cpu_simd.gather16` for a 16-token run of scales, every head in one call against one call per head.

    PYTHONPATH=src python docs/results/gather_heads_ab.py [OUT.json]
    NUMBA_CPU_FEATURES=$(cat docs/results/avx2_features_emr.txt) NUMBA_CACHE_DIR=/tmp/nc_avx2 \\
        PYTHONPATH=src python docs/results/gather_heads_ab.py [OUT.json]     # the AVX2 code

Scales laid out as the pool keeps them, [token, head] rows contiguous. "per head": one call per head with
heads=1 (16 scalar loads and inserts, one vector store: how the row kernel gathered them before); "all heads":
one call with every head (one vector load split by shuffles for the head counts in `cpu_simd._WIDE_HEADS`,
the per-head loads for the rest). Same outputs checked; one thread, loops of calls over 128 runs, the two taking
turns, best of 9, ns per run (all heads).
"""

import json
import sys
import time

import numpy as np
from numba import njit

from int8kv.ops import cpu_simd


@njit
def per_head(src, dst, hkv, runs, n):
    for _ in range(n):
        for r in range(runs):
            for h in range(hkv):
                cpu_simd.gather16(src, r * 16 * hkv + h, hkv, 1, 1, dst, h * 64 + (r % 4) * 16, 64)


@njit
def all_heads(src, dst, hkv, runs, n):
    for _ in range(n):
        for r in range(runs):
            cpu_simd.gather16(src, r * 16 * hkv, hkv, hkv, 1, dst, (r % 4) * 16, 64)


def main() -> None:
    result = {"command": "PYTHONPATH=src python docs/results/gather_heads_ab.py", "features":
              cpu_simd.target_features(), "ns_per_run": {}}
    runs, calls = 128, 2000
    for hkv in (1, 2, 3, 4, 5, 8):
        src = np.random.default_rng(hkv).random(runs * 16 * hkv).astype(np.float32)
        dsts = {"per head": np.zeros(hkv * 64, np.float32), "all heads": np.zeros(hkv * 64, np.float32)}
        fns = {"per head": per_head, "all heads": all_heads}
        for name, fn in fns.items():
            fn(src, dsts[name], hkv, runs, 1)
        assert np.array_equal(dsts["per head"], dsts["all heads"])
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(9):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(src, dsts[name], hkv, runs, calls)
                best[name] = min(best[name], (time.perf_counter() - start) / calls / runs * 1e9)
        result["ns_per_run"][hkv] = best
        print(hkv, "heads:", {k: round(v, 2) for k, v in best.items()}, flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


main()
