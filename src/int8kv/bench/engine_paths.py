"""The engine's two model paths on one decode step: the model's own forward (generic) vs the fused Llama forward.

    python -m int8kv.bench engine_paths [--model PATH] [--context 2048] [--batches 1,8] [--steps 16]
                                        [--rounds 5] [--threads N] [--json PATH]

Both paths run the same decode step (`batch` sequences of `context` tokens each, one new token per sequence)
on the same INT8 paged cache, filled with random codes and scales (attention costs the same whatever the
values; prefilling 8 x 2,048 tokens would take minutes per path on a 2-core machine). A round times `steps`
steps of each path back to back (fused, then generic, alternating which goes first), so a slow spell of a
shared machine hits both; the figure per path is the median step time over `rounds` rounds, and the ratio is
generic tokens/s over fused tokens/s. Scheduling, sampling and packing are the same code for both paths and
are not timed.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..cli_common import bench_parser, check_minimums
from ..formats import KvStorageFormat
from ..progress import note
from .e2e import _int_list
from .timing import emit, set_threads

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1


def _decode_batch(cache, batch: int, context: int, vocab: int):
    from ..engine import Batch

    gen = torch.Generator().manual_seed(0)
    slots = []
    for seq in range(batch):
        cache.add_sequence(seq, context)
        slots.append(cache.grow(seq, 1))
    for layer in range(cache.num_layers):
        for t in (cache.k_codes[layer], cache.v_codes[layer]):
            t.copy_(torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8))
        for t in (cache.k_scales[layer], cache.v_scales[layer]):
            t.copy_(torch.rand(t.shape, generator=gen) * 0.05 + 1e-3)
    tables, lens = cache.batch_tensors(list(range(batch)))
    return Batch(torch.randint(0, vocab, (batch,), generator=gen), torch.full((batch,), context), torch.cat(slots),
                 torch.arange(batch + 1, dtype=torch.int32), tables, lens, is_decode=True)  # fmt: skip


def _time_steps(model, cache, batch, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        model.forward(cache, batch)
    return (time.perf_counter() - start) / steps


def run(model_path: str | None, context: int, batches: list[int], steps: int, rounds: int) -> dict:
    from ..engine import DecoderModel
    from ..engine.hf_model import TransformersModel
    from ..models import load_model

    hf_model, _ = load_model(model_path)
    paths = {"fused": DecoderModel(hf_model), "generic": TransformersModel(hf_model)}
    cells = []
    for batch in batches:
        cache = paths["fused"].make_cache(batch * (-(-(context + 1) // 16)), 16, INT8)
        step = _decode_batch(cache, batch, context, paths["fused"].vocab_size)
        for model in paths.values():
            _time_steps(model, cache, step, 2)  # compile (or load) the kernels, warm the allocator
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(rounds):
            order = list(paths) if r % 2 == 0 else list(paths)[::-1]
            note(f"engine_paths: batch {batch}, round {r + 1}/{rounds}")
            for name in order:
                samples[name].append(_time_steps(paths[name], cache, step, steps))
        step_s = {name: statistics.median(s) for name, s in samples.items()}
        cells.append({
            "batch": batch,
            "step_ms": {name: 1e3 * s for name, s in step_s.items()},
            "step_ms_rounds": {name: [1e3 * x for x in s] for name, s in samples.items()},
            "tok_per_s": {name: batch / s for name, s in step_s.items()},
            "generic / fused": step_s["fused"] / step_s["generic"],
        })  # fmt: skip
    import os

    return {"context": context, "steps": steps, "rounds": rounds, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "cells": cells}  # fmt: skip


def report(result: dict) -> str:
    lines = [
        f"decode step at {result['context']} tokens of context, INT8 cache (median of {result['rounds']} rounds "
        f"x {result['steps']} steps, {result['threads']} threads, load average {result['load_average'][0]:.1f})",
        f"{'batch':>6}{'fused ms':>10}{'generic ms':>12}{'fused tok/s':>13}{'generic tok/s':>15}{'generic/fused':>15}",
    ]
    for c in result["cells"]:
        ms, tps = c["step_ms"], c["tok_per_s"]
        lines.append(f"{c['batch']:>6}{ms['fused']:>10.2f}{ms['generic']:>12.2f}{tps['fused']:>13.1f}"
                     f"{tps['generic']:>15.1f}{c['generic / fused']:>14.2f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("engine_paths", __doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="local Llama/Qwen3 dir or .gguf (default: packaged SmolLM2)")
    parser.add_argument("--context", type=int, default=2048, help="tokens already in each sequence's cache")
    parser.add_argument("--batches", type=_int_list, default=[1, 8], help="sequences decoded together")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per path and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the median is reported)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch and numba threads (default: as configured); on a loaded machine 1 avoids "
                             "oversubscription (2 threads at a load of 8 on 2 cores: 1.5 s per step, 1 thread: 0.2 s)")
    args = parser.parse_args(argv)
    check_minimums(args, {"context": 1, "steps": 1, "rounds": 1})
    if args.threads is not None:
        check_minimums(args, {"threads": 1})
        set_threads(args.threads)
    result = run(args.model, args.context, args.batches, args.steps, args.rounds)
    return emit(result, report(result), args.json)
