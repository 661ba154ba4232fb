"""Perplexity of the INT8 cache per attention precision with every scored token a decode step.

    python docs/results/eval_decode_precision.py docs/results/eval_decode_precision.json

The 2,048 scored tokens of `int8kv eval`'s default run (its text, 8 windows of 512 tokens, the second half of
each scored), the 8 windows decoded as one batch: the first half of each prefilled in chunks of 128, then one
token per forward, so every scored token goes through the decode kernels (the only ones the int16 path
changes). `INT8KV_ATTENTION_PRECISION=<p> int8kv eval --chunk 1 --prompts 0 --no-fp8` computes the same one
window and one token at a time. One process, torch and numba on one thread; the JSON is rewritten after each
cache, so a partial run keeps what it measured.
"""

import json
import math
import os
import sys
import time

import torch
from decode_run import decode_logits, setup

from int8kv.ops.plan import PRECISION_ENV

out_path = sys.argv[1]
model, base, int8, wins, half, result = setup(
    "python docs/results/eval_decode_precision.py docs/results/eval_decode_precision.json"
)


def nll(make) -> float:
    """Mean negative log-likelihood of the second halves, the prefix prefilled, the rest decoded."""
    steps = [logits.double() for logits in decode_logits(model, make, wins, half)]
    lp = torch.log_softmax(torch.cat(steps, dim=1), dim=-1)  # [windows, half, vocab]: positions half..end
    return float(-lp.gather(2, wins[:, half:, None]).sum()) / (wins.shape[0] * half)


# The int8 query's row in eval_decode_precision.json (+0.294 %) came from a run of a tree that still offered it;
# `precision="int8"` is refused now (+0.24 pp against exact, beyond the 0.02 budget).
for name, precision, kind in (("int8kv INT8, exact", "exact", int8), ("int8kv INT8, int16", "int16", int8),
                              ("DynamicCache fp32", "exact", base)):
    os.environ[PRECISION_ENV] = precision
    start = time.time()
    value = nll(kind.make)
    result["rows"].append({"cache": name, "precision": precision, "perplexity": math.exp(value),
                           "seconds": time.time() - start})
    result["load_average_after"] = os.getloadavg()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{name:24s} {math.exp(value):.5f} ({time.time() - start:.0f} s)", flush=True)
