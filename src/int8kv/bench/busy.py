"""Decode speed on a busy machine: the engine's own thread choice against fixed thread counts, same load.

    python -m int8kv.bench busy [--loads 0,2] [--context 512] [--new-tokens 48] [--repeat 3] [--json PATH]

For each load level, that many CPU-bound processes (a Python busy loop each, started here, stopped by their pid
at the end and bounded in time by themselves) run beside the benchmark. Under each load every peer prefills the
same `--context` tokens of the license texts and decodes `--new-tokens` tokens at batch 1, the peers taking turns
per repetition; the figure is the median decode tokens/s. Peers, for INT8 (the default precision) and F16:
  threads=1       every step on one thread
  threads=N       every step on the N CPUs the process may use (affinity, cgroup quota)
  auto            the engine's default: one or N per step, whichever it measures faster (engine/step_threads.py)
Ratios printed: auto against the better fixed count under the same load, and INT8 auto against F16 auto.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from ..cli_common import CliError, bench_parser, check_minimums
from ..cpu_budget import available_cpus
from ..formats import KvStorageFormat
from ..progress import note
from .timing import emit

_SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("busy", __doc__.split("\n")[0])
    parser.add_argument("--loads", default=f"0,{available_cpus()}",
                        help="comma-separated counts of CPU-bound processes run beside it (default: 0 and one per CPU)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=int, default=48, help="decode steps per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per peer and load (median)")
    args = parser.parse_args(argv)
    check_minimums(args, {"context": 1, "new_tokens": 8, "repeat": 1})
    try:
        args.loads = [int(x) for x in args.loads.split(",")]
    except ValueError:
        raise CliError(f"--loads must be comma-separated integers, got {args.loads!r}") from None
    if any(n < 0 or n > 64 for n in args.loads):
        raise CliError("--loads takes counts from 0 to 64")
    return args


def _start_load(count: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds)], stdin=subprocess.DEVNULL)
            for _ in range(count)]


def _stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)


def run(args: argparse.Namespace) -> dict:
    from ..engine import LLM, EngineStats, SamplingParams
    from ..eval import read_text
    from ..models import load_model

    model, tokenizer = load_model(None)
    ids = tokenizer(read_text(None))["input_ids"][: args.context]
    if len(ids) < args.context:
        raise CliError(f"the default text has only {len(ids)} tokens; use a smaller --context")
    cpus = available_cpus()
    counts = {"threads=1": 1, f"threads={cpus}": cpus, "auto": None} if cpus > 1 else {"threads=1": 1}
    formats = {"int8": KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, "f16": KvStorageFormat.F16}
    engines = {}
    for fname, fmt in formats.items():
        for tname, threads in counts.items():
            engines[f"{fname} {tname}"] = LLM(model, kv_format=fmt, memory="64MiB", max_num_seqs=1,
                                              tokenizer=tokenizer, threads=threads)  # fmt: skip
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    def decode(llm) -> float:
        llm.stats = EngineStats()
        llm.generate([ids], params)
        return llm.stats.decode_tokens_per_s

    for name, llm in engines.items():  # compile and load every kernel outside the timings
        note(f"busy: warming {name}")
        llm.generate([ids[:64]], SamplingParams(max_tokens=8, ignore_eos=True))
    results = {}
    for load in args.loads:
        procs = _start_load(load, seconds=600.0)
        try:
            time.sleep(0.5 if load else 0.0)  # the spinners running before the first timing
            loadavg_before = os.getloadavg()
            samples: dict[str, list[float]] = {name: [] for name in engines}
            for rep in range(args.repeat):
                for name, llm in engines.items():
                    note(f"busy: load {load}, run {rep + 1}/{args.repeat}, {name}")
                    samples[name].append(decode(llm))
        finally:
            _stop_load(procs)
        tok_s = {name: statistics.median(v) for name, v in samples.items()}
        row: dict = {"tok_s": tok_s, "runs": samples, "load_average_before": loadavg_before}
        if "auto" in counts:
            for fname in formats:
                fixed = max(tok_s[f"{fname} {t}"] for t in counts if t != "auto")
                row[f"{fname}_auto_vs_best_fixed"] = tok_s[f"{fname} auto"] / fixed
            row["int8_vs_f16_auto"] = tok_s["int8 auto"] / tok_s["f16 auto"]
        results[str(load)] = row
    return {
        "benchmark": "decode_under_load",
        "model": "SmolLM2-135M-Instruct (packaged)",
        "context": args.context,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "cpus_available": cpus,
        "machine_cpus": os.cpu_count(),
        "results": results,
    }


def report(result: dict) -> str:
    lines = [f"decode tokens/s at batch 1, SmolLM2, {result['context']} prompt tokens, {result['new_tokens']} new, "
             f"median of {result['repeat']}; {result['cpus_available']} CPUs available"]
    for load, row in result["results"].items():
        avg = ", ".join(f"{x:.1f}" for x in row["load_average_before"])
        lines.append(f"-- {load} CPU-bound processes beside it (load average before: {avg})")
        for name, value in row["tok_s"].items():
            lines.append(f"   {name:<16}{value:>8.1f} tok/s")
        for key in ("int8_auto_vs_best_fixed", "f16_auto_vs_best_fixed", "int8_vs_f16_auto"):
            if key in row:
                lines.append(f"   {key.replace('_', ' '):<28}{row[key]:>6.2f}x")
    lines.append("auto vs best fixed: the engine's own choice against the faster of threads=1 and threads=N under the "
                 "same load")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    return emit(result, report(result), args.json)
