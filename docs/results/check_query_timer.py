"""Inside transformers' `generate` on SmolLM2-135M (the drop-in, batch 1): the median microseconds of
`ops.check_query`, the query check every layer's attention call makes, over the decode and prefill calls of
docs/results/generate_split.py's rounds:

    PYTHONPATH=src python docs/results/check_query_timer.py [--context 512] [--rounds 2]
"""

import atexit
import os
import runpy
import statistics
import sys
import time

import int8kv.ops as ops

SPENT: list[int] = []
REAL = ops.check_query


def timed(pool, q, plan):
    start = time.perf_counter_ns()
    out = REAL(pool, q, plan)
    SPENT.append(time.perf_counter_ns() - start)
    return out


ops.check_query = timed
atexit.register(lambda: print(f"check_query median {statistics.median(SPENT) / 1e3:.2f} us over {len(SPENT)} calls"))
sys.argv = ["generate_split.py", *sys.argv[1:]]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_split.py"), run_name="__main__")
