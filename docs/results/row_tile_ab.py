"""The decode row kernel (`ops.cpu._attend_row`) on one thread with other key counts per softmax step: its own
source compiled here with TILE replaced, SmolLM2's shape (9 q / 3 kv heads x 64, blocks of 16 in shuffled order,
the int16 query path), keys 512 / 2,048 / 7,000. Best of 7 rounds of repeated calls, ns per (key, KV head), and
each variant's largest difference from the first one's output.

    PYTHONPATH=src python docs/results/row_tile_ab.py 64,128,256,512
"""

import sys
import time

import numpy as np
from row_ablation import HKV, row_args, variant  # this directory: the same kernel source and inputs


def main() -> None:
    tiles = [int(x) for x in sys.argv[1].split(",")]
    kernels = {t: variant(None, tile=t) for t in tiles}
    rng = np.random.default_rng(0)
    for keys in (512, 2048, 7000):
        args = row_args(rng, keys)
        denom, acc = args[-2:]
        outs = {}
        best = {t: float("inf") for t in kernels}
        reps = max(3, 300_000 // keys)
        for _ in range(7):
            for t, kernel in kernels.items():
                kernel(*args)
                outs[t] = acc / denom[..., None]
                start = time.perf_counter()
                for _ in range(reps):
                    kernel(*args)
                best[t] = min(best[t], (time.perf_counter() - start) / reps / (keys * HKV) * 1e9)
        ref = outs[tiles[0]]
        diffs = {t: float(np.abs(o - ref).max()) for t, o in outs.items()}
        print(keys, {t: round(ns, 2) for t, ns in best.items()}, diffs, flush=True)


main()
