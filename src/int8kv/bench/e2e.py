"""End-to-end decode speed on a real model: a context sweep, every peer at the same batch, in one process.

    python -m int8kv.bench e2e [--model PATH] [--contexts 512,2048,7000] [--batches 1,8] [--runs 3]
                               [--new-tokens 32] [--max-batch-tokens 16384] [--peers hf] [--json PATH]

Peers, each given `batch` copies of the same `context`-token prompt:
  hf dynamic    transformers generate, DynamicCache (float32), SDPA attention
  hf int8kv     transformers generate, int8kv.hf.Int8KvCache (INT8), int8kv attention kernels
  engine int8   int8kv.engine.LLM, INT8 paged cache
  engine f16    int8kv.engine.LLM, F16 paged cache
The engine peers run the model's float32 weights through torch's matmuls (`weights="dense"`), as transformers'
generate does: this benchmark compares caches and attention on the same matmuls (the engine's default packed
GGUF blocks are measured by `bench slope` and docs/results/packed_weights_bench.py).
`--peers hf` runs the two transformers peers only (the drop-in against DynamicCache, in about half the time);
the ratios are those of the peers run.

Every peer's decode rate counts the same thing: tokens generated per second while all the batch's
sequences decode, i.e. after the prefill (and so after the first token, which the prefill produces) until
the last token. transformers' generate is timestamped once per new token by a stopping criterion that never
stops: rate = batch * (new_tokens - 1) / (last stamp - first stamp). The engine reports the same window as
`EngineStats.decode_tokens_per_s`; it is given a token budget of batch * context so the whole batch is
prefilled in one step, as generate does, and all sequences then decode in lockstep. Each figure is the
median of `runs` runs; prefill seconds are reported beside it.

Sweep size: on the 2-core CPU this was written on, one run of the four peers costs about (prefill
dominates) 3 s at 1 x 512, 7 s at 1 x 2,048, 20 s at 1 x 7,000, 10 s at 8 x 512 and 35 s at 8 x 2,048
per peer, so the default sweep (three runs) takes about 15 minutes. 8 x 7,000 tokens would add ~150 s per
peer and run (quadratic prefill) - half an hour for the cell alone - so cells above --max-batch-tokens
(batch x context) are skipped and listed; raise the limit to include them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .. import numba_threads
from ..formats import KvStorageFormat
from ..progress import note
from .timing import emit

PEERS = ("hf dynamic", "hf int8kv", "engine int8", "engine f16")
PEER_SETS = {"all": PEERS, "hf": PEERS[:2]}


def _prompt_ids(tokenizer, context: int) -> list[int]:
    from ..eval import read_text

    ids = tokenizer(read_text(None))["input_ids"]
    if len(ids) < context:
        raise ValueError(f"the default text has only {len(ids)} tokens; use a smaller context")
    return ids[:context]


class _TokenClock:
    """A stopping criterion that never stops: generate calls it once per new token, so it timestamps them."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_decode(model, ids: list[int], batch: int, new_tokens: int, make_cache) -> dict:
    """transformers generate on `batch` copies of `ids`: prefill seconds and decode tokens/s."""
    from transformers import StoppingCriteriaList

    inputs = torch.tensor([ids] * batch)
    clock = _TokenClock()
    cache = make_cache()  # built first: Int8KvCache switches the model to its attention function
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            inputs, attention_mask=torch.ones_like(inputs), cache=cache, do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    # The first stamp follows the prefill (which produced token 1); each later one ends a decode step.
    decode_s = clock.stamps[-1] - clock.stamps[0]
    return {
        "prefill_s": clock.stamps[0] - start,
        "decode_tokens": batch * (len(clock.stamps) - 1),
        "decode_tok_per_s": batch * (len(clock.stamps) - 1) / decode_s,
    }


