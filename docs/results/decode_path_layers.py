"""One decode step of SmolLM2-135M's 30 layers through the drop-in, without the rest of the model: per layer
`Int8KvCache.update` of one position, then the int8kv attention function as the model calls it (its own
attention module, position kwargs, no mask), with the forward boundary (`get_mask_sizes`, `finish_forward`)
and a `crop(-1)` per step. Prints microseconds per layer (update, attention) and per step, min over 10 rounds
of 20 steps, for whichever checkout PYTHONPATH names; run two checkouts taking turns:

    for r in 1 2 3; do for c in /path/to/before/src src; do
        PYTHONPATH=$c python docs/results/decode_path_layers.py 512 1; done; done
"""

from __future__ import annotations

import json
import sys
import time

import torch

import int8kv.hf.attention as A
from int8kv.hf import Int8KvCache
from int8kv.models import load_model

ctx, batch = int(sys.argv[1]), int(sys.argv[2])
model, tok = load_model(None)
cfg = model.config
layers = cfg.num_hidden_layers
hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
d = cfg.hidden_size // hq
g = torch.Generator().manual_seed(0)
mods = [la.self_attn for la in model.model.layers]
with torch.inference_mode():
    cache = Int8KvCache(cfg)
    cache.get_mask_sizes(ctx, 0)
    for i in range(layers):
        k, v = (torch.randn(batch, hkv, ctx, d, generator=g) for _ in range(2))
        kh, vh = cache.update(k, v, i)
        q = torch.randn(batch, hq, ctx, d, generator=g)
        A.int8kv_attention_forward(mods[i], q, kh, vh, None, scaling=d**-0.5)
    k1 = [torch.randn(batch, hkv, 1, d, generator=g) for _ in range(layers)]
    v1 = [torch.randn(batch, 1, hkv, d, generator=g).transpose(1, 2) for _ in range(layers)]  # the model's V layout
    q1 = [torch.randn(batch, hq, 1, d, generator=g) for _ in range(layers)]
    pos = torch.tensor([[ctx]])
    kw = dict(position_ids=pos, cache_position=pos[0])
    res: dict[str, list[float]] = {"update": [], "attention": [], "step": []}
    steps = 20
    for r in range(12):
        tu = ta = 0
        t00 = time.perf_counter_ns()
        for _ in range(steps):
            cache.get_mask_sizes(1, 0)
            for i in range(layers):
                t0 = time.perf_counter_ns()
                kh, vh = cache.update(k1[i], v1[i], i)
                t1 = time.perf_counter_ns()
                A.int8kv_attention_forward(mods[i], q1[i], kh, vh, None, scaling=d**-0.5, **kw)
                t2 = time.perf_counter_ns()
                tu += t1 - t0
                ta += t2 - t1
            cache.finish_forward()
            cache.crop(-1)
        if r >= 2:  # two rounds untimed
            res["update"].append(tu / steps / layers / 1e3)
            res["attention"].append(ta / steps / layers / 1e3)
            res["step"].append((time.perf_counter_ns() - t00) / steps / 1e3)
print(json.dumps({k: round(min(v), 1) for k, v in res.items()}))
