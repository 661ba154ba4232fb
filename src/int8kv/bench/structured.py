"""What a structured output costs per decode step: the engine with and without a JSON-schema grammar, same run.

    python -m int8kv.bench structured [--batch 16] [--new-tokens 32] [--repeat 3] [--json PATH]

Peers, on the packaged SmolLM2 at batch `--batch`, every request the same license-text prompt, greedy:
  free      no grammar
  json      each request held to a JSON schema (an object with one string of at least 400 characters, so no
            request can end before `--new-tokens`: every step decodes the whole batch)
The peers take turns per repetition; the figure is the median decode tokens/s (EngineStats.decode_tokens_per_s:
the steps in which the whole batch decodes). Printed: each peer, and the json peer's extra time per step as a
share of the free one's.
"""

from __future__ import annotations

import argparse
import os
import statistics

from ..cli_common import CliError, bench_parser, check_minimums
from ..progress import note
from .timing import emit

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400}}, "required": ["story"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("structured", __doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="requests decoded together")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (at most 100)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per peer (median)")
    args = parser.parse_args(argv)
    check_minimums(args, {"batch": 1, "new_tokens": 4, "repeat": 1})
    if args.new_tokens > 100:  # 400 characters of string take more than 100 tokens, so none ends early
        raise CliError(f"--new-tokens must be <= 100, got {args.new_tokens}")
    return args


def run(args: argparse.Namespace) -> dict:
    from ..engine import LLM, EngineStats, Guide, SamplingParams
    from ..eval import read_text
    from ..models import load_model

    model, tokenizer = load_model(None)
    ids = tokenizer(read_text(None))["input_ids"][:64]
    llm = LLM(model, memory="256MiB", max_num_seqs=args.batch, tokenizer=tokenizer)
    peers = {"free": None, "json": Guide.json_schema(SCHEMA)}

    def decode(guide: Guide | None, tokens: int) -> float:
        llm.stats = EngineStats()
        params = SamplingParams(max_tokens=tokens, ignore_eos=guide is None, guide=guide)
        outs = llm.generate([ids] * args.batch, params)
        if any(len(o.token_ids) != tokens for o in outs):
            raise RuntimeError("a request ended early: the step would not decode the whole batch")
        return llm.stats.decode_tokens_per_s

    for name, guide in peers.items():  # kernels compiled, the grammar compiled, outside the timings
        note(f"structured: warming {name}")
        decode(guide, 4)
    runs: dict[str, list[float]] = {name: [] for name in peers}
    for rep in range(args.repeat):
        for name, guide in peers.items():
            note(f"structured: run {rep + 1}/{args.repeat}, {name}")
            runs[name].append(decode(guide, args.new_tokens))
    tok_s = {name: statistics.median(v) for name, v in runs.items()}
    step_ms = {name: 1e3 * args.batch / v for name, v in tok_s.items()}
    return {
        "benchmark": "structured_output_overhead",
        "model": "SmolLM2-135M-Instruct (packaged)",
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "machine_cpus": os.cpu_count(),
        "tok_s": tok_s,
        "runs": runs,
        "step_ms": step_ms,
        "json_overhead_per_step": step_ms["json"] / step_ms["free"] - 1,
    }


def report(result: dict) -> str:
    lines = [f"decode at batch {result['batch']}, SmolLM2, {result['new_tokens']} new tokens, median of "
             f"{result['repeat']}"]
    for name in result["tok_s"]:
        lines.append(f"   {name:<6}{result['tok_s'][name]:>9.1f} tok/s {result['step_ms'][name]:>8.2f} ms a step")
    lines.append(f"   json's extra time a step: {100 * result['json_overhead_per_step']:+.1f} % of free's")
    lines.append("free: no grammar; json: every request held to a JSON schema (the mask filled, applied and advanced "
                 "each step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    return emit(result, report(result), args.json)
