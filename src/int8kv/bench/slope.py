"""Decode cost per 1,000 tokens of context, batch 1, SmolLM2: the int8kv engine against llama.cpp.

    python -m int8kv.bench slope [--contexts 512,7000] [--new-tokens 16] [--repeat 3] [--weights model,int8]
                                 [--implementations transformers] [--json PATH]

For each peer and context: prefill `context` tokens of the license texts, then decode `--new-tokens` tokens one
at a time; the decode cost is the median milliseconds per new token. The slope between the shortest and the
longest context, in ms per generated token per 1,000 tokens of context, is what attention adds as the context
grows (the weights cost the same at every context). Peers, all in one process, taking turns per repetition:
  engine int8         int8kv engine, INT8 paged cache, the default attention (precision "int16"), the model's own
                      weights (GGUF blocks packed), the model's own forward (`implementation="transformers"`);
                      "w:dense" / "w:bfloat16" / "w:int8" after the name: those weights (`LLM(weights=)`, one peer
                      per --weights entry), "fused": the fused forward, the engine's default for Llama / Qwen3 (one
                      peer per --implementations entry and weights)
  engine f16          int8kv engine, F16 paged cache
  llama.cpp f16 / q8_0  llama-cpp-python (the optional `peers` extra), same GGUF, flash attention on, F16 or
                      q8_0 K and V cache; skipped with a note when llama_cpp is not installed
The machine's load average is recorded beside the figures: on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from .. import numba_threads
from ..cli_common import CliError, bench_parser, check_minimums
from ..engine.llm import IMPLEMENTATIONS
from ..formats import KvStorageFormat
from ..models.weights import WEIGHTS
from ..ops.plan import DEFAULT_PRECISION, PRECISION_ENV
from ..progress import note
from .timing import emit

GGML_TYPE_F16 = 1  # ggml's type ids (ggml.h), as llama_cpp.Llama's type_k / type_v take them
GGML_TYPE_Q8_0 = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("slope", __doc__.split("\n")[0])
    parser.add_argument("--contexts", default="512,7000", help="comma-separated contexts; the slope uses the ends")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per peer and context (median)")
    parser.add_argument("--threads", type=int, default=None, help="threads for every peer (default: torch's)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp even when installed")
    parser.add_argument("--weights", default="model,int8", help=f"engine weight precisions, of {', '.join(WEIGHTS)}")
    parser.add_argument("--implementations", default="transformers", help=f"engine model paths, of "
                        f"{', '.join(IMPLEMENTATIONS)}")  # fmt: skip
    args = parser.parse_args(argv)
    check_minimums(args, {"new_tokens": 2, "repeat": 1})
    for name, allowed in (("weights", WEIGHTS), ("implementations", IMPLEMENTATIONS)):
        values = [v.strip() for v in getattr(args, name).split(",")]
        unknown = [v for v in values if v not in allowed]
        if unknown or len(set(values)) != len(values):
            raise CliError(f"--{name} takes distinct names of {', '.join(allowed)}, got {getattr(args, name)!r}")
        setattr(args, name, values)
    try:
        args.contexts = sorted({int(c) for c in args.contexts.split(",")})
    except ValueError:
        raise CliError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
    if len(args.contexts) < 2 or args.contexts[0] < 1:
        raise CliError("--contexts needs two or more contexts >= 1")
    return args


def _engine_peer(
    model, tokenizer, fmt: KvStorageFormat, precision: str, longest: int, new_tokens: int,
    weights: str = "model", implementation: str = "transformers",
):  # fmt: skip
    """ms per decode step of the int8kv engine at batch 1, for a prompt of ids."""
    from ..engine import LLM, EngineStats, SamplingParams
    from ..models import kv_dims

    memory = int(1.2 * (longest + new_tokens + 64) * fmt.bytes_per_token(*kv_dims(model.config)))
    llm = LLM(model, kv_format=fmt, memory=max(memory, 64 << 20), max_num_seqs=1, tokenizer=tokenizer,
              weights=weights, implementation=implementation)  # fmt: skip

    def run(ids: list[int]) -> float:
        previous = os.environ.get(PRECISION_ENV)
        os.environ[PRECISION_ENV] = precision  # the engine plans with the environment's default precision
        try:
            llm.stats = EngineStats()
            llm.generate([ids], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        finally:
            if previous is None:
                os.environ.pop(PRECISION_ENV, None)
            else:
                os.environ[PRECISION_ENV] = previous
        return 1e3 / llm.stats.decode_tokens_per_s

    return run


def open_llama(path: str, n_ctx: int, threads: int, kv_type: int = GGML_TYPE_F16):
    """A llama_cpp.Llama over ``path``, flash attention on, K and V cache of ``kv_type``, ``threads`` threads.

    The weights load without ggml's "extra" buffer types (``use_extra_bufts=False``, which llama-cpp-python
    0.3.36 does not expose, hence the patched default params): on the 2-core Xeon VM, which reports AMX,
    ggml's AMX matmul (`ggml_backend_amx_mul_mat`) crashes with SIGSEGV on the first decode. The KV cache and
    flash attention, what the benchmarks compare, are unaffected."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = without_extra_buffers
    try:
        return llama_cpp.Llama(
            model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
            flash_attn=True, type_k=kv_type, type_v=kv_type, verbose=False,
        )  # fmt: skip
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


