"""The CPU backend's thread choice when a process changes numba's thread count between calls.

    PYTHONPATH=src python docs/results/threads_switch.py [--context 2048] [OUT.json]

SmolLM2's shape (batch 1, 9 q / 3 kv heads x 64, blocks of 16 in shuffled order), INT8 with the int16 query and
F16 pools of the attention benchmark; per format, 1 / 2 / 1 / 2 threads (numba.set_num_threads), each phase 300
untimed then 2,000 timed calls of `ops.attention`; prints and records the median and best us per phase. A choice
that measured two threads slow at first and kept one shows as a two-thread median near the one-thread one.
"""

import json
import statistics
import sys
import time

import numba
import torch

from int8kv.bench import attention as bench


def main() -> None:
    argv = sys.argv[1:]
    context = 2048
    if argv[:1] == ["--context"]:
        context, argv = int(argv[1]), argv[2:]
    args = bench.parse_args(["--preset", "smollm2"])
    args.batch, args.q_heads, args.kv_heads, args.head_dim, _ = bench.PRESETS["smollm2"]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, args.q_heads, args.head_dim, generator=gen)
    fns = bench._methods(args, context, gen, q, ("int8_q16_paged", "f16_paged"))
    rows = []
    for name, fn in fns.items():
        for threads in (1, 2, 1, 2):
            numba.set_num_threads(threads)
            for _ in range(300):
                fn()
            seconds = []
            for _ in range(2000):
                start = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - start)
            row = {"method": name, "threads": threads, "median_us": statistics.median(seconds) * 1e6,
                   "best_us": min(seconds) * 1e6}
            rows.append(row)
            print(f"{name:16s} {threads} threads: median {row['median_us']:.1f} us, best {row['best_us']:.1f}")
    if argv:
        with open(argv[0], "w") as f:
            json.dump({"context": context, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
