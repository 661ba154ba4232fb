"""Packed GGUF blocks against the dense float32 weights they decode to: SmolLM2-135M in the engine, INT8 cache.

    python docs/results/packed_weights_bench.py docs/results/packed_weights.json

Peers `weights="model"` (Q4_1 / Q8_0 blocks, int8kv.models.packed) and `weights="dense"` (torch's float32
matmuls), both on the default model path, take turns in one process, 3 runs each (median): the wall time of a
512-token prefill (one chunk: its matmuls decode the blocks to float32), and the decode step at batch 1 and 8
(512-token prompts of the license texts, 16 new tokens; ms per step = batch / the engine's decode tokens per s).
"""

import json
import os
import statistics
import sys
import time

import torch

from int8kv.engine import LLM, EngineStats, SamplingParams
from int8kv.eval import read_text
from int8kv.models import load_model

model, tokenizer = load_model(None, quiet=True)
text = tokenizer(read_text(None))["input_ids"]
prompts = [text[i * 600 : i * 600 + 512] for i in range(8)]
peers = {w: LLM(model, memory=256 << 20, max_num_seqs=8, tokenizer=tokenizer, weights=w, prefix_caching=False)
         for w in ("model", "dense")}  # fmt: skip
runs: dict[str, dict[str, list[float]]] = {w: {"prefill_ms": [], "decode_ms_b1": [], "decode_ms_b8": []} for w in peers}
load_before = os.getloadavg()
for llm in peers.values():  # warm-up: kernels, first calls
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))
for _ in range(3):
    for w, llm in peers.items():
        start = time.perf_counter()
        llm.generate([prompts[0]], SamplingParams(max_tokens=1, ignore_eos=True))
        runs[w]["prefill_ms"].append(1e3 * (time.perf_counter() - start))
        for batch in (1, 8):
            llm.stats = EngineStats()
            llm.generate(prompts[:batch], SamplingParams(max_tokens=16, ignore_eos=True))
            runs[w][f"decode_ms_b{batch}"].append(1e3 * batch / llm.stats.decode_tokens_per_s)
medians = {w: {k: statistics.median(v) for k, v in r.items()} for w, r in runs.items()}
ratios = {k: medians["dense"][k] / medians["model"][k] for k in medians["model"]}
result = {
    "command": f"python docs/results/packed_weights_bench.py {sys.argv[1]}",
    "torch_threads": torch.get_num_threads(),
    "load_average_before": load_before,
    "load_average_after": os.getloadavg(),
    "runs": runs,
    "medians": medians,
    "dense_over_packed": ratios,
}
for k in medians["model"]:
    print(f"{k:14s} packed {medians['model'][k]:9.2f}  dense {medians['dense'][k]:9.2f}  dense/packed {ratios[k]:.2f}x")
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
