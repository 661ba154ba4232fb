"""`int8kv demo | eval | serve | bench | cache inspect`: the command-line front end.

Errors a user can cause (missing model, unknown format, a budget too small, a bad text file) print one
line and exit 1; --debug shows the traceback instead. Every argument is checked before a model is loaded.
`int8kv bench <name> ...` is `python -m int8kv.bench <name> ...`: the same function, the same parser.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import __version__, progress
from .bench import BENCHMARKS
from .cache.paged import PagedKvCache
from .cli_common import (
    COMMON_FLAGS,
    CliError,
    HelpFormatter,
    check_minimums,
    check_outputs,
    memory_budget,
    report_errors,
    write_json,
)
from .formats import INT4_SINK_WINDOW_V1, KvStorageFormat
from .models.weights import WEIGHTS

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16
# The --kv-format / --formats choices: every registered format's stable name, and the dtype aliases.
FORMAT_CHOICES = ", ".join((*(f.value for f in KvStorageFormat), "int8", "f16", "int4"))
DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning a new language.",
)
MODEL_HELP = "local transformers dir or .gguf file (default: packaged SmolLM2-135M)"
JSON_HELP = "also write the results as JSON (NaN and inf as null)"
WEIGHTS_HELP = (
    "precision of the model's matmuls: model (its own weights exactly; an engine runs a GGUF file's Q4_0-Q8_0 and "
    "K-quant blocks packed), dense (as loaded, torch's matmuls: SmolLM2's are float32), bfloat16, or int8 (per-row "
    "int8 weights, bfloat16 inputs; CPU only); perplexity and speed of each in docs/performance.md"
)
THREADS_HELP = (
    "threads per engine step (default: one or every CPU the process may use, its affinity and cgroup quota, "
    "whichever the engine measures faster under the machine's current load)"
)
KV_STORE_HELP = (
    "share prefix KV blocks through a block store: embedded, disk:PATH, redis://host:6379/0, "
    "redis+cluster://host:port,... (docs/block_store.md); the demo then reruns the prompts on a fresh engine "
    "that loads them from it"
)


TOOL_PARSERS = ("hermes", "llama3_json")  # server/tools.py PARSERS (not imported: the server's modules load late)
# vLLM's --dtype -> --weights
VLLM_DTYPES = {"auto": "model", "bfloat16": "bfloat16", "float32": "dense", "float": "dense"}
# Flags of vLLM and llama.cpp's server that int8kv has no flag for, each with what to use instead.
_NO_GPU = "int8kv runs on the CPU"
_ONE_PROCESS = ("not supported: one process serves the whole model; for more throughput run replicas that share a "
                "--kv-store (docs/serving.md)")
FOREIGN_FLAGS = {
    "--gpu-memory-utilization": "the KV pool is sized in bytes here: use --memory (e.g. --memory 8GiB)",
    "--kv-cache-memory-bytes": "the KV pool is sized with --memory (e.g. --memory 8GiB)",
    "--tensor-parallel-size": _ONE_PROCESS, "-tp": _ONE_PROCESS, "--pipeline-parallel-size": _ONE_PROCESS,
    "-pp": _ONE_PROCESS, "--data-parallel-size": _ONE_PROCESS, "-dp": _ONE_PROCESS,
    "--quantization": "the weights' precision is --weights (model, dense, bfloat16, int8); a GGUF file's own "
                      "quantization is read as the file holds it",
    "--swap-space": f"not supported: {_NO_GPU}; a preempted request is recomputed",
    "--cpu-offload-gb": f"not supported: {_NO_GPU}",
    "--enforce-eager": f"not supported: {_NO_GPU} and captures no CUDA graphs",
    "--n-gpu-layers": f"not supported: {_NO_GPU}", "-ngl": f"not supported: {_NO_GPU}",
    "--block-size": "not supported: KV blocks hold 16 tokens (64 positions in the 4-bit format)",
    "--seed": "not supported: seed each request with its 'seed' field",
    "--trust-remote-code": "not supported: int8kv runs transformers' own model classes, never code from a model "
                           "directory",
    "--tokenizer": "not supported: the tokenizer comes with --model",
    "--download-dir": "not supported: --model is a local directory or a .gguf file",
    "--revision": "not supported: --model is a local directory or a .gguf file",
    "-c": "llama.cpp's context size is --max-model-len here", "--ctx-size": "the context size is --max-model-len here",
    "-np": "llama.cpp's parallel slots are --max-num-seqs here", "--parallel": "parallel slots are --max-num-seqs here",
    "-t": "threads are --threads here", "-m": "the model is --model (or the first argument) here",
    "-n": "a request's token limit is its max_tokens field; the server's cap is --max-tokens",
    "--n-predict": "a request's token limit is its max_tokens field; the server's cap is --max-tokens",
    "--uvicorn-log-level": "the server logs warnings; --debug logs everything",
}


def _foreign(extra: list[str], command: str) -> None:
    """CliError for arguments the parser did not take: another server's flag names int8kv's equivalent."""
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in FOREIGN_FLAGS:
            raise CliError(f"{name}: {FOREIGN_FLAGS[name]}")
    raise CliError(f"unrecognized arguments: {' '.join(extra)} (see int8kv {command} --help)")


def _common(p: argparse.ArgumentParser) -> None:
    for flag, text in COMMON_FLAGS.items():
        p.add_argument(flag, action="store_true", help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="int8kv", description="INT8 KV-cache storage for LLM inference", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"int8kv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(parent: Any, name: str, text: str) -> argparse.ArgumentParser:  # parent: add_subparsers()
        return parent.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)

    demo = command(sub, "demo", "F16 vs INT8 KV cache side by side on a real model")
    demo.add_argument("--model", help=MODEL_HELP)
    demo.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    demo.add_argument("--threads", type=int, help=THREADS_HELP)
    demo.add_argument("--prompt", action="append", help="your own prompt (repeatable; default: three built-in)")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens generated per prompt")
    demo.add_argument("--memory", default="8GiB", help="budget for the capacity table, e.g. 512MiB, 8GiB")
    demo.add_argument("--formats", default="f16,int8", help=f"comma-separated KV formats to compare: {FORMAT_CHOICES}")
    demo.add_argument("--json", metavar="PATH", help=JSON_HELP)
    demo.add_argument("--plot", metavar="PATH.png", help="KV memory versus context length per format")
    demo.add_argument("--kv-store", metavar="URL", help=KV_STORE_HELP)
    _common(demo)

    ev = command(sub, "eval", "perplexity and greedy agreement per KV cache type")
    ev.add_argument("--model", help=MODEL_HELP)
    ev.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    ev.add_argument("--text", help="UTF-8 text file (default: the license texts in /usr/share/common-licenses)")
    ev.add_argument("--ctx", type=int, default=512, help="tokens per perplexity window (the second half is scored)")
    ev.add_argument("--chunk", type=int, default=128, help="tokens fed per forward (K/V written, then read)")
    ev.add_argument("--windows", type=int, default=8,
                    help="at most this many windows: the default 8 x 512 tokens go through the model once per "
                         "cache, 2,048 of them scored (about three quarters of the default run's time)")
    ev.add_argument("--gen-tokens", type=int, default=32,
                    help="greedy tokens generated per prompt and cache, one forward each: the default 4 x 32 take "
                         "about a quarter of the default run's time; 128 makes the run about 1.8x as long")
    ev.add_argument("--prompts", type=int, default=4, help="built-in prompts to generate from (0: none)")
    ev.add_argument("--fp8", action=argparse.BooleanOptionalAction,
                    help="also score transformers' fp8 QuantizedCache (off by default: its perplexity passes are "
                         "several times slower than the other caches', which more than doubles the run)")
    ev.add_argument("--kv-format", default=None, help=f"comma-separated Int8KvCache formats to score after the "
                    f"float32 baseline (default: F16 and INT8): {FORMAT_CHOICES}")
    ev.add_argument("--json", metavar="PATH", help=JSON_HELP)
    ev.add_argument("--plot", metavar="PATH.png", help="perplexity change per cache type")
    _common(ev)

    # Everything after the name goes to the benchmark's own parser (`int8kv bench <name> --help` shows it).
    bench = command(sub, "bench", "benchmarks: int8kv bench <name> [options] runs python -m int8kv.bench <name>")
    bench.add_argument("name", choices=tuple(BENCHMARKS), help="the benchmark")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options (see <name> --help)")
    _common(bench)

    serve = command(sub, "serve", "an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    serve.add_argument("model_path", nargs="?", metavar="MODEL", help=f"{MODEL_HELP}; or --model")
    serve.add_argument("--model", help=MODEL_HELP)
    serve.add_argument("--weights", choices=WEIGHTS, help=WEIGHTS_HELP + " (default: model)")
    serve.add_argument("--threads", type=int, help=THREADS_HELP)
    serve.add_argument("--kv-format", help=f"KV storage format: {FORMAT_CHOICES} (default: int8)")
    serve.add_argument("--memory", default="512MiB", help="KV cache pool size, e.g. 512MiB, 8GiB")
    serve.add_argument("--kv-store", help="shared KV block store (disk:PATH, redis://..., embedded)")
    serve.add_argument("--kv-store-secret", metavar="SECRET",
                       help="authenticate the store's blocks with this shared secret (>= 16 bytes; prefer the "
                            "INT8KV_KV_STORE_SECRET variable: a command line is visible to other users)")  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together in one step")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    serve.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot (then 429)")
    serve.add_argument("--max-tokens", type=int, default=1024, help="the most new tokens a request may ask for")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds SIGTERM lets running requests finish before aborting them")
    serve.add_argument("--served-model-name", help="the model name clients use (default: from --model)")
    serve.add_argument("--max-model-len", type=int,
                       help="the most tokens (prompt + new) one request may use (default: the model's context)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health and "
                                          "/metrics (default: $INT8KV_API_KEY, which keeps the key out of the "
                                          "process list)")
    serve.add_argument("--no-log-requests", "--disable-log-requests", dest="no_log_requests", action="store_true",
                       help="no log line per request (id, tokens, finish reason, seconds)")
    # vLLM's names for the same settings, so its launch lines run as they are
    serve.add_argument("--kv-cache-dtype", metavar="DTYPE",
                       help="vLLM's name for --kv-format: auto (the model's own precision: f16), int8, f16, int4")
    serve.add_argument("--dtype", choices=tuple(VLLM_DTYPES), help="vLLM's name for the weights' precision: auto "
                       "(--weights model), bfloat16 (--weights bfloat16), float32 (--weights dense)")
    serve.add_argument("--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                       help="reuse the KV blocks of prompts seen before (default: on, off for models with state "
                            "layers)")
    serve.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                       help="a Jinja chat template (a file, or the template itself) in place of the tokenizer's")
    serve.add_argument("--tool-call-parser", choices=TOOL_PARSERS,
                       help="how tool calls are read from a model's output for tool_choice auto: hermes (Qwen 2.5/3, "
                            "Hermes, SmolLM3) or llama3_json (Llama 3.1+); needs --enable-auto-tool-choice")
    serve.add_argument("--kv-events-config", metavar="JSON",
                       help='publish the prefix cache\'s block events in vLLM\'s format for KV-aware routers, e.g. '
                            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (docs/serving.md)')
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let requests use tool_choice auto (the model decides; calls read by --tool-call-parser)")
    _common(serve)

    where = command(sub, "model-dir", "the transformers directory a model loads from (the packaged SmolLM2's: "
                    "converted from its GGUF on first use), for AutoModelForCausalLM.from_pretrained")
    where.add_argument("--model", help=MODEL_HELP)
    _common(where)

    cache = command(sub, "cache", "saved KV files")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    inspect = command(cache_sub, "inspect", "what a saved KV file holds")
    inspect.add_argument("path", help="a file written by int8kv.save_kv")
    inspect.add_argument("--json", metavar="PATH", help=JSON_HELP)
    _common(inspect)
    return parser


# -- demo ----------------------------------------------------------------------------------------------
def _formats(text: str) -> list[KvStorageFormat]:
    out = []
    for name in text.split(","):
        try:
            out.append(KvStorageFormat.parse(name.strip()))
        except ValueError:
            out.append(KvStorageFormat.from_dtype(name.strip()))
    return out


def _chat(tokenizer, prompt: str) -> list[int]:
    from .engine.chat import chat_prompt_ids

    if getattr(tokenizer, "chat_template", None):
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def _load(args: argparse.Namespace, engine: bool = True):
    """(model, tokenizer) of --model, with a line before and after: the first use of a GGUF converts it. For an
    engine, "model" weights run GGUF blocks packed (int8kv.models.packed); `int8kv eval` runs the model's own
    forward over whole chunks, where packed layers would only decode their weights to the same float32 values."""
    from .models import load_model

    progress.note(f"loading model {args.model or '(packaged SmolLM2-135M-Instruct)'} ...")
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, quiet=progress.is_quiet(), progress=progress.note, weights=args.weights)
    if engine or args.weights not in ("model", "dense"):
        from .models import convert_weights

        model = convert_weights(model, args.weights, inplace=True)
    progress.note(f"model loaded in {time.perf_counter() - start:.1f} s ({args.weights} weights)")
    return model, tokenizer


def _engine_weights(args: argparse.Namespace) -> str:
    """`LLM(weights=)` for a model `_load` made: "dense" keeps the loaded float Linear layers out of packing; any
    other choice was applied by `_load` already ("model" packed them, bfloat16 / int8 left no float Linear)."""
    return "dense" if args.weights == "dense" else "model"


def _check_memory_holds_a_block(args: argparse.Namespace, budget: int, fmt: KvStorageFormat, what: str) -> None:
    """Refuse --memory below one 16-token block of the model in ``fmt`` (the 4-bit format: one 64-position page
    next to the window pages and sink slots of the engine's worst step), reading only the model's config."""
    from .models import kv_dims, model_config

    config = model_config(args.model, progress=progress.note, quiet=progress.is_quiet())
    if fmt.is_stateful:
        from .cache.paged_q4w import plan_sizes
        from .cache.state import KvLayout

        blocks, _, _ = plan_sizes(budget, KvLayout(*kv_dims(config), fmt), args.max_num_seqs,
                                  args.max_num_batched_tokens)  # fmt: skip
        if blocks < 1:
            raise CliError(f"--memory {args.memory} holds no 64-position page of this model in {fmt.value} next to "
                           f"the window pages and sink slots of {args.max_num_seqs} sequences: {what}")
        return
    block = PagedKvCache.bytes_per_block(16, *kv_dims(config), fmt)
    if budget < block:
        name = fmt.as_str().split("_")[0].upper()
        raise CliError(f"--memory {args.memory} is smaller than one 16-token {name} block of this model "
                       f"({block:,} B): {what}")


def run_demo(args: argparse.Namespace) -> dict:
    check_minimums(args, {"max_tokens": 1})
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    budget = memory_budget(args.memory)
    formats = _formats(args.formats)
    _check_memory_holds_a_block(args, budget, INT8, "the capacity table counts whole blocks")
    store = None
    if args.kv_store:
        from .blockstore import open_block_store

        store = open_block_store(args.kv_store, namespace="int8kv-demo")  # a bad URL fails before the model loads
    try:
        return _demo(args, store, budget, formats)
    finally:
        if store is not None:
            store.close()


def _demo(args: argparse.Namespace, store: Any, budget: int, formats: list[KvStorageFormat]) -> dict:
    from .engine import LLM, SamplingParams
    from .models import kv_dims

    model, tokenizer = _load(args)
    dims = kv_dims(model.config)
    prompts = args.prompt or list(DEMO_PROMPTS)
    prompt_ids = [_chat(tokenizer, p) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    runs = {}
    for fmt in formats:
        name = fmt.as_str().split("_")[0].upper()
        kv_store = store  # block values, or the 4-bit format's page values (engine/store_tier.py)
        engine = dict(kv_format=fmt, memory="512MiB", tokenizer=tokenizer, max_num_seqs=len(prompts), kv_store=kv_store,
                      weights=_engine_weights(args), threads=args.threads)  # fmt: skip
        llm = LLM(model, **engine)
        progress.note(f"{name}: warming up (the first run compiles the kernels, cached afterwards) ...")
        llm.generate([prompt_ids[0][:8]], SamplingParams(max_tokens=2))  # compile kernels before timing
        start = time.perf_counter()
        outs = _generate_with_bar(llm, prompt_ids, params, f"{name}: generating")
        seconds = time.perf_counter() - start
        tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
        runs[fmt.as_str()] = {
            "texts": [o.text for o in outs],
            "token_ids": [o.token_ids for o in outs],
            "seconds": seconds,
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
            "kv_bytes": tokens * llm.kv_bytes_per_token(),
            "kv_bytes_per_token": llm.kv_bytes_per_token(),
        }
        if kv_store is not None:
            llm.flush_kv_store(timeout=30)
            fresh = LLM(model, **engine)  # an empty pool: the prompts' full blocks can only come from the store
            start = time.perf_counter()
            again = _generate_with_bar(fresh, prompt_ids, params, f"{name}: a fresh engine on the store")
            runs[fmt.as_str()]["store_rerun"] = {
                "seconds": time.perf_counter() - start,
                "prompt_tokens": sum(map(len, prompt_ids)),
                "store_hit_tokens": fresh.stats.store_hit_tokens,
                "pool_hit_tokens": fresh.stats.prefix_hit_tokens,
                "prefill_tokens": fresh.stats.prefill_tokens,
                "identical": [o.token_ids for o in again] == [o.token_ids for o in outs],
            }
    # The 4-bit format's figure is one sequence's stored form, F16 sinks and window included (KvLayout).
    capacity = {fmt.as_str(): PagedKvCache.tokens_for_memory(budget, *dims, fmt) for fmt in KvStorageFormat}
    name = os.path.basename(str(args.model).rstrip("/")) if args.model else "SmolLM2-135M-Instruct"
    return {"model": name, "prompts": prompts, "runs": runs, "kv_store": args.kv_store,
            "memory_budget": budget, "dims": dims, "capacity_tokens": capacity}


def _generate_with_bar(llm: Any, prompt_ids: list[list[int]], params: Any, desc: str) -> list:
    """`llm.generate`, its generated tokens counted on a progress bar after every step."""
    with progress.Bar(desc, total=len(prompt_ids) * params.max_tokens, unit="tok") as bar:
        first = llm.stats.generated_tokens
        return llm.generate(prompt_ids, params,
                            on_step=lambda stats: bar.update(stats.generated_tokens - first - bar.done))


def format_demo(result: dict) -> str:
    lines = []
    runs = result["runs"]
    names = list(runs)
    for i, prompt in enumerate(result["prompts"]):
        lines.append(f"\n> {prompt}")
        for name in names:
            lines.append(f"  [{name.split('_')[0]}] {runs[name]['texts'][i].strip()!r}")
    lines.append("")
    lines.append(f"{'format':<36}{'tok/s':>8}{'KV bytes':>12}{'B/token':>9}")
    for name in names:
        r = runs[name]
        lines.append(f"{name:<36}{r['tokens_per_s']:>8.1f}{r['kv_bytes']:>12,}{r['kv_bytes_per_token']:>9,}")
    if "f16" in runs and INT8.as_str() in runs:
        ratio = runs[INT8.as_str()]["kv_bytes"] / runs["f16"]["kv_bytes"]
        same = runs[INT8.as_str()]["token_ids"] == runs["f16"]["token_ids"]
        agree = [a == b for a, b in zip(runs[INT8.as_str()]["token_ids"], runs["f16"]["token_ids"], strict=True)]
        lines.append(f"INT8 / F16 KV bytes: {ratio:.3f}")
        lines.append(f"greedy outputs identical: {'yes' if same else 'no'} ({sum(agree)}/{len(agree)} prompts)")
    for name in names:
        rerun = runs[name].get("store_rerun")
        if rerun:
            lines.append(
                f"{name.split('_')[0]}: a fresh engine on {result['kv_store']} loaded {rerun['store_hit_tokens']} of "
                f"{rerun['prompt_tokens']} prompt tokens from the store, reused {rerun['pool_hit_tokens']} from its "
                f"own pool, prefilled {rerun['prefill_tokens']}, "
                f"{rerun['seconds']:.2f} s; outputs identical: {'yes' if rerun['identical'] else 'no'}"
            )
    gib = result["memory_budget"] / (1 << 30)
    lines.append(f"\ncontext that fits in {gib:g} GiB of KV memory (all layers, K and V):")
    for name, tokens in result["capacity_tokens"].items():
        lines.append(f"  {name:<36}{tokens:>14,} tokens")
    lines.append(_demo_summary(result))
    return "\n".join(lines)


def _demo_summary(result: dict) -> str:
    """What the demo's figures mean, in a few lines."""
    layers, heads, head_dim = result["dims"]
    runs, capacity = result["runs"], result["capacity_tokens"]
    lines = [
        "\nwhat these figures mean:",
        f"  B/token    bytes the KV cache stores per token: {layers} layers x {heads} KV heads x K and V x one row"
        f" of {head_dim} values (F16: {2 * head_dim} bytes a row; INT8: {head_dim} one-byte codes + a 4-byte scale)",
        "  KV bytes   B/token x the tokens these prompts and answers hold (prompt + generated)",
        f"  tok/s      generated tokens per second, {len(result['prompts'])} prompt(s) decoded together after a "
        "warm-up: a demo on a small model, not a benchmark (python -m int8kv.bench e2e measures decode speed)",
    ]
    if "f16" in runs and INT8.as_str() in runs:
        lines.append("  identical  whether INT8 storage changed any greedy (temperature 0) token against F16; a "
                     "long answer may part after a near-tie (docs/performance.md, Quality)")
    if "f16" in capacity and INT8.as_str() in capacity:
        more = capacity[INT8.as_str()] / capacity["f16"]
        lines.append(f"  fits       the same memory holds {more:.2f}x the tokens in INT8: longer contexts or more "
                     "requests at once")
    if "f16" in capacity and INT4_SINK_WINDOW_V1.name in capacity:
        more = capacity[INT4_SINK_WINDOW_V1.name] / capacity["f16"]
        lines.append(f"  4-bit      {more:.2f}x in {INT4_SINK_WINDOW_V1.name} (one sequence's stored form, F16 sinks "
                     "and window included): --formats f16,int8,int4 runs it in the engine; the transformers "
                     "drop-in and `int8kv eval --kv-format` take it too")
    return "\n".join(lines)


def plot_memory(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    dims = result["dims"]
    contexts = [2**k for k in range(9, 16)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    per = {"float32": 2 * dims[0] * dims[1] * dims[2] * 4}
    per.update({f.as_str().split("_")[0]: f.bytes_per_token(*dims) for f in KvStorageFormat})
    for name, bpt in per.items():
        ax.plot(contexts, [c * bpt / 2**20 for c in contexts], marker="o", label=f"{name} ({bpt:,} B/token)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("context length (tokens, one sequence)")
    ax.set_ylabel("KV cache (MiB)")
    ax.set_title(f"KV memory per sequence, {result['model']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- eval ----------------------------------------------------------------------------------------------
def run_eval(args: argparse.Namespace) -> dict:
    from .eval import DEFAULT_PROMPTS, MIN_CTX, cache_kinds, evaluate, read_text

    check_minimums(args, {"ctx": MIN_CTX, "chunk": 1, "windows": 1, "gen_tokens": 1, "prompts": 0})
    if args.prompts > len(DEFAULT_PROMPTS):
        raise CliError(f"--prompts must be in [0, {len(DEFAULT_PROMPTS)}] (0: no greedy run), got {args.prompts}")
    formats = None
    if args.kv_format is not None:
        from .hf.cache import resolve_format

        try:
            formats = [resolve_format(name.strip()) for name in args.kv_format.split(",")]
        except ValueError as exc:
            raise CliError(f"--kv-format: {exc}") from None
    text = read_text(args.text)
    model, tokenizer = _load(args, engine=False)
    result = evaluate(
        model, tokenizer, text, ctx=args.ctx, chunk=args.chunk, max_windows=args.windows,
        gen_tokens=args.gen_tokens, prompts=DEFAULT_PROMPTS[: args.prompts],
        kinds=cache_kinds(bool(args.fp8), formats),
    )
    return {"weights": args.weights, **result}


def plot_eval(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = [r["cache"] for r in rows]
    change = [100 * r["ppl_change_vs_baseline"] for r in rows]
    bars = ax.bar(range(len(rows)), change, color=["#888", "#4c72b0", "#55a868", "#c44e52", "#8172b2"][: len(rows)])
    for bar, r in zip(bars, rows, strict=True):
        ax.annotate(f"{100 * r['ppl_change_vs_baseline']:+.3f}%\n{r['kv_bytes_per_token']:,.0f} B/tok",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom" if bar.get_height() >= 0 else "top", fontsize=8)
    ax.set_xticks(range(len(rows)), [n.replace(" (baseline)", "\n(baseline)") for n in names], fontsize=8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("perplexity change vs float32 cache (%)")
    ax.set_title(f"KV storage quality ({result['scored_tokens']} scored tokens)")
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- serve ---------------------------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    import inspect

    from .engine import LLM

    check_minimums(args, {"port": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1, "max_queue": 0,
                          "max_tokens": 1})
    if args.max_model_len is not None and args.max_model_len < 1:
        raise CliError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    if args.model_path and args.model and args.model_path != args.model:
        raise CliError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    args.model = args.model or args.model_path
    if args.port > 65535:
        raise CliError(f"--port must be <= 65535, got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise CliError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    _vllm_names(args)
    fmt = _formats(args.kv_format)
    if len(fmt) != 1:
        raise CliError(f"--kv-format takes one format, got {args.kv_format!r}")
    template = _chat_template(args.chat_template) if args.chat_template is not None else None
    events = None
    if args.kv_events_config is not None:
        from .engine.kv_events import KvEventsConfig

        events = KvEventsConfig.parse(args.kv_events_config)  # before the model loads
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise CliError("--enable-auto-tool-choice and --tool-call-parser go together: auto tool choice reads calls "
                       "with the parser")
    _check_memory_holds_a_block(args, memory_budget(args.memory), fmt[0], "the KV pool would hold no block")
    extra: dict[str, Any] = {} if events is None else {"kv_events_config": events}
    if args.kv_store:
        if "kv_store" not in inspect.signature(LLM).parameters:
            raise CliError("--kv-store needs an engine with a shared KV block store (LLM(kv_store=...)), "
                           "which this build does not have")
        extra["kv_store"] = args.kv_store
        if args.prefix_caching is False:
            raise CliError("--kv-store shares prefix blocks, which needs prefix caching: drop "
                           "--no-enable-prefix-caching")
    if args.prefix_caching is not None:
        extra["prefix_caching"] = args.prefix_caching
    if args.kv_store_secret is not None:
        if not args.kv_store:
            raise CliError("--kv-store-secret needs --kv-store")
        from .blockstore import check_secret

        try:
            check_secret(args.kv_store_secret)  # before the model loads
        except ValueError as exc:
            raise CliError(f"--kv-store-secret: {exc}") from None
        extra["kv_store_secret"] = args.kv_store_secret
    key = _api_key(args)  # before the port is bound and the model loads
    from .server import Limits, serve
    from .server.run import bind

    sock = bind(args.host, args.port)  # a port already taken fails now, not after the model has loaded
    model, tokenizer = _load(args)
    if template is not None:
        tokenizer.chat_template = template
    llm = LLM(model, kv_format=fmt[0], memory=args.memory, tokenizer=tokenizer, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, weights=_engine_weights(args), threads=args.threads,
              **extra)
    name = args.served_model_name or (
        os.path.basename(str(args.model).rstrip("/")) if args.model else "SmolLM2-135M-Instruct")
    limits = Limits(max_tokens=args.max_tokens, max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout,
                    max_model_len=args.max_model_len)
    return serve(llm, name, args.host, args.port, limits, log_level="debug" if args.debug else "warning",
                 api_key=key, sock=sock, kv_store=args.kv_store, log_requests=not args.no_log_requests,
                 tool_parser=args.tool_call_parser)


def _vllm_names(args: argparse.Namespace) -> None:
    """Fold vLLM's --kv-cache-dtype and --dtype into --kv-format and --weights (CliError when both name a value
    and they differ)."""
    if args.kv_cache_dtype is not None:
        value = args.kv_cache_dtype.strip().lower()
        if value.startswith("fp8"):
            raise CliError(f"--kv-cache-dtype {args.kv_cache_dtype}: fp8 KV caches are not supported; int8 (the "
                           "default) is int8kv's 8-bit format")
        value = "f16" if value == "auto" else value
        if args.kv_format is not None and _formats(args.kv_format) != _formats(value):
            raise CliError(f"--kv-cache-dtype {args.kv_cache_dtype} and --kv-format {args.kv_format} disagree; "
                           "give one")
        args.kv_format = value
    args.kv_format = args.kv_format or "int8"
    if args.dtype is not None:
        weights = VLLM_DTYPES[args.dtype]
        if args.weights is not None and args.weights != weights:
            raise CliError(f"--dtype {args.dtype} is --weights {weights}, and --weights {args.weights} was given; "
                           "give one")
        args.weights = weights
    args.weights = args.weights or "model"


def _chat_template(value: str) -> str:
    """--chat-template's text: the file it names, else the value itself when it reads as a Jinja template;
    checked for Jinja syntax before the model loads."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise CliError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise CliError(f"--chat-template: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return text


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $INT8KV_API_KEY (not a parser default: --help would show it), else None. A key given
    empty or blank is refused: read as "no key" it served every route to anyone."""
    from .server.app import check_api_key

    key, where = args.api_key, "--api-key"
    if key is None:
        key, where = os.environ.get("INT8KV_API_KEY"), "$INT8KV_API_KEY"
    if key is None:
        return None
    try:
        return check_api_key(key)
    except ValueError as exc:
        raise CliError(f"{where}: {exc}") from None


# -- entry point -----------------------------------------------------------------------------------------
def _dispatch(args: argparse.Namespace, extra: list[str]) -> int | None:
    if extra:
        _foreign(extra, args.command)
    check_outputs(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "model-dir":
        from .models import model_dir

        print(model_dir(args.model, progress=progress.note))
        return 0
    if args.command == "demo":
        result = run_demo(args)
        print(format_demo(result))
        if args.plot:
            plot_memory(result, args.plot)
    elif args.command == "eval":
        result = run_eval(args)
        from .eval import format_eval

        print(f"weights: {result['weights']}\n{format_eval(result)}")
        if args.plot:
            plot_eval(result, args.plot)
    else:
        from .store import format_inspect, inspect_kv

        result = inspect_kv(args.path)
        print(format_inspect(result))
    write_json(getattr(args, "json", None), result)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench.__main__ import main as bench_main

        flags = [flag for flag in COMMON_FLAGS if getattr(args, flag.lstrip("-"))]
        return bench_main([args.name, *extra, *args.options, *flags])
    progress.set_quiet(args.quiet)
    return report_errors(lambda: _dispatch(args, extra), args.debug)


if __name__ == "__main__":
    sys.exit(main())
