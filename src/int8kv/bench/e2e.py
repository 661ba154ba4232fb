"""End-to-end decode speed on a real model, every peer in one process on the same prompt.

    python -m int8kv.bench e2e [--model PATH] [--context 2048] [--new-tokens 32] [--json PATH]

Decode tokens/s counts only steps after the prefill: transformers' generate is timestamped once per new
token (a stopping criterion that never stops), the engine times its pure-decode steps. So the figure is the
cost of decoding at `context` tokens of history, with the prefill reported beside it.
  hf DynamicCache   transformers generate, batch 1, float32 cache (sdpa)
  hf Int8KvCache    transformers generate, batch 1, our INT8 cache read by the int8kv attention
  engine int8 bN    our continuous-batching engine, INT8 paged cache, N copies of the prompt
"""

from __future__ import annotations

import argparse
import time

import torch

from ..formats import KvStorageFormat
from ..progress import note
from .timing import emit


def _prompt_ids(tokenizer, context: int) -> list[int]:
    from ..eval import read_text

    ids = tokenizer(read_text(None))["input_ids"]
    if len(ids) < context:
        raise ValueError(f"the default text has only {len(ids)} tokens; use a smaller --context")
    return ids[:context]


class _TokenClock:
    """A stopping criterion that never stops: generate calls it once per new token, so it timestamps them."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_decode(model, ids: list[int], new_tokens: int, make_cache) -> dict:
    from transformers import StoppingCriteriaList

    inputs = torch.tensor([ids])
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            inputs, attention_mask=torch.ones_like(inputs), cache=make_cache(), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    # The first stamp follows the prefill; the ones after it are pure decode steps.
    decode_s = clock.stamps[-1] - clock.stamps[0]
    return {"prefill_s": clock.stamps[0] - start, "decode_tok_per_s": (len(clock.stamps) - 1) / decode_s}


def engine_decode(llm, ids: list[int], batch: int, new_tokens: int) -> dict:
    from ..engine import EngineStats, SamplingParams

    llm.stats = EngineStats()
    start = time.perf_counter()
    llm.generate([ids] * batch, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    total = time.perf_counter() - start
    return {"prefill_s": total - llm.stats.decode_step_seconds, "decode_tok_per_s": llm.stats.decode_tokens_per_s}


def run(model_path: str | None, context: int, new_tokens: int, batch: int) -> dict:
    from transformers import DynamicCache

    from ..engine import LLM
    from ..hf import Int8KvCache
    from ..models import kv_dims, load_model

    model, tokenizer = load_model(model_path)
    ids = _prompt_ids(tokenizer, context)
    cfg = model.config
    fmt = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
    memory = int(1.2 * batch * (context + new_tokens) * fmt.bytes_per_token(*kv_dims(cfg)))
    llm = LLM(model, kv_format=fmt, memory=max(memory, 64 << 20), max_num_seqs=batch, tokenizer=tokenizer)
    for b in (1, batch):  # compile (or load) every kernel variant outside the timings
        engine_decode(llm, ids[:64], b, 3)
    hf_decode(model, ids[:64], 3, lambda: Int8KvCache(cfg))
    peers = {
        "hf DynamicCache b1": lambda: hf_decode(model, ids, new_tokens, DynamicCache),
        "hf Int8KvCache b1": lambda: hf_decode(model, ids, new_tokens, lambda: Int8KvCache(cfg)),
        "engine int8 b1": lambda: engine_decode(llm, ids, 1, new_tokens),
        f"engine int8 b{batch}": lambda: engine_decode(llm, ids, batch, new_tokens),
    }
    results = {}
    for name, fn in peers.items():
        note(f"e2e: {name} ...")
        results[name] = fn()
    base = results["hf DynamicCache b1"]["decode_tok_per_s"]
    for row in results.values():
        row["vs_hf_dynamic_b1"] = row["decode_tok_per_s"] / base
    return {"context": context, "new_tokens": new_tokens, "threads": torch.get_num_threads(), "results": results}


def report(result: dict) -> str:
    lines = [
        f"decode at {result['context']} tokens of context, {result['new_tokens']} new tokens, "
        f"{result['threads']} threads",
        f"{'peer':<22}{'prefill s':>10}{'decode tok/s':>14}{'x hf dyn b1':>13}",
    ]
    for name, r in result["results"].items():
        lines.append(f"{name:<22}{r['prefill_s']:>10.2f}{r['decode_tok_per_s']:>14.2f}{r['vs_hf_dynamic_b1']:>13.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m int8kv.bench e2e")
    parser.add_argument("--model", default=None, help="local transformers dir or .gguf (default: packaged SmolLM2)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    result = run(args.model, args.context, args.new_tokens, args.batch)
    return emit(result, report(result), args.json)
