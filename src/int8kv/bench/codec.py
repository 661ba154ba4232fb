"""Codec throughput: quantize/dequantize against a plain copy of the same tensor.

    python -m int8kv.bench codec [--tokens 4096 --heads 8 --head-dim 128] [--json PATH]

Throughput is in GB/s of the float32 tensor (input of quantize, output of dequantize),
so all three rows move the same logical data and the ratios compare like with like.
"""

from __future__ import annotations

import torch

from ..cli_common import bench_parser, check_minimums
from ..codec import dequantize_int8, quantize_int8
from .timing import best_seconds, emit


def run(tokens: int = 4096, heads: int = 8, head_dim: int = 128, repeat: int = 30) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, heads, head_dim, generator=gen)
    q, s = quantize_int8(x)
    nbytes = x.numel() * 4
    seconds = {
        "copy": best_seconds(lambda: x.clone(), repeat),
        "quantize": best_seconds(lambda: quantize_int8(x), repeat),
        "dequantize": best_seconds(lambda: dequantize_int8(q, s), repeat),
    }
    rows = {
        name: {"ms": t * 1e3, "gb_per_s": nbytes / t / 1e9, "vs_copy": seconds["copy"] / t}
        for name, t in seconds.items()
    }
    return {"shape": [tokens, heads, head_dim], "threads": torch.get_num_threads(), "results": rows}


def report(result: dict) -> str:
    lines = [f"codec on float32 {tuple(result['shape'])}, {result['threads']} threads (best of N)"]
    lines.append(f"{'op':<12}{'ms':>9}{'GB/s':>9}{'x copy':>9}")
    for name, row in result["results"].items():
        lines.append(f"{name:<12}{row['ms']:>9.3f}{row['gb_per_s']:>9.2f}{row['vs_copy']:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("codec", __doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the float32 tensor")
    parser.add_argument("--heads", type=int, default=8, help="KV heads per row")
    parser.add_argument("--head-dim", type=int, default=128, help="values per head")
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per op (best kept)")
    args = parser.parse_args(argv)
    check_minimums(args, {"tokens": 1, "heads": 1, "head_dim": 1, "repeat": 1})
    result = run(args.tokens, args.heads, args.head_dim, args.repeat)
    return emit(result, report(result), args.json)
