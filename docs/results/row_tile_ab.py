"""The decode row kernel (`ops.cpu._attend_row`) on one thread with other key counts per softmax step: its own
source compiled here with TILE replaced, SmolLM2's shape (9 q / 3 kv heads x 64, blocks of 16 in shuffled order,
the int16 query path), keys 512 / 2,048 / 7,000. Best of 7 rounds of repeated calls, ns per (key, KV head), and
each variant's largest difference from the first one's output.

    PYTHONPATH=src python docs/results/row_tile_ab.py 64,128,256,512
"""

import inspect
import sys
import time

import numpy as np
from numba import njit

from int8kv.ops import cpu

SOURCE = inspect.getsource(cpu._attend_row.py_func)
SOURCE = SOURCE[SOURCE.index("def ") :]


def variant(tile):
    ns = dict(vars(cpu))
    ns["TILE"] = tile
    exec(SOURCE, ns)
    return njit(fastmath=True)(ns["_attend_row"])


tiles = [int(x) for x in sys.argv[1].split(",")]
kernels = {t: variant(t) for t in tiles}
rng = np.random.default_rng(0)
hq, hkv, d, bs = 9, 3, 64, 16
for keys in (512, 2048, 7000):
    nb = (keys + bs - 1) // bs + 4
    kc = rng.integers(-127, 128, size=(nb, bs, hkv, d)).astype(np.int8)
    vc = rng.integers(-127, 128, size=(nb, bs, hkv, d)).astype(np.int8)
    ks = (rng.random((nb, bs, hkv)) * 0.01).astype(np.float32)
    vs = (rng.random((nb, bs, hkv)) * 0.01).astype(np.float32)
    tables = rng.permutation(nb)[: (keys + bs - 1) // bs].astype(np.int32)[None, :]
    q = rng.standard_normal((1, hq, d)).astype(np.float32)
    outs = {}
    best = {t: float("inf") for t in kernels}
    reps = max(3, 300_000 // keys)
    for _ in range(7):
        for t, kernel in kernels.items():
            m = np.empty((hkv, hq // hkv), np.float32)
            denom = np.empty_like(m)
            acc = np.empty((hkv, hq // hkv, d), np.float32)
            args = (q, cpu._INT16_QUERY, np.float32(0.125), None, kc, ks, vc, vs, tables, 0, 0, 0, keys, m, denom, acc)
            kernel(*args)
            outs[t] = acc / denom[..., None]
            start = time.perf_counter()
            for _ in range(reps):
                kernel(*args)
            best[t] = min(best[t], (time.perf_counter() - start) / reps / (keys * hkv) * 1e9)
    ref = outs[tiles[0]]
    diffs = {t: float(np.abs(o - ref).max()) for t, o in outs.items()}
    print(keys, {t: round(ns, 2) for t, ns in best.items()}, diffs, flush=True)
