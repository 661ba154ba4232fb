"""Cold compile of one kernel specialisation: CPU seconds per numba dispatcher, and in all.

    cd TREE && rm -rf /tmp/nc && NUMBA_CACHE_DIR=/tmp/nc PYTHONPATH=src python docs/results/compile_ab.py [JOB ...]

Runs tests/warm_kernels.py's jobs (default 0: INT8, exact query, no window / softcap / sinks, serial and
parallel kernel) in this process with an empty numba cache and prints the process's CPU seconds and, per
dispatcher compiled, the CPU seconds of its compile (inclusive of the callees compiled inside it). Run it in
two checkouts alternately (a fresh cache each time) to compare them on the same load; the output of such a run
is docs/results/compile_ab.txt.
"""

import os
import sys
import time

from numba.core import event

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import warm_kernels  # noqa: E402

KERNELS = (
    "_attend_row", "_attend_item", "_run_items", "_merge_states", "_attention_serial", "_attention_kernel", "fan_out",
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


def main(argv: list[str]) -> None:
    timer = CompileTimer()
    event.register("numba:compile", timer)
    jobs = [int(a) for a in argv] or [0]
    cpu, wall = time.process_time(), time.perf_counter()
    for i in jobs:
        warm_kernels.warm(*warm_kernels.JOBS[i], q_heads=warm_kernels.KV_HEADS * (i + 1))
    print(f"cpu {time.process_time() - cpu:.1f} s wall {time.perf_counter() - wall:.1f} s")
    for name, seconds in timer.records:
        if name in KERNELS:
            print(f"  {name:28s} {seconds:6.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
