"""How much the decode perplexity of the INT8 cache moves when a decode step's attention input moves by one ulp.

    python docs/results/eval_decode_noise.py docs/results/eval_decode_noise.json [SEEDS]

The run of `eval_decode_precision.py` (the 2,048 scored tokens of `int8kv eval`'s default text, 8 windows of 512,
the first half prefilled in chunks of 128, then every scored token a decode step), for: DynamicCache fp32;
the INT8 cache with exact attention; the same with every decode query multiplied by (1 + u), u uniform in
[-2**-23, 2**-23] (at most about one float32 ulp; one seed per run); the int16-query path; and the int16 path
with the same perturbation. Each row: perplexity, and against the fp32 run: mean |logit change| and mean
KL(fp32 || cache) per scored token. The perturbed rows measure the metric's own noise: a decode step's K and V
are quantized to INT8 when stored, so any change of a row's last bits flips some of the codes in later layers
and positions (a full code step each), whatever made the change. One process, torch and numba on one thread.
"""

import json
import math
import os
import sys
import time

import torch
from decode_run import decode_logits, setup

from int8kv import ops
from int8kv.ops.plan import PRECISION_ENV

out_path = sys.argv[1]
seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
model, base, int8, wins, half, result = setup(f"python docs/results/eval_decode_noise.py {out_path} {seeds}")
attention = ops.attention
noise = {"gen": None}


def perturbed(pool, layer, q, plan, **kw):
    gen = noise["gen"]
    if gen is not None and plan.is_decode:
        q = q * (1 + (torch.rand(q.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 2.0**-23).float()
    return attention(pool, layer, q, plan, **kw)


ops.attention = perturbed  # the drop-in calls ops.attention by the module's attribute


def log_probs(make) -> torch.Tensor:
    """float32 log-probabilities [windows, half, vocab] of positions half..end, the prefix prefilled."""
    steps = [torch.log_softmax(logits.double(), -1).float() for logits in decode_logits(model, make, wins, half)]
    return torch.cat(steps, dim=1)


runs = [("DynamicCache fp32", "exact", base, None), ("INT8, exact", "exact", int8, None)]
runs += [(f"INT8, exact, q +-1 ulp seed {s}", "exact", int8, s) for s in range(1, seeds + 1)]
runs += [("INT8, int16 query", "int16", int8, None)]
runs += [(f"INT8, int16 query, q +-1 ulp seed {s}", "int16", int8, s) for s in range(1, seeds // 2 + 1)]
reference = None
for name, precision, kind, seed in runs:
    os.environ[PRECISION_ENV] = precision
    noise["gen"] = None if seed is None else torch.Generator().manual_seed(seed)
    start = time.time()
    lp = log_probs(kind.make)
    nll = float(-lp.gather(2, wins[:, half:, None]).double().sum()) / (wins.shape[0] * half)
    row = {"cache": name, "precision": precision, "seed": seed, "perplexity": math.exp(nll)}
    if reference is None:
        reference = lp
    else:
        p = reference.double().exp()
        row["mean_abs_logprob_change"] = float((lp.double() - reference.double()).abs().mean())
        row["mean_kl_from_fp32"] = float((p * (reference.double() - lp.double())).sum(-1).mean())
    row["seconds"] = time.time() - start
    result["rows"].append(row)
    result["load_average_after"] = os.getloadavg()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(row), flush=True)
