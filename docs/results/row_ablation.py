"""The decode row kernel (`ops.cpu._attend_row`) on one thread, whole and with one part left out at a time.

    PYTHONPATH=src python docs/results/row_ablation.py [OUT.json]

SmolLM2's shape (9 q / 3 kv heads x 64, blocks of 16 in shuffled order), an INT8 pool of random codes and
scales, the int16 query path, keys 512 / 2,048 / 7,000. Each variant is the kernel's own source with one call
replaced by `pass` (the scores `_scores16`, the values `pv16`, the softmax `_tile_weights`, the scales
`_scales16`), compiled here; what a left-out part saves is its cost (a checkout without those calls: the whole
kernel only). Outputs of a variant are meaningless: only
the time is read. Best of 7 rounds of repeated calls, ns per (key, KV head).
"""

import inspect
import json
import sys
import time

import numpy as np
from numba import njit

from int8kv.ops import cpu

SOURCE = inspect.getsource(cpu._attend_row.py_func)
SOURCE = SOURCE[SOURCE.index("def ") :]
LEFT_OUT = {
    "scores": "_scores16(qflat, h * g * d, kflat, base + h * d, row_stride, sflat, h * g * TILE + t,\n"
    "                              TILE, g, d, kbuf)",
    "values": "cpu_simd.pv16(sflat, h * g * TILE + t, TILE, vflat, base + h * d, row_stride, accflat,\n"
    "                                  h * g * d, g, d)",
    "softmax": "_tile_weights(s[h, r], k_scale[h], v_scale[h], q_logit[h * g + r], nt, r, m[h], denom[h], acc[h], cap)",
    "scales": "_scales16(ks, block_id, offset, k_scale_flat, t, TILE)\n"
    "                _scales16(vs, block_id, offset, v_scale_flat, t, TILE)",
}


def variant(left_out: str | None, tile: int | None = None):
    """The kernel without ``left_out`` (None: whole), with ``tile`` keys a softmax step (None: the module's
    TILE; docs/results/row_tile_ab.py); None where this checkout's kernel has no such call (an older one: then
    only the whole kernel is timed)."""
    source = SOURCE
    if left_out is not None:
        if LEFT_OUT[left_out] not in source:
            return None
        source = source.replace(LEFT_OUT[left_out], "pass")
    namespace = dict(vars(cpu))
    if tile is not None:
        namespace["TILE"] = tile
    exec(source, namespace)
    return njit(fastmath=True)(namespace["_attend_row"])


HQ, HKV, D, BS = 9, 3, 64, 16  # SmolLM2's shape, blocks of 16


def row_args(rng, keys: int) -> tuple:
    """The row kernel's arguments over ``keys`` keys of a random INT8 pool (blocks in shuffled order) with the
    int16 query path; its state arrays m, denom, acc are the last three."""
    nb = (keys + BS - 1) // BS + 4
    kc = rng.integers(-127, 128, size=(nb, BS, HKV, D)).astype(np.int8)
    vc = rng.integers(-127, 128, size=(nb, BS, HKV, D)).astype(np.int8)
    ks = (rng.random((nb, BS, HKV)) * 0.01).astype(np.float32)
    vs = (rng.random((nb, BS, HKV)) * 0.01).astype(np.float32)
    tables = rng.permutation(nb)[: (keys + BS - 1) // BS].astype(np.int32)[None, :]
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    m = np.empty((HKV, HQ // HKV), np.float32)
    state = (m, np.empty_like(m), np.empty((HKV, HQ // HKV, D), np.float32))
    return (q, cpu._INT16_QUERY, np.float32(0.125), None, kc, ks, vc, vs, tables, 0, 0, 0, keys, *state)


def main() -> None:
    kernels = {"whole": variant(None), **{f"without {name}": variant(name) for name in LEFT_OUT}}
    kernels = {name: kernel for name, kernel in kernels.items() if kernel is not None}
    rng = np.random.default_rng(0)
    result = {"command": "PYTHONPATH=src python docs/results/row_ablation.py", "ns_per_key_head": {}}
    for keys in (512, 2048, 7000):
        args = row_args(rng, keys)
        best = {name: float("inf") for name in kernels}
        reps = max(3, 300_000 // keys)
        for _ in range(7):
            for name, kernel in kernels.items():
                kernel(*args)
                start = time.perf_counter()
                for _ in range(reps):
                    kernel(*args)
                best[name] = min(best[name], (time.perf_counter() - start) / reps / (keys * HKV) * 1e9)
        result["ns_per_key_head"][keys] = best
        print(keys, {name: round(ns, 2) for name, ns in best.items()}, flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
