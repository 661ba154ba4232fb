"""A GGUF model file on the int8kv engine against llama.cpp: decode, prefill, peak memory and load time.

    python -m int8kv.bench gguf --model FILE.gguf [--contexts 512,4096] [--prefill 512] [--new-tokens 16]
                                [--repeat 3] [--threads N] [--json PATH]

Each peer runs in a process of its own (started here, one at a time, taking turns per repetition), so its peak
resident memory (getrusage's ru_maxrss: weights, caches and everything else the process touched) and its load
time are its own:
  int8kv      the engine (`LLM(FILE)`: the file's blocks kept as they are, INT8 KV cache, default attention), on
              `--threads` threads, prefix caching off (every prefill is computed)
  llama.cpp   llama-cpp-python (the `peers` extra) over the same file, F16 K and V cache, flash attention on, the
              same threads
Both get the same token ids (drawn from the file's vocabulary with a fixed seed: the benchmark measures speed,
not text). Figures: load seconds (file to ready), prefill tokens/s over `--prefill` tokens, decode ms per token at
each context (median of `--new-tokens` steps after a prefill of that many tokens), peak RSS; the ratios are
int8kv's over llama.cpp's (below 1 is faster / smaller for times and memory, above 1 faster for prefill).
Without llama_cpp installed only int8kv runs, with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..cli_common import CliError, bench_parser, check_minimums
from ..cpu_budget import available_cpus
from ..progress import note
from .timing import emit

PEERS = ("int8kv", "llama.cpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("gguf", __doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a .gguf model file")
    parser.add_argument("--contexts", default="512,4096", help="comma-separated contexts for the decode figures")
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the timed prefill")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each peer (medians)")
    parser.add_argument("--threads", type=int, default=available_cpus(), help="threads of both peers")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)  # one peer's run, in its own process
    args = parser.parse_args(argv)
    check_minimums(args, {"prefill": 1, "new_tokens": 2, "repeat": 1, "threads": 1})
    path = Path(args.model)
    if not path.is_file():
        raise CliError(f"--model {args.model}: no such file")
    try:
        args.contexts = sorted({int(c) for c in args.contexts.split(",")})
    except ValueError:
        raise CliError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
    if args.contexts[0] < 1:
        raise CliError("--contexts must be >= 1")
    args.peers = [p.strip() for p in args.peers.split(",")]
    if any(p not in PEERS for p in args.peers) or len(set(args.peers)) != len(args.peers):
        raise CliError(f"--peers takes distinct names of {', '.join(PEERS)}, got {','.join(args.peers)!r}")
    return args


def _token_ids(reader, path: str, count: int) -> list[int]:
    """``count`` token ids drawn from the file's vocabulary (a fixed seed), skipping its first 16 (control ids)."""
    import numpy as np

    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise CliError(f"{path} has no tokenizer.ggml.tokens: cannot draw token ids")
    vocab = len(field.data)
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(16, vocab, size=count)]


