"""A pytest plugin that logs every numba compile (a disk-cache miss) of the processes it is loaded in, xdist
workers included: one JSON line per compiled signature to $INT8KV_COMPILE_LOG (function, module, signature,
wall and CPU seconds inclusive of the callees compiled inside it, nesting depth, the running test).

    INT8KV_COMPILE_LOG=/tmp/compiles.jsonl PYTHONPATH=$PWD/tools/suite_cpu \
        .venv/bin/python -m pytest -n 2 -p numba_compile_log
    python tools/suite_cpu/report.py --compiles /tmp/compiles.jsonl
"""

import json
import os
import time

from numba.core import event


class CompileLog(event.Listener):
    def __init__(self, path: str) -> None:
        self.path = path
        self.started: list[tuple[float, float]] = []

    def on_start(self, ev: event.Event) -> None:
        self.started.append((time.perf_counter(), time.process_time()))

    def on_end(self, ev: event.Event) -> None:
        wall, cpu = self.started.pop()
        func = getattr(ev.data.get("dispatcher"), "py_func", None)
        line = {"fn": getattr(func, "__qualname__", None), "module": getattr(func, "__module__", None),
                "sig": str(ev.data.get("args")), "wall": time.perf_counter() - wall,
                "cpu": time.process_time() - cpu, "depth": len(self.started),
                "test": os.environ.get("PYTEST_CURRENT_TEST")}  # fmt: skip
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


if os.environ.get("INT8KV_COMPILE_LOG"):
    event.register("numba:compile", CompileLog(os.environ["INT8KV_COMPILE_LOG"]))