def _llama_peer(path: str, kv_type: int, longest: int, new_tokens: int, threads: int):
    """ms per decode step of llama.cpp (flash attention on) after a prefill of ids."""
    llm = open_llama(path, longest + new_tokens + 16, threads, kv_type)

    def run(ids: list[int]) -> float:
        llm.reset()
        llm.eval(ids)
        token = ids[-1]
        stamps = [time.perf_counter()]
        for _ in range(new_tokens):
            llm.eval([token])
            stamps.append(time.perf_counter())
        steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        return 1e3 * statistics.median(steps)

    return run


def run(args: argparse.Namespace) -> dict:
    from ..eval import read_text
    from ..models import default_gguf_path, load_model

    if args.threads is not None:  # torch, numba and llama.cpp alike
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    threads = torch.get_num_threads()
    model, tokenizer = load_model(None)
    text_ids = tokenizer(read_text(None))["input_ids"]
    if len(text_ids) < args.contexts[-1]:
        raise CliError(f"the default text has only {len(text_ids)} tokens; use smaller --contexts")
    longest = args.contexts[-1]
    int8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
    peers: dict[str, Callable[[list[int]], float]] = {}
    for implementation in args.implementations:
        for weights in args.weights:
            name = "engine int8" + ("" if weights == "model" else f" w:{weights}")
            name += "" if implementation == "transformers" else f" {implementation}"
            peers[name] = _engine_peer(model, tokenizer, int8, DEFAULT_PRECISION, longest, args.new_tokens, weights,
                                       implementation)  # fmt: skip
    peers["engine f16"] = _engine_peer(model, tokenizer, KvStorageFormat.F16, "exact", longest, args.new_tokens)
    llama_note = None
    if args.no_llama:
        llama_note = "skipped (--no-llama)"
    else:
        try:
            import llama_cpp
        except ImportError:
            llama_note = "llama_cpp not installed (pip install int8kv[peers])"
        else:
            gguf = str(default_gguf_path())
            llama_note = f"llama-cpp-python {llama_cpp.__version__}"
            peers["llama.cpp f16"] = _llama_peer(gguf, GGML_TYPE_F16, longest, args.new_tokens, threads)
            peers["llama.cpp q8_0"] = _llama_peer(gguf, GGML_TYPE_Q8_0, longest, args.new_tokens, threads)
    for name, fn in peers.items():  # compile / load every kernel outside the timings
        note(f"slope: warming {name}")
        fn(text_ids[:64])
    load_before = os.getloadavg()
    samples: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.contexts} for name in peers}
    for rep in range(args.repeat):  # peers take turns: the machine's load drifts alike for all of them
        for context in args.contexts:
            for name, fn in peers.items():
                note(f"slope: run {rep + 1}/{args.repeat}, {name}, context {context}")
                samples[name][context].append(fn(text_ids[:context]))
    lo, hi = args.contexts[0], args.contexts[-1]
    results = {}
    for name, per_context in samples.items():
        ms = {c: statistics.median(v) for c, v in per_context.items()}
        results[name] = {
            "ms_per_token": ms,
            "runs": per_context,
            "slope_ms_per_1k": (ms[hi] - ms[lo]) / ((hi - lo) / 1000),
        }
    base = results.get("llama.cpp f16")
    for row in results.values():
        row["slope_vs_llama_f16"] = row["slope_ms_per_1k"] / base["slope_ms_per_1k"] if base else None
        # The fixed cost: ms per token at the shortest context against llama.cpp's (F16 KV) in the same run.
        row["ms_vs_llama_f16_at_shortest"] = row["ms_per_token"][lo] / base["ms_per_token"][lo] if base else None
    return {
        "benchmark": "decode_slope_batch1",
        "contexts": args.contexts,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "threads": threads,
        "numba_threading_layer": numba_threads.layer(),
        "weights": args.weights,
        "implementations": args.implementations,
        "llama_cpp": llama_note,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }


def report(result: dict) -> str:
    lo, hi = result["contexts"][0], result["contexts"][-1]
    load = ", ".join(f"{x:.1f}" for x in result["load_average_before"])
    lines = [
        f"decode cost per 1,000 tokens of context, batch 1, SmolLM2, {result['threads']} threads, "
        f"{result['new_tokens']} new tokens, median of {result['repeat']}; llama.cpp: {result['llama_cpp']}; "
        f"load average {load}",
        f"{'peer':<26}" + "".join(f"{f'ms/tok @{c}':>14}" for c in result["contexts"])
        + f"{'ms per 1k ctx':>15}{'x llama f16':>13}{f'ms @{lo} x llama':>18}",
    ]  # fmt: skip
    for name, r in result["results"].items():
        ratio = "" if r["slope_vs_llama_f16"] is None else f"{r['slope_vs_llama_f16']:.2f}"
        fixed = "" if r["ms_vs_llama_f16_at_shortest"] is None else f"{r['ms_vs_llama_f16_at_shortest']:.2f}"
        lines.append(
            f"{name:<26}" + "".join(f"{r['ms_per_token'][c]:>14.2f}" for c in result["contexts"])
            + f"{r['slope_ms_per_1k']:>15.3f}{ratio:>13}{fixed:>18}"
        )  # fmt: skip
    lines.append(f"slope = (ms/token at {hi} - at {lo}) / {(hi - lo) / 1000:g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    return emit(result, report(result), args.json)
