"""Prefill and decode attention calls, INT8 and F16, at two shapes: microseconds per call, one thread.

    cd TREE && NUMBA_NUM_THREADS=1 PYTHONPATH=src python docs/results/prefill_ab.py

A sequence of 2,048 keys (random K/V, seed 0) in 16-token blocks; a 128-query prefill chunk at its end (64 at
32/8 x 128) through the several-row kernel, and a decode row. Each figure: the median of 7 timings of 10 prefill
(200 decode) calls, after one call that compiles. The last line, "json {...}", is for docs/results/ab_checkouts.py.
"""

import json
import statistics
import time

import torch

from int8kv.cache.paged import PagedKvCache
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, paged_decode_attention, paged_prefill_attention

SHAPES = {"smollm2 9/3 x 64": (9, 3, 64, 128), "32/8 x 128": (32, 8, 128, 64)}  # q heads, kv heads, dim, queries
KEYS = 2048

torch.manual_seed(0)
result = {}
for shape, (hq, hkv, d, nq) in SHAPES.items():
    for fmt in (KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, KvStorageFormat.F16):
        cache = PagedKvCache(KEYS // 16 + 4, 16, 1, hkv, d, fmt)
        cache.add_sequence(0)
        cache.grow(0, KEYS)
        append_paged_kv(cache, 0, torch.randn(KEYS, hkv, d), torch.randn(KEYS, hkv, d), cache.slots(0))
        tables, context = cache.batch_tensors([0], min_blocks=1)
        q = torch.randn(nq, hq, d)
        cu = torch.tensor([0, nq], dtype=torch.int32)
        q1 = torch.randn(1, hq, d)
        calls = {
            "prefill": (lambda: paged_prefill_attention(cache, 0, q, cu, tables, context, backend="cpu"), 10),
            "decode": (lambda: paged_decode_attention(cache, 0, q1, tables, context, backend="cpu"), 200),
        }
        for kind, (call, n) in calls.items():
            call()
            times = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(n):
                    call()
                times.append((time.perf_counter() - start) / n)
            name = f"{shape} {'int8' if fmt.is_quantized else 'f16'} {kind}"
            result[name] = round(statistics.median(times) * 1e6, 1)
            print(name, result[name], "us", flush=True)
print("json " + json.dumps(result))
