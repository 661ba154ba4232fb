"""Where an engine decode step's CPU time goes: SmolLM2-135M, the packaged GGUF, INT8 cache, batch 1, 512 tokens.

    python docs/results/engine_step_profile.py docs/results/engine_step_profile.json

For each model path (transformers, fused): three `generate` runs of 16 new tokens after a 512-token prompt of the
license texts (ms per decode token from the engine's stats, the first run compiling), then one more under
torch.profiler twice, with 2 and with 18 new tokens: the difference of the two is 16 decode steps, whose aten ops'
self CPU time per step is given in all and for the top 6 ops (the numba attention kernel and Python are not aten
ops: they are the rest of the step's wall time).
"""

import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from int8kv.engine import LLM, EngineStats, SamplingParams
from int8kv.eval import read_text
from int8kv.formats import KvStorageFormat
from int8kv.models import load_model

model, tokenizer = load_model(None)
ids = tokenizer(read_text(None))["input_ids"][:512]
result = {"command": f"python docs/results/engine_step_profile.py {sys.argv[1]}", "torch_threads": torch.get_num_threads(),
          "load_average_before": os.getloadavg(), "paths": {}}
for implementation in ("transformers", "fused"):
    llm = LLM(model, kv_format=KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, memory=64 << 20, max_num_seqs=1,
              tokenizer=tokenizer, implementation=implementation)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ms = []
    for _ in range(3):
        llm.stats = EngineStats()
        llm.generate([ids], params)
        ms.append(1e3 / llm.stats.decode_tokens_per_s)
    per_op = []
    for tokens in (2, 18):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
        per_op.append({e.key: e.self_cpu_time_total for e in prof.key_averages()})
    decode = {k: (per_op[1].get(k, 0) - per_op[0].get(k, 0)) / 16 / 1e3 for k in per_op[1]}  # ms per decode step
    top = dict(sorted(((k, round(v, 3)) for k, v in decode.items()), key=lambda kv: -kv[1])[:6])
    shares = {"aten_ms_per_step": round(sum(decode.values()), 2), "top_ops_ms_per_step": top}
    result["paths"][implementation] = {"ms_per_token": ms, "profile": shares}
    print(implementation, [round(x, 1) for x in ms], "ms/token;", shares, flush=True)
result["load_average_after"] = os.getloadavg()
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
