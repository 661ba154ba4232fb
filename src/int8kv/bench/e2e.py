"""End-to-end decode speed on a real model, every peer in one process on the same prompt.

    python -m int8kv.bench e2e [--model PATH] [--context 2048] [--new-tokens 32] [--json PATH]

Decode tokens/s = (new_tokens - 1) / (t(new_tokens) - t(1)): the prefill is timed separately and
taken out, so the figure is the cost of decoding at `context` tokens of history.
  hf DynamicCache   transformers generate, batch 1, float32 cache (sdpa)
  hf Int8KvCache    transformers generate, batch 1, our INT8 cache read by the int8kv attention
  engine int8 bN    our continuous-batching engine, INT8 paged cache, N copies of the prompt
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ..progress import note


def _prompt_ids(tokenizer, context: int) -> list[int]:
    from ..eval import read_text

    ids = tokenizer(read_text(None))["input_ids"]
    if len(ids) < context:
        raise ValueError(f"the default text has only {len(ids)} tokens; use a smaller --context")
    return ids[:context]


def _hf_seconds(model, ids: list[int], new_tokens: int, make_cache) -> float:
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            inputs, attention_mask=torch.ones_like(inputs), cache=make_cache(), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
        )
    return time.perf_counter() - start


def _engine_seconds(llm, ids: list[int], batch: int, new_tokens: int) -> float:
    from ..engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([ids] * batch, params)
    return time.perf_counter() - start


def decode_rate(seconds, batch: int, new_tokens: int) -> dict:
    full, first = seconds(new_tokens), seconds(1)
    decode = max(full - first, 1e-9)
    return {"prefill_s": first, "total_s": full, "decode_tok_per_s": batch * (new_tokens - 1) / decode}


def run(model_path: str | None, context: int, new_tokens: int, batch: int) -> dict:
    from transformers import DynamicCache

    from ..engine import LLM
    from ..hf import Int8KvCache
    from ..models import load_model

    model, tokenizer = load_model(model_path)
    ids = _prompt_ids(tokenizer, context)
    cfg = model.config
    memory = int(1.2 * batch * (context + new_tokens) * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 68)
    llm = LLM(model, kv_format="int8", memory=max(memory, 64 << 20), max_num_seqs=batch, tokenizer=tokenizer)
    _engine_seconds(llm, ids[:64], 1, 2)  # compile the kernels outside the timings
    peers = {
        "hf DynamicCache b1": (1, lambda n: _hf_seconds(model, ids, n, DynamicCache)),
        "hf Int8KvCache b1": (1, lambda n: _hf_seconds(model, ids, n, lambda: Int8KvCache(cfg))),
        "engine int8 b1": (1, lambda n: _engine_seconds(llm, ids, 1, n)),
        f"engine int8 b{batch}": (batch, lambda n: _engine_seconds(llm, ids, batch, n)),
    }
    results = {}
    for name, (b, fn) in peers.items():
        note(f"e2e: {name} ...")
        results[name] = decode_rate(fn, b, new_tokens)
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
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
