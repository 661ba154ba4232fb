"""Where a decode attention call's time goes at SmolLM2's shape, INT8 (int16 query) and F16, layer by layer.

    PYTHONPATH=src python docs/results/call_layers_2048.py [--keys 2048] [OUT.json]

- "kernel, 2 threads": the row kernel (`ops.cpu._attend_row`) on the plan's four items, two per worker, in a
  jitted `prange` over two workers (each item's state allocated by its worker, so no two workers write one cache
  line), the call's wall time from Python; each worker's start and end in CPU cycles (`llvm.readcyclecounter`)
  give the skew between the workers;
- "kernel, 1 thread": the same four items one after another from Python;
- "cpu run": the CPU backend's prepared call (`cpu.prepare(...)(pool, layer, q)`: `_run`, `fan_out`, the merge);
- "prepared": `ops.PreparedAttention.run` (adds the pool, layer and query checks);
- "attention": `ops.attention` (adds resolving the backend and the plan's work).
Medians of 40 rounds of 50 calls each (the methods taking turns, `bench.timing.seconds_in_turns`), us a call;
the F16 / INT8 ratio per layer; the workers' stamps from 200 more calls.
"""

import argparse
import json
import statistics

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from int8kv import KvStorageFormat
from int8kv.bench.attention import paged_cache
from int8kv.bench.timing import seconds_in_turns
from int8kv.ops import PreparedAttention, attention, cpu, plan_attention


@intrinsic
def cycles(typingctx):
    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(fastmath=True)
def serial(q, qs, kc, ks, vc, vs, tables, items, sm):
    g = q.shape[1] // kc.shape[2]
    for it in range(items.shape[0]):
        m = np.empty((kc.shape[2], g), np.float32)
        den = np.empty_like(m)
        acc = np.empty((kc.shape[2], g, kc.shape[3]), np.float32)
        cpu._attend_row(q, qs, sm, None, kc, ks, vc, vs, tables, 0, 0, items[it, 0], items[it, 1], m, den, acc)


@njit(parallel=True, fastmath=True)
def two_workers(q, qs, kc, ks, vc, vs, tables, items, sm, stamps):
    g = q.shape[1] // kc.shape[2]
    start = cycles()
    for w in prange(2):
        stamps[w * 8, 0] = cycles() - start  # rows 8 apart: no shared cache line
        for it in range(w, items.shape[0], 2):
            m = np.empty((kc.shape[2], g), np.float32)
            den = np.empty_like(m)
            acc = np.empty((kc.shape[2], g, kc.shape[3]), np.float32)
            cpu._attend_row(q, qs, sm, None, kc, ks, vc, vs, tables, 0, 0, items[it, 0], items[it, 1], m, den, acc)
        stamps[w * 8, 1] = cycles() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=2048)
    parser.add_argument("json", nargs="?")
    args = parser.parse_args()
    shape = argparse.Namespace(batch=1, q_heads=9, kv_heads=3, head_dim=64, block_size=16)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 64, generator=gen)
    quarter = args.keys // 4
    items = np.array([[i * quarter, (i + 1) * quarter] for i in range(4)], np.int64)
    result = {"command": "PYTHONPATH=src python docs/results/call_layers_2048.py", "keys": args.keys, "us": {},
              "worker_cycles": {}}
    fns, stamps = {}, {}
    for name, fmt, precision in (("int8", KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, "int16"),
                                 ("f16", KvStorageFormat.F16, "exact")):
        cache, tables, lens = paged_cache(shape, args.keys, fmt, gen)
        plan = plan_attention(cache.pool, tables, lens, precision=precision)
        kc, ks, vc, vs = cpu._layer_arrays(cache.pool, 0)
        qs = cpu._INT16_QUERY if name == "int8" else cpu._NO_SCALE
        sm = np.float32(plan.softmax_scale)
        table = tables.numpy()
        stamps[name] = np.zeros((16, 2), np.int64)
        run = cpu.prepare(cache.pool, plan, 9)
        prepared = PreparedAttention(cache, plan, 9, backend="cpu")
        kernel_args = (q.numpy(), qs, kc, ks, vc, vs, table, items, sm)
        fns[name] = {
            "kernel, 2 threads": lambda a=kernel_args, st=stamps[name]: two_workers(*a, st),
            "kernel, 1 thread": lambda a=kernel_args: serial(*a),
            "cpu run": lambda run=run, pool=cache.pool: run(pool, 0, q),
            "prepared": lambda p=prepared, c=cache: p.run(c, 0, q),
            "attention": lambda c=cache, p=plan: attention(c, 0, q, p, backend="cpu"),
        }
    calls = {(f, m): fn for f in fns for m, fn in fns[f].items()}
    for fn in calls.values():
        for _ in range(200):
            fn()
    samples = {key: [s * 1e6 for s in seconds] for key, seconds in seconds_in_turns(calls, 40, 50).items()}
    starts = {f: [] for f in fns}
    for _ in range(200):  # the workers' cycle stamps, of calls of their own after the timed ones
        for f in fns:
            fns[f]["kernel, 2 threads"]()
            starts[f].append(stamps[f][[0, 8]].copy())
    for m in fns["int8"]:
        i8, f16 = statistics.median(samples[("int8", m)]), statistics.median(samples[("f16", m)])
        result["us"][m] = {"int8": i8, "f16": f16, "f16_over_int8": f16 / i8}
        print(f"{m:18s} INT8 {i8:6.1f} us  F16 {f16:6.1f} us  F16 / INT8 {f16 / i8:.3f}")
    for f, rows in starts.items():
        med = np.median(np.array(rows), axis=0)  # [worker, (start, end)]
        result["worker_cycles"][f] = med.tolist()
        print(f"{f}: worker 0 starts {med[0, 0]:.0f} and ends {med[0, 1]:.0f} cycles in, worker 1 {med[1, 0]:.0f} "
              f"and {med[1, 1]:.0f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


main()
