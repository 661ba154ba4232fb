"""The server as users see it: `int8kv serve` driven by the openai client, against the offline engine.

    python -m int8kv.bench serve [--clients 1,4,16] [--requests-per-client 2] [--prompt-tokens 64]
        [--max-tokens 32] [--memory 256MiB] [--capacity-memory 24MiB] [--model PATH] [--json PATH]

1. Throughput: for each client count c, c threads each stream `--requests-per-client` completions (seeded random
   token-id prompts, greedy, ignore_eos so every request yields exactly --max-tokens tokens) from a live server
   (a child process on a loopback port, --max-num-seqs = the largest c). Reported: time to first token p50/p99
   (client side: request sent to first text chunk) and output tokens/s (all completion tokens over wall time).
   The anchor: the same prompts through the offline engine (`LLM.generate`, at most c at once) in this process,
   on a thread of its own as in the server (see `_in_thread`).
2. Capacity at one memory budget, INT8 against F16: a server per format with --capacity-memory of KV pool; from
   its block count, the number of requests (--capacity-prompt + --capacity-tokens tokens each) that fit at once.
   That many clients are sent together (preemptions must stay 0, peak running is sampled from /metrics), then
   one more (which must wait or preempt); the throughput of the first run is reported.
"""

from __future__ import annotations

import math
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..cli_common import bench_parser
from ..progress import note
from .timing import emit

INT8, F16 = "int8", "f16"


def _prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from the lower part of the vocabulary: ordinary word pieces in SmolLM2's BPE, no special tokens.
    return torch.randint(100, min(vocab, 40000), (n, tokens), generator=gen).tolist()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _drive(base: str, model: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict[str, Any]:
    """`clients` threads stream `prompts` (each taken by the next free thread); TTFTs, tokens and wall time."""
    import openai

    work: queue.SimpleQueue = queue.SimpleQueue()
    for p in prompts:
        work.put(p)
    ttfts: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        while True:
            try:
                prompt = work.get_nowait()
            except queue.Empty:
                return
            sent, first, used = time.perf_counter(), None, 0
            try:
                stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.perf_counter() - sent
                    if chunk.usage is not None:
                        used = chunk.usage.completion_tokens
            except openai.APIError as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                tokens.append(used)
                if first is not None:
                    ttfts.append(first)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": len(prompts), "completed": len(tokens), "errors": errors,
            "output_tokens": sum(tokens), "seconds": wall, "output_tokens_per_s": sum(tokens) / wall,
            "ttft_p50_s": _percentile(ttfts, 0.5), "ttft_p99_s": _percentile(ttfts, 0.99)}


def _server(model_path: str | None, log_dir: str, name: str, *args: str):
    from ..server.launch import LocalServer

    model_args = ["--model", model_path] if model_path else []
    return LocalServer(*model_args, "--served-model-name", "bench", *args, log_path=Path(log_dir) / f"{name}.log")


def _throughput(model_path: str | None, levels: list[int], per_client: int, prompt_tokens: int, max_tokens: int,
                memory: str, vocab: int, log_dir: str) -> tuple[list[dict], list[list[list[int]]], int]:
    rows = []
    level_prompts = [_prompts(c * per_client, prompt_tokens, vocab, seed=c) for c in levels]
    note("server: starting")
    server = _server(model_path, log_dir, "throughput", "--memory", memory, "--max-num-seqs", str(max(levels)),
                     "--max-queue", "4096", "--max-tokens", str(max_tokens))
    try:
        _drive(server.base, "bench", level_prompts[0][:1], 1, 4)  # compile kernels, fill caches
        for c, prompts in zip(levels, level_prompts, strict=True):
            note(f"server: {c} client(s)")
            rows.append(_drive(server.base, "bench", prompts, c, max_tokens))
    finally:
        status = server.stop()
    return rows, level_prompts, status