def engine_decode(llm, ids: list[int], batch: int, new_tokens: int) -> dict:
    from ..engine import EngineStats, SamplingParams

    llm.stats = EngineStats()
    start = time.perf_counter()
    llm.generate([ids] * batch, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    total = time.perf_counter() - start
    s = llm.stats
    return {
        "prefill_s": total - s.decode_phase_seconds,
        "decode_tokens": s.decode_phase_tokens,
        "decode_tok_per_s": s.decode_tokens_per_s,
    }


def _peers(model, tokenizer, ids: list[int], batch: int, new_tokens: int, names: tuple[str, ...] = PEERS) -> dict:
    """name -> a callable doing one timed run, for one (context, batch) cell (the peers of ``names``)."""
    from transformers import DynamicCache

    from ..cache.state import KvLayout
    from ..engine import LLM
    from ..hf import Int8KvCache

    def dynamic() -> dict:
        model.set_attn_implementation("sdpa")  # plain transformers, whatever a previous Int8KvCache attached
        return hf_decode(model, ids, batch, new_tokens, DynamicCache)

    def engine(fmt: KvStorageFormat):
        context = len(ids)
        per_token = KvLayout.from_config(model.config, fmt).bytes_per_token
        memory = int(1.1 * batch * (context + new_tokens) * per_token) + (16 << 20)
        # No prefix caching: the batch is copies of one prompt and runs repeat it, so cached blocks would let
        # the engine's sequences share K/V pages (and skip prefill) that transformers' copies each hold apart.
        llm = LLM(model, kv_format=fmt, memory=memory, max_num_seqs=batch,
                  max_num_batched_tokens=batch * context, tokenizer=tokenizer, prefix_caching=False,
                  weights="dense")  # fmt: skip
        engine_decode(llm, ids[:64], batch, 3)  # compile (or load) the kernels outside the timings
        return lambda: engine_decode(llm, ids, batch, new_tokens)

    makers = {
        "hf dynamic": lambda: dynamic,
        "hf int8kv": lambda: lambda: hf_decode(model, ids, batch, new_tokens, lambda: Int8KvCache(model.config)),
        "engine int8": lambda: engine(KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1),
        "engine f16": lambda: engine(KvStorageFormat.F16),
    }
    return {name: makers[name]() for name in names}  # an engine peer not run is not built (nor warmed up)


def run(model_path: str | None, contexts: list[int], batches: list[int], runs: int, new_tokens: int,
        max_batch_tokens: int, peers: str = "all") -> dict:
    from ..hf import Int8KvCache
    from ..models import load_model

    model, tokenizer = load_model(model_path)
    hf_decode(model, _prompt_ids(tokenizer, 64), 1, 3, lambda: Int8KvCache(model.config))  # compile kernels
    cells, skipped = [], []
    for context in contexts:
        ids = _prompt_ids(tokenizer, context)
        for batch in batches:
            if batch * context > max_batch_tokens:
                skipped.append({"context": context, "batch": batch})
                continue
            calls = _peers(model, tokenizer, ids, batch, new_tokens, PEER_SETS[peers])
            samples: dict[str, list[dict]] = {name: [] for name in calls}
            for r in range(runs):  # interleaved, so a slow spell of the shared machine hits every peer
                for name, call in calls.items():
                    note(f"e2e: context {context}, batch {batch}, run {r + 1}/{runs}: {name} ...")
                    samples[name].append(call())
            results = {name: _median(rows) for name, rows in samples.items()}
            cells.append({"context": context, "batch": batch, "results": results, "ratios": _ratios(results)})
    return {
        "new_tokens": new_tokens, "runs": runs, "threads": torch.get_num_threads(), "peers": list(PEER_SETS[peers]),
        "numba_threading_layer": numba_threads.layer(), "max_batch_tokens": max_batch_tokens, "cells": cells,
        "skipped": skipped,
    }


def _median(rows: list[dict]) -> dict:
    out = {key: statistics.median(r[key] for r in rows) for key in ("prefill_s", "decode_tok_per_s")}
    out["decode_tok_per_s_runs"] = [r["decode_tok_per_s"] for r in rows]
    out["decode_tokens"] = rows[0]["decode_tokens"]
    return out


def _ratios(results: dict) -> dict:
    rate = {name: r["decode_tok_per_s"] for name, r in results.items()}
    pairs = [("hf int8kv", "hf dynamic"), ("engine int8", "hf dynamic"), ("engine int8", "hf int8kv"),
             ("engine int8", "engine f16")]
    return {f"{a} / {b}": rate[a] / rate[b] for a, b in pairs if a in rate and b in rate}


def report(result: dict) -> str:
    lines = [
        f"decode tokens/s while the whole batch decodes ({result['new_tokens']} new tokens, median of "
        f"{result['runs']} runs, {result['threads']} threads)",
        f"{'context':>8}{'batch':>6}  {'peer':<13}{'prefill s':>10}{'decode tok/s':>14}",
    ]
    for cell in result["cells"]:
        for name, r in cell["results"].items():
            rate = r["decode_tok_per_s"]
            lines.append(f"{cell['context']:>8}{cell['batch']:>6}  {name:<13}{r['prefill_s']:>10.2f}{rate:>14.2f}")
        lines.append("    " + ", ".join(f"{k} {v:.2f}x" for k, v in cell["ratios"].items()))
    for cell in result["skipped"]:
        lines.append(f"skipped {cell['batch']} x {cell['context']} tokens (> --max-batch-tokens "
                     f"{result['max_batch_tokens']})")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m int8kv.bench e2e",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="local transformers dir or .gguf (default: packaged SmolLM2)")
    parser.add_argument("--contexts", type=_int_list, default=[512, 2048, 7000], help="prompt lengths in tokens")
    parser.add_argument("--batches", type=_int_list, default=[1, 8], help="copies of the prompt decoded together")
    parser.add_argument("--runs", type=int, default=3, help="runs per peer and cell (the median is reported)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence (>= 2)")
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="skip cells whose batch x context exceeds this (8 x 7000 alone takes ~30 min)")
    parser.add_argument("--peers", choices=sorted(PEER_SETS), default="all",
                        help="all four peers, or hf: DynamicCache and Int8KvCache only")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.new_tokens < 2:
        parser.error("--runs must be >= 1 and --new-tokens >= 2 (the decode window starts after token 1)")
    result = run(args.model, args.contexts, args.batches, args.runs, args.new_tokens, args.max_batch_tokens,
                 args.peers)
    return emit(result, report(result), args.json)
