"""The CPU decode kernel on one thread and on two, each mode forced, INT8 (int16 query) and F16 taking turns.

    PYTHONPATH=src python docs/results/thread_modes_ab.py [--context 2048] [--preset smollm2] [--rounds 150] [OUT.json]

The attention benchmark's inputs (`bench attention`'s caches and query); `ThreadChoice.parallel` is wrapped so
that each call runs the mode asked for (the serial kernel, or the parallel one on numba's threads) and records
nothing. A third mode runs the parallel entry with numba set to one thread: the same items, one after the other,
what the dispatch alone costs. Each round runs every (format, mode) in turn: two untimed calls, then 20 timed;
prints the median and best us per call of the rounds and the F16 / INT8 ratio per mode.
"""

import argparse
import json
import statistics
import time

import numba
import torch

from int8kv.bench import attention as bench
from int8kv.ops import cpu

BURST = 20
_ask = {"parallel": None}
_choose = cpu.ThreadChoice.parallel


def _forced(self, work, threads):
    chosen = _choose(self, work, threads)
    if _ask["parallel"] is None:
        return chosen
    self.timed = False  # a forced call teaches the choice nothing
    return _ask["parallel"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--preset", default="smollm2")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("out", nargs="?")
    opts = parser.parse_args()
    cpu.ThreadChoice.parallel = _forced
    args = bench.parse_args(["--preset", opts.preset])
    args.batch, args.q_heads, args.kv_heads, args.head_dim, _ = bench.PRESETS[opts.preset]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, args.q_heads, args.head_dim, generator=gen)
    fns = bench._methods(args, opts.context, gen, q, ("int8_q16_paged", "f16_paged"))
    threads = numba.get_num_threads()
    modes = {"serial": (False, threads), "parallel on one thread": (True, 1), "parallel": (True, threads)}
    cases = [(name, mode) for name in fns for mode in modes]
    seconds: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    for _ in range(opts.rounds):
        for name, mode in cases:
            _ask["parallel"], n = modes[mode]
            numba.set_num_threads(n)
            fn = fns[name]
            fn()
            fn()
            start = time.perf_counter()
            for _ in range(BURST):
                fn()
            seconds[(name, mode)].append((time.perf_counter() - start) / BURST)
    numba.set_num_threads(threads)
    rows = []
    for (name, mode), s in seconds.items():
        row = {"method": name, "mode": mode, "median_us": statistics.median(s) * 1e6, "best_us": min(s) * 1e6}
        rows.append(row)
        print(f"{name:16s} {mode:22s} median {row['median_us']:7.1f} us, best {row['best_us']:7.1f}")
    ratios = {}
    for mode in modes:
        f16, int8 = seconds[("f16_paged", mode)], seconds[("int8_q16_paged", mode)]
        ratios[mode] = {"medians": statistics.median(f16) / statistics.median(int8), "bests": min(f16) / min(int8)}
        print(f"{mode}: F16 / INT8 medians {ratios[mode]['medians']:.3f}, bests {ratios[mode]['bests']:.3f}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"preset": opts.preset, "context": opts.context, "rounds": opts.rounds, "threads": threads,
                       "rows": rows, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
