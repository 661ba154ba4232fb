"""Inside transformers' `generate` on SmolLM2-135M (the drop-in, batch 1): where an attention call of each decode
step goes. Timers around the functions it calls; per function the median microseconds of a call and how many
calls an attention call makes:

    PYTHONPATH=src python docs/results/first_layer_split.py [--layers first|rest] [--json PATH] [--rounds 3]

``--layers first`` (the default) counts layer 0's calls, the call that plans the step for every layer; ``rest``
counts every other layer's, which run the plan (there "launch" is the parallel kernel with its numba dispatch and
"_run_items" the serial one: which one a call takes is the thread choice's). It runs
docs/results/generate_split.py's rounds (DynamicCache and Int8KvCache taking turns) with these timers; the other
options go to it. Medians, not means: the first calls compile or load kernels (milliseconds), which a mean over
~100 steps shows as tens of microseconds a step. Each timer adds its own ~0.2 us. A function the checkout does
not have is not timed (to run it against an older checkout).
"""

import argparse
import atexit
import json
import os
import runpy
import statistics
import sys
import time

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import int8kv.hf.attention as attention_module
import int8kv.ops as ops
import int8kv.ops.cpu as cpu

SPENT: dict[str, list[int]] = {}
COUNTING = [False]
WHOLE = "the attention call"
TIMED = [
    (attention_module, "_shared_plan"), (attention_module, "plan_attention"), (attention_module, "_prepared"),
    (cpu, "_work"), (cpu, "_decode_items"), (cpu, "_assign_items"), (cpu, "_runner"), (cpu, "_entry"),
    (cpu, "_leaves"), (cpu, "_run_items"), (cpu, "_layer_arrays"), (cpu, "launch"), (ops, "check_query"),
    (ops.PreparedAttention, "run"),
]  # fmt: skip


def _timed(fn, label: str):
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        if COUNTING[0]:
            SPENT.setdefault(label, []).append(time.perf_counter_ns() - start)
        return out

    return timed


def _attention(real, rest: bool):
    whole = _timed(real, WHOLE)

    def call(module, query, *args, **kwargs):
        COUNTING[0] = query.shape[2] == 1 and (module.layer_idx > 0 if rest else module.layer_idx == 0)
        try:
            return whole(module, query, *args, **kwargs)
        finally:
            COUNTING[0] = False

    return call


def _report(path: str | None, layers: str) -> None:
    calls = len(SPENT.get(WHOLE, [])) or 1
    rows = {k: {"median_us": statistics.median(ns) / 1e3, "per_call": len(ns) / calls} for k, ns in SPENT.items()}
    for label, row in sorted(rows.items(), key=lambda kv: -kv[1]["median_us"]):
        print(f"{label:22s} median {row['median_us']:8.1f} us  x{row['per_call']:.2f}")
    if path:
        with open(path, "w") as out:
            json.dump({"layers": layers, "calls": calls, "timers": rows}, out, indent=1)


parser = argparse.ArgumentParser(add_help=False)
parser.add_argument("--layers", choices=("first", "rest"), default="first")
parser.add_argument("--json")
mine, passed = parser.parse_known_args()
for owner, name in (t for t in TIMED if hasattr(*t)):
    label = "PreparedAttention.run" if owner is ops.PreparedAttention else name
    setattr(owner, name, _timed(getattr(owner, name), label))
ALL_ATTENTION_FUNCTIONS["int8kv"] = _attention(attention_module.int8kv_attention_forward, mine.layers == "rest")
atexit.register(_report, mine.json, mine.layers)
sys.argv = ["generate_split.py", *passed]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_split.py"), run_name="__main__")
