"""Paged decode attention on the CPU against its peers and its memory-bandwidth floor.

    python -m int8kv.bench attention [--batch 8 --context 4096 --q-heads 32 --kv-heads 8 --head-dim 128]
                                     [--block-size 16] [--sweep] [--json PATH] [--plot PATH.png]
    python -m int8kv.bench attention --preset all [--contexts 512,7000] [--json PATH]
    python -m int8kv.bench attention --preset long --window 1024     (adds a sliding-window decode)

One decode step (one query token per sequence), all in one process; the methods take turns (interleaved
bursts) and each reports the best and the median of its calls; with --trials N the whole timing runs N times in
the process and each figure is the median of the N trial medians (best: the best call of all):
  int8 paged    int8kv cpu backend, INT8 blocks read directly (scales folded into scores and weights), float32
                query (precision="exact")
  int8 q16      the same with precision="int16", the default: each (token, head) of q rounded to int16, q . k
                on the codes in int32 (`vpdpwssd` / `vpmaddwd`, the variant of this CPU: "dot" in the JSON)
  f16 paged     int8kv cpu backend, F16 blocks
  torch gather  vectorised torch: gather the INT8 blocks through the block table, dequantize, then SDPA
  sdpa f32/bf16 torch scaled_dot_product_attention (enable_gqa) over contiguous caches of the same shape
  floor         bytes the INT8 kernel must read (codes + scales of K and V) / measured copy bandwidth
  int8 window   with --window N: int8 paged with a sliding window of N keys (`window=N`), on the same cache;
                reported as its median over int8 paged's ("window/full")
Block tables are a random permutation of the pool, as after a long run of allocations and frees.
Presets: smollm2 = batch 1, 9 q / 3 kv heads, head_dim 64, 7,000 tokens; batch8 = batch 8,
32 / 8, 128, 4,096; long = batch 1, 32 / 8, 128, 32,768. They time int8 (exact), int8 q16 (the default), f16
and SDPA float32 (the gather and bf16 peers only run without --preset). The machine's load average is recorded
beside the figures.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import numba
import torch
import torch.nn.functional as F

from .. import numba_threads
from ..cache.paged import PagedKvCache
from ..cli_common import CliError, bench_parser, check_minimums, legend, output_path
from ..formats import KvStorageFormat
from ..ops import attention, cpu_simd, plan_attention
from ..progress import progress
from .timing import copy_bandwidth, emit

SWEEP_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
METHODS = ("int8_paged", "int8_q16_paged", "f16_paged", "torch_gather_int8", "sdpa_f32", "sdpa_bf16")
PRESET_METHODS = ("int8_paged", "int8_q16_paged", "f16_paged", "sdpa_f32")
OURS = ("int8_paged", "int8_q16_paged")  # the INT8 paths, each compared with every peer
# name: (batch, q heads, kv heads, head_dim, context)
PRESETS = {
    "smollm2": (1, 9, 3, 64, 7000),
    "batch8": (8, 32, 8, 128, 4096),
    "long": (1, 32, 8, 128, 32768),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of `python -m int8kv.bench attention` and `int8kv bench attention` (checked: bad values raise
    CliError before anything runs)."""
    parser = bench_parser("attention", __doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--context", type=int, default=4096, help="tokens of K/V per sequence")
    parser.add_argument("--q-heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (divides --q-heads)")
    parser.add_argument("--head-dim", type=int, default=128, help="values per head")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per paged block")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per method (fewer at long contexts)")
    parser.add_argument("--trials", type=int, default=1, help="timings per context; figures: median of the trials")
    parser.add_argument("--sweep", action="store_true", help=f"contexts {SWEEP_CONTEXTS[0]}..{SWEEP_CONTEXTS[-1]}")
    parser.add_argument(
        "--preset", choices=(*PRESETS, "all"), help="reference shapes (overrides batch, heads, head_dim, context)"
    )
    parser.add_argument("--contexts", help="comma-separated contexts, e.g. 512,7000 (overrides --context/--sweep)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random caches and queries")
    parser.add_argument("--window", type=int, help="also time int8 paged with this sliding window (keys)")
    parser.add_argument(
        "--plot", metavar="PATH.png", type=output_path, help="latency versus context per method (turns on --sweep)"
    )
    args = parser.parse_args(argv)
    check_minimums(args, {name: 1 for name in ("batch", "context", "q_heads", "kv_heads", "head_dim",
                                               "block_size", "repeat", "trials")})
    if args.window is not None and args.window < 1:
        raise CliError(f"--window must be >= 1, got {args.window}")
    if args.q_heads % args.kv_heads:
        raise CliError(f"--q-heads {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")
    args.sweep = args.sweep or args.plot is not None
    if args.contexts is not None:
        try:
            args.contexts = tuple(int(c) for c in args.contexts.split(","))
        except ValueError:
            raise CliError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
        if not args.contexts or min(args.contexts) < 1:
            raise CliError("--contexts needs at least one context, each >= 1")
    return args


