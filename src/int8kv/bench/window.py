"""Real weights with a sliding window: SmolLM2 loaded into ``MistralForCausalLM`` with ``sliding_window``.

    python -m int8kv.bench window [--window 1024] [--text FILE] [--tokens 6144] [--memory-tokens 8192]
                                  [--chunk 512] [--model PATH] [--json PATH]

SmolLM2's weights load unchanged into Mistral's architecture (the same layers plus a sliding window), which
gives an offline model whose every layer attends to the last ``--window`` tokens only. The text (default: the
first license of /usr/share/common-licenses long enough, GPL-3) is fed in chunks through a fresh cache of
each kind; every token after the first ``--window`` is scored, so each scored token sees a full window.

Peers, same run, same tokens: ``DynamicCache(config)`` in float32 (the baseline; transformers keeps the last
``window - 1`` tokens of each sliding layer), ``Int8KvCache`` F16 and INT8. Memory: bytes each cache holds
after ``--memory-tokens`` tokens (DynamicCache counted as float16, what it would hold in the model's half
precision), and the same through the engine (blocks in use x bytes per block after that prompt's prefill).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ..cli_common import bench_parser
from ..formats import KvStorageFormat
from ..progress import progress
from .timing import emit

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
FORMATS = (KvStorageFormat.F16, KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1)


def windowed_model(model: Any, window: int) -> Any:
    """A ``MistralForCausalLM`` holding ``model``'s (a Llama's) weights, every layer sliding over ``window``."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = model.config
    if cfg.model_type != "llama" or getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError(f"expected a Llama model without biases, got {cfg.model_type!r}")
    fields = cfg.to_dict()
    for name in ("architectures", "model_type", "attention_bias", "mlp_bias", "pretraining_tp",
                 "transformers_version", "_attn_implementation_autoset"):  # fmt: skip
        fields.pop(name, None)
    mistral = MistralForCausalLM(MistralConfig(**fields, sliding_window=window))
    mistral.load_state_dict(model.state_dict(), strict=True)
    return mistral.eval()


