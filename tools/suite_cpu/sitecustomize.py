"""Per-process CPU log for a test run: every Python process started with this directory on PYTHONPATH appends
one JSON line to $INT8KV_SUITE_LOG when it exits (pid, argv, own user + system CPU seconds, wall seconds, and
the test that was running when it was started, from PYTEST_CURRENT_TEST). A process killed by a signal that
Python does not handle writes nothing.

    INT8KV_SUITE_LOG=/tmp/procs.jsonl PYTHONPATH=$PWD/tools/suite_cpu make test
    python tools/suite_cpu/report.py /tmp/procs.jsonl
"""

import atexit
import json
import os
import sys
import time

_LOG = os.environ.get("INT8KV_SUITE_LOG")
_START = time.time()


def _write() -> None:
    times = os.times()
    line = {"pid": os.getpid(), "argv": sys.argv[:6], "cpu": times.user + times.system,
            "wall": time.time() - _START, "test": os.environ.get("PYTEST_CURRENT_TEST")}  # fmt: skip
    with open(_LOG, "a") as f:  # one short append per process: lines from concurrent processes stay whole
        f.write(json.dumps(line) + "\n")


if _LOG:
    atexit.register(_write)
