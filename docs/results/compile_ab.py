"""Cold compile of one kernel specialisation: CPU seconds per numba dispatcher, and in all.

    cd TREE && rm -rf /tmp/nc && NUMBA_CACHE_DIR=/tmp/nc PYTHONPATH=src python docs/results/compile_ab.py [JOB ...]

Runs tests/warm_kernels.py's jobs (default 0: INT8, exact query, no window / softcap / sinks, serial and
parallel decode calls) in this process with an empty numba cache, then with ``p`` among the arguments a prefill
call of each job's kind (5 query rows per sequence: the several-row kernel), and prints the process's CPU
seconds and, per dispatcher compiled, the CPU seconds of its compile (inclusive of the callees compiled inside
it), and last a "json {...}" line of the same. docs/results/ab_checkouts.py runs it in two checkouts
alternately (a fresh cache each time) to compare them on the same load: docs/results/compile_ab.json.
"""

import json
import os
import sys
import time

from numba.core import event

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import warm_kernels  # noqa: E402

KERNELS = (
    "_attend_row", "_attend_item", "_row_item", "_general_item", "_run_items", "_merge_states", "_attention_serial",
    "_attention_kernel", "fan_out",
)


class CompileTimer(event.Listener):
    def __init__(self) -> None:
        self.started: dict = {}
        self.records: list[tuple[str, float]] = []

    def on_start(self, ev) -> None:
        self.started[id(ev.data["dispatcher"]), str(ev.data["args"])] = time.process_time()

    def on_end(self, ev) -> None:
        start = self.started.pop((id(ev.data["dispatcher"]), str(ev.data["args"])))
        self.records.append((ev.data["dispatcher"].py_func.__name__, time.process_time() - start))


def prefill(fmt, precision: str, variant: tuple) -> None:
    """A prefill call (5 query rows per sequence) of one job's kind, through the public calls."""
    import torch

    from int8kv.cache.paged import PagedKvCache
    from int8kv.ops import append_paged_kv, attention, plan_attention

    window, softcap, sinks = variant
    gen = torch.Generator().manual_seed(1)
    n, kv_heads, head_dim, block = warm_kernels.CONTEXT, warm_kernels.KV_HEADS, warm_kernels.HEAD_DIM, 8
    cache = PagedKvCache(2 * -(-n // block), block, 1, kv_heads, head_dim, fmt)
    for seq in (0, 1):
        cache.add_sequence(seq, n)
        kv = torch.randn(2, n, kv_heads, head_dim, generator=gen)
        append_paged_kv(cache, 0, kv[0], kv[1], cache.slots(seq))
    tables, context = cache.batch_tensors([0, 1], min_blocks=1)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    plan = plan_attention(cache.pool, tables, context, cu_seqlens_q=cu, precision=precision)
    q = torch.randn(10, 2 * kv_heads, head_dim, generator=gen)
    extra = dict(window=window, softcap=softcap, sinks=torch.zeros(2 * kv_heads) if sinks else None)
    for _ in range(warm_kernels.CALLS):
        out = attention(cache, 0, q, plan, backend="cpu", **extra)
    assert torch.isfinite(out).all()


def main(argv: list[str]) -> None:
    timer = CompileTimer()
    event.register("numba:compile", timer)
    jobs = [int(a) for a in argv if a != "p"] or [0]
    cpu, wall = time.process_time(), time.perf_counter()
    for i in jobs:
        warm_kernels.warm(*warm_kernels.JOBS[i], q_heads=warm_kernels.KV_HEADS * (i + 1))
    if "p" in argv:
        for i in jobs:
            prefill(*warm_kernels.JOBS[i])
    result = {"cpu_s": round(time.process_time() - cpu, 2), "wall_s": round(time.perf_counter() - wall, 2),
              "compiles_s": [[name, round(seconds, 2)] for name, seconds in timer.records if name in KERNELS]}
    print(f"cpu {result['cpu_s']:.1f} s wall {result['wall_s']:.1f} s")
    for name, seconds in result["compiles_s"]:
        print(f"  {name:28s} {seconds:6.1f}")
    print("json " + json.dumps(result))  # the last line: what docs/results/ab_checkouts.py collects


if __name__ == "__main__":
    main(sys.argv[1:])