def dynamic_bytes(cache: Any, bytes_per_value: int = 2) -> int:
    """K/V bytes a DynamicCache holds, counted at ``bytes_per_value`` per element."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * bytes_per_value
    return total


@torch.inference_mode()
def feed(model: Any, cache: Any, ids: list[int], chunk: int, scored_from: int | None) -> tuple[float, int]:
    """Run ``ids`` through ``model`` in chunks over ``cache``; the summed NLL of tokens ``>= scored_from``."""
    nll, count = 0.0, 0
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        logits = model(input_ids=torch.tensor([part]), cache=cache, use_cache=True).logits[0].double()
        if scored_from is None:
            continue
        # logits[i] predicts token start + i + 1.
        targets = torch.tensor(ids[start + 1 : start + 1 + len(part)])
        lp = torch.log_softmax(logits[: len(targets)], dim=-1).gather(1, targets[:, None])[:, 0]
        pos = torch.arange(start + 1, start + 1 + len(targets))
        keep = pos >= scored_from
        nll -= float(lp[keep].sum())
        count += int(keep.sum())
    return nll, count


def run(
    window: int = 1024,
    text_path: str = DEFAULT_TEXT,
    tokens: int = 6144,
    memory_tokens: int = 8192,
    chunk: int = 512,
    model_path: str | None = None,
    engine: bool = True,
) -> dict:
    from transformers import DynamicCache

    from ..eval import read_text
    from ..hf import Int8KvCache
    from ..models import load_model

    base, tokenizer = load_model(model_path, quiet=True)
    model = windowed_model(base, window)
    ids = tokenizer(read_text(text_path))["input_ids"]
    if len(ids) < window + chunk:
        raise ValueError(f"the text has {len(ids)} tokens; it needs more than window + chunk ({window + chunk})")
    ids = ids[:tokens]
    config = model.config
    kinds = {"DynamicCache fp32 (baseline)": lambda: DynamicCache(config=config)}
    for fmt in FORMATS:
        kinds[f"Int8KvCache {fmt.as_str()}"] = lambda fmt=fmt: Int8KvCache(config, fmt)
    rows: dict[str, dict[str, Any]] = {}
    for name, make in progress(list(kinds.items()), f"window {window}: perplexity over {len(ids)} tokens"):
        start = time.perf_counter()
        nll, count = feed(model, make(), ids, chunk, window)
        seconds = time.perf_counter() - start
        rows[name] = {"perplexity": math.exp(nll / count), "scored_tokens": count, "seconds": seconds}
    base_ppl = rows["DynamicCache fp32 (baseline)"]["perplexity"]
    for row in rows.values():
        row["ppl_change"] = row["perplexity"] / base_ppl - 1

    # Memory after memory_tokens tokens (the text repeated if it is shorter).
    long_ids = (ids * (memory_tokens // len(ids) + 1))[:memory_tokens]
    memory: dict[str, int] = {}
    dyn = DynamicCache(config=config)
    feed(model, dyn, long_ids, chunk, None)
    memory["DynamicCache (float16)"] = dynamic_bytes(dyn, 2)
    for fmt in FORMATS:
        cache = Int8KvCache(config, fmt)
        feed(model, cache, long_ids, chunk, None)
        # Between forwards, as the next forward (or a caller after the last one) finds it: sliding layers drop
        # what no later query sees when a forward ends, not inside one (a failed step must roll back).
        memory[f"Int8KvCache {fmt.as_str()}, last chunk's rows held"] = cache.memory_bytes()
        cache.finish_forward()
        memory[f"Int8KvCache {fmt.as_str()}"] = cache.memory_bytes()
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct as MistralForCausalLM",
        "window": window,
        "text": text_path,
        "tokens": len(ids),
        "chunk": chunk,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "memory_tokens": memory_tokens,
        "memory_bytes": memory,
        "memory_vs_dynamic_f16": {k: v / memory["DynamicCache (float16)"] for k, v in memory.items()},
    }
    if engine:
        result["engine"] = engine_figures(model, tokenizer, ids, long_ids, window)
    return result


def engine_figures(model: Any, tokenizer: Any, ids: list[int], long_ids: list[int], window: int) -> dict:
    """Perplexity (`LLM.prompt_logprobs`) and the most KV blocks in use while a ``len(long_ids)``-token prompt
    prefills and decodes 16 tokens, through the engine (prefix caching off, so nothing outlives the request)."""
    from ..engine import LLM, SamplingParams

    new_tokens = 16
    prompt = long_ids[: len(long_ids) - new_tokens]  # prompt + generated tokens within the model's positions
    out: dict[str, Any] = {}
    for fmt in ("f16", "int8"):
        with LLM(model, kv_format=fmt, memory="1GiB", tokenizer=tokenizer, prefix_caching=False) as llm:
            scored = [e.logprob for e in llm.prompt_logprobs(ids)[window:]]
            llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0))
            peak = llm.stats.peak_blocks_used
            block_bytes = llm.cache.pool.layout.bytes_per_block(llm.cache.block_size)
            out[fmt] = {
                "perplexity": math.exp(-sum(scored) / len(scored)),
                "scored_tokens": len(scored),
                "context": len(prompt) + new_tokens,
                "peak_blocks_used": peak,
                "kv_bytes_in_use": peak * block_bytes,
                "pool_blocks": llm.cache.num_blocks,
            }
    return out


def report(result: dict) -> str:
    lines = [
        f"{result['model']}, sliding_window {result['window']}: {result['tokens']} tokens of {result['text']}, "
        f"chunks of {result['chunk']}, every token after the first {result['window']} scored "
        f"(torch threads {result['threads']})",
        f"{'cache':<44}{'ppl':>10}{'Δppl':>10}{'scored':>8}{'s':>7}",
    ]
    for name, row in result["rows"].items():
        lines.append(
            f"{name:<44}{row['perplexity']:>10.4f}{100 * row['ppl_change']:>+9.3f}%{row['scored_tokens']:>8}"
            f"{row['seconds']:>7.1f}"
        )
    lines.append(f"KV bytes held after {result['memory_tokens']} tokens:")
    for name, nbytes in result["memory_bytes"].items():
        lines.append(f"  {name:<66}{nbytes / 2**20:>8.2f} MiB  {result['memory_vs_dynamic_f16'][name]:.3f}x")
    for fmt, row in result.get("engine", {}).items():
        lines.append(
            f"engine {fmt}: ppl {row['perplexity']:.4f} over {row['scored_tokens']} tokens; at {row['context']} "
            f"tokens of context at most {row['peak_blocks_used']} of {row['pool_blocks']} blocks in use "
            f"({row['kv_bytes_in_use'] / 2**20:.2f} MiB)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("window", __doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=1024, help="sliding_window of every layer")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="text to score")
    parser.add_argument("--tokens", type=int, default=6144, help="tokens of the text scored (after the window)")
    parser.add_argument("--memory-tokens", type=int, default=8192, help="context at which memory is measured")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per forward")
    parser.add_argument("--model", metavar="PATH", default=None, help="a Llama model (default: packaged SmolLM2)")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine figures")
    args = parser.parse_args(argv)
    if min(args.window, args.tokens, args.memory_tokens, args.chunk) < 1:
        parser.error("--window, --tokens, --memory-tokens and --chunk must be >= 1")
    result = run(args.window, args.text, args.tokens, args.memory_tokens, args.chunk, args.model, not args.no_engine)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