def _run_int8kv(args: argparse.Namespace, ids: list[int], reader) -> dict:
    from ..engine import LLM, EngineStats, SamplingParams

    longest = max(max(args.contexts), args.prefill) + args.new_tokens + 64
    start = time.perf_counter()
    llm = LLM(args.model, memory=_kv_budget(reader, longest), max_num_seqs=1, max_num_batched_tokens=512,
              prefix_caching=False, threads=args.threads)  # fmt: skip
    load_s = time.perf_counter() - start
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([ids[:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # compile / load the kernels
    start = time.perf_counter()
    llm.generate([ids[: args.prefill]], one)
    prefill_s = time.perf_counter() - start
    decode = {}
    for context in args.contexts:
        llm.stats = EngineStats()
        llm.generate([ids[:context]], SamplingParams(max_tokens=args.new_tokens + 1, ignore_eos=True))
        decode[context] = 1e3 / llm.stats.decode_tokens_per_s
    return {"load_s": load_s, "prefill_tok_s": args.prefill / prefill_s, "decode_ms": decode,
            "weights": type(llm.model).__name__}


def _kv_budget(reader, tokens: int) -> int:
    """An INT8 pool for ``tokens`` tokens of the file's model (its layers, KV heads and head size)."""
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def value(key: str) -> int:
        field = reader.fields[f"{arch}.{key}"]
        return int(field.parts[field.data[0]][0])

    layers, kv_heads = value("block_count"), value("attention.head_count_kv")
    head_dim = value("embedding_length") // value("attention.head_count")
    per_token = layers * 2 * kv_heads * (head_dim + 4)  # INT8 codes and one float32 scale per (token, KV head)
    return max(64 << 20, int(1.25 * tokens * per_token) + (16 << 20))


def _run_llama(args: argparse.Namespace, ids: list[int]) -> dict:
    from .slope import open_llama

    longest = max(max(args.contexts), args.prefill) + args.new_tokens + 16
    start = time.perf_counter()
    llm = open_llama(args.model, longest, args.threads)
    load_s = time.perf_counter() - start
    llm.eval(ids[:16])  # the first eval allocates its buffers
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids[: args.prefill])
    prefill_s = time.perf_counter() - start
    decode = {}
    for context in args.contexts:
        llm.reset()
        llm.eval(ids[:context])
        token, stamps = ids[context], [time.perf_counter()]
        for _ in range(args.new_tokens):
            llm.eval([token])
            stamps.append(time.perf_counter())
        decode[context] = 1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return {"load_s": load_s, "prefill_tok_s": args.prefill / prefill_s, "decode_ms": decode}


def _child(args: argparse.Namespace) -> None:
    import gguf

    reader = gguf.GGUFReader(args.model)  # parsed once: the token ids and the pool's size both read it
    ids = _token_ids(reader, args.model, max(max(args.contexts), args.prefill) + 1)
    out = _run_int8kv(args, ids, reader) if args.child == "int8kv" else _run_llama(args, ids)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print("RESULT " + json.dumps(out), flush=True)


def _one(args: argparse.Namespace, peer: str) -> dict:
    argv = [sys.executable, "-m", "int8kv.bench", "gguf", "--quiet", "--model", args.model, "--child", peer,
            "--contexts", ",".join(map(str, args.contexts)), "--prefill", str(args.prefill),
            "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, stdin=subprocess.DEVNULL)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise CliError(f"the {peer} run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    row = json.loads(lines[-1][len("RESULT "):])
    row["decode_ms"] = {int(k): v for k, v in row["decode_ms"].items()}
    return row


def run(args: argparse.Namespace) -> dict:
    peers = list(args.peers)
    llama_note = None
    if "llama.cpp" in peers:
        try:
            import llama_cpp
        except ImportError:
            peers.remove("llama.cpp")
            llama_note = "llama_cpp not installed (pip install int8kv[peers])"
        else:
            llama_note = f"llama-cpp-python {llama_cpp.__version__}"
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for rep in range(args.repeat):  # the peers take turns: the machine's drift reaches both alike
        for peer in peers:
            note(f"gguf: run {rep + 1}/{args.repeat}, {peer}")
            runs[peer].append(_one(args, peer))
    results = {}
    for peer, rows in runs.items():
        results[peer] = {
            "load_s": statistics.median(r["load_s"] for r in rows),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rows),
            "decode_ms": {c: statistics.median(r["decode_ms"][c] for r in rows) for c in args.contexts},
            "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in rows),
            "runs": rows,
        }
    ratios = None
    if "int8kv" in results and "llama.cpp" in results:
        a, b = results["int8kv"], results["llama.cpp"]
        ratios = {
            "decode_ms": {c: a["decode_ms"][c] / b["decode_ms"][c] for c in args.contexts},
            "prefill_tok_s": a["prefill_tok_s"] / b["prefill_tok_s"],
            "peak_rss": a["peak_rss_bytes"] / b["peak_rss_bytes"],
            "load_s": a["load_s"] / b["load_s"],
        }
    return {
        "benchmark": "gguf_model_vs_llama_cpp",
        "model": os.path.basename(args.model),
        "model_bytes": os.path.getsize(args.model),
        "contexts": args.contexts,
        "prefill": args.prefill,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "threads": args.threads,
        "llama_cpp": llama_note,
        "load_average": os.getloadavg(),
        "results": results,
        "int8kv_over_llama_cpp": ratios,
    }


def report(result: dict) -> str:
    ctx = result["contexts"]
    lines = [f"{result['model']} ({result['model_bytes'] / 2**30:.2f} GiB), {result['threads']} threads, median of "
             f"{result['repeat']}; llama.cpp: {result['llama_cpp']}",
             f"{'peer':<12}" + "".join(f"{f'ms/tok @{c}':>13}" for c in ctx)
             + f"{'prefill tok/s':>15}{'peak RSS GiB':>14}{'load s':>9}"]  # fmt: skip
    for peer, r in result["results"].items():
        lines.append(f"{peer:<12}" + "".join(f"{r['decode_ms'][c]:>13.1f}" for c in ctx)
                     + f"{r['prefill_tok_s']:>15.1f}{r['peak_rss_bytes'] / 2**30:>14.2f}{r['load_s']:>9.2f}")
    q = result["int8kv_over_llama_cpp"]
    if q:
        lines.append(f"{'int8kv / llama.cpp':<12}" + "".join(f"{q['decode_ms'][c]:>12.2f}x" for c in ctx)
                     + f"{q['prefill_tok_s']:>14.2f}x{q['peak_rss']:>13.2f}x{q['load_s']:>8.2f}x")
    lines.append("ms/tok: decode ms per token after a prefill of that many tokens (lower is faster); prefill tok/s: "
                 "higher is faster; peak RSS: the process's resident peak (weights mapped from the file count once "
                 "touched)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        _child(args)
        return None
    result = run(args)
    return emit(result, report(result), args.json)