def _in_thread(fn: Any) -> Any:
    """fn() on a fresh thread, as the server steps its engine. Measured on this shared 2-core machine (load ~12):
    32 tokens of the tiny test model took 0.065 s on a fresh thread but 0.9-2.9 s on the main thread, where
    torch's two intra-op threads wait for a busy core at every op (0.09 s there with torch.set_num_threads(1))."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _offline(model_path: str | None, levels: list[int], level_prompts: list, max_tokens: int, memory: str) -> list:
    from ..engine import LLM, SamplingParams
    from ..models import load_model

    model, tokenizer = load_model(model_path, quiet=True)
    llm = LLM(model, memory=memory, tokenizer=tokenizer, max_num_seqs=max(levels))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    _in_thread(lambda: llm.generate([level_prompts[0][0]], SamplingParams(max_tokens=4)))
    rows = []
    for c, prompts in zip(levels, level_prompts, strict=True):
        llm.scheduler.max_num_seqs = c  # as many at once as the server had clients
        note(f"offline: {c} at once")
        start = time.perf_counter()
        outs = _in_thread(lambda prompts=prompts: llm.generate(prompts, params))
        wall = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append({"max_num_seqs": c, "requests": len(prompts), "output_tokens": tokens, "seconds": wall,
                     "output_tokens_per_s": tokens / wall})
    return rows


def _capacity(model_path: str | None, memory: str, prompt_tokens: int, new_tokens: int, vocab: int,
              log_dir: str) -> dict[str, dict]:
    from ..server.launch import read_metric

    out = {}
    for fmt in (INT8, F16):
        note(f"capacity: {fmt} server")
        server = _server(model_path, log_dir, f"capacity-{fmt}", "--memory", memory, "--kv-format", fmt,
                         "--max-num-seqs", "256", "--max-queue", "4096", "--max-tokens", str(new_tokens))
        try:
            blocks = int(read_metric(server.base, "int8kv_kv_blocks_total"))
            per_request = math.ceil((prompt_tokens + new_tokens) / 16)
            fits = blocks // per_request
            _drive(server.base, "bench", _prompts(1, 8, vocab, seed=99), 1, 2)
            runs = []
            for n in (fits, fits + 1):
                peak = [0.0]
                done = threading.Event()

                def sample(peak: list[float] = peak, done: threading.Event = done, base: str = server.base) -> None:
                    while not done.is_set():
                        peak[0] = max(peak[0], read_metric(base, "int8kv_requests_running"))
                        done.wait(0.05)

                before = read_metric(server.base, "int8kv_preemptions_total")
                sampler = threading.Thread(target=sample)
                sampler.start()
                note(f"capacity: {fmt}, {n} clients")
                row = _drive(server.base, "bench", _prompts(n, prompt_tokens, vocab, seed=n), n, new_tokens)
                done.set()
                sampler.join()
                row["preemptions"] = int(read_metric(server.base, "int8kv_preemptions_total") - before)
                row["peak_running_sampled"] = int(peak[0])
                runs.append(row)
            out[fmt] = {"kv_blocks": blocks, "blocks_per_request": per_request, "requests_that_fit": fits,
                        "kv_bytes_per_token": int(read_metric(server.base, "int8kv_kv_bytes_per_token")),
                        "at_fit": runs[0], "one_more": runs[1]}
        finally:
            server.stop()
    return out


def run(model_path: str | None = None, levels: tuple[int, ...] = (1, 4, 16), per_client: int = 2,
        prompt_tokens: int = 64, max_tokens: int = 32, memory: str = "256MiB", capacity_memory: str = "24MiB",
        capacity_prompt: int = 64, capacity_tokens: int = 64) -> dict:
    from ..models import load_model

    vocab = int(load_model(model_path, quiet=True)[0].config.vocab_size)
    with tempfile.TemporaryDirectory() as log_dir:
        server_rows, level_prompts, status = _throughput(model_path, list(levels), per_client, prompt_tokens,
                                                         max_tokens, memory, vocab, log_dir)
        offline_rows = _offline(model_path, list(levels), level_prompts, max_tokens, memory)
        capacity = _capacity(model_path, capacity_memory, capacity_prompt, capacity_tokens, vocab, log_dir)
    for s, o in zip(server_rows, offline_rows, strict=True):
        s["vs_offline"] = s["output_tokens_per_s"] / o["output_tokens_per_s"]
    ratio = capacity[INT8]["requests_that_fit"] / max(1, capacity[F16]["requests_that_fit"])
    return {"model": model_path or "SmolLM2-135M-Instruct (packaged)", "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "memory": memory, "server": server_rows, "offline": offline_rows,
            "server_exit_status": status, "capacity_memory": capacity_memory, "capacity_prompt": capacity_prompt,
            "capacity_tokens": capacity_tokens, "capacity": capacity, "int8_over_f16_requests": ratio}


def report(r: dict) -> str:
    lines = [f"server vs offline engine, {r['model']}: {r['prompt_tokens']}-token prompts, {r['max_tokens']} new "
             f"tokens each, greedy, KV pool {r['memory']}",
             f"{'clients':>8}{'requests':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'server tok/s':>14}"
             f"{'offline tok/s':>15}{'ratio':>7}"]
    for s, o in zip(r["server"], r["offline"], strict=True):
        lines.append(f"{s['clients']:>8}{s['requests']:>10}{s['ttft_p50_s']:>9.3f}s{s['ttft_p99_s']:>9.3f}s"
                     f"{s['output_tokens_per_s']:>14.1f}{o['output_tokens_per_s']:>15.1f}{s['vs_offline']:>7.2f}")
        if s["errors"]:
            lines.append(f"         {len(s['errors'])} error(s), first: {s['errors'][0]}")
    lines.append(f"server exit status after SIGTERM: {r['server_exit_status']}")
    lines.append(f"\nat {r['capacity_memory']} of KV pool, requests of {r['capacity_prompt']} + "
                 f"{r['capacity_tokens']} tokens:")
    lines.append(f"{'format':>8}{'B/token':>9}{'blocks':>8}{'fit':>5}{'preempt':>9}{'peak run':>10}{'tok/s':>8}"
                 f"{'  +1 client: preempt / peak run':>33}")
    for fmt, c in r["capacity"].items():
        a, b = c["at_fit"], c["one_more"]
        lines.append(f"{fmt:>8}{c['kv_bytes_per_token']:>9,}{c['kv_blocks']:>8}{c['requests_that_fit']:>5}"
                     f"{a['preemptions']:>9}{a['peak_running_sampled']:>10}{a['output_tokens_per_s']:>8.1f}"
                     f"{b['preemptions']:>19} / {b['peak_running_sampled']}")
    lines.append(f"INT8 holds {r['int8_over_f16_requests']:.2f}x the concurrent requests of F16")
    return "\n".join(lines)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise ValueError(f"--clients takes positive integers separated by commas, got {text!r}")
    return levels


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("serve", __doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,4,16", help="concurrent client counts, comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (random token ids)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--memory", default="256MiB", help="KV pool of the throughput server")
    parser.add_argument("--capacity-memory", default="24MiB", help="KV pool of the INT8-vs-F16 capacity servers")
    parser.add_argument("--capacity-prompt", type=int, default=64, help="prompt tokens per capacity request")
    parser.add_argument("--capacity-tokens", type=int, default=64, help="new tokens per capacity request")
    parser.add_argument("--model", metavar="PATH", default=None, help="model (default: packaged SmolLM2-135M)")
    args = parser.parse_args(argv)
    try:
        levels = _levels(args.clients)
    except ValueError as e:
        parser.error(str(e))
    for name in ("requests_per_client", "prompt_tokens", "max_tokens", "capacity_prompt", "capacity_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    from ..cli_common import memory_budget

    memory_budget(args.memory)
    memory_budget(args.capacity_memory, "--capacity-memory")
    result = run(args.model, levels, args.requests_per_client, args.prompt_tokens, args.max_tokens, args.memory,
                 args.capacity_memory, args.capacity_prompt, args.capacity_tokens)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
