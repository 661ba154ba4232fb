"""Redraw the plots of docs/ from the recorded results: no model is loaded and nothing is timed.

    python -m int8kv.bench plots [--results docs/results] [--out docs]

Each plot is drawn by the function its command's --plot uses, from the JSON quoted in docs/performance.md.
"""

from __future__ import annotations

import json
import os

from ..cli_common import CliError, bench_parser, output_problem, write_json

# plot file -> the results file it is drawn from
PLOTS = {
    "kv_memory.png": "demo.json",
    "attention_latency.png": "attention_presets_s3.json",
    "eval_perplexity.png": "eval_ppl64.json",
}


def main(argv: list[str] | None = None) -> dict:
    from ..cli import plot_eval, plot_memory
    from .attention import plot as plot_attention

    draw = {"kv_memory.png": plot_memory, "attention_latency.png": plot_attention, "eval_perplexity.png": plot_eval}
    parser = bench_parser("plots", __doc__.split("\n")[0])
    parser.add_argument("--results", default=os.path.join("docs", "results"), help="folder of the result JSON files")
    parser.add_argument("--out", default="docs", help="folder the PNG files are written to")
    args = parser.parse_args(argv)
    jobs = []
    for png, source in PLOTS.items():  # every input read and every output checked before anything is drawn
        source_path, png_path = os.path.join(args.results, source), os.path.join(args.out, png)
        if not os.path.isfile(source_path):
            raise CliError(f"--results: {source_path!r} is not a file")
        problem = output_problem(png_path)
        if problem:
            raise CliError(f"--out: {problem}")
        with open(source_path, encoding="utf-8") as f:
            try:
                jobs.append((png, png_path, source_path, json.load(f)))
            except ValueError as exc:
                raise CliError(f"{source_path!r} is not JSON: {exc}") from None
    written = {}
    for png, png_path, source_path, result in jobs:
        draw[png](result, png_path)
        written[png_path] = source_path
        print(f"{png_path} <- {source_path}")
    write_json(args.json, written)
    return written
