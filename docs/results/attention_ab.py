"""CPU attention of this checkout against another checkout's, in one process, on the same inputs.

    PYTHONPATH= python docs/results/attention_ab.py --baseline /tmp/kmain [--contexts 512,2048] [--queries 0]
        [--shape smollm2|batch8|long] [--format int8|f16] [--seconds 15] [--max-diff 0] [--json PATH]

The baseline's package is loaded under the name ``int8kv_baseline`` (its modules import each other relatively),
this checkout's as ``int8kv``; both get the same random cache (INT8 unless ``--format f16``; SmolLM2's shape,
batch 1, 9 q / 3 kv heads, head_dim 64, unless ``--shape`` names another of `bench attention`'s presets; block
16, block table a random permutation) and query, their outputs must be bit-identical (or, with ``--max-diff X``
for a change that moves the last bits, within X of the baseline's max |output|; the difference is recorded),
and their calls alternate in bursts of five for ``--seconds`` per context. ``--queries N`` times a prefill chunk
of N queries at the end of the context instead of a decode step. Prints and records median and best us per call
and the ratios this / baseline. numba's on-disk cache goes to ``--numba-cache`` (default: a new temporary
directory): a kernel cached while its module had another name must not be loaded under this one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[2]


def load(name: str, root: Path):
    spec = importlib.util.spec_from_file_location(
        name, root / "src/int8kv/__init__.py", submodule_search_locations=[str(root / "src/int8kv")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    for sub in ("ops", "cache.paged", "formats"):
        importlib.import_module(f"{name}.{sub}")
    return sys.modules[f"{name}.ops"], sys.modules[f"{name}.cache.paged"], sys.modules[f"{name}.formats"]


# bench attention's presets: (batch, q heads, kv heads, head_dim)
SHAPES = {"smollm2": (1, 9, 3, 64), "batch8": (8, 32, 8, 128), "long": (1, 32, 8, 128)}


def call_for(ops, paged, formats, ctx: int, nq: int, shape: str = "smollm2", fmt_name: str = "int8"):
    (batch, hq, hkv, d), bs = SHAPES[shape], 16
    fmt = formats.KvStorageFormat.F16 if fmt_name == "f16" else formats.KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
    gen = torch.Generator().manual_seed(0)
    nb = batch * -(-ctx // bs)
    cache = paged.PagedKvCache(nb, bs, 1, hkv, d, fmt)
    tables = torch.randperm(nb, generator=gen).view(batch, -1).to(torch.int32)
    k, v = torch.randn(nb * bs, hkv, d, generator=gen), torch.randn(nb * bs, hkv, d, generator=gen)
    ops.append_paged_kv(cache, 0, k, v, torch.arange(nb * bs))
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    if nq:
        cu = torch.tensor([0, nq], dtype=torch.int32)
        plan = ops.plan_attention(cache.pool, tables, lens, cu_seqlens_q=cu, num_queries=nq)
    else:
        plan = ops.plan_attention(cache.pool, tables, lens)
    q = torch.randn(nq or batch, hq, d, generator=torch.Generator().manual_seed(1))
    return lambda: ops.attention(cache, 0, q, plan, backend="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="root of the other checkout")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--queries", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="batch and heads (default smollm2)")
    parser.add_argument("--format", choices=("int8", "f16"), default="int8")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--json")
    parser.add_argument("--numba-cache", help="numba's cache directory for this run (default: a new one)")
    parser.add_argument("--max-diff", type=float, default=0.0,
                        help="largest |this - baseline| allowed, relative to max |baseline| (default 0: the same bits)")
    args = parser.parse_args()
    os.environ["NUMBA_CACHE_DIR"] = args.numba_cache or tempfile.mkdtemp(prefix="attention_ab_numba_")
    trees = {"baseline": load("int8kv_baseline", args.baseline), "this": load("int8kv", HERE)}
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        calls = {name: call_for(*mods, ctx, args.queries, args.shape, args.format) for name, mods in trees.items()}
        base, this = calls["baseline"](), calls["this"]()
        diff = float((this.double() - base.double()).abs().max() / base.double().abs().max().clamp_min(1e-30))
        assert torch.equal(base, this) if args.max_diff == 0 else diff <= args.max_diff, f"outputs differ ({diff:.2e})"
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(20):  # warm-up: thread choice, caches
            for f in calls.values():
                f()
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            for name, f in calls.items():
                for _ in range(5):
                    t = time.perf_counter()
                    f()
                    samples[name].append(time.perf_counter() - t)
        med = {n: statistics.median(s) * 1e6 for n, s in samples.items()}
        best = {n: min(s) * 1e6 for n, s in samples.items()}
        row = {"context": ctx, "queries": args.queries, "shape": args.shape, "format": args.format,
               "calls": len(samples["this"]), "median_us": med, "best_us": best,
               "median_ratio": med["this"] / med["baseline"], "best_ratio": best["this"] / best["baseline"],
               "max_rel_diff": diff}
        rows.append(row)
        print(f"context {ctx}, {args.queries or 'decode'} queries: {row['calls']} calls each; median us baseline "
              f"{med['baseline']:.1f} this {med['this']:.1f} ({row['median_ratio']:.3f}); best {best['baseline']:.1f} "
              f"vs {best['this']:.1f} ({row['best_ratio']:.3f}); outputs "
              f"{'bit-identical' if diff == 0 else f'within {diff:.1e}'}", flush=True)
    result = {"benchmark": "attention_ab", "baseline": str(args.baseline), "numba_threads": os.environ.get(
        "NUMBA_NUM_THREADS", "default"), "load_average_after": os.getloadavg(), "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