def interleaved_samples(
    fns: dict[str, Callable[[], object]], repeat: int, budget_s: float = 6.0, burst: int = 3, warmup: int = 8
) -> dict[str, list[float]]:
    """Seconds of every timed call per method. Methods take turns, `burst` back-to-back calls each per round: the
    load of a shared machine drifts, and turns give every method the same chances; the bursts keep a call from
    paying for the previous method's cache footprint and still-spinning thread pool. Each method first runs
    `warmup` untimed calls (compiling, starting thread pools, and the CPU backend's thread choice measuring one
    thread and two, which it does in a model's first steps), then the steady state is timed."""
    first = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
        if first[name] * warmup < budget_s / 4:
            for _ in range(warmup):
                fn()
    rounds = max(2, min(repeat // burst, int(budget_s / max(burst * sum(first.values()), 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in first}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(burst):
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    return samples


def _interleaved_best(fns: dict[str, Callable[[], object]], repeat: int, **kw: float) -> dict[str, float]:
    """Best-of-N seconds per method (see `interleaved_samples`)."""
    return {name: min(ts) for name, ts in interleaved_samples(fns, repeat, **kw).items()}


def paged_cache(args: argparse.Namespace, context: int, fmt: KvStorageFormat, gen: torch.Generator):
    blocks_per_seq = math.ceil(context / args.block_size)
    num_blocks = args.batch * blocks_per_seq + 1
    cache = PagedKvCache(num_blocks, args.block_size, 1, args.kv_heads, args.head_dim, fmt)
    for codes in (cache.k_codes[0], cache.v_codes[0]):
        if fmt.is_quantized:
            codes.copy_(torch.randint(-127, 128, codes.shape, dtype=torch.int8, generator=gen))
        else:
            codes.copy_(torch.randn(codes.shape, generator=gen))
    for scales in (cache.k_scales[0], cache.v_scales[0]):
        if scales is not None:
            scales.copy_(torch.rand(scales.shape, generator=gen) * 0.015 + 0.005)
    order = torch.randperm(num_blocks - 1, generator=gen)[: args.batch * blocks_per_seq] + 1
    tables = order.reshape(args.batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((args.batch,), context, dtype=torch.int32)
    return cache, tables, lens


def _torch_gather(cache: PagedKvCache, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The vectorised-torch alternative: materialise dequantized K/V of every sequence, then SDPA."""
    ctx = int(lens.max())
    blocks = tables.long()
    shape = (q.shape[0], -1, cache.num_kv_heads, cache.head_dim)
    k = (
        cache.k_codes[0][blocks].reshape(shape)[:, :ctx].float()
        * cache.k_scales[0][blocks].reshape(shape[:3])[:, :ctx, :, None]
    )
    v = (
        cache.v_codes[0][blocks].reshape(shape)[:, :ctx].float()
        * cache.v_scales[0][blocks].reshape(shape[:3])[:, :ctx, :, None]
    )
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    return out[:, :, 0]


def _methods(args: argparse.Namespace, context: int, gen: torch.Generator, q: torch.Tensor, names=METHODS) -> dict:
    """The callables `names` to time, over inputs of the same shape (built once, all alive while timing)."""
    int8, tables, lens = paged_cache(args, context, KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, gen)
    f16, f16_tables, f16_lens = paged_cache(args, context, KvStorageFormat.F16, gen)
    shape = (args.batch, args.kv_heads, context, args.head_dim)
    dtypes = [dt for dt, name in ((torch.float32, "sdpa_f32"), (torch.bfloat16, "sdpa_bf16")) if name in names]
    dense = {
        dtype: (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for dtype in dtypes
    }
    # One plan per cache, as a model step builds it once for all its layers.
    plans = {
        "exact": plan_attention(int8.pool, tables, lens, precision="exact"),
        "int16": plan_attention(int8.pool, tables, lens, precision="int16"),
        "f16": plan_attention(f16.pool, f16_tables, f16_lens),
    }

    def sdpa(dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        k, v = dense[dtype]
        qq = q[:, :, None].to(dtype)
        return lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True)

    fns = {
        "int8_paged": lambda: attention(int8, 0, q, plans["exact"], backend="cpu"),
        "int8_q16_paged": lambda: attention(int8, 0, q, plans["int16"], backend="cpu"),
        "f16_paged": lambda: attention(f16, 0, q, plans["f16"], backend="cpu"),
        "torch_gather_int8": lambda: _torch_gather(int8, q, tables, lens),
        "sdpa_f32": (lambda: sdpa(torch.float32)()) if torch.float32 in dense else None,
        "sdpa_bf16": (lambda: sdpa(torch.bfloat16)()) if torch.bfloat16 in dense else None,
        "int8_window": lambda: attention(int8, 0, q, plans["exact"], backend="cpu", window=args.window),
    }
    return {name: fns[name] for name in names}


def run_context(args: argparse.Namespace, context: int, bandwidth: float, names=METHODS) -> dict:
    if args.window is not None:
        names = (*names, "int8_window")
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(args.batch, args.q_heads, args.head_dim, generator=gen)
    fns = _methods(args, context, gen, q, names)
    exact = fns["int8_paged"]()
    if "torch_gather_int8" in fns:
        agreement = _rel_diff(exact, fns["torch_gather_int8"]())
    else:  # the float32 exact path stands in for the gather (both agree with the float64 reference to ~1e-6)
        agreement = None
    q16_diff = _rel_diff(fns["int8_q16_paged"](), exact)
    trials = [interleaved_samples(fns, args.repeat) for _ in range(args.trials)]
    samples = {name: [t for trial in trials for t in trial[name]] for name in fns}
    best = {name: min(ts) for name, ts in samples.items()}
    trial_medians = {name: [statistics.median(trial[name]) for trial in trials] for name in fns}
    median = {name: statistics.median(ms) for name, ms in trial_medians.items()}
    int8_bytes = 2 * args.batch * context * args.kv_heads * (args.head_dim + 4)  # K and V: codes + a float32 scale
    floor = int8_bytes / bandwidth
    row = {
        "context": context,
        "ms": {name: best[name] * 1e3 for name in names},
        "median_ms": {name: median[name] * 1e3 for name in names},
        "trial_median_ms": {name: [t * 1e3 for t in trial_medians[name]] for name in names},
        "calls": {name: len(samples[name]) for name in names},
        "int8_bytes_read": int8_bytes,
        "floor_ms": floor * 1e3,
        "int8_over_floor": best["int8_paged"] / floor,
        "q16_over_floor": best["int8_q16_paged"] / floor,
        "int8_rel_diff_vs_torch_gather": agreement,
        "q16_rel_diff_vs_exact": q16_diff,
    }
    for fast in OURS:  # peer time / ours, on medians: > 1 means ours is faster
        for peer in names:
            if peer not in (*OURS, "int8_window"):
                row[f"{fast}_speedup_vs_{peer}"] = median[peer] / median[fast]
    row["int8_q16_paged_speedup_vs_int8_paged"] = median["int8_paged"] / median["int8_q16_paged"]
    if "int8_window" in median:
        row["window"] = args.window
        row["window_over_full"] = median["int8_window"] / median["int8_paged"]
    return row


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by `args` (see `parse_args`) and return the results as a dict: one config,
    or with --preset a list of them under "presets"."""
    if args.preset is None:
        return _run_config(args, copy_bandwidth(), METHODS)
    bandwidth = copy_bandwidth()
    names = tuple(PRESETS) if args.preset == "all" else (args.preset,)
    load_before = os.getloadavg()
    runs = []
    for name in names:
        sub = argparse.Namespace(**vars(args))
        sub.batch, sub.q_heads, sub.kv_heads, sub.head_dim, sub.context = PRESETS[name]
        runs.append({"preset": name, **_run_config(sub, bandwidth, PRESET_METHODS)})
    return {
        "benchmark": "paged_decode_attention_cpu_presets",
        "copy_gb_per_s": bandwidth / 1e9,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "presets": runs,
    }


def _run_config(args: argparse.Namespace, bandwidth: float, names: tuple[str, ...]) -> dict:
    if args.contexts is not None:
        contexts = args.contexts
    else:
        contexts = SWEEP_CONTEXTS if args.sweep else (args.context,)
    load_before = os.getloadavg()
    results = [run_context(args, ctx, bandwidth, names) for ctx in progress(contexts, "attention: contexts")]
    return {
        "benchmark": "paged_decode_attention_cpu",
        "config": {
            "batch": args.batch,
            "q_heads": args.q_heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
        },
        "machine": {
            "cpu": _cpu_model(),
            "dot": cpu_simd.DOT,  # the integer q . k variant of the int16 path (None: float fallback)
            "torch_threads": torch.get_num_threads(),
            "numba_threads": numba.get_num_threads(),
            "numba_threading_layer": numba_threads.layer() or "not yet initialised",
            "torch": torch.__version__,
        },
        "copy_gb_per_s": bandwidth / 1e9,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }


def _cpu_model() -> dict:
    """The CPU as Linux reports it (model name, and its vector flags that matter here) and as LLVM names it."""
    from llvmlite import binding

    model, flags = "unknown", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = sorted(x for x in value.split() if x.startswith(("avx", "amx")) or x in ("f16c", "fma"))
    except OSError:
        pass
    return {"model": model, "llvm_name": binding.get_host_cpu_name(), "flags": flags}


def report(result: dict) -> str:
    """The table of each configuration (one per preset), then a legend that says what every column shows."""
    runs = result["presets"] if "presets" in result else [result]
    columns: dict[str, str] = {}
    tables = [_table({**run, "copy_gb_per_s": result["copy_gb_per_s"]}, columns) for run in runs]
    return "\n\n".join(tables) + "\n\n" + legend(columns)


# What each method's column times (median ms of its calls, the best call in brackets).
METHOD_LEGEND = {
    "int8_paged": "int8kv's CPU kernel over INT8 blocks with a float32 query (precision=\"exact\"), the scales "
                  "folded into scores and weights",
    "int8_q16_paged": "the same kernel with precision=\"int16\", the DEFAULT path (what models and the engine "
                      "run): the query rounded to int16, q . k computed on the INT8 codes in integers",
    "f16_paged": "the same CPU kernel over F16 blocks",
    "torch_gather_int8": "plain torch: gather the INT8 blocks through the block table, dequantize, then SDPA",
    "sdpa_f32": "torch's scaled_dot_product_attention over a contiguous float32 cache of the same shape",
    "sdpa_bf16": "torch's scaled_dot_product_attention over a contiguous bfloat16 cache of the same shape",
    "int8_window": "int8_paged with a sliding window of --window keys, on the same cache",
}


def _table(result: dict, columns: dict[str, str]) -> str:
    """One configuration's title and table; adds an entry to ``columns`` for each column it prints."""
    c = result["config"]
    m = result["machine"]
    names = list(result["results"][0]["ms"])
    peers = [name for name in names if not name.startswith("int8")]
    window = "window_over_full" in result["results"][0]
    load = ", ".join(f"{x:.1f}" for x in result["load_average_before"])
    title = f"preset {result['preset']}: " if "preset" in result else ""
    lines = [
        f"{title}paged decode attention (CPU): batch {c['batch']}, {c['q_heads']} q heads, "
        f"{c['kv_heads']} kv heads, head_dim {c['head_dim']}, block {c['block_size']}; torch {m['torch_threads']} / "
        f"numba {m['numba_threads']} threads ({m['numba_threading_layer']}); copy bandwidth "
        f"{result['copy_gb_per_s']:.1f} GB/s (read + write); load average {load}; CPU {m['cpu']['model']} "
        f"({m['cpu']['llvm_name']}), integer dot {m['dot']}; median ms (best)",
        f"{'context':>8}" + "".join(f"{name:>22}" for name in names) + f"{'floor':>9}"
        + "".join(f"{'x ' + peer:>22}" for peer in peers)
        + f"{'int8/floor':>12}{'q16/floor':>11}{'q16 diff':>10}{'q16 x int8':>12}"
        + (f"{'window/full':>13}" if window else ""),
    ]
    for r in result["results"]:
        lines.append(
            f"{r['context']:>8}"
            + "".join(f"{r['median_ms'][n]:>13.3f} ({r['ms'][n]:>6.3f})" for n in names)
            + f"{r['floor_ms']:>9.3f}"
            + "".join(
                f"{r[f'int8_paged_speedup_vs_{p}']:>16.2f}/{r[f'int8_q16_paged_speedup_vs_{p}']:<5.2f}" for p in peers
            )
            + f"{r['int8_over_floor']:>11.2f}x{r['q16_over_floor']:>10.2f}x"
            + f"{r['q16_rel_diff_vs_exact']:>10.1e}"
            + f"{r['int8_q16_paged_speedup_vs_int8_paged']:>11.2f}x"
            + (f"{r['window_over_full']:>13.3f}" if window else "")
        )
    columns["context"] = "keys per sequence: the tokens of K/V each query attends to"
    for name in names:
        columns[name] = METHOD_LEGEND[name] + "; median ms of the timed calls, the best call in brackets"
    columns["floor"] = ("ms to read the INT8 K/V once (codes and scales of K and V) at this machine's copy "
                        "bandwidth: no kernel that reads its input can beat it")
    for peer in peers:
        columns[f"x {peer}"] = (f"{peer}'s median over int8_paged's, then over int8_q16_paged's (above 1: int8kv's "
                                "kernel is faster)")
    columns.update({
        "int8/floor": "int8_paged's best call over the floor (1.00x: as fast as the memory allows)",
        "q16/floor": "int8_q16_paged's best call over the floor",
        "q16 diff": "largest difference between the int16 path's output and the exact path's, relative to the "
                    "largest output: what rounding the query to int16 costs in accuracy",
        "q16 x int8": "int8_paged's median over int8_q16_paged's (above 1: the default int16 path is faster)",
    })  # fmt: skip
    if window:
        columns["window/full"] = (f"int8_window's median over int8_paged's (a window of "
                                  f"{result['results'][0]['window']} keys)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Latency (median of the timed calls where recorded, else best) versus context per method, with the INT8
    bandwidth floor, as a PNG: one panel per preset of a `--preset all` run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = result.get("presets", [result])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        points = panel["results"]
        contexts = [p["context"] for p in points]
        key = "median_ms" if "median_ms" in points[0] else "ms"
        for method in points[0][key]:
            ax.plot(contexts, [p[key][method] for p in points], marker="o", label=method)
        ax.plot(contexts, [p["floor_ms"] for p in points], "k--", label="INT8 bandwidth floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context per sequence (tokens)")
        ax.set_ylabel(f"decode attention, one layer (ms, {'median' if key == 'median_ms' else 'best'})")
        c = panel["config"]
        ax.set_title(
            f"batch {c['batch']}, {c['q_heads']} q / {c['kv_heads']} kv heads, head_dim {c['head_dim']}, "
            f"{panel['machine']['numba_threads']} threads", fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    emit(result, report(result), args.json)
    if args.plot:
        plot(result, args.plot)
    return result
