"""Time of one CPU decode attention call, to compare two checkouts (run each alternately, same machine state).

    cd TREE && PYTHONPATH=src python docs/results/call_ab.py

INT8 pool, block 16, the public `attention` call after 50 warm-up calls (the thread choice settles), then 15
trials of `reps` calls: the fastest trial's microseconds per call. Cases: SmolLM2's shape (9 / 3 heads x 64)
at batch 1 x 512 keys, the same with a softcap of 30, and batch 4 x 1,024 keys.
"""

import json
import time

import torch

from int8kv.cache.paged import PagedKvCache
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, attention, plan_attention

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1


def per_call(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, softcap=None, reps=400) -> float:
    gen = torch.Generator().manual_seed(0)
    block = 16
    cache = PagedKvCache(batch * -(-context // block) + 2, block, 1, kv_heads, head_dim, INT8)
    for seq in range(batch):
        cache.add_sequence(seq, context)
        kv = torch.randn(2, context, kv_heads, head_dim, generator=gen)
        append_paged_kv(cache, 0, kv[0], kv[1], cache.slots(seq))
    tables, lens = cache.batch_tensors(list(range(batch)), min_blocks=1)
    plan = plan_attention(cache.pool, tables, lens)
    q = torch.randn(batch, q_heads, head_dim, generator=gen)
    extra = {} if softcap is None else {"softcap": softcap}
    for _ in range(50):
        attention(cache, 0, q, plan, backend="cpu", **extra)
    best = float("inf")
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(reps):
            attention(cache, 0, q, plan, backend="cpu", **extra)
        best = min(best, (time.perf_counter() - start) / reps * 1e6)
    return best


if __name__ == "__main__":
    result = {"b1x512_us": per_call(1, 512, 9, 3, 64), "b1x512_softcap_us": per_call(1, 512, 9, 3, 64, 30.0),
              "b4x1024_us": per_call(4, 1024, 9, 3, 64)}
    print("  ".join(f"{k} {v:.1f}" for k, v in result.items()))
    print("json " + json.dumps({k: round(v, 2) for k, v in result.items()}))  # collected by ab_checkouts.py
