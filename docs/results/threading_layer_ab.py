"""A/B of numba's threading layers on ops.attention: INT8 paged decode at 2,048 keys, SmolLM2's shape (1 sequence,
9 query / 3 KV heads, head dim 64), the kernels forced onto numba's threads (every call through fan_out) and as
the CPU backend chooses. Children alternate omp, tbb, omp, tbb from one parent; each prints the median over its
trials of the mean microseconds a call. Usage: PYTHONPATH=src python docs/results/threading_layer_ab.py [rounds]"""

import json
import os
import subprocess
import sys

CHILD = """
import json, sys, time, torch
from int8kv import numba_threads
from int8kv.bench.attention import paged_cache, parse_args
from int8kv.formats import KvStorageFormat
from int8kv.ops import attention, cpu, plan_attention

args = parse_args(["--batch", "1", "--q-heads", "9", "--kv-heads", "3", "--head-dim", "64", "--context", "2048"])
gen = torch.Generator().manual_seed(0)
cache, tables, lens = paged_cache(args, 2048, KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, gen)
plan = plan_attention(cache.pool, tables, lens)
q = torch.randn(1, 9, 64, generator=gen)

def timed(calls=300, trials=9):
    for _ in range(calls):
        attention(cache, 0, q, plan, backend="cpu")
    means = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(calls):
            attention(cache, 0, q, plan, backend="cpu")
        means.append((time.perf_counter() - t) / calls * 1e6)
    return sorted(means)[trials // 2]

chosen = timed()
cpu.ThreadChoice.parallel = lambda self, work, threads: True
forced = timed()
print(json.dumps({"layer": numba_threads.layer(), "chosen_us": chosen, "parallel_us": forced}))
"""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    results: dict[str, list[dict]] = {"omp": [], "tbb": []}
    for _ in range(rounds):
        for layer in results:
            env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            assert row["layer"] == layer, row
            results[layer].append(row)
            print(json.dumps(row), flush=True)
    for layer, rows in results.items():
        print(layer, "chosen us/call", [round(r["chosen_us"], 1) for r in rows],
              "parallel us/call", [round(r["parallel_us"], 1) for r in rows])


if __name__ == "__main__":
    main()
