"""Shared helpers for the benchmarks: best-of-N wall time, copy bandwidth, printing and saving results."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..cli_common import write_json


def best_seconds(fn: Callable[[], object], repeat: int = 20, warmup: int = 3) -> float:
    """Best wall time of `repeat` calls: on a shared machine the minimum is the least noisy estimate."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def seconds_in_turns(fns: dict[Any, Callable[[], object]], rounds: int, calls: int) -> dict[Any, list[float]]:
    """Seconds a call of each of ``fns``, one figure per round: every round runs each function ``calls`` times in
    a row, the functions taking turns, so a shared machine's drifting load reaches them all alike (A/B scripts in
    docs/results: the mean of a batch of calls, where one call is too short to time alone)."""
    seconds: dict[Any, list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds[key].append((time.perf_counter() - start) / calls)
    return seconds


def copy_bandwidth(nbytes: int = 256 << 20, repeat: int = 10) -> float:
    """Measured tensor-copy bandwidth in bytes/s (bytes read + written), for bandwidth floors."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), repeat=repeat, warmup=2)
    return 2 * nbytes / seconds


def emit(result: dict, text: str, json_path: str | None) -> dict:
    """Print a benchmark's report and, when asked, write its results as JSON (the CLI's --json)."""
    print(text)
    write_json(json_path, result)
    return result


def set_threads(threads: int) -> None:
    """Run torch and the numba kernels on ``threads`` threads for the rest of the process."""
    import numba

    from ..codec import quantize_int8

    # The numba kernels run on the OpenMP runtime torch also uses, and their first launch resets its thread
    # count to numba's: launch once, then set both, so the count holds for the whole run.
    quantize_int8(torch.ones(2, 8))
    numba.set_num_threads(threads)
    torch.set_num_threads(threads)
