"""The step plan's range checks computed by numpy (the host path of `ops.plan.validate_values`, CPU tensors)
against torch's ops (the device path), in one process on the same metadata:

    PYTHONPATH=src python docs/results/plan_host_ab.py [--rounds 6] [--json PATH]

1. `validate_values` in a loop on an engine decode step's metadata (batch 1 and 8, 33 blocks a table, slots and
   positions), microseconds a call, best of 5 repeats.
2. The engine (SmolLM2-135M, the packaged GGUF, INT8 cache, fused forward, batch 1): a 512-token prompt and 32
   new tokens per run, the runs taking turns between the two paths; per decode step the time of
   `DecoderModel.plan` (its checks and the plan), and ms per token from the engine's stats.
"""

import argparse
import functools
import json
import os
import statistics
import time
import timeit

import torch

import int8kv.ops.plan as plan_mod
from int8kv.cache import PagedKvCache
from int8kv.engine import LLM, EngineStats, SamplingParams
from int8kv.engine import model as engine_model
from int8kv.eval import read_text
from int8kv.formats import KvStorageFormat
from int8kv.models import load_model

REAL = plan_mod.validate_values


def loop_figures() -> dict:
    pool = PagedKvCache(512, 16, 1, 3, 64).pool
    out = {}
    for batch in (1, 8):
        tables = (torch.arange(batch * 33, dtype=torch.int32).reshape(batch, 33) % 512).contiguous()
        lens = torch.full((batch,), 513, dtype=torch.int32)
        slots = torch.arange(batch, dtype=torch.int64) * 16 + 512
        positions = torch.full((batch,), 512, dtype=torch.int64)
        args = (pool, tables, lens, None, None, batch, slots, positions, 8192)
        for host in (True, False):
            call = functools.partial(REAL, *args, host=host)
            best = min(timeit.repeat(call, number=2000, repeat=5)) / 2000 * 1e6
            out[f"batch {batch}, {'numpy' if host else 'torch'}"] = round(best, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = {"load_average_before": os.getloadavg(), "loop_us": loop_figures()}
    print("validate_values in a loop, us a call:", result["loop_us"], flush=True)
    model, tokenizer = load_model(None, quiet=True)
    ids = tokenizer(read_text(None))["input_ids"][:512]
    llm = LLM(model, kv_format=KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, memory=64 << 20, max_num_seqs=1,
              tokenizer=tokenizer, implementation="fused")  # fmt: skip
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    spent: list[float] = []
    plan = engine_model.DecoderModel.plan

    def timed(self, cache, batch, validate=True):
        start = time.perf_counter()
        out = plan(self, cache, batch, validate)
        if batch.is_decode:
            spent.append(time.perf_counter() - start)
        return out

    engine_model.DecoderModel.plan = timed
    llm.generate([ids], params)  # compiles, warms
    rows = {"numpy": [], "torch": []}
    for r in range(args.rounds):
        for name in ("numpy", "torch") if r % 2 == 0 else ("torch", "numpy"):
            plan_mod.validate_values = REAL if name == "numpy" else functools.partial(REAL, host=False)
            spent.clear()
            llm.stats = EngineStats()
            llm.generate([ids], params)
            rows[name].append({"plan_us": statistics.median(spent) * 1e6,
                               "ms_per_token": 1e3 / llm.stats.decode_tokens_per_s})  # fmt: skip
            print(f"round {r + 1} {name}: plan {rows[name][-1]['plan_us']:.0f} us a step (median), "
                  f"{rows[name][-1]['ms_per_token']:.2f} ms/token", flush=True)
    plan_mod.validate_values = REAL
    summary = {name: {key: round(statistics.median(x[key] for x in runs), 2) for key in runs[0]}
               for name, runs in rows.items()}  # fmt: skip
    result.update(rounds=rows, medians=summary, load_average_after=os.getloadavg())
    print("medians:", summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
