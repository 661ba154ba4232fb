"""CPU decode attention reading 4-bit codes (int8kv.ops.cpu_q4) against the INT8 kernel, same shapes, same run.

    python -m int8kv.bench kv4_attention [--preset batch8|smollm2|all] [--repeat 20] [--threads N] [--json PATH]

One decode step (one query token per sequence). Both kernels read random codes and scales of the same shape
from a pool whose block tables are a random permutation (INT8: 16-position blocks, the 4-bit format: 16-position
sealed blocks plus each sequence's open block of ``context % 16`` F16 rows), over the same queries; they take
turns (bench attention's interleaved bursts) and each reports its best and median call; each picks one thread
or all of numba's (``--threads``, default all) by what it measured (cpu.ThreadChoice). Shapes: batch8 = 8
sequences, 32 query / 8 KV heads x 128, 4,096 positions; smollm2 = 1 sequence, 9 / 3 x 64, 7,000 positions.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import numba
import numpy as np
import torch

from ..cli_common import CliError, bench_parser, check_minimums
from ..formats import KvStorageFormat
from ..ops import attention, plan_attention
from ..ops.cpu_q4 import decode_attention
from ..quant4 import BLOCK, bytes_per_position
from .attention import PRESETS, interleaved_samples, paged_cache
from .timing import emit

SHAPES = ("batch8", "smollm2")


def q4_layout(batch: int, heads: int, d: int, context: int, r: np.random.Generator) -> dict[str, np.ndarray]:
    """Random codes, scales and open rows of the 4-bit layout (the keyword arguments of decode_attention)."""
    sealed = context // BLOCK
    total = batch * sealed
    order = r.permutation(total).astype(np.int32)

    def f16(shape, lo, hi):
        return r.uniform(lo, hi, shape).astype(np.float16)

    return {
        "k_codes": r.integers(0, 256, (total, BLOCK, heads, d // 2), dtype=np.uint8),
        "k_scale": f16((total, heads, d), 0.005, 0.02), "k_min": f16((total, heads, d), -0.15, 0.0),
        "v_codes": r.integers(0, 256, (total, BLOCK, heads, d // 2), dtype=np.uint8),
        "v_scale": f16((total, BLOCK, heads), 0.005, 0.02), "v_min": f16((total, BLOCK, heads), -0.15, 0.0),
        "k_open": f16((batch, BLOCK, heads, d), -1, 1), "v_open": f16((batch, BLOCK, heads, d), -1, 1),
        "block_tables": order.reshape(batch, max(1, sealed)) if sealed else np.zeros((batch, 1), np.int32),
        "context_lens": np.full(batch, context, np.int32),
    }  # fmt: skip


def run_shape(name: str, repeat: int, seed: int = 0, context: int | None = None) -> dict[str, Any]:
    batch, hq, heads, d, preset_context = PRESETS[name]
    context = context or preset_context
    gen = torch.Generator().manual_seed(seed)
    ns = argparse.Namespace(batch=batch, block_size=16, kv_heads=heads, head_dim=d)
    int8, tables, lens = paged_cache(ns, context, KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, gen)
    plan = plan_attention(int8.pool, tables, lens)
    q = torch.randn(batch, hq, d, generator=gen)
    qn = q.numpy()
    layout = q4_layout(batch, heads, d, context, np.random.default_rng(seed))
    fns = {
        "int8_paged": lambda: attention(int8, 0, q, plan, backend="cpu"),
        "q4_paged": lambda: decode_attention(qn, **layout),
    }
    samples = interleaved_samples(fns, repeat)
    best = {k: min(v) * 1e3 for k, v in samples.items()}
    median = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    sealed_rows = context // BLOCK * BLOCK
    q4_bytes = batch * heads * (sealed_rows * bytes_per_position(d) + (context - sealed_rows) * 4 * d)
    return {
        "shape": name, "batch": batch, "q_heads": hq, "kv_heads": heads, "head_dim": d, "context": context,
        "best_ms": best, "median_ms": median, "calls": {k: len(v) for k, v in samples.items()},
        "q4_over_int8_best": best["q4_paged"] / best["int8_paged"],
        "q4_over_int8_median": median["q4_paged"] / median["int8_paged"],
        "bytes_read": {"int8_paged": 2 * batch * context * heads * (d + 4), "q4_paged": q4_bytes},
    }  # fmt: skip


def run_rows(run_shape, shapes: tuple[str, ...], repeat: int, context: int | None = None) -> dict[str, Any]:
    """``run_shape(shape, repeat, context=context)`` for each shape (``context`` None: the preset's), with the
    threads and the load they ran under."""
    return {
        "numba_threads": numba.get_num_threads(), "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()), "rows": [run_shape(s, repeat, context=context) for s in shapes],
    }


def run(shapes: tuple[str, ...] = SHAPES, repeat: int = 20, context: int | None = None) -> dict[str, Any]:
    return run_rows(run_shape, shapes, repeat, context)


def heading(result: dict) -> str:
    return (f"decode attention, one step; numba threads {result['numba_threads']}, load average "
            + ", ".join(f"{x:.1f}" for x in result["load_average"]))


def report(result: dict) -> str:
    lines = [
        heading(result),
        f"{'shape':<10}{'int8 best':>11}{'q4 best':>10}{'q4/int8':>9}{'int8 med':>10}{'q4 med':>9}{'q4/int8':>9}"
        f"{'bytes q4/int8':>15}",
    ]
    for r in result["rows"]:
        b, m = r["best_ms"], r["median_ms"]
        lines.append(
            f"{r['shape']:<10}{b['int8_paged']:>9.2f}ms{b['q4_paged']:>8.2f}ms{r['q4_over_int8_best']:>9.2f}"
            f"{m['int8_paged']:>8.2f}ms{m['q4_paged']:>7.2f}ms{r['q4_over_int8_median']:>9.2f}"
            f"{r['bytes_read']['q4_paged'] / r['bytes_read']['int8_paged']:>15.3f}"
        )
    return "\n".join(lines)


def decode_args(name: str, description: str, repeat: int, argv: list[str] | None):
    """The options of a decode-kernel benchmark over SHAPES (--preset, --repeat, --threads, --json), checked;
    numba's thread count set. Returns ``(args, shapes)``."""
    parser = bench_parser(name, description)
    parser.add_argument("--preset", choices=(*SHAPES, "all"), default="all", help="shape(s) to time")
    parser.add_argument("--repeat", type=int, default=repeat, help="timed calls per kernel")
    parser.add_argument("--threads", type=int, default=None, help="numba threads (default: numba's)")
    parser.add_argument("--context", type=int, default=None, help="positions per sequence (default: the preset's)")
    args = parser.parse_args(argv)
    check_minimums(args, {"repeat": 1} | ({"context": 1} if args.context is not None else {}))
    if args.threads is not None:
        check_minimums(args, {"threads": 1})
        if args.threads > numba.config.NUMBA_NUM_THREADS:
            raise CliError(f"--threads {args.threads}: numba has {numba.config.NUMBA_NUM_THREADS} threads")
        numba.set_num_threads(args.threads)
    return args, SHAPES if args.preset == "all" else (args.preset,)


def main(argv: list[str] | None = None) -> dict:
    args, shapes = decode_args("kv4_attention", __doc__.split("\n")[0], 20, argv)
    result = run(shapes, args.repeat, args.context)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
