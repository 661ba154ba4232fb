"""Compile the numba CPU kernels that the test suite runs into numba's disk cache (`cache=True`), before pytest.

    python tests/warm_kernels.py [SHARD COUNT]     (PYTHONPATH=src when int8kv is not installed)

`make test WARM_KERNELS=1` runs two shards in the background while pip installs the rest of the packages (pip
leaves a core idle while it downloads and unpacks), so every kernel specialisation the suite needs is compiled
once, instead of in whichever test first calls it, on both pytest workers at once and again in every server or
child process the tests start. One specialisation (format x query precision x window / softcap) cost 28-30 s of
CPU, the item loop `_run_items` with `_attend_item` and `_attend_row` inside it and the small parallel entry
`ops.calls.fan_out` (INT8 exact, cold cache, load ~1: docs/archive/benchmarks-2026.md "Kernel compile time"); an
engine test on Gemma 2 once spent 234 of its 237 s compiling. The 9 jobs below compile 9 specialisations, serial and
parallel calls each; after them tests/test_engine_models.py, test_ops_cpu_quantized.py and test_plan.py compiled
nothing.

Only public entry points are called (a paged cache, `plan_attention`, `attention`), so what compiles is what
the tests' calls compile: the signatures depend only on the formats, the precision and which of window and
softcap are set. Each variant gets its own number of query heads, hence its own thread-choice state,
and runs enough calls for both the serial and the parallel kernel to be tried (and so compiled).
"""

from __future__ import annotations

import sys
import time

import torch

from int8kv.cache.paged import PagedKvCache
from int8kv.codec import dequantize_int8, quantize_int8
from int8kv.formats import KvStorageFormat
from int8kv.ops import append_paged_kv, attention, plan_attention

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
KV_HEADS, HEAD_DIM, BLOCK, CONTEXT, SEQUENCES = 2, 64, 8, 40, [0, 1]
CALLS = 8  # a kind of call tries each of the two kernels twice (after the call that compiled it) before choosing
# (window, softcap, sinks): the combinations the engine runs on the model families of tests/test_engine_models.py
# (sliding layers and chunked attention: a window's key bounds; Gemma 2: softcap on full and sliding layers;
# gpt-oss: sinks on full and sliding layers) and all three at once (tests/test_ops_windows.py). The sinks are a
# runtime array in the kernels (no specialisation of their own), so each is warmed alongside a window or softcap.
VARIANTS = [(None, None, False), (4, None, True), (None, 30.0, False), (4, 30.0, True)]
JOBS = [(fmt, precision, variant) for fmt in (INT8, F16) for precision in ("exact", "int16") for variant in VARIANTS
        if precision == "exact" or fmt is INT8 and variant == VARIANTS[0]]  # fmt: skip


def warm(fmt: KvStorageFormat, precision: str, variant: tuple, q_heads: int) -> None:
    window, softcap, sinks = variant
    gen = torch.Generator().manual_seed(0)
    cache = PagedKvCache(2 * -(-CONTEXT // BLOCK), BLOCK, 1, KV_HEADS, HEAD_DIM, fmt)
    for seq in SEQUENCES:  # two sequences: two work items, so the parallel kernel is a choice (one is serial)
        cache.add_sequence(seq, CONTEXT)
        kv = torch.randn(2, CONTEXT, KV_HEADS, HEAD_DIM, generator=gen)
        append_paged_kv(cache, 0, kv[0], kv[1], cache.slots(seq))
    tables, context = cache.batch_tensors(SEQUENCES, min_blocks=1)
    plan = plan_attention(cache.pool, tables, context, precision=precision)
    q = torch.randn(len(SEQUENCES), q_heads, HEAD_DIM, generator=gen)
    extra = dict(window=window, softcap=softcap, sinks=torch.zeros(q_heads) if sinks else None)
    for _ in range(CALLS):
        out = attention(cache, 0, q, plan, backend="cpu", **extra)
    assert torch.isfinite(out).all()


def main(argv: list[str]) -> int:
    shard, count = (int(argv[0]), int(argv[1])) if argv else (0, 1)
    start = time.perf_counter()
    if shard == 0:
        codes, scales = quantize_int8(torch.randn(64, HEAD_DIM))
        dequantize_int8(codes, scales)
    for i, job in enumerate(JOBS):
        if i % count == shard:
            warm(*job, q_heads=KV_HEADS * (i + 1))  # a head count per job: a thread-choice state of its own
    print(f"warm_kernels: shard {shard}/{count} ready in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
